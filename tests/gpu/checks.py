"""The pass/fail ledger the GPU check scripts print at the end."""

from __future__ import annotations

rows: list[tuple[str, str, bool]] = []


def check(name: str, detail: str, ok: bool) -> None:
    rows.append((name, detail, ok))
    print(("PASS " if ok else "FAIL ") + name + ": " + detail, flush=True)


def paged_case(
    dev: str, g, ctx: list[int], q_lens: list[int], bs: int, heads: int, kv_heads: int, hd: int, dtype, spare: int = 8
):
    """A random paged cache holding each context (shuffled blocks) and q_lens new query tokens per sequence:
    (q, k_cache, v_cache, block_tables, AttentionMetadata)."""
    import torch

    from novainfer.attention.metadata import AttentionMetadata

    seq_lens = [c + q for c, q in zip(ctx, q_lens)]
    nb = [(s + bs - 1) // bs for s in seq_lens]
    perm = torch.randperm(sum(nb) + spare, device=dev, generator=g).tolist()
    tables, used = [], 0
    for n in nb:
        tables.append(perm[used : used + n] + [-1] * (max(nb) - n))
        used += n
    bt = torch.tensor(tables, dtype=torch.int32, device=dev)
    kc = torch.randn(sum(nb) + spare, bs, kv_heads, hd, device=dev, generator=g).to(dtype)
    vc = torch.randn(kc.shape, device=dev, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), heads, hd, device=dev, generator=g).to(dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32, device=dev),
        torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        torch.zeros(0, dtype=torch.long, device=dev),
        bt,
        max(q_lens),
        max(seq_lens),
        qsl,
        seq_lens,
    )
    return q, kc, vc, bt, meta
