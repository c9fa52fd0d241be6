"""Draft-model speculation, the worker's side: a small model with the target's vocabulary guesses the next
tokens of every speculating sequence, in batched forwards over its own paged KV cache.

The draft's cache has the target's num_blocks and block_size, so the target's block tables address it (as in
vLLM); the scheduler reserves the lookahead slots its guesses write. Guesses are greedy: the target's
rejection sampler treats each guess as a one-hot proposal, which keeps the target's distribution exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from types import ModuleType
from typing import Any

import numpy as np
import torch

from novainfer.attention.metadata import AttentionMetadata, attention_metadata
from novainfer.config import EngineConfig
from novainfer.layers.attention import Attention
from novainfer.layers.quantization.selector import get_quant_config
from novainfer.loader.model_loader import load_hf_config, load_model, load_tokenizer
from novainfer.models.qwen3_5 import is_hybrid
from novainfer.step_types import DraftRequest
from novainfer.worker.decode_strategy import DecodeStrategy, decode_forward, select_decode_strategy
from novainfer.worker.kv_cache import allocate_kv_cache, kv_bytes_per_block, release_kv_cache

logger = logging.getLogger(__name__)


def load_draft_config(config: EngineConfig, target_hf_config: Any, max_model_len: int) -> Any:
    """The draft checkpoint's HF config, once it is known to fit the target: it exists and loads, has the
    target's vocabulary and covers max_model_len positions. Errors name speculative_config.model."""
    path = config.speculative_config.model
    if not os.path.exists(path):
        raise ValueError(f"speculative_config.model {path!r} does not exist (give an HF folder or a .gguf file)")
    try:
        hf_config = load_hf_config(path)
    except Exception as exc:
        raise ValueError(f"speculative_config.model {path!r} has no loadable model config: {exc}") from exc
    if is_hybrid(hf_config):  # the draft runner keeps a KV cache only, no recurrent state slots
        raise ValueError(
            f"speculative_config.model {path!r} has linear-attention layers, which a draft model cannot have"
        )
    draft_vocab, target_vocab = getattr(hf_config, "vocab_size", None), target_hf_config.vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(
            f"speculative_config.model {path!r} has vocab_size {draft_vocab}, the target has "
            f"{target_vocab}: the draft must share the target's vocabulary"
        )
    draft_positions = getattr(hf_config, "max_position_embeddings", None)
    if draft_positions is not None and draft_positions < max_model_len:
        raise ValueError(
            f"speculative_config.model {path!r} has max_position_embeddings {draft_positions} < "
            f"max_model_len {max_model_len}; set max_model_len <= {draft_positions}"
        )
    _check_tokenizers(path, config.model_config.tokenizer or config.model_config.model)
    return hf_config


def _check_tokenizers(draft_path: str, target_path: str) -> None:
    """Each id must name the same token in both vocabularies (the draft reads the target's ids; how each would
    split text does not matter). Compared where both are GGUF files (their token lists) or both are HF
    folders (their tokenizers); converting a GGUF tokenizer to compare it with a folder's takes seconds."""
    if draft_path.endswith(".gguf") != target_path.endswith(".gguf"):
        logger.info("draft vocabulary not compared: one of %s and %s is GGUF, the other not", draft_path, target_path)
        return
    try:
        draft_vocab, target_vocab = _vocab(draft_path), _vocab(target_path)
    except Exception as exc:  # e.g. a config-only folder: nothing to compare
        logger.info("draft vocabulary not compared with the target's: %s", exc)
        return
    differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda kv: kv[1])
    if differ:
        raise ValueError(
            f"speculative_config.model {draft_path!r}: its tokenizer's vocabulary differs from the "
            f"target's in {len(differ)} (token, id) entries, e.g. {differ[:3]}"
        )


def _vocab(path: str) -> dict[str, int]:
    if path.endswith(".gguf"):
        from novainfer.loader.gguf_loader import load_gguf_vocab

        return load_gguf_vocab(path)
    return load_tokenizer(path).get_vocab()


