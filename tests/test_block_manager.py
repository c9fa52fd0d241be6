"""BlockManager and Scheduler bookkeeping, without a model."""

from novainfer.config import SchedulerConfig
from novainfer.engine.block_manager import BlockManager, hash_block
from novainfer.engine.scheduler import Scheduler
from novainfer.sequence import Sequence, SequenceStatus
from novainfer.sampling_params import SamplingParams


def seq(tokens):
    return Sequence(tokens, SamplingParams(max_tokens=8))


def test_hash_chains_on_previous_block():
    a = hash_block([1, 2, 3, 4], -1)
    assert a == hash_block([1, 2, 3, 4], -1)
    assert hash_block([5, 6, 7, 8], a) != hash_block([5, 6, 7, 8], -1)


def test_prefix_hit_shares_blocks_and_refcounts():
    bm = BlockManager(num_blocks=10, block_size=4)
    s1 = seq(list(range(10)))
    bm.admit(s1, bm.find_cached_prefix(s1))
    bm.allocate_slots(s1, 10)
    assert len(s1.block_table) == 3 and len(s1.block_hashes) == 2  # two full blocks registered
    s2 = seq(list(range(8)) + [99, 98, 97])
    hits = bm.find_cached_prefix(s2)
    assert hits == s1.block_table[:2]
    bm.admit(s2, hits)
    assert s2.num_computed_tokens == 8
    assert [bm.blocks[b].ref_count for b in s1.block_table] == [2, 2, 1]
    bm.free(s1)
    bm.free(s2)
    assert bm.num_free_blocks == 10


def test_hit_leaves_a_token_to_compute_and_verifies_tokens():
    bm = BlockManager(num_blocks=10, block_size=4)
    s1 = seq(list(range(8)))
    bm.admit(s1, [])
    bm.allocate_slots(s1, 8)
    bm.free(s1)
    same = seq(list(range(8)))
    assert len(bm.find_cached_prefix(same)) == 1  # the last block is recomputed for its logits
    # a hash collision must not be trusted: corrupt the stored tokens
    bm.blocks[bm.hash_to_block_id[hash_block([0, 1, 2, 3], -1)]].token_ids = [9, 9, 9, 9]
    assert bm.find_cached_prefix(seq(list(range(8)) + [1])) == []


def test_freed_blocks_keep_hash_until_reused_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    s1 = seq([1, 2, 3, 4, 5])
    bm.admit(s1, [])
    bm.allocate_slots(s1, 5)
    bm.free(s1)
    assert len(bm.find_cached_prefix(seq([1, 2, 3, 4, 7]))) == 2
    # allocating every block evicts the cached ones
    s2 = seq(list(range(100, 108)))
    bm.admit(s2, [])
    bm.allocate_slots(s2, 8)
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 7])) == []


def test_scheduler_preempts_newest_and_respects_limits():
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), bm)
    seqs = [seq(list(range(i * 10, i * 10 + 8))) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [x.seq for x in out.scheduled] == seqs[:2]  # max_num_seqs
    for s in seqs[:2]:
        s.append_token(1)
    # decode steps until blocks run out: 2 seqs x 3 blocks = 6 blocks, so growth past 12 tokens preempts
    preempted = 0
    for _ in range(8):
        out = sched.schedule()
        preempted += out.num_preempted
        sampling = [x.seq for x in out.scheduled if x.samples]
        for s in sampling:
            s.append_token(1)
    assert preempted > 0 and seqs[1].num_preemptions > 0 and seqs[0].num_preemptions == 0
    assert seqs[1].status == SequenceStatus.WAITING


def test_chunked_prefill_splits_by_budget():
    bm = BlockManager(num_blocks=20, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10), bm)
    s = seq(list(range(25)))
    sched.add(s)
    chunks = []
    while s.num_computed_tokens < 25:
        out = sched.schedule()
        chunks.append(out.scheduled[0].num_new_tokens)
        assert out.scheduled[0].samples == (out.scheduled[0].start + chunks[-1] == 25)
    assert chunks == [10, 10, 5]


def test_unmixed_steps_carry_prompt_or_decode_tokens_never_both():
    """Batch-invariant mode's scheduler (mixed_steps=False): while prompts are waiting or mid-prefill a step carries
    prompt tokens only; decodes resume when none can go, and every sequence still finishes."""
    bm = BlockManager(num_blocks=40, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), bm, mixed_steps=False)
    seqs = [seq(list(range(10 + i))) for i in range(3)]
    sched.add(seqs[0])
    kinds, steps = [], 0
    while sched.has_unfinished() and steps < 200:
        if steps == 3:  # arrives while the first decodes
            for s in seqs[1:]:
                sched.add(s)
        out = sched.schedule()
        prompt = [x for x in out.scheduled if x.start < x.seq.num_prompt_tokens]
        decode = [x for x in out.scheduled if x.start >= x.seq.num_prompt_tokens]
        assert not (prompt and decode), out.scheduled
        kinds.append("p" if prompt else "d")
        for x in out.scheduled:  # the step ran: a sampled token for each sequence that samples
            x.seq.num_pending_tokens = 0
            if x.samples:
                x.seq.append_token(7)
                if x.seq.num_output_tokens >= 4:
                    sched.finish(x.seq)
        steps += 1
    assert not sched.has_unfinished() and "p" in kinds[3:] and "d" in kinds
