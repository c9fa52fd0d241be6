"""Speculative decoding returns what decoding without it returns: greedy tokens equal (and equal to
transformers'), in mixed batches, with prefix caching, under preemption and chunked prefill, with stops
inside an accepted run; sampled tokens keep the target's distribution (chi-square); counters add up."""

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from novainfer import LLM, SamplingParams
from novainfer.config import EngineConfig, SpeculativeConfig
from novainfer.layers.sampler import Sampler
from novainfer.layers.sampling_metadata import SamplingMetadata, SamplingRow
from novainfer.spec_decode import rejection_sampler
from novainfer.spec_decode.ngram_proposer import propose_ngram
from tests.tiny_models import hf_greedy, make_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# repetitive prompts: a random tiny model soon loops, and prompt lookup then guesses right
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 5, 6, 7],
    [1, 2, 3, 4, 1, 2, 3, 4, 1, 2],
    [40, 41, 42],
    [100, 200, 300, 100, 200, 300, 100, 200, 300, 100, 200, 300, 100, 200, 300, 100, 200, 300],
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def make(path: str, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("num_gpu_blocks", 128)
    return LLM(path, dtype="float32", device="cpu", block_size=4, speculative_config=spec, **kw)


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [c.token_ids for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


@pytest.fixture(scope="module")
def plain(tiny_qwen2):
    return make(tiny_qwen2)


@pytest.fixture(scope="module")
def ngram(tiny_qwen2):
    return make(tiny_qwen2, NGRAM)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """Another architecture and other weights, the same tokenizer: its guesses are often wrong."""
    return make_tiny_model(
        str(tmp_path_factory.mktemp("draft")), "llama", seed=5, layers=1, num_heads=2, num_kv_heads=1
    )


@pytest.fixture(scope="module", params=["ngram", "draft=target", "draft=other"])
def any_spec(request, tiny_qwen2, tiny_draft):
    """An engine of each kind of speculation: prompt lookup; a draft model that is the target itself (every
    greedy guess right); a draft model of other weights (many rejections)."""
    if request.param == "ngram":
        llm = request.getfixturevalue("ngram")
    else:
        draft = tiny_qwen2 if request.param == "draft=target" else tiny_draft
        llm = make(tiny_qwen2, {"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    llm.spec_kind = request.param
    return llm


def test_ngram_lookup_takes_the_latest_longest_match():
    assert propose_ngram(np.array([1, 2, 3, 4, 5, 9, 1, 2, 3]), 1, 3, 3) == [4, 5, 9]
    assert propose_ngram(np.array([7, 1, 8, 2, 1]), 1, 3, 2) == [8, 2]  # only a 1-gram matches
    assert propose_ngram(np.array([5, 6, 7]), 1, 3, 3) == []
    assert propose_ngram(np.array([1, 2, 9, 1, 2, 8, 1, 2]), 2, 2, 1) == [8]  # the latest of two matches
    # scaled to the match (the CPU's default): 1 token for a 1-gram, 2 for a 2-gram, 4 for a 3-gram
    assert propose_ngram(np.array([7, 1, 8, 2, 1]), 1, 3, 2, scale_by_match=True) == [8]
    assert propose_ngram(np.array([1, 2, 3, 4, 5, 9, 8, 1, 2, 3]), 1, 3, 6, scale_by_match=True) == [4, 5, 9, 8]
    assert propose_ngram(np.array([4, 1, 2, 3, 4, 5, 1, 2]), 1, 3, 6, scale_by_match=True) == [3, 4]


def test_ngram_lookup_equals_a_brute_force_search():
    def brute(t: list[int], min_n: int, max_n: int, k: int) -> list[int]:
        for n in range(max_n, min_n - 1, -1):
            for end in range(len(t) - 2, n - 2, -1):  # latest earlier match first
                if t[end - n + 1 : end + 1] == t[len(t) - n :]:
                    return t[end + 1 : end + 1 + k]
        return []

    def brute_scaled(t: list[int], min_n: int, max_n: int, k: int) -> list[int]:
        for n in range(max_n, min_n - 1, -1):  # as above, at most 2^(n-1) tokens for a match of n
            if out := brute(t, n, n, k):
                return out[: 2 ** (n - 1)]
        return []

    rng = np.random.default_rng(0)
    for _ in range(3000):
        t = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 30))).tolist()
        lo = int(rng.integers(1, 4))
        hi, k = int(rng.integers(lo, 6)), int(rng.integers(1, 6))
        assert propose_ngram(np.array(t), lo, hi, k) == brute(t, lo, hi, k), (t, lo, hi, k)
        assert propose_ngram(np.array(t), lo, hi, k, scale_by_match=True) == brute_scaled(t, lo, hi, k), (t, lo, hi, k)


def test_greedy_equals_no_speculation_and_transformers(tiny_qwen2, plain, any_spec):
    ref = tokens(plain, PROMPTS, GREEDY)
    before = any_spec.get_metrics()
    steps_before = any_spec.llm_engine.step_id
    got = tokens(any_spec, PROMPTS, GREEDY)
    assert got == ref
    assert got[1] == hf_greedy(tiny_qwen2, PROMPTS[1], 40)
    m = any_spec.get_metrics()
    drafted, accepted = (m[k] - before[k] for k in ("spec_num_draft_tokens", "spec_num_accepted_tokens"))
    if any_spec.spec_kind == "draft=other":
        assert drafted > accepted  # its guesses are rejected: the rejection path ran
    else:
        assert accepted > 0, "no guess accepted: the check would be vacuous"
    if any_spec.spec_kind != "draft=other":
        assert any_spec.llm_engine.step_id - steps_before < 40  # fewer steps than tokens per sequence


def test_greedy_equal_on_the_torch_reference_backend(tiny_qwen2, plain):
    """The verify step through the torch backend's varlen path (the CPU backend runs it as decode rows)."""
    ref = make(tiny_qwen2, attention_backend="torch")
    spec = make(tiny_qwen2, NGRAM, attention_backend="torch")
    assert tokens(spec, PROMPTS, GREEDY) == tokens(ref, PROMPTS, GREEDY) == tokens(plain, PROMPTS, GREEDY)
    assert spec.get_metrics()["spec_num_accepted_tokens"] > 0


def test_counters_add_up(tiny_qwen2):
    llm = make(tiny_qwen2, NGRAM)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    m = llm.get_metrics()
    assert 0 < m["spec_num_accepted_tokens"] <= m["spec_num_draft_tokens"] <= 4 * m["spec_num_drafts"]
    # every verified sequence-step emits its accepted guesses plus one token (no stop cuts a run here)
    assert m["spec_num_emitted_tokens"] == m["spec_num_drafts"] + m["spec_num_accepted_tokens"]
    assert m["num_generation_tokens"] == 40 * len(PROMPTS)
    assert m["spec_mean_accepted_length"] == pytest.approx(m["spec_num_emitted_tokens"] / m["spec_num_drafts"])
    per_request = [o.metrics for o in outs]
    assert sum(r["spec_num_draft_tokens"] for r in per_request) == m["spec_num_draft_tokens"]
    assert sum(r["spec_num_accepted_tokens"] for r in per_request) == m["spec_num_accepted_tokens"]


def test_mixed_batch_with_requests_that_do_not_speculate(plain, any_spec):
    """Greedy, seeded sampling, min_tokens (which keeps a sequence from guessing) and n=2 in one batch."""
    eos = sorted(plain.llm_engine.eos_token_ids)[0]
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=10, logit_bias={eos: 100.0}),
        SamplingParams(temperature=0, max_tokens=25, n=2, ignore_eos=True),
    ]
    ref = tokens(plain, PROMPTS, params)
    got = tokens(any_spec, PROMPTS, params)
    assert got[0] == ref[0] and got[2] == ref[2] and got[3] == got[4] == ref[3] == ref[4]
    assert len(ref[2]) == 11 and ref[2][-1] == eos  # min_tokens held eos back, then the bias ended it
    again = tokens(any_spec, PROMPTS, params)
    assert again[1] == got[1] and len(got[1]) == 30  # a seed fixes the speculative run too