class DraftModelRunner:
    """Loads the draft (the target's dtype and device), holds its KV cache and proposes greedy guesses.

    propose runs one varlen forward over every request's unread tokens (in chunks of at most
    max_num_batched_tokens), then one decode forward per further guess over the sequences still guessing.
    Plain eager forwards on every device this round (no CUDA graphs)."""

    def __init__(
        self,
        config: EngineConfig,
        target_hf_config: Any,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
    ):
        path = config.speculative_config.model
        self.hf_config = load_draft_config(config, target_hf_config, max_model_len)
        # the draft's weights are always read, also under a load_format="dummy" target (a benchmark's random one)
        draft_mc = dataclasses.replace(
            config.model_config,
            model=path,
            hf_config=self.hf_config,
            tokenizer=None,
            max_model_len=None,
            load_format="auto",
        )
        try:
            self.model = load_model(path, self.hf_config, dtype, device, "auto", get_quant_config(draft_mc, device))
        except Exception as exc:
            raise ValueError(f"speculative_config.model {path!r} does not load: {exc}") from exc
        self.layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.device, self.kv_dtype = device, kv_dtype
        self.block_size = config.cache_config.block_size
        self.max_num_batched_tokens = config.scheduler_config.max_num_batched_tokens
        self.max_position = getattr(self.hf_config, "max_position_embeddings", None) or max_model_len
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        self.decode_strategy: DecodeStrategy | None = None  # as the target runner's (decode_strategy.py)

    # ---- KV cache: the target's num_blocks and block_size, so its block tables address this one too ------
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.layers, self.block_size, self.kv_dtype)

    def allocate_kv_cache(self, num_blocks: int, backend: ModuleType) -> None:
        """The cache [2, layers, num_blocks, block_size, kv_heads, head_dim]; backend: the target's."""
        self.kv_cache = allocate_kv_cache(self.layers, num_blocks, self.block_size, self.kv_dtype, self.device, backend)
        self.decode_strategy = select_decode_strategy(self.model, backend)
        self.num_blocks = num_blocks

    def release_kv_cache(self) -> None:
        self.kv_cache = None
        release_kv_cache(self.layers)

    def profile_run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, rows: int) -> None:
        """The largest draft forward (reading chunks of max_num_batched_tokens in all, logits for rows sequences),
        for the target runner's memory profile; meta addresses the scratch cache."""
        with attention_metadata(meta):
            hidden = self.model(ids, positions)
        self.model.compute_logits(hidden[-rows:])

    # ---- proposing -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """requests[i].num_tokens greedy guesses each, after reading token_ids at positions start, start+1, ...

        Guesses 1..k-1 are fed back, so their KV lands at positions end..end+k-2 (end = start + len(token_ids));
        the guesses come to the host once, at the end."""
        if self.kv_cache is None:
            raise RuntimeError("the draft model's KV cache is not allocated (ModelRunner.allocate_kv_cache)")
        if not requests:
            return []
        for r in requests:
            self._check(r)
        width = max(len(r.block_table) for r in requests)
        tables = np.zeros((len(requests), width), dtype=np.int64)
        for i, r in enumerate(requests):
            tables[i, : len(r.block_table)] = r.block_table
        ends = np.array([r.start + len(r.token_ids) for r in requests], dtype=np.int64)
        wanted = np.array([r.num_tokens for r in requests], dtype=np.int64)
        guesses = torch.zeros(len(requests), int(wanted.max()), dtype=torch.long, device=self.device)
        guesses[:, 0] = self._read(requests, tables)
        for j in range(1, guesses.shape[1]):  # guess j+1 from guess j, for every sequence that wants it
            rows = np.flatnonzero(wanted > j)
            index = slice(None) if len(rows) == len(requests) else self._upload(rows)
            hidden = self._forward(
                guesses[index, j - 1], tables, rows, ends[rows] + j - 1, np.ones(len(rows), dtype=np.int64)
            )
            guesses[index, j] = self.model.compute_logits(hidden).argmax(dim=-1)
        return [row[:k] for row, k in zip(guesses.tolist(), wanted.tolist())]

    def _read(self, requests: list[DraftRequest], tables: np.ndarray) -> torch.Tensor:
        """Guess 1 of every request (device [num_requests]): its token_ids read in chunks of at most
        max_num_batched_tokens tokens, like a chunked prefill."""
        first = torch.empty(len(requests), dtype=torch.long, device=self.device)
        pieces: list[tuple[int, int, int]] = []  # (request, offset in its token_ids, length)
        room = self.max_num_batched_tokens
        for i, r in enumerate(requests):
            done = 0
            while done < len(r.token_ids):
                take = min(room, len(r.token_ids) - done)
                pieces.append((i, done, take))
                done, room = done + take, room - take
                if room == 0:
                    self._read_chunk(requests, tables, pieces, first)
                    pieces, room = [], self.max_num_batched_tokens
        if pieces:
            self._read_chunk(requests, tables, pieces, first)
        return first

    def _read_chunk(
        self, requests: list[DraftRequest], tables: np.ndarray, pieces: list[tuple[int, int, int]], first: torch.Tensor
    ) -> None:
        """One varlen forward over pieces; a piece that ends its request's tokens gives that request's guess 1."""
        rows = np.array([i for i, _, _ in pieces], dtype=np.int64)
        offsets = np.array([off for _, off, _ in pieces], dtype=np.int64)
        lengths = np.array([n for _, _, n in pieces], dtype=np.int64)
        starts = np.array([requests[i].start for i in rows], dtype=np.int64) + offsets
        ids = [t for i, off, n in pieces for t in requests[i].token_ids[off : off + n]]
        hidden = self._forward(self._upload(np.array(ids, dtype=np.int64)), tables, rows, starts, lengths)
        last = [p for p, (i, off, n) in enumerate(pieces) if off + n == len(requests[i].token_ids)]
        if last:
            ends = np.cumsum(lengths)[last] - 1
            logits = self.model.compute_logits(hidden[self._upload(ends)])
            first[self._upload(rows[last])] = logits.argmax(dim=-1)

    def _forward(
        self, ids: torch.Tensor, tables: np.ndarray, rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray
    ) -> torch.Tensor:
        """Hidden states of ids: lengths[s] tokens of request rows[s] at positions starts[s]..., packed."""
        ends = np.cumsum(lengths)
        total = int(ends[-1])
        positions = np.arange(total) + np.repeat(starts - (ends - lengths), lengths)
        token_rows = np.repeat(rows, lengths)
        slots = tables[token_rows, positions // self.block_size] * self.block_size + positions % self.block_size
        seq_lens = starts + lengths
        qsl = np.concatenate([[0], ends])
        meta = AttentionMetadata(
            query_start_loc=self._upload(qsl, torch.int32),
            seq_lens=self._upload(seq_lens, torch.int32),
            slot_mapping=self._upload(slots),
            block_tables=self._upload(tables[rows], torch.int32),
            max_query_len=int(lengths.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        with attention_metadata(meta):
            return decode_forward(self.model, self.decode_strategy, ids, self._upload(positions))

    def _upload(self, x: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        """x on the device; on CUDA from pinned memory without waiting, so a forward's inputs never sync the host
        with the device (the guesses' one read at the end does)."""
        t = torch.from_numpy(x) if dtype is None else torch.from_numpy(x).to(dtype)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _check(self, r: DraftRequest) -> None:
        """A request the cache can serve: tokens to read, guesses wanted, slots and positions that exist."""
        if not r.token_ids:
            raise ValueError(f"DraftRequest.token_ids is empty for seq {r.seq_id}: the draft needs a token to read")
        if r.num_tokens < 1 or r.start < 0:
            raise ValueError(
                f"DraftRequest for seq {r.seq_id} needs num_tokens >= 1 and start >= 0, got "
                f"num_tokens={r.num_tokens}, start={r.start}"
            )
        last = r.start + len(r.token_ids) + r.num_tokens - 2  # the last position whose KV the draft writes
        if len(r.block_table) * self.block_size <= last:
            raise ValueError(
                f"DraftRequest.block_table of seq {r.seq_id} has {len(r.block_table)} blocks of "
                f"{self.block_size}; position {last} needs {last // self.block_size + 1}"
            )
        if min(r.block_table) < 0 or max(r.block_table) >= self.num_blocks:
            raise ValueError(
                f"DraftRequest.block_table of seq {r.seq_id} names a block outside 0.."
                f"{self.num_blocks - 1}: {r.block_table}"
            )
        if last >= self.max_position:
            raise ValueError(
                f"seq {r.seq_id}: draft position {last} is past the draft model's "
                f"max_position_embeddings {self.max_position}"
            )
