"""Start the tensor-parallel ranks of one extra node (node_rank > 0) of an mp engine.

Node 0 runs the engine (`novainfer serve/generate ... --distributed-executor-backend mp --nnodes N`);
each other node runs, with the same model and engine flags:
    python -m novainfer.executor.node_worker MODEL -tp 4 --nnodes 2 --node-rank 1 --master-addr HOST --master-port P
Its ranks join node 0's group, follow rank 0's calls and exit when the engine shuts down; the exit
status is non-zero when a rank failed.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing.connection
import signal
import sys

from novainfer.config import EngineConfig
from novainfer.entrypoints.engine_args import add_engine_args, engine_kwargs
from novainfer.executor.multiproc import start_local_workers, stop_workers
from novainfer.loader.model_info import with_hf_config

logger = logging.getLogger("novainfer.node_worker")


def run_node(config: EngineConfig) -> int:
    """Spawn this node's ranks and wait for them; a rank that fails stops the others."""
    config = with_hf_config(config)
    procs, _ = start_local_workers(config, config.model_config.hf_config)
    pending = {p.sentinel: p for p in procs}
    try:
        while pending:
            for sentinel in multiprocessing.connection.wait(list(pending)):
                proc = pending.pop(sentinel)
                proc.join()
                if proc.exitcode != 0:
                    logger.error("rank %d (pid %d) exited with code %s", proc.tp_rank, proc.pid, proc.exitcode)
                    return 1
        return 0
    finally:
        stop_workers(procs, timeout=2.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, model_positional=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    kwargs = engine_kwargs(args)
    kwargs["distributed_executor_backend"] = "mp"
    config = EngineConfig.from_kwargs(args.model, **kwargs)
    if config.parallel_config.node_rank == 0:
        parser.error("--node-rank 0 is the engine's node: start it with `novainfer serve/generate`")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # SIGTERM still stops this node's ranks (finally)
    return run_node(config)


if __name__ == "__main__":
    sys.exit(main())
