"""Lab helpers (session 21) the profiling scripts here share: wall-time wrappers around entry points, and a timed
greedy generate on a fresh random prompt. Not part of the package."""

import collections
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))

acc: collections.defaultdict = collections.defaultdict(float)  # key -> seconds inside the wrapped calls
cnt: collections.Counter = collections.Counter()  # key -> calls


def timed(f, key):
    """f, its wall time and calls added to acc[key] / cnt[key]."""

    def g(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        acc[key] += time.perf_counter() - t
        cnt[key] += 1
        return r

    return g


def wrap(obj, name, key):
    """obj.name replaced by its timed form."""
    setattr(obj, name, timed(getattr(obj, name), key))


def reset():
    acc.clear()
    cnt.clear()


def generate_s(llm, new_tokens: int, prompt_len: int = 16) -> float:
    """Seconds of one greedy generate of new_tokens after a fresh random prompt (no prefix-cache hit)."""
    from novainfer import SamplingParams

    p = [random.randrange(1000, 200000) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    return time.perf_counter() - t


def report(steps: int, calls_per: int, width: int = 28):
    """Each key's ms a step and calls a step."""
    for k in acc:
        print(f"{k:{width}s} {acc[k] * 1e3 / steps:.3f} ms/step  calls/step {cnt[k] / calls_per:.2f}")


def step_report(llm, steps: int) -> None:
    """One greedy generate of steps + 1 tokens on a fresh prompt, timed afresh: ms a decode step, then report()."""
    reset()
    t = generate_s(llm, steps + 1)
    print(f"step {t / steps * 1e3:.2f} ms")
    report(steps, steps + 1)
