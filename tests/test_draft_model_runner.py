"""The draft model's runner (worker/draft_model_runner.py): its greedy guesses equal transformers' greedy
continuation of the draft checkpoint, batched, chunked and incremental over its own paged KV cache."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from novainfer import LLM
from novainfer.config import EngineConfig
from novainfer.engine.llm_engine import load_model_info
from novainfer.sequence import Sequence
from novainfer.sampling_params import SamplingParams
from novainfer.spec_decode.draft_model_proposer import DraftModelProposer
from novainfer.step_types import DraftRequest
from novainfer.worker.worker import Worker
from tests.tiny_models import hf_greedy_with, make_tiny_model

BLOCK_SIZE = 4
NUM_BLOCKS = 48
VOCAB = 400  # make_tiny_model's tokenizer


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """Same tokenizer and vocabulary as the tiny target, another architecture, one layer, one KV head."""
    return make_tiny_model(
        str(tmp_path_factory.mktemp("draft")), "llama", seed=5, layers=1, num_heads=2, num_kv_heads=1
    )


@pytest.fixture(scope="module")
def hf_draft(tiny_draft):
    return AutoModelForCausalLM.from_pretrained(tiny_draft, dtype=torch.float32).eval()


def make_worker(target: str, draft: str, **kw) -> Worker:
    config = EngineConfig.from_kwargs(
        target,
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_gpu_blocks=NUM_BLOCKS,
        speculative_config={"method": "draft_model", "num_speculative_tokens": 4, "model": draft},
        **kw,
    )
    config, _, _ = load_model_info(config)
    worker = Worker(config, config.model_config.hf_config)
    worker.init_device()
    worker.load_model()
    worker.initialize_cache(NUM_BLOCKS)
    return worker


@pytest.fixture(scope="module", params=["cpu", "torch"])
def worker(request, tiny_qwen2, tiny_draft):
    """With each CPU attention backend; a budget of 16 tokens, so the batch's reading pass below runs in
    chunks, one prompt split over two."""
    return make_worker(tiny_qwen2, tiny_draft, max_num_batched_tokens=16, attention_backend=request.param)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length + 4 * i,), generator=gen).tolist() for i in range(n)]


def tables(free: list[int], lengths: list[int]) -> list[list[int]]:
    """Block tables for sequences of the given lengths, taken from free in order."""
    out = []
    for n in lengths:
        need = -(-n // BLOCK_SIZE)
        out.append(free[:need])
        free = free[need:]
    return out


def test_batched_guesses_match_hf_greedy(worker, hf_draft):
    ps = prompts(3, 5, seed=0) + [[7]]  # 5, 9, 13 and 1 tokens: 28 > 16, so two chunks
    ks = [4, 1, 6, 3]
    free = list(range(NUM_BLOCKS - 1, 0, -3))  # scattered blocks, not in order
    bts = tables(free, [len(p) + k - 1 for p, k in zip(ps, ks)])
    reqs = [DraftRequest(i, 0, p, bt, k) for i, (p, bt, k) in enumerate(zip(ps, bts, ks))]
    forwards = []  # tokens per draft forward
    hook = worker.model_runner.drafter.model.register_forward_hook(lambda m, args, out: forwards.append(len(args[0])))
    try:
        guesses = worker.propose_draft_tokens(reqs)
    finally:
        hook.remove()
    assert guesses == [hf_greedy_with(hf_draft, p, k) for p, k in zip(ps, ks)]
    # two reading chunks, then one decode forward per further guess over the sequences still guessing
    assert forwards == [16, 12, 3, 3, 2, 1, 1]


def test_incremental_reads_its_own_cache(worker, hf_draft):
    """A second pass starts where the first left the draft's KV valid: accepted guesses stay, the token after
    them (a correction, or the bonus after a fully accepted run) is read, rejected positions are overwritten."""
    ps, k = prompts(2, 6, seed=1), 4
    bts = tables(list(range(1, NUM_BLOCKS)), [len(p) + 2 * k + 2 for p in ps])
    first = worker.propose_draft_tokens([DraftRequest(i, 0, p, bt, k) for i, (p, bt) in enumerate(zip(ps, bts))])
    assert first == [hf_greedy_with(hf_draft, p, k) for p in ps]
    # seq 0: the target accepted 2 guesses, then corrected the third; seq 1: all 4 accepted, plus a bonus token
    fix = (first[0][2] + 1) % VOCAB
    full0, new0 = ps[0] + first[0][:2] + [fix], [fix]
    full1, new1 = ps[1] + first[1] + [11], [first[1][3], 11]
    second = worker.propose_draft_tokens(
        [DraftRequest(0, len(ps[0]) + 2, new0, bts[0], 5), DraftRequest(1, len(ps[1]) + k - 1, new1, bts[1], 3)]
    )
    assert second == [hf_greedy_with(hf_draft, full0, 5), hf_greedy_with(hf_draft, full1, 3)]


class OneWorker:
    """The uni executor's collective_rpc over one worker."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def collective_rpc(self, method: str, *args):
        return [getattr(self.worker, method)(*args)]


