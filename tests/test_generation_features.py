"""Sampling features through the whole engine: seeds, top-k, logprobs, n, stop conditions, chat."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from novainfer import LLM, SamplingParams


pytestmark = pytest.mark.usefixtures("step_loop")  # every test with the synchronous and the overlapped loop


@pytest.fixture(scope="module")
def llm(tiny_qwen2, step_loop):
    return LLM(tiny_qwen2, dtype="float32", block_size=4)


def texts(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_seeded_sampling_reproducible_alone_and_in_batch(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(["Hello"], p, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(["Hello"], p, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(["The quick", "Hello", "def add"], [other, p, other], use_tqdm=False)
    assert alone == again == batch[1].outputs[0].token_ids
    different = (
        llm.generate(
            ["Hello"], SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert different != alone


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(
        ["The capital"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    topk = llm.generate(
        ["The capital"], SamplingParams(temperature=0.8, top_k=1, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    assert texts(greedy) == texts(topk)


def test_logprobs_match_transformers(llm, tiny_qwen2):
    p = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = llm.generate(["Hello, my"], p, use_tqdm=False)[0]
    comp = out.outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    ids = out.prompt_token_ids + comp.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert len(comp.logprobs) == 6
    total = 0.0
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(out.prompt_token_ids) - 1 + i]
        assert tok in entry and abs(entry[tok].logprob - row[tok].item()) < 1e-4
        top = torch.topk(row, 3)
        for lp, tid in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(entry[tid].logprob - lp) < 1e-4
        assert entry[tok].rank == 1  # greedy picks the best
        total += entry[tok].logprob
    assert math.isclose(comp.cumulative_logprob, total, rel_tol=1e-6)


def test_n_2_shares_prompt_and_gives_two_samples(llm):
    prompt = "Paged attention stores keys and values in fixed-size blocks"
    out = llm.generate(
        [prompt], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids


def test_stop_string_is_trimmed(llm):
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate(["Hello"], p, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = llm.generate(
        ["Hello"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate(
        ["Hello"],
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    toks = llm.generate(["Hello"], p, use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = toks[4]
    first = toks.index(stop_tok)
    out = llm.generate(
        ["Hello"],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == toks[: first + 1] and out.stop_reason == stop_tok
    longer = llm.generate(
        ["Hello"],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=10, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(longer.token_ids) >= 10 and stop_tok not in longer.token_ids[:10]


def test_eos_stops_unless_ignored(llm):
    toks = (
        llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    engine, saved = llm.llm_engine, llm.llm_engine.eos_token_ids
    engine.eos_token_ids = {toks[3]}  # pretend the 4th greedy token is the model's eos
    try:
        out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
        ignored = llm.generate(
            ["Hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )[0].outputs[0]
    finally:
        engine.eos_token_ids = saved
    assert out.token_ids == toks[: toks.index(toks[3]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert ignored.token_ids == toks and ignored.finish_reason == "length"


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=-5),
        dict(n=0),
        dict(max_tokens=0),
        dict(min_p=2),
        dict(presence_penalty=5),
        dict(repetition_penalty=0),
        dict(logprobs=-1),
    ],
)
def test_bad_parameters_raise_naming_the_field(bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_chat_applies_template(llm):
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "Hello"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert (
        out.prompt_token_ids
        == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    )


def test_token_id_prompts_and_order(llm):
    outs = llm.generate(
        [[5, 6, 7], "Hello", {"prompt_token_ids": [9, 10]}],
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.prompt_token_ids[:2] for o in outs] == [[5, 6], llm.get_tokenizer().encode("Hello")[:2], [9, 10]]
