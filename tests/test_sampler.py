"""The batched Sampler against direct per-row reference computations."""

import torch

from novainfer.layers.sampler import Sampler
from novainfer.layers.sampling_metadata import SamplingMetadata, SamplingRow
from novainfer.sampling_params import SamplingParams

V = 12


def run(logits, rows):
    return Sampler()(logits, SamplingMetadata.build(rows, logits.shape[-1], logits.device))


def row(gen_seed=None, prompt=(), output=(), blocked=(), **kw):
    gen = None
    if gen_seed is not None:
        gen = torch.Generator().manual_seed(gen_seed)
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), gen, list(blocked))


def test_greedy_and_top_k_1_take_argmax():
    logits = torch.randn(5, V)
    out = run(logits, [row(temperature=0)] * 2 + [row(temperature=1.3, top_k=1)] * 3)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    steps = [torch.randn(4, V) for _ in range(6)]
    solo = torch.Generator().manual_seed(5)
    alone = [
        run(s[1:2], [SamplingRow(SamplingParams(temperature=1.0), [], [], solo)]).sampled_token_ids.item()
        for s in steps
    ]
    gen = torch.Generator().manual_seed(5)
    mixed = []
    for s in steps:
        rows = [
            row(temperature=0.7),
            SamplingRow(SamplingParams(temperature=1.0), [], [], gen),
            row(gen_seed=9, temperature=2.0),
            row(temperature=0),
        ]
        mixed.append(run(s, rows).sampled_token_ids[1].item())
    assert alone == mixed


def test_distribution_follows_softmax_with_temperature():
    torch.manual_seed(0)
    logits = torch.randn(1, 6)
    n = 20000
    out = run(logits.expand(n, 6).contiguous(), [row(temperature=0.7)] * n).sampled_token_ids
    freq = torch.bincount(out, minlength=6).float() / n
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert (freq - expected).abs().max() < 0.015


def test_top_k_top_p_min_p_only_sample_allowed_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(3000, 1)
    probs = torch.softmax(logits[0], -1)
    out = run(logits, [row(temperature=1.0, top_k=2)] * 3000).sampled_token_ids
    assert set(out.tolist()) == {0, 1}
    # top_p: the smallest set whose mass reaches p
    p = float(probs[0] + probs[1] / 2)
    out = run(logits, [row(temperature=1.0, top_p=p)] * 3000).sampled_token_ids
    assert set(out.tolist()) == {0, 1}
    out = run(logits, [row(temperature=1.0, min_p=0.3)] * 3000).sampled_token_ids
    allowed = {i for i in range(6) if probs[i] >= 0.3 * probs[0]}
    assert set(out.tolist()) == allowed


