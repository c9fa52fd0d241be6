"""The grammar gate of thinking models: a constraint starts after `</think>` (free reasoning before it, the
grammar's bitmask after it, rebuilt the same from the tokens), and constrained greedy output is the same with the
overlapped loop and with speculative decoding as without."""

import json
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from novainfer import LLM, SamplingParams
from novainfer.config import EngineConfig
from novainfer.sampling_params import StructuredOutputsParams
from novainfer.structured_output import StructuredOutputManager
from tests.thinking_model import make_thinking_model
from tests.tiny_models import make_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["unit", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    return make_thinking_model(str(tmp_path_factory.mktemp("thinking")))


def _seq(tokens: list[int], state) -> SimpleNamespace:
    return SimpleNamespace(
        seq_id=0, grammar=state, output_token_ids=tokens, num_output_tokens=len(tokens), min_tokens_blocked=[]
    )


def _allowed(mask: torch.Tensor, vocab: int) -> set[int]:
    bits = ((mask.unsqueeze(-1) >> torch.arange(32)) & 1).flatten()[:vocab]
    return set(torch.nonzero(bits).flatten().tolist())


def test_the_grammar_starts_after_the_end_of_reasoning():
    tok = make_tokenizer(extra_tokens=("<think>", "</think>"))
    vocab, end = len(tok), tok.convert_tokens_to_ids("</think>")
    manager = StructuredOutputManager(tok, vocab, {tok.eos_token_id})
    grammar = manager.compile(StructuredOutputsParams(choice=["yes", "no"]))
    ungated = manager.new_state(grammar)
    assert manager.grammar_bitmask([_seq([], ungated)]) is not None  # no gate: constrained from the first token
    state = manager.new_state(grammar, after=[end])
    out: list[int] = []
    for t in tok.encode("Let me think", add_special_tokens=False):
        assert manager.grammar_bitmask([_seq(out, state)]) is None  # reasoning samples freely
        out.append(t)
        manager.accept(state, out)
    out.append(end)
    manager.accept(state, out)
    mask = manager.grammar_bitmask([_seq(out, state)])
    allowed = _allowed(mask.bitmask[0], vocab)
    assert end not in allowed and tok.encode("y", add_special_tokens=False)[0] in allowed
    assert len(allowed) < vocab // 4
    rebuilt = manager.new_state(grammar, after=[end])  # a state behind its tokens is rebuilt from them
    assert torch.equal(manager.grammar_bitmask([_seq(out, rebuilt)]).bitmask, mask.bitmask)
    for t in tok.encode("yes", add_special_tokens=False):
        out.append(t)
        manager.accept(state, out)  # raises if the grammar had not started after </think>
    assert state.matcher.is_terminated()


def _outputs(path: str, **kw) -> list[list[int]]:
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, num_gpu_blocks=128, **kw)
    tok_end = llm.get_tokenizer().convert_tokens_to_ids("</think>")
    prompt = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    gated = SamplingParams(
        temperature=0,
        max_tokens=48,
        logit_bias={tok_end: 2.0},
        structured_outputs=StructuredOutputsParams(json=SCHEMA, after_tokens=[tok_end]),
    )
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([prompt, prompt + "a b a b a b"], [gated, free], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs[0].outputs[0].text


@pytest.fixture(scope="module")
def baseline(thinking):
    """The synchronous loop's greedy tokens, after checking the constrained output: reasoning, then the schema."""
    tokens, text = _outputs(thinking)
    reasoning, sep, answer = text.partition("</think>")
    assert sep and reasoning, text  # some free reasoning, closed (the bias) within the budget, then the schema
    jsonschema.validate(json.loads(answer), SCHEMA)
    return tokens


def test_gated_structured_output_is_identical_with_speculation(thinking, baseline):
    spec, _ = _outputs(
        thinking, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    )
    assert spec == baseline


def test_gated_structured_output_is_identical_with_the_overlapped_loop(thinking, baseline, monkeypatch):
    monkeypatch.setattr(EngineConfig, "use_async_scheduling", lambda self: True)
    overlap, _ = _outputs(thinking)
    assert overlap == baseline


@pytest.mark.parametrize("choice,min_tokens", [("", 2), ("yes", 6)])
def test_min_tokens_yields_to_a_grammar_at_its_end(thinking, choice, min_tokens):
    """A grammar that allows only its end (eos) wins over min_tokens: the output ends there, with no error."""
    llm = LLM(thinking, dtype="float32", device="cpu")
    params = SamplingParams(
        temperature=0, max_tokens=8, min_tokens=min_tokens, structured_outputs=StructuredOutputsParams(choice=[choice])
    )
    out = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == (choice, "stop")