def test_penalties_and_logprobs_match(plain, ngram):
    params = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.2, logprobs=3
    )
    ref = plain.generate(PROMPTS, params, use_tqdm=False)
    got = ngram.generate(PROMPTS, params, use_tqdm=False)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lr.keys() == lg.keys()
            for tid in lr:
                assert lg[tid].logprob == pytest.approx(lr[tid].logprob, abs=1e-4)
                assert lg[tid].rank == lr[tid].rank


def test_stops_inside_an_accepted_run_cut_it_there(plain, any_spec):
    ngram = any_spec
    full = tokens(plain, PROMPTS[1:2], GREEDY)[0]
    stop_id = full[9]
    first = full.index(stop_id)
    text = plain.generate(PROMPTS[1:2], GREEDY, use_tqdm=False)[0].outputs[0].text
    cases = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[text[12:16]]),
    ]
    for params in cases:
        r = plain.generate(PROMPTS[1:2], params, use_tqdm=False)[0].outputs[0]
        g = ngram.generate(PROMPTS[1:2], params, use_tqdm=False)[0].outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
            r.token_ids,
            r.text,
            r.finish_reason,
            r.stop_reason,
        )
    assert len(tokens(ngram, PROMPTS[1:2], cases[0])[0]) == first + 1


@pytest.mark.parametrize("spec_config", ["ngram", "draft"])
def test_prefix_caching_preemption_and_chunked_prefill(tiny_qwen2, spec_config):
    long = [p * 4 for p in PROMPTS]  # 12..72 tokens
    kw = dict(max_num_batched_tokens=16, num_gpu_blocks=40, enable_prefix_caching=True)
    config = (
        NGRAM if spec_config == "ngram" else {"method": "draft_model", "model": tiny_qwen2, "num_speculative_tokens": 3}
    )
    plain, spec = make(tiny_qwen2, **kw), make(tiny_qwen2, config, **kw)
    ref = tokens(plain, long, GREEDY)
    got = tokens(spec, long, GREEDY)
    assert got == ref
    assert spec.get_metrics()["num_preemptions"] > 0, "the cache was meant to run out"
    assert spec.get_metrics()["spec_num_accepted_tokens"] > 0
    cached = make(tiny_qwen2, config, max_num_batched_tokens=16)
    assert tokens(cached, long[:2], GREEDY) == ref[:2]
    assert tokens(cached, long[:2], GREEDY) == ref[:2]  # their prompts' blocks are cached now
    assert cached.get_metrics()["prefix_cache_hits"] > 0


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ],
)
def test_bad_configurations_fail_at_start_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs("unused", speculative_config=bad)


