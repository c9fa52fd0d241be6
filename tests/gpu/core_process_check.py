"""The server's engine-core process on a GPU: AsyncLLM spawns the core (CUDA cannot be forked), which loads the
model's config and tokenizer and sends the tokenizer back; its greedy tokens must equal the offline LLM's on the
same random checkpoint. Needs no FastAPI (the server's HTTP layer is not involved).

    python3 tests/gpu/core_process_check.py [--model random:qwen2.5-0.5b]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PROMPTS = [
    [11, 12, 13, 14, 15],
    [40, 41, 42],
    [7, 7, 7, 7, 7, 7],
]  # token ids: the random checkpoints have no real vocabulary


async def core_process_tokens(path: str, fmt: str, max_tokens: int) -> tuple[list[list[int]], str]:
    from novainfer.config import EngineConfig
    from novainfer.sampling_params import SamplingParams
    from novainfer.server.async_llm import AsyncLLM

    llm = AsyncLLM(EngineConfig.from_kwargs(path, load_format=fmt, gpu_memory_utilization=0.5))
    llm.start()
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out = []
        for i, prompt in enumerate(PROMPTS):
            await llm.submit(str(i), prompt, params)
            last = None
            async for last in llm.stream(str(i)):
                pass
            out.append(list(last.outputs[0].token_ids))
        method = "spawned" if "spawn" in type(llm.core.proc._popen).__module__ else "forked"
        return out, f"{method} (pid {llm.core_pid})"
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    from benchmarks.checkpoints import load_format, resolve_model

    path, fmt = resolve_model(args.model), load_format(args.model)
    got, how = asyncio.run(core_process_tokens(path, fmt, args.max_tokens))
    from novainfer import LLM, SamplingParams

    llm = LLM(path, load_format=fmt, gpu_memory_utilization=0.5)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    ok = got == want and all(len(t) == args.max_tokens for t in got)
    print(
        f"{'PASS' if ok else 'FAIL'} engine-core process on {llm.llm_engine.config.resolve_device()}: core {how}, "
        f"greedy tokens equal to the offline LLM's for {sum(g == w for g, w in zip(got, want))}/{len(PROMPTS)} "
        f"prompts"
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
