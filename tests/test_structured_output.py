"""Structured outputs, logit_bias, prompt logprobs and the finished text, offline (LLM) on tiny random models,
checked against independent references: jsonschema / re for constraints, transformers for log-probabilities,
the tokenizer's decode for text; plus the tool-call parsers on hand-written model outputs."""

import json
import re

import jsonschema
import pytest
import torch

from novainfer import LLM, SamplingParams
from novainfer.sampling_params import StructuredOutputsParams
from novainfer.server.tool_parsers import get_tool_parser

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "inner": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 1, "maximum": 3}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
    "required": ["color", "ok", "n", "tags", "inner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # few KV blocks so that n=4 constrained samples get preempted and recomputed mid-output
    return LLM(tiny_llama, device="cpu", dtype="float32", block_size=4, num_gpu_blocks=24)


def test_json_schema_holds_for_random_samples_with_preemption_and_unconstrained_neighbours(llm):
    constrained = SamplingParams(
        n=3, temperature=1.0, seed=0, max_tokens=100, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    free = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=40, ignore_eos=True)
    outs = llm.generate(["Hello", "The quick brown fox", "Hello"], [constrained, free, constrained], use_tqdm=False)
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions > 0  # the grammar state survived recomputation
    for out in (outs[0], outs[2]):
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert all(len(c.token_ids) == 40 for c in outs[1].outputs)  # the free rows were not masked to an early end


def test_regex_choice_and_grammar_hold(llm):
    regex = SamplingParams(
        n=3,
        temperature=1.0,
        seed=2,
        max_tokens=30,
        structured_outputs=StructuredOutputsParams(regex=r"[a-c]{2,4}-\d\d"),
    )
    choice = SamplingParams(
        n=6,
        temperature=1.0,
        seed=3,
        max_tokens=10,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    )
    grammar = SamplingParams(
        n=3,
        temperature=1.0,
        seed=4,
        max_tokens=30,
        structured_outputs=StructuredOutputsParams(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]/'),
    )
    r, c, g = llm.generate(["Hi", "Hi", "Hi"], [regex, choice, grammar], use_tqdm=False)
    assert all(re.fullmatch(r"[a-c]{2,4}-\d\d", o.text) for o in r.outputs), [o.text for o in r.outputs]
    assert all(o.text in ("yes", "no", "maybe") for o in c.outputs)
    assert all(re.fullmatch(r"\(\d(\+\d)*\)", o.text) for o in g.outputs if o.finish_reason == "stop")


def test_invalid_constraints_are_refused_before_queueing(llm):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured output"):
        llm.generate(["Hi"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_grammar_state_is_rebuilt_from_the_tokens(llm):
    """A matcher ahead of its sequence (a rollback: the sequence lost tokens it had accepted) is rebuilt from
    the sequence's output tokens: its mask then equals a fresh matcher's after those tokens."""
    from types import SimpleNamespace

    mgr = llm.llm_engine.structured_output
    tok = llm.get_tokenizer()
    grammar = mgr.compile(StructuredOutputsParams(choice=["abc abc abc"]))
    ids = tok.encode("abc abc abc", add_special_tokens=False)
    assert len(ids) >= 3
    rolled, fresh = mgr.new_state(grammar), mgr.new_state(grammar)
    for i in range(1, 4):
        mgr.accept(rolled, ids[:i])
    for i in range(1, 2):
        mgr.accept(fresh, ids[:i])
    seqs = [
        SimpleNamespace(seq_id=s, grammar=g, num_output_tokens=1, output_token_ids=ids[:1], min_tokens_blocked=())
        for s, g in ((1, rolled), (2, fresh))
    ]
    masks = mgr.grammar_bitmask(seqs)
    assert masks.seq_ids == [1, 2] and rolled.num_accepted == 1
    assert torch.equal(masks.bitmask[0], masks.bitmask[1])
    assert masks.bitmask[0].count_nonzero() > 0


def test_logit_bias_bans_and_forces(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base = llm.generate(["Hello"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    banned = llm.generate(
        ["Hello"],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={base[0]: -100}),
        use_tqdm=False,
    )[0]
    assert base[0] not in banned.outputs[0].token_ids
    forced = llm.generate(
        ["Hello"],
        SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True, logit_bias={17: 100}),
        use_tqdm=False,
    )[0]
    assert forced.outputs[0].token_ids == [17] * 6


def test_prompt_logprobs_match_transformers_across_chunks_and_cache_hits(tiny_llama):
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_llama, device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8)
    tok = llm.get_tokenizer()
    prompt = "The quick brown fox jumps over the lazy dog and the cat"
    ids = tok.encode(prompt)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    for _ in range(2):  # the second run's prompt is in the prefix cache: its logprobs are recomputed
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids) > 8  # several chunks
        for pos in range(1, len(ids)):
            entry = out.prompt_logprobs[pos]
            assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4
            top = ref[pos - 1].topk(2).indices.tolist()
            assert set(top) <= set(entry)


def test_finished_text_equals_decode_of_the_output_ids(tiny_qwen2):
    llm = LLM(tiny_qwen2, device="cpu", dtype="float32")
    tok = llm.get_tokenizer()
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True)
        c = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "parser,text,content,calls",
    [
        (
            "hermes",
            'Sure.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "g", '
            '"arguments": {}}</tool_call>',
            "Sure.",
            [("f", {"a": 1}), ("g", {})],
        ),
        ("hermes", "no call here", "no call here", []),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}', None, [("f", {"a": [1, 2]})]),
        (
            "llama3_json",
            '<|python_tag|>{"name": "f", "parameters": {"q": "x"}}; {"name": "g", "parameters": {}}',
            None,
            [("f", {"q": "x"}), ("g", {})],
        ),
        ("llama3_json", 'The answer is {"name": 1}', 'The answer is {"name": 1}', []),
    ],
)
def test_tool_parsers(parser, text, content, calls):
    got_content, got = get_tool_parser(parser).extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
