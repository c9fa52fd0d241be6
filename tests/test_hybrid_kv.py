"""The grouped KV cache (worker/kv_layout.py, engine/kv_group_manager.py): sliding-window layers keep only their
window. Tiny Gemma 3 (sliding/full) and Mistral (every layer sliding) checkpoints with a window of 7 and blocks of
4: greedy output equals transformers and the whole-context layout with prompts and generations past the window;
blocks are given back as the window passes them; prefix-cache hits and preemption stay exact; the same memory
holds the expected multiple of context."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from novainfer import LLM, SamplingParams
from novainfer.engine.kv_group_manager import KVGroupBlockManager
from novainfer.sampling_params import SamplingParams as Params
from novainfer.sequence import Sequence
from novainfer.worker import model_runner
from novainfer.worker.kv_layout import NULL_BLOCK, KVGroup, plan_kv_layout
from tests.tiny_models import WINDOW, hf_greedy_with, make_tiny_model

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The capital of France is",
    "Hello, my name is",
    "One two three four five six seven eight nine ten eleven twelve",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {
        arch: make_tiny_model(str(tmp_path_factory.mktemp(arch)), arch, seed=17, layers=layers)
        for arch, layers in (("gemma3", 2), ("mistral", 2))
    }


def run(path: str, prompts: list[str], **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16, **kw)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def whole_context(monkeypatch) -> None:
    """The layout every layer kept before: the whole context (the reference the grouped one must equal)."""
    monkeypatch.setattr(model_runner, "kv_layout_of", lambda layers, block_size: None)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_greedy_equals_transformers_and_the_whole_context_layout(arch, paths, monkeypatch):
    got, llm = run(paths[arch], PROMPTS)
    bm = llm.llm_engine.block_manager
    assert isinstance(bm, KVGroupBlockManager)
    assert [g.sliding_window for g in bm.groups] == ([None, WINDOW] if arch == "gemma3" else [WINDOW])
    tok = llm.get_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(paths[arch], dtype=torch.float32).eval()
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == hf_greedy_with(model, tok.encode(prompt), GREEDY.max_tokens), prompt
    llm.llm_engine.shutdown()
    whole_context(monkeypatch)
    ref, llm = run(paths[arch], PROMPTS)
    assert not isinstance(llm.llm_engine.block_manager, KVGroupBlockManager)
    assert got == ref


def test_prefix_cache_hit_is_exact(paths):
    """A second request with the same long prompt starts from cached blocks (past the window) and decodes the
    same tokens as the cache-off run; so does a next turn (a session's) that continues prompt and reply."""
    path = paths["gemma3"]
    prompt = PROMPTS[0] + " and the capital of Spain is"
    off = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    on = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16, enable_prefix_caching=True)
    first = on.generate([prompt], GREEDY, use_tqdm=False)[0]
    second = on.generate([prompt], GREEDY, use_tqdm=False)[0]
    ref = off.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens > 2 * WINDOW
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == ref.outputs[0].token_ids
    turn = {"prompt_token_ids": first.prompt_token_ids + first.outputs[0].token_ids + [5, 6, 7]}
    cont, cont_ref = (llm.generate([turn], GREEDY, use_tqdm=False)[0] for llm in (on, off))
    assert cont.num_cached_tokens >= len(turn["prompt_token_ids"]) - 3 - 4
    assert cont.outputs[0].token_ids == cont_ref.outputs[0].token_ids


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_preemption_under_a_tiny_cache(arch, paths, monkeypatch):
    got, llm = run(paths[arch], PROMPTS * 2, num_gpu_blocks={"gemma3": 40, "mistral": 12}[arch])
    assert llm.llm_engine.scheduler.num_preemptions > 0
    whole_context(monkeypatch)
    ref, _ = run(paths[arch], PROMPTS * 2)
    assert got == ref