def test_speculation_refuses_executors_it_does_not_run_on():
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig.from_kwargs("unused", speculative_config=NGRAM, distributed_executor_backend="mp")
    draft = {"method": "draft_model", "model": "d", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_kwargs("unused", speculative_config=draft, tensor_parallel_size=2)


def test_disable_by_batch_size_stops_guessing_in_a_busy_batch(tiny_qwen2, plain):
    spec = make(tiny_qwen2, dict(NGRAM, disable_by_batch_size=3))
    assert tokens(spec, PROMPTS, GREEDY) == tokens(plain, PROMPTS, GREEDY)
    assert spec.get_metrics()["spec_num_drafts"] == 0  # four sequences ran together the whole time
    assert tokens(spec, PROMPTS[:2], GREEDY) == tokens(plain, PROMPTS[:2], GREEDY)
    assert spec.get_metrics()["spec_num_drafts"] > 0  # two: under the limit, they guess


def test_speculation_turns_the_overlapped_loop_off():
    cfg = EngineConfig.from_kwargs("unused", speculative_config=NGRAM, async_scheduling=True, device="cpu")
    assert isinstance(cfg.speculative_config, SpeculativeConfig) and not cfg.use_async_scheduling()


# ---- the rejection sampler keeps the target's distribution --------------------------------------------------
def _verify_many(probs: torch.Tensor, guess: int, n: int, temperature: float = 1.0) -> np.ndarray:
    """n independent verify rows of the same target distribution checking the same guess: emitted tokens."""
    logits = (probs.log() * temperature).expand(n, -1).contiguous()
    params = SamplingParams(temperature=temperature)
    meta = SamplingMetadata.build([SamplingRow(params, [], [])] * n, probs.shape[0], "cpu")
    out = rejection_sampler.rejection_sample(Sampler(), logits, meta, torch.full((n,), guess))
    return np.bincount(out.sampled_token_ids.numpy(), minlength=probs.shape[0])


@pytest.mark.parametrize("guess", [0, 2, 4])  # the most likely token, a middling one, an impossible one
def test_rejection_sampling_keeps_the_distribution(guess, monkeypatch):
    torch.manual_seed(0)
    p = torch.tensor([0.45, 0.25, 0.15, 0.15, 0.0])
    n = 20000
    counts = _verify_many(p, guess, n)
    assert counts[4] == 0
    assert chisquare(counts[:4], p[:4].numpy() * n).pvalue > 0.01
    if guess == 0:  # accepting a likely guess without the coin flip (greedy-style) is caught
        monkeypatch.setattr(rejection_sampler, "uniforms", lambda meta, device: torch.zeros(len(meta.generators)))
        broken = _verify_many(p, guess, n)
        assert chisquare(broken[:4], p[:4].numpy() * n).pvalue < 0.01


def test_sampled_tokens_keep_their_distribution_end_to_end(tiny_qwen2, plain):
    """Many seeds, the first positions after the prompt: token frequencies with and without speculation agree.
    The draft is the target itself, so its (greedy) guesses are the likeliest tokens and often accepted: a
    verifier that accepted them without the coin flip would skew every position toward the argmax."""
    spec = make(tiny_qwen2, {"method": "draft_model", "model": tiny_qwen2, "num_speculative_tokens": 3})
    prompt, n = PROMPTS[3], 200  # 4 tokens each: at most 3 guesses checked, each accepted with p(argmax)
    ref = np.array(
        tokens(
            plain,
            [prompt] * n,
            [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=4, ignore_eos=True) for s in range(n)],
        )
    )
    got = np.array(
        tokens(
            spec,
            [prompt] * n,
            [SamplingParams(temperature=1.0, top_k=3, seed=1000 + s, max_tokens=4, ignore_eos=True) for s in range(n)],
        )
    )
    m = spec.get_metrics()
    assert m["spec_num_accepted_tokens"] > n // 2, "too few guesses accepted for the test to mean anything"
    for pos in range(1, 4):
        cats = sorted(set(ref[:, pos]) | set(got[:, pos]))
        table = np.array([[(ref[:, pos] == c).sum() for c in cats], [(got[:, pos] == c).sum() for c in cats]])
        assert chi2_contingency(table + 0.5).pvalue > 0.01, (pos, cats, table)


