"""The batched Sampler against direct per-row reference computations."""
import torch

from novainfer.layers.sampler import Sampler, SamplingMetadata, SamplingRow
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
    alone = [run(s[1:2], [SamplingRow(SamplingParams(temperature=1.0), [], [], solo)]).sampled_token_ids.item()
             for s in steps]
    gen = torch.Generator().manual_seed(5)
    mixed = []
    for s in steps:
        rows = [row(temperature=0.7), SamplingRow(SamplingParams(temperature=1.0), [], [], gen),
                row(gen_seed=9, temperature=2.0), row(temperature=0)]
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