def test_sliding_groups_free_blocks_past_the_window():
    """A sequence decoding past the window: the full group keeps every block, each sliding group only those its
    window reaches (given back at the latest with the step that opens the next block), the rest go back to the
    pool."""
    groups = (KVGroup(None, 4), KVGroup(WINDOW, 4), KVGroup(WINDOW, 4))
    bm = KVGroupBlockManager(64, 4, groups, enable_prefix_caching=True)
    free0 = bm.num_free_blocks
    assert free0 == 63  # the null block is never handed out
    seq = Sequence(list(range(100, 110)), Params(max_tokens=40))
    bm.admit(seq, bm.find_cached_prefix(seq))
    bm.allocate_slots(seq, 10)
    seq.num_computed_tokens = 10
    assert bm.group_usage(seq) == [3, 3, 3]
    for t in range(30):
        seq.append_token(200 + t)
        bm.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        start = seq.num_computed_tokens - 1
        gone = max(0, start - WINDOW + 1) // 4  # blocks wholly below the window of the step from start
        kept = (start + 1 + 3) // 4 - gone
        usage = bm.group_usage(seq)
        assert usage[0] == (start + 4) // 4 and usage[1] == usage[2], start
        assert kept <= usage[1] <= kept + 1 and (usage[1] == kept or start % 4), start
        assert all(b == NULL_BLOCK for b in seq.group_tables[0][: gone - 1])
    assert bm.group_usage(seq)[1] <= (WINDOW + 3) // 4 + 2
    assert free0 - bm.num_free_blocks == sum(bm.group_usage(seq))
    bm.free(seq)
    assert bm.num_free_blocks == free0


def test_same_memory_holds_more_context(paths):
    """Gemma 3's 5:1 pattern: the grouped layout holds about six times the context in the memory that held the
    whole-context layout's tokens; in the engine, the same CPU budget gives more context than before."""
    sliding, full = (1024, 16 * 128), (None, 16 * 128)
    layout = plan_kv_layout([sliding] * 5 + [full] + [sliding] * 5 + [full], 16)
    whole_blocks = 4096  # 64k tokens of every layer
    blocks = whole_blocks * 12 // layout.num_slots  # the same bytes in blocks of num_slots layers
    assert 5.5 * whole_blocks * 16 < layout.max_context(blocks) < 6 * whole_blocks * 16
    llm = LLM(paths["gemma3"], dtype="float32", block_size=4, cpu_kv_cache_tokens=400, max_model_len=512)
    bm = llm.llm_engine.block_manager
    assert bm.num_blocks == 400 // 4 * 2  # 2 layers a whole-context block, 1 layer a pool block
    assert llm.llm_engine.engine_core.max_model_len == 512  # more than the whole-context layout's 400 tokens
    tokens = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True), use_tqdm=False)
    assert len(tokens[0].outputs[0].token_ids) == 300