def test_server_speculates_streams_and_counts(tiny_qwen2, plain, tmp_path):
    """`novainfer serve --speculative-config`: the official client gets the tokens decoding without speculation
    gives, streamed or not, and /metrics counts guesses."""
    import json

    import openai

    from tests.server_utils import RemoteServer

    srv = RemoteServer(
        [tiny_qwen2, "--served-model-name", "tiny", "--dtype", "float32", "--speculative-config", json.dumps(NGRAM)],
        str(tmp_path / "server.log"),
    )
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        tok = plain.get_tokenizer()
        prompt = tok.decode(PROMPTS[3])
        want = (
            plain.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
            .outputs[0]
            .text
        )
        resp = client.completions.create(
            model="tiny", prompt=prompt, temperature=0, max_tokens=30, extra_body={"ignore_eos": True}
        )
        assert resp.choices[0].text == want and resp.usage.completion_tokens == 30
        chunks = client.completions.create(
            model="tiny", prompt=prompt, temperature=0, max_tokens=30, stream=True, extra_body={"ignore_eos": True}
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        srv.wait_idle()
        accepted = srv.metric("novainfer:spec_decode_num_accepted_tokens_total", model_name="tiny")
        drafts = srv.metric("novainfer:spec_decode_num_drafts_total", model_name="tiny")
        emitted = srv.metric("novainfer:spec_decode_num_emitted_tokens_total", model_name="tiny")
        assert 0 < accepted <= srv.metric("novainfer:spec_decode_num_draft_tokens_total", model_name="tiny")
        assert emitted == drafts + accepted
        assert srv.metric("novainfer:spec_decode_mean_accepted_length", model_name="tiny") == pytest.approx(
            emitted / drafts
        )
    finally:
        srv.stop()


def test_abort_mid_run_frees_everything_and_leaves_the_others_alone(plain, any_spec):
    engine = any_spec.llm_engine
    want = tokens(plain, PROMPTS[1:2], GREEDY)[0]
    engine.add_request("keep", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    engine.add_request("drop", {"prompt_token_ids": PROMPTS[3]}, GREEDY)
    outs = {}
    for i in range(200):
        for out in engine.step():
            outs[out.request_id] = out
        if i == 3:
            engine.abort_request("drop")
        if not engine.has_unfinished_requests():
            break
    assert outs["keep"].finished and outs["keep"].outputs[0].token_ids == want
    assert "drop" not in engine.engine_core.requests
    bm = engine.engine_core.block_manager
    assert bm.num_free_blocks == bm.num_blocks
