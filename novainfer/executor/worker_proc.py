"""The body of one mp worker process: join the group, then run the calls rank 0 broadcasts until told to stop.

Rank 0 reads each call (method, args, gather) from the driver's pipe and broadcasts it over a gloo group
(so ranks on other nodes, which have no pipe, follow too); every rank runs it; with gather the ranks'
results travel to rank 0, which answers the driver with [(rank, ok, result or traceback), ...].
A rank that fails outside a gathered call exits non-zero: its peers' collectives then fail and the
driver, watching every local process, names the rank that died.

With async scheduling the driver sends "launch_step": every rank launches the step and reads for the next
call at once; the step is read back, and answered by rank 0, on the StepPipeline's thread
(executor/step_pipeline.py). Any other call first waits for the launched steps.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import sys
import traceback
from typing import Any

import torch

from novainfer.config import EngineConfig

logger = logging.getLogger(__name__)

Reply = tuple[int, bool, Any]  # (rank, ok, result or formatted traceback)


def run_worker(
    conn: multiprocessing.connection.Connection | None,
    config: EngineConfig,
    hf_config: Any,
    rank: int,
    local_rank: int,
    log_level: int,
) -> None:
    """Process entry point (spawned). conn is the pipe to the driver, for rank 0 only."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s [rank {rank}] %(name)s: %(message)s")
    pc = config.parallel_config
    if config.resolve_device().type == "cpu":  # share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // pc.ranks_per_node))
    from novainfer.worker.worker import Worker

    worker = Worker(config, hf_config, rank, local_rank, pc.distributed_init_method, is_driver_worker=rank == 0)
    try:
        worker.init_device()
        objects = _object_group() if worker.group.size > 1 else None
    except Exception:
        logger.exception("rank %d failed to join the tensor-parallel group", rank)
        sys.exit(1)
    if conn is not None:
        conn.send([(rank, True, "ready")])
    try:
        _serve(conn, worker, objects)
    except (EOFError, KeyboardInterrupt):  # the driver went away
        pass
    except Exception:
        logger.exception("rank %d stopped", rank)
        sys.exit(1)
    finally:
        worker.shutdown()


def _object_group() -> Any:
    """The group calls are broadcast over: a gloo group (CPU objects) of its own, never the model's, since the
    main thread broadcasts the next call while a launched step's all-reduces run on the runner's step thread."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def _serve(conn, worker, objects) -> None:
    from novainfer.executor.step_pipeline import StepPipeline

    pipeline = StepPipeline(worker.rank, conn.send if worker.rank == 0 else None, worker.device)
    try:
        _serve_calls(conn, worker, objects, pipeline)
    finally:
        pipeline.close()  # the steps in flight are read back (rank 0 answers them if the driver still listens)


def _serve_calls(conn, worker, objects, pipeline) -> None:
    import torch.distributed as dist

    from novainfer.executor.step_wire import StepReceiver

    world = worker.group.size
    steps = StepReceiver(worker)
    while True:
        call = conn.recv() if worker.rank == 0 else None
        if world > 1:
            box = [call]
            dist.broadcast_object_list(box, src=0, group=objects)
            call = box[0]
        if call is None:
            return
        method, args, gather = call
        if method == "launch_step":  # answered by the pipeline's thread once the step is read back
            pipeline.launch(lambda: steps.launch_step(*args))  # noqa: B023 - called before the loop goes on
            continue
        pipeline.drain()
        try:
            if callable(method):  # collective_rpc(fn): fn(worker, *args), as vLLM's collective_rpc allows
                result = method(worker, *args)
            else:
                result = getattr(steps if method == "execute_step" else worker, method)(*args)
            reply: Reply = (worker.rank, True, result)
        except Exception:
            reply = (worker.rank, False, traceback.format_exc())
            if not gather:  # nobody collects this rank's reply: fail loudly so the peers notice
                logger.error("rank %d failed in %s:\n%s", worker.rank, method, reply[2])
                if worker.rank != 0:
                    raise
        if gather and world > 1:
            replies = [None] * world if worker.rank == 0 else None
            dist.gather_object(reply, replies, dst=0, group=objects)
        else:
            replies = [reply]
        if worker.rank == 0:
            conn.send(replies)
