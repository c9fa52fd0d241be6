"""The core API by example: several chats share one system prompt through kv_seq_cp and decode in one batch.

    python examples/core_api.py [MODEL]        # MODEL: an HF folder or .gguf file; default: the shipped model

The system prompt is decoded once into sequence 0, then attached to sequences 1..n without copying
any K/V; each question and every generated token after it go in one batch per step, and the next
token of each sequence is read from its logits row.
"""
from __future__ import annotations

import sys

from novainfer.core import Batch, Context, Status

SYSTEM = "You are a concise assistant. Answer in one short sentence."
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?"]


def chat_suffix_ids(tokenizer, question: str) -> tuple[list[int], list[int]]:
    """(system prompt ids, the ids that follow it for this question) under the model's chat template."""
    system = [{"role": "system", "content": SYSTEM}]
    head = tokenizer.apply_chat_template(system, tokenize=False)
    full = tokenizer.apply_chat_template(system + [{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    assert full.startswith(head), "the chat template does not extend the system prompt"
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return encode(head), encode(full[len(head):])


def run(model: str | None = None, questions: list[str] = QUESTIONS, max_new_tokens: int = 24,
        verbose: bool = True) -> tuple[list[int], dict[int, list[int]], dict[int, list[int]]]:
    """Greedy answers; returns (system ids, question ids per sequence, generated ids per sequence)."""
    ctx = Context(model, n_cells=1024, n_seq_max=len(questions) + 1)
    tok = ctx.tokenizer
    parts = [chat_suffix_ids(tok, q) for q in questions]
    system = parts[0][0]
    prompts = {s + 1: suffix for s, (_, suffix) in enumerate(parts)}
    eos = tok.eos_token_id

    # 1. the shared prefix, once, in sequence 0; then every chat sequence attaches to its cells
    if ctx.decode(Batch.get_one(system)) != Status.OK:
        raise RuntimeError("decoding the system prompt failed")
    for s in prompts:
        ctx.kv_seq_cp(s, 0, 0, -1)
    ctx.kv_seq_rm(0, 0, -1)  # sequence 0 itself is not needed any more; the cells stay with 1..n

    # 2. all questions in one batch, logits only for each question's last token
    batch = Batch.init(sum(len(p) for p in prompts.values()), n_seq_max=1)
    last_index = {}
    for s, ids in prompts.items():
        for j, t in enumerate(ids):
            batch.add(t, len(system) + j, [s], logits=j == len(ids) - 1)
        last_index[s] = batch.n_tokens - 1
    generated: dict[int, list[int]] = {s: [] for s in prompts}
    active = set(prompts)
    while True:
        rc = ctx.decode(batch)
        if rc != Status.OK:
            raise RuntimeError(f"decode returned {int(rc)} ({Status(rc).name})")
        # 3. one greedy token per live sequence, all in the next batch
        batch = Batch.init(len(prompts), n_seq_max=1)
        for s in sorted(active):
            nxt = int(ctx.get_logits_ith(last_index[s]).argmax())
            generated[s].append(nxt)
            if nxt == eos or len(generated[s]) >= max_new_tokens:
                active.discard(s)
                continue
            last_index[s] = batch.n_tokens
            batch.add(nxt, ctx.kv_seq_pos_max(s) + 1, [s], logits=True)
        if not active:
            break
    if verbose:
        unshared = sum(len(system) + len(p) + len(g) for p, g in zip(prompts.values(), generated.values()))
        print(f"cells used: {ctx.cache.n_used} (without sharing the system prompt: about {unshared})")
        for s, q in zip(prompts, questions):
            print(f"[seq {s}] {q}\n  -> {tok.decode(generated[s], skip_special_tokens=True).strip()}")
    return system, prompts, generated


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else None)