def test_core_side_proposer_keeps_the_draft_cache_in_step(worker, hf_draft):
    """DraftModelProposer's bookkeeping (what the draft has read, what verification lets it keep) and the
    runner agree over rounds of scripted verification: some guesses accepted, then a correction or a bonus."""
    proposer = DraftModelProposer(OneWorker(worker))
    seqs = [Sequence(p, SamplingParams()) for p in prompts(2, 3, seed=2)]
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(1 + 12 * i, 13 + 12 * i))  # 48 slots: room for every round below
    ks = [4, 2]
    scripts = [[2, 4, 0, 3], [2, 0, 1, 2]]  # guesses the target accepts, per round
    for round_ in range(4):
        guesses = proposer.propose(seqs, ks)
        assert guesses == [hf_greedy_with(hf_draft, seq.token_ids, k) for seq, k in zip(seqs, ks)], round_
        for seq, g, k, script in zip(seqs, guesses, ks, scripts):
            accepted = script[round_]
            nxt = (g[accepted] + 1) % VOCAB if accepted < k else 17  # the target's correction, or its bonus token
            seq.token_ids += g[:accepted] + [nxt]
            proposer.on_verified(seq, k, accepted)


def test_cache_sized_for_both_models(worker):
    runner = worker.model_runner
    target, draft = runner.hf_config, runner.drafter.hf_config

    def per_block(cfg) -> int:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return 2 * cfg.num_hidden_layers * BLOCK_SIZE * cfg.num_key_value_heads * head_dim * 4  # float32

    assert runner.kv_bytes_per_block() == per_block(target) + per_block(draft)
    assert runner.drafter.kv_cache.shape == (2, 1, NUM_BLOCKS, BLOCK_SIZE, 1, 16)
    assert runner.kv_cache.shape[2] == runner.drafter.kv_cache.shape[2] == runner.num_blocks == NUM_BLOCKS
    assert runner.drafter.kv_cache.data_ptr() != runner.kv_cache.data_ptr()
    assert {layer.backend for layer in runner.drafter.layers} == {runner.attn_backend}


def test_profile_run_releases_both_caches(tiny_qwen2, tiny_draft):
    """The memory profile (CUDA's; it runs on the CPU too) works with a draft and gives both scratch caches back."""
    runner = make_worker(tiny_qwen2, tiny_draft, max_num_batched_tokens=32).model_runner
    runner.profile_run()
    assert runner.kv_cache is None and runner.drafter.kv_cache is None
    assert all(layer.k_cache.numel() == 0 for layer in runner.attention_layers() + runner.drafter.layers)


def test_bad_requests_are_refused(worker):
    with pytest.raises(ValueError, match="block_table"):  # 5 tokens + 3 guesses need 7 slots: 2 blocks
        worker.propose_draft_tokens([DraftRequest(0, 0, [1, 2, 3, 4, 5], [1], 3)])
    with pytest.raises(ValueError, match="block_table"):
        worker.propose_draft_tokens([DraftRequest(0, 0, [1, 2], [NUM_BLOCKS], 1)])
    with pytest.raises(ValueError, match="token_ids"):
        worker.propose_draft_tokens([DraftRequest(0, 3, [], [1], 1)])


def test_missing_draft_fails_at_start_up(tiny_qwen2, tmp_path):
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(
            tiny_qwen2,
            dtype="float32",
            speculative_config={
                "method": "draft_model",
                "num_speculative_tokens": 2,
                "model": str(tmp_path / "nothing"),
            },
        )


def test_draft_with_another_vocabulary_fails(tiny_qwen2, tmp_path):
    other = make_tiny_model(str(tmp_path / "other"), "qwen2", layers=1, vocab_size=300)
    with pytest.raises(ValueError, match="speculative_config.model.*vocab_size"):
        make_worker(tiny_qwen2, other)


def test_draft_whose_ids_name_other_tokens_fails(tiny_qwen2, tiny_draft, tmp_path):
    """Same vocab_size, but two ids swapped in the tokenizer: the draft would read the target's ids wrongly."""
    other = shutil.copytree(tiny_draft, tmp_path / "swapped")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = [t for t, i in vocab.items() if i in (300, 301)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="speculative_config.model.*vocabulary differs"):
        make_worker(tiny_qwen2, str(other))
