"""Incremental detokenization never shows half a character, and stop strings are found across deltas."""

from novainfer.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from tests.tiny_models import make_tokenizer

TEXT = "héllo wörld, 你好世界 🙂🚀 naïve café <|im_end|> done"


def test_deltas_are_utf8_safe_and_add_up():
    tok = make_tokenizer()
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT) / 4
    prompt = tok.encode("Hello, my name is")
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
    deltas = [detok.step([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == tok.decode(ids)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens hold back an incomplete character


def test_skip_special_tokens():
    tok = make_tokenizer()
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    for i in ids:
        detok.step([i])
    assert "<|im_end|>" not in detok.output_text
    assert detok.output_text == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_across_two_deltas():
    text = "Hello wor"
    assert check_stop_strings(text, 3, ["world"], False) is None
    text += "ld and more"
    assert check_stop_strings(text, len("ld and more"), ["world"], False) == ("world", 6)
    assert check_stop_strings(text, len("ld and more"), ["world"], True) == ("world", 11)
    # the earliest of several stop strings wins
    assert check_stop_strings("abc STOP x END", 14, ["END", "STOP"], False) == ("STOP", 4)


def test_final_only_output_text_equals_streamed_text(tiny_qwen2):
    """LLM.generate defers detokenization to the end; the text must equal the per-step (streamed) text."""
    from novainfer import LLM, SamplingParams
    from novainfer.sampling_params import RequestOutputKind

    llm = LLM(tiny_qwen2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    final = llm.generate(["héllo wörld", "def add(a, b):"], params, use_tqdm=False)
    engine = llm.llm_engine
    for i, prompt in enumerate(["héllo wörld", "def add(a, b):"]):
        engine.add_request(f"s{i}", prompt, params)
    streamed = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] = out.outputs[0].text
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    assert [streamed["s0"], streamed["s1"]] == [o.outputs[0].text for o in final]
    assert all(o.outputs[0].text for o in final)


def test_last_token_completing_one_character_and_starting_another_ends_as_decode_does():
    """Streamed (step) and deferred (flush) text end alike and equal tokenizer.decode of the ids: the complete
    character, then the dangling byte as U+FFFD (it used to vanish at the finish)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = make_tokenizer()
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    raw = {
        i: bytes(byte_of[c] for c in tok.convert_ids_to_tokens(i))
        for i in range(len(tok))
        if all(c in byte_of for c in tok.convert_ids_to_tokens(i))
    }
    # a token of two non-ASCII bytes, the first a continuation byte, like '¸ĸ' (0xB8 0x96): after 0xC7 it ends
    # 'Ǹ' and leaves a byte that no later token can make whole
    tail = next(i for i, b in raw.items() if len(b) == 2 and 0x80 <= b[0] < 0xC0 and b[1] >= 0x80)
    lead = next(i for i, b in raw.items() if b == b"\xc7")
    hello = tok.encode("Hello")
    ids = hello + [lead, tail]
    expected = tok.decode(ids)
    assert expected.endswith(bytes([0xC7, raw[tail][0]]).decode() + "\ufffd")
    streamed = IncrementalDetokenizer(tok, [])
    assert streamed.step(hello) == "Hello"
    assert streamed.step([lead]) == streamed.step([tail]) == ""  # both held back: each ends mid-character
    deferred = IncrementalDetokenizer(tok, [])  # never stepped: flush decodes the whole output at once
    for detok in (streamed, deferred, streamed, deferred):  # flush twice: idempotent
        detok.flush(ids)
        assert detok.output_text == expected


def test_byte_level_prefix_reuse_gives_the_plain_deltas():
    """With a byte-level decoder the next window's text is taken from the last delta (one decode per token);
    random ids, valid text or stray bytes, must give the same deltas as decoding both windows every step,
    and end as tokenizer.decode does."""
    import random

    tok = make_tokenizer()
    rng = random.Random(0)
    text_ids = tok.encode(TEXT)
    fast_steps = 0
    for trial in range(400):
        pool = text_ids if trial % 2 else list(range(len(tok)))
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 40))]
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 8))]
        for skip in (True, False):
            fast = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
            plain = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
            plain._delta_is_prefix = False
            assert fast._delta_is_prefix
            deltas = []
            for i in ids:
                deltas.append(fast.step([i]))
                fast_steps += fast._prefix_text is not None
            assert deltas == [plain.step([i]) for i in ids]
            fast.flush(ids)
            plain.flush(ids)
            assert fast.output_text == plain.output_text
            if not prompt:
                assert fast.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert fast_steps > 1000  # the reuse did happen
