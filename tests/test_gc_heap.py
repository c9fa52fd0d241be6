"""The startup heap is kept out of the collector's full passes while LLM.generate runs, and given back after."""

import gc
import weakref

from novainfer.engine.gc_heap import frozen_heap


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_frozen_objects_are_skipped_then_collected_after():
    gc.collect()
    garbage = Node()
    alive = weakref.ref(garbage)
    with frozen_heap():
        del garbage
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert alive() is not None  # frozen: the full pass did not walk it
        fresh = Node()  # created inside: collected as usual
        fresh_alive = weakref.ref(fresh)
        del fresh
        gc.collect()
        assert fresh_alive() is None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None


def test_a_heap_frozen_by_someone_else_stays_frozen():
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with frozen_heap():
            pass
        # still frozen (an unfreeze would empty it); a thread left by another test may free a few frozen objects
        assert gc.get_freeze_count() > count - 1000
    finally:
        gc.unfreeze()


def test_generate_runs_frozen_and_leaves_the_engine_collectable(tiny_qwen2):
    from novainfer import LLM, SamplingParams

    llm = LLM(tiny_qwen2, dtype="float32", device="cpu", cpu_kv_cache_tokens=256)
    seen = []
    llm.llm_engine.step = lambda step=llm.llm_engine.step: seen.append(gc.get_freeze_count()) or step()
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert seen and all(n > 0 for n in seen) and gc.get_freeze_count() == 0
    runner = weakref.ref(llm.llm_engine.executor.workers[0].model_runner)  # in a reference cycle with its steps
    del llm
    gc.collect()
    assert runner() is None
