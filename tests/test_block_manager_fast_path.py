"""BlockManager's fast allocate path against the straightforward one, through the real scheduler.

Two schedulers run the same random workload in lockstep (shared prefixes, chunked prefill, preemption, finishes,
tokens applied at once or one step late as with async scheduling): one over BlockManager, one over a reference
that grows tables block by block and rehashes every full block with the numpy formula. Block tables, hashes,
the prefix cache and the free list must be equal after every step.
"""

import random

import numpy as np
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from novainfer.config import SchedulerConfig
from novainfer.engine.block_manager import BlockManager, hash_block
from novainfer.engine.scheduler import Scheduler
from novainfer.sequence import Sequence
from novainfer.sampling_params import SamplingParams


def reference_hash(token_ids: list[int], prev_hash: int) -> int:
    h = xxhash.xxh64()
    h.update(prev_hash.to_bytes(8, "little", signed=True))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest() - (1 << 63)


class ReferenceBlockManager(BlockManager):
    """allocate_slots written the plain way: one block at a time, every full block checked on every call."""

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead_slots: int = 0) -> None:
        total = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) < self.blocks_needed(total + num_lookahead_slots):
            seq.block_table.append(self._take_free_block())
        if not self.enable_prefix_caching:
            return
        num_full = min(total, len(seq)) // self.block_size
        for i in range(len(seq.block_hashes), num_full):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            prev = reference_hash(tokens, seq.block_hashes[-1] if seq.block_hashes else -1)
            seq.block_hashes.append(prev)
            block = self.blocks[seq.block_table[i]]
            if block.hash == -1 and prev not in self.hash_to_block_id:
                block.hash, block.token_ids = prev, tokens
                self.hash_to_block_id[prev] = block.block_id


def test_hash_block_equals_the_numpy_formula():
    rng = random.Random(0)
    prev = -1
    for n in (1, 4, 16, 33):
        tokens = [rng.randrange(0, 2**31) for _ in range(n)]
        assert hash_block(tokens, prev) == reference_hash(tokens, prev)
        prev = hash_block(tokens, prev)
    assert hash_block([0, 2**40], -(2**63)) == reference_hash([0, 2**40], -(2**63))


def state(sched: Scheduler) -> tuple:
    bm = sched.block_manager
    seqs = [
        (s.request_id, s.status.value, s.num_computed_tokens, list(s.block_table), list(s.block_hashes))
        for s in list(sched.running) + list(sched.waiting)
    ]
    blocks = [(b.ref_count, b.hash, list(b.token_ids)) for b in bm.blocks]
    return seqs, blocks, dict(bm.hash_to_block_id), list(bm.free_block_ids)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(4, 40),
    budget=st.integers(1, 48),
    overlap=st.booleans(),
    caching=st.booleans(),
    lookahead=st.sampled_from([0, 3]),
)
def test_fast_allocate_equals_reference(seed, block_size, num_blocks, budget, overlap, caching, lookahead):
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget)
    pair = [
        Scheduler(cfg, cls(num_blocks, block_size, caching), lookahead)  # lookahead: a draft model's slots
        for cls in (BlockManager, ReferenceBlockManager)
    ]
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
    for i in range(6):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 10))]
        for sched in pair:
            sched.add(Sequence(prompt, SamplingParams(max_tokens=8), f"r{i}"))
    pending: list[list] = [[], []]  # per scheduler: sequences whose sampled token is still to be appended
    for _ in range(60):
        if not pair[0].has_unfinished():
            break
        outs = [sched.schedule() for sched in pair]
        assert [[(s.seq.request_id, s.num_new_tokens) for s in o.scheduled] for o in outs] == [
            [(s.seq.request_id, s.num_new_tokens) for s in outs[1].scheduled]
        ] * 2
        assert state(pair[0]) == state(pair[1])
        for s in pair[0].running:  # and what the definition says, as planned (before this step's tokens arrive)
            bm = pair[0].block_manager  # a draft model's lookahead slots may hold blocks past the computed tokens
            assert (
                bm.blocks_needed(s.num_computed_tokens)
                <= len(s.block_table)
                <= bm.blocks_needed(s.num_computed_tokens + lookahead)
            )
            num_full = min(s.num_computed_tokens, len(s)) // block_size if caching else 0
            chain, prev = [], -1
            for i in range(num_full):
                prev = reference_hash(s.token_ids[i * block_size : (i + 1) * block_size], prev)
                chain.append(prev)
            assert s.block_hashes == chain
        token, finish = rng.randrange(50), rng.random() < 0.1
        for k, (sched, out) in enumerate(zip(pair, outs)):
            sampled = [s.seq for s in out.scheduled if s.samples]
            ready, pending[k] = (pending[k], sampled) if overlap else (sampled, [])
            for seq in ready:
                if seq.num_pending_tokens and not seq.is_finished:
                    seq.append_token(token)
                    if finish or seq.num_output_tokens >= 8:
                        sched.finish(seq)
        assert state(pair[0]) == state(pair[1])


def test_taking_blocks_stays_constant_time_in_a_large_cache():
    """An H200's cache has ~366k blocks; the free list must not get slower as blocks are taken from its front
    (a dict did: each take scanned the holes earlier takes left, ~18x slower after 18k takes)."""
    import statistics
    import time

    bm = BlockManager(num_blocks=100_000, block_size=16)

    def chunk_us() -> float:
        t0 = time.perf_counter()
        for _ in range(50):
            bm._take_free_block()
        return (time.perf_counter() - t0) / 50 * 1e6

    first = statistics.median(chunk_us() for _ in range(40))
    for _ in range(16_000 // 50):
        chunk_us()
    last = statistics.median(chunk_us() for _ in range(40))
    assert last < 4 * first + 1.0, (first, last)
    assert bm.num_free_blocks == 100_000 - 20_000