def test_prefix_hit_needs_only_the_window():
    """A hit past the window takes every block of the full group and only the window's blocks of the sliding one
    (null below it); once a window block is evicted, the hit ends before it."""
    groups = (KVGroup(None, 4), KVGroup(WINDOW, 4))
    bm = KVGroupBlockManager(64, 4, groups, enable_prefix_caching=True)
    prompt = list(range(100, 141))  # 41 tokens: a hit leaves the last one to compute
    a = Sequence(prompt, Params(max_tokens=4))
    bm.admit(a, bm.find_cached_prefix(a))
    bm.allocate_slots(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    bm.free(a)
    b = Sequence(prompt, Params(max_tokens=4))
    hit = bm.find_cached_prefix(b)
    assert hit.num_tokens == 40
    lo = (40 - WINDOW + 1) // 4
    assert hit.block_ids[1][:lo] == [NULL_BLOCK] * lo and NULL_BLOCK not in hit.block_ids[1][lo:]
    assert len(hit.block_ids[0]) == len(hit.block_ids[1]) == 10 and NULL_BLOCK not in hit.block_ids[0]
    assert bm.can_admit(b, hit, 1)
    bm.admit(b, hit)
    assert bm.group_usage(b) == [10, 10 - lo] and b.num_computed_tokens == 40
    bm.free(b)
    # evict the sliding group's last window block: the hit must end where that group's window is still whole
    victim = hit.block_ids[1][-1]
    while True:
        taken = bm._take_free_block()
        if taken == victim:
            break
    assert bm.find_cached_prefix(Sequence(prompt, Params(max_tokens=4))).num_tokens < 40


def test_step_wire_sends_the_group_tables():
    """The mp driver's step message carries the other groups' tables when one grew, and the worker's mirror
    takes them."""
    from novainfer.executor.step_wire import StepPacker, StepReceiver
    from novainfer.step_types import ScheduledSequence, SchedulerOutput

    seq = Sequence([1, 2, 3, 4, 5], Params(max_tokens=4))
    seq.block_table, seq.group_tables = [3, 4], [[5, 6]]
    packer, receiver = StepPacker(), StepReceiver(worker=None)
    mirror_of = lambda: receiver.seqs[seq.seq_id]  # noqa: E731
    receiver.unpack(packer.pack(SchedulerOutput([ScheduledSequence(seq, 5)])))
    assert mirror_of().block_table == [3, 4] and mirror_of().group_tables == [[5, 6]]
    seq.num_computed_tokens = 5
    seq.group_tables[0].append(7)
    seq.group_tables[0][0] = NULL_BLOCK
    msg = packer.pack(SchedulerOutput([ScheduledSequence(seq, 1)]))
    assert msg.rows[0][5] is None  # group 0's table did not change
    receiver.unpack(msg)
    assert mirror_of().group_tables == [[NULL_BLOCK, 6, 7]]
    assert packer.pack(SchedulerOutput([ScheduledSequence(seq, 1)])).rows[0][8] is None  # nothing changed


def test_ngram_speculation_equals_plain_decoding(paths):
    """Verify steps over a grouped cache (guesses past the window, rejected ones rolled back) decode as plain
    steps do."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], [100, 200, 300] * 6]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    outs = []
    for kw in ({}, {"speculative_config": spec}):
        llm = LLM(paths["gemma3"], dtype="float32", block_size=4, num_gpu_blocks=128, **kw)
        assert isinstance(llm.llm_engine.block_manager, KVGroupBlockManager)
        outs.append(
            [
                o.outputs[0].token_ids
                for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            ]
        )
    assert outs[0] == outs[1]


def test_decode_graph_inputs_per_group():
    """A decode graph's static inputs hold a block table and slot row per KV group; each group's metadata reads its
    own, and rows padded up to the captured batch size write nowhere (slot -1) in every group."""
    from novainfer.worker.cuda_graph import DecodeGraphs

    graphs = DecodeGraphs(lambda i, p: None, 4, 3, 8, torch.float32, torch.device("cpu"), lambda bs: 1, num_groups=2)
    tables = torch.arange(1, 13, dtype=torch.int32).view(2, 3, 2)
    zeros = torch.zeros(3, dtype=torch.long)
    graphs.load_inputs(zeros, zeros, torch.arange(6).view(2, 3), torch.tensor([5, 6, 7], dtype=torch.int32), tables)
    meta = graphs.metadata(4)
    assert [g.block_tables[:3, :2].tolist() for g in meta.groups] == tables.tolist()
    assert [g.slot_mapping.tolist() for g in meta.groups] == [[0, 1, 2, -1], [3, 4, 5, -1]]
    assert meta.groups[0] is meta and meta.seq_lens.tolist() == [5, 6, 7, 1]


def test_gemma4_full_layers_take_longer_blocks(tmp_path):
    """Gemma 4 with full-attention layers half as wide a token as its sliding ones (1 KV head of 32 against 4 of
    16): their group's blocks hold 8 tokens where the sliding groups' hold 4, in the same bytes. Greedy equals
    transformers in a batch, on prefix-cache hits (aligned to both block sizes) and under preemption."""
    from tests.test_gemma4 import PROMPTS as G4_PROMPTS, hf_greedy, save_tiny

    path = save_tiny(tmp_path, moe=False, num_global_key_value_heads=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16, enable_prefix_caching=True)
    bm = llm.llm_engine.block_manager
    assert [(g.sliding_window, g.block_size) for g in bm.groups] == [(None, 8), (WINDOW, 4), (WINDOW, 4)]
    ids = [llm.get_tokenizer().encode(p) for p in G4_PROMPTS]
    refs = [hf_greedy(model, i, 16) for i in ids]
    for _ in range(2):  # the second pass starts from cached prefixes
        outs = llm.generate(G4_PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs
    assert max(o.num_cached_tokens for o in outs) >= 8 and all(o.num_cached_tokens % 8 == 0 for o in outs)
    small = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=16, num_gpu_blocks=30)
    outs = small.generate(G4_PROMPTS * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs * 2
    assert small.llm_engine.scheduler.num_preemptions > 0


def test_capacity_benchmark_gemma3_27b():
    """benchmarks/kv_capacity.py's Gemma-3-27B row against the arithmetic: 62 layers of 16 KV heads x 128 in bf16
    before; after, 10 full layers a pool block (one full group, six sliding ones of up to 10 layers, each holding
    its 1024-token window in at most 66 blocks of 16)."""
    from benchmarks.kv_capacity import capacity_row

    budget = 40 << 30
    row = capacity_row("gemma-3-27b", budget, 16, 32768, 2)
    token = 2 * 16 * 128 * 2  # K and V of one layer, bytes
    assert row["before"] == budget // (62 * token * 16) * 16
    blocks = budget // (10 * token * 16)
    assert row["after"] == (blocks - 1 - 6 * 66) * 16
    assert 6.0 < row["after"] / row["before"] < 62 / 10
