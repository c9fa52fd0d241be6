"""Async scheduling (step N+1 planned and launched before step N is read back) returns exactly what the
synchronous loop returns: no extra token, equal usage counts, the same tokens under preemption, chunked
prefill, seeds, penalties, aborts and request faults."""

import pytest

from novainfer import LLM, SamplingParams
from novainfer.config import EngineConfig
from novainfer.engine.llm_engine import LLMEngine
from tests import faults

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def add(a, b):",
    "Paged attention stores keys",
    "héllo wörld",
    "The quick brown fox jumps over the lazy dog",
]


def make(path: str, overlap: bool, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    return LLM(path, dtype="float32", device="cpu", async_scheduling=overlap, **kw)


def run(llm: LLM, prompts, params) -> tuple[list, int]:
    before = llm.llm_engine.num_generated_tokens
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]
    return got, llm.llm_engine.num_generated_tokens - before


@pytest.fixture(scope="module")
def pair(tiny_qwen2):
    sync, overlap = make(tiny_qwen2, False), make(tiny_qwen2, True)
    assert overlap.llm_engine.engine_core.async_scheduling and not sync.llm_engine.engine_core.async_scheduling
    return sync, overlap


def test_stop_conditions_return_the_same_tokens_and_counts(pair):
    sync, overlap = pair
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    toks = sync.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0]
    cases = [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[toks.token_ids[3]]),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[toks.text[4:7]]),
    ]
    for params in cases:
        a, b = run(sync, PROMPTS, params), run(overlap, PROMPTS, params)
        assert a == b, params
    engines = [sync.llm_engine, overlap.llm_engine]
    saved = [e.eos_token_ids for e in engines]
    try:
        for e in engines:
            e.eos_token_ids = {toks.token_ids[2]}  # pretend a greedy token is the model's eos
        a, b = (run(e, PROMPTS, SamplingParams(temperature=0, max_tokens=16)) for e in (sync, overlap))
        assert a == b and any(r[2] == "stop" for r in a[0])
    finally:
        for e, ids in zip(engines, saved):
            e.eos_token_ids = ids


def test_extra_token_of_a_finished_sequence_is_dropped(pair):
    _, overlap = pair
    got, counted = run(overlap, PROMPTS, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert [len(r[0]) for r in got] == [3] * len(PROMPTS) and counted == 3 * len(PROMPTS)
    core = overlap.llm_engine.engine_core
    while core.has_unfinished_requests():  # read back the step still in flight: nothing comes of it
        core.step()
    assert core.block_manager.num_free_blocks == core.num_blocks


def test_seeds_penalties_min_tokens_and_n_match(pair):
    sync, overlap = pair
    params = [
        SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(
            temperature=0.8,
            seed=5,
            max_tokens=12,
            ignore_eos=True,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.3,
        ),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, min_tokens=6, top_k=20, top_p=0.9),
        SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=21, max_tokens=12, ignore_eos=True, min_p=0.05),
    ]
    assert run(sync, PROMPTS, params) == run(overlap, PROMPTS, params)


def test_preemption_and_chunked_prefill_match(tiny_qwen2):
    kw = dict(cpu_kv_cache_tokens=96, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sync, overlap = make(tiny_qwen2, False, **kw), make(tiny_qwen2, True, **kw)
    prompts = [p * 2 for p in PROMPTS]
    assert run(sync, prompts, params) == run(overlap, prompts, params)
    assert overlap.llm_engine.scheduler.num_preemptions > 0


def test_abort_mid_stream_frees_blocks_and_leaves_the_rest(tiny_qwen2):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = []
    for overlap in (False, True):
        engine = LLMEngine(
            EngineConfig.from_kwargs(tiny_qwen2, dtype="float32", device="cpu", block_size=4, async_scheduling=overlap)
        )
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(str(i), prompt, params)
        finished = {}
        for n in range(40):
            if n == 6:
                aborted = engine.abort_request("1")
                assert aborted.outputs[0].finish_reason == "abort"
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
            if not engine.engine_core.has_unfinished_requests():
                break
        assert sorted(finished) == ["0", "2"]
        assert engine.block_manager.num_free_blocks == engine.engine_core.num_blocks
        results.append(finished)
    assert results[0] == results[1]


@pytest.mark.parametrize("stage", ["prepare", "postprocess"])
def test_request_fault_fails_it_alone(tiny_qwen2, stage, monkeypatch):
    faults.install(f"{stage}:bad-", monkeypatch.setattr)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = []
    for overlap in (False, True):
        engine = LLMEngine(
            EngineConfig.from_kwargs(tiny_qwen2, dtype="float32", device="cpu", block_size=4, async_scheduling=overlap)
        )
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(f"ok-{i}", prompt, params)
        engine.step()
        engine.step()
        engine.add_request("bad-1", PROMPTS[3], params)
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
        assert outs["bad-1"].outputs[0].finish_reason == "error"
        results.append({k: v.outputs[0].token_ids for k, v in outs.items() if k.startswith("ok-")})
        assert all(len(t) == 12 for t in results[-1].values())
    assert results[0] == results[1]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_dropped_engine_is_freed_at_once(tiny_qwen2, overlap):
    """Shutting an engine down gives its KV cache back at once, and no reference cycle keeps the runner alive
    until the collector runs: a second LLM in the same process sizes its GPU cache from free memory."""
    import gc
    import weakref

    llm = make(tiny_qwen2, overlap)
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6), use_tqdm=False)
    runner = weakref.ref(llm.llm_engine.executor.workers[0].model_runner)
    cache = weakref.ref(runner().kv_cache)
    gc.disable()
    try:
        llm.llm_engine.shutdown()
        assert cache() is None
        del llm
        assert runner() is None
    finally:
        gc.enable()