def test_penalties_follow_the_formulas():
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    prompt, output = [1, 2], [2, 3, 3, 5]
    params = dict(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    rows = [row(prompt=prompt, output=output, **params), row(temperature=0)]
    meta = SamplingMetadata.build(rows, V, "cpu")
    got = Sampler.apply_penalties(logits.clone(), meta)
    ref = logits.clone()
    for t in set(prompt) | set(output):
        ref[0, t] = ref[0, t] / 1.5 if ref[0, t] > 0 else ref[0, t] * 1.5
    for t in set(output):
        ref[0, t] -= 0.5 * output.count(t) + 0.25
    assert torch.allclose(got, ref)


def test_logprobs_are_raw_log_softmax_with_sampled_token_first():
    logits = torch.randn(3, V)
    out = run(logits, [row(temperature=0, logprobs=3), row(temperature=0.5, logprobs=1), row(temperature=0)])
    ref = torch.log_softmax(logits, -1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(out.logprobs[:, 0], ref.gather(1, out.sampled_token_ids[:, None])[:, 0], atol=1e-6)
    assert torch.equal(out.logprob_token_ids[0, 1:], ref[0].topk(3).indices)
    assert out.sampled_token_ranks[0].item() == 1


def test_blocked_tokens_are_never_sampled():
    logits = torch.zeros(500, V)
    logits[:, 7] = 10.0
    out = run(logits, [row(temperature=1.0, blocked=[7, 8])] * 500).sampled_token_ids
    assert 7 not in out.tolist() and 8 not in out.tolist()


def test_a_penalty_that_underflows_float32_samples_only_allowed_seen_tokens():
    """repetition_penalty 5e-324 is 0 in float32: seen positive logits become +inf and a blocked seen token's
    -inf * 0 would be NaN. Rows sample uniformly among their +inf tokens the grammar allows, never a blocked or
    masked one (the schema fuzzer's 500: a grammar allowing only the end drew an arbitrary token)."""
    logits = torch.full((400, V), -1.0)
    logits[:, [2, 4, 6]] = 3.0  # seen and positive: all three become +inf
    rows = [row(prompt=[2, 4, 6, 7], temperature=1.0, repetition_penalty=5e-324, blocked=[6])] * 400
    meta = SamplingMetadata.build(rows, V, "cpu")
    out = Sampler()(logits.clone(), meta).sampled_token_ids
    assert set(out.tolist()) == {2, 4}  # 6 is blocked, the others are finite beside +inf
    allow_only_4 = torch.full((400, 1), 1 << 4, dtype=torch.int32)
    masked = Sampler()(logits.clone(), meta, (torch.arange(400), allow_only_4)).sampled_token_ids
    assert set(masked.tolist()) == {4}
    greedy = [row(prompt=[6, 7], temperature=0, repetition_penalty=5e-324, blocked=[7])]
    assert Sampler()(logits[:1].clone(), SamplingMetadata.build(greedy, V, "cpu")).sampled_token_ids.item() == 6


def test_cpu_draw_follows_unnormalised_probs_and_never_draws_a_zero():
    """The CPU's inverse-CDF draw (one uniform a row): frequencies follow p / sum(p) for rows that do not sum to 1
    (min-p leaves them so), zero entries, the last one included, never come out, and a seeded row's draws
    repeat with its seed."""
    from scipy.stats import chisquare

    torch.manual_seed(0)
    p = torch.tensor([0.0, 0.3, 0.0, 0.1, 0.2, 0.0])  # sums to 0.6
    n = 20000
    meta = SamplingMetadata.build([row(temperature=1.0)] * n, 6, "cpu")
    out = Sampler.draw(p.expand(n, 6).contiguous(), meta)
    counts = torch.bincount(out, minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert chisquare(counts[[1, 3, 4]].numpy(), (p[[1, 3, 4]] / 0.6).numpy() * n).pvalue > 0.01
    seeded = [
        Sampler.draw(
            p.expand(8, 6).contiguous(), SamplingMetadata.build([row(gen_seed=3, temperature=1.0)] * 8, 6, "cpu")
        )
        for _ in range(2)
    ]
    assert torch.equal(seeded[0], seeded[1])


def test_cpu_top_k_top_p_among_candidates_equal_the_full_sort():
    """Rows whose kept set lies among the 1,024 highest logits get, from those alone, the distribution the full
    sort gives; rows whose set might not (top-k past 1,024, a nucleus wider than the candidates, no filter at
    all) are flagged for the full sort, and the Sampler's draws stay inside each row's support either way."""
    from novainfer.layers.sampler_candidates import CANDIDATES, candidate_probs

    torch.manual_seed(0)
    vocab = 3000
    peaked = torch.randn(vocab) * 4
    flat = torch.randn(vocab) * 0.01
    cases = [
        (peaked, dict(top_k=50), True),
        (peaked, dict(top_p=0.9), True),
        (peaked, dict(top_k=200, top_p=0.5, min_p=0.05), True),
        (peaked, dict(top_k=2000), False),
        (flat, dict(top_p=0.9), False),
        (flat, dict(top_k=10, top_p=0.9), True),
        (peaked, dict(), False),
        (peaked, dict(min_p=0.1, top_p=0.95), True),
    ]
    logits = torch.stack([c[0] for c in cases])
    rows = [row(temperature=0.8, **c[1]) for c in cases]
    meta = SamplingMetadata.build(rows, vocab, "cpu")
    scaled = logits / meta.temperature.unsqueeze(1)
    probs, ids, resolved = candidate_probs(scaled, meta.top_k, meta.top_p, meta.min_p)
    assert probs.shape == (len(cases), CANDIDATES)
    assert resolved.tolist() == [c[2] for c in cases]
    full = Sampler.probs(logits, meta)
    for i in resolved.nonzero().squeeze(1).tolist():
        got = torch.zeros(vocab).scatter(0, ids[i], probs[i])
        torch.testing.assert_close(got, full[i], rtol=1e-5, atol=1e-7)
    draws = torch.stack([run(logits, rows).sampled_token_ids for _ in range(200)])
    assert bool((full.gather(1, draws.T) > 0).all()), "a draw outside its row's kept set"


def test_a_top_p_below_float32s_range_keeps_the_most_likely_token():
    """top_p=5e-324 (the fuzzer's) reads as 0 in float32 and masked every token, so the draw took an arbitrary
    one (outside a structured-output grammar: a 500); the nucleus always keeps its first token, on the CPU's
    candidate path and in the full sort alike."""
    from novainfer.layers.sampler_candidates import candidate_probs

    logits = torch.randn(4, 3000)
    logits[:, 7] = -float("inf")  # a grammar's mask: the best allowed token is still the one kept
    rows = [row(temperature=1.0, top_p=5e-324)] * 2 + [row(temperature=0.7, top_k=5, top_p=5e-324)] * 2
    meta = SamplingMetadata.build(rows, logits.shape[-1], "cpu")
    for _ in range(20):
        assert torch.equal(run(logits, rows).sampled_token_ids, logits.argmax(-1))
    full = Sampler.probs(logits, meta)
    assert torch.equal((full > 0).sum(-1), torch.ones(4, dtype=torch.long)) and torch.equal(
        full.argmax(-1), logits.argmax(-1)
    )
    probs, ids, _ = candidate_probs(logits / meta.temperature.unsqueeze(1), meta.top_k, meta.top_p, meta.min_p)
    assert torch.equal((probs > 0).sum(-1), torch.ones(4, dtype=torch.long)) and torch.equal(
        ids[:, 0], logits.argmax(-1)
    )
