"""Context: a model plus a SLOT KV cache, driven batch by batch as llama.cpp's llama_context.

decode(batch) checks the batch, plans cells (find_slots), commits them, builds the slot-mode
AttentionMetadata (a visibility mask over cells) and runs the same model forward as the engine. The
K/V of each layer are its cache viewed as [n_cells, 1, kv_heads, head_dim], so the attention layer's
store_kv writes token i into cell slot_mapping[i].
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np
import torch

from novainfer.attention import torch_backend
from novainfer.attention.metadata import SlotAttentionMetadata, attention_metadata
from novainfer.config import EngineConfig
from novainfer.core.batch import Batch, BatchView, resolve_batch
from novainfer.core.kv_cache import SlotInfo, SlotKvCache, Status
from novainfer.core.outputs import OutputBuffer
from novainfer.layers.attention import Attention
from novainfer.layers.rotary import RotaryEmbedding, compute_inv_freq, rope_parameters
from novainfer.loader.model_loader import load_hf_config, load_model, load_tokenizer, resolve_model_path
from novainfer.models.qwen3_5 import is_hybrid
from novainfer.worker.kv_cache import allocate_kv_cache

logger = logging.getLogger(__name__)


class Context:
    """One model with n_cells KV cells shared by sequences 0..n_seq_max-1 (None = the default model)."""

    def __init__(
        self,
        model_path: str | None = None,
        n_cells: int = 4096,
        n_seq_max: int = 64,
        n_ubatch: int = 512,
        dtype: str | torch.dtype | None = None,
        device: str = "auto",
    ):
        if n_ubatch < 1:
            raise ValueError(f"n_ubatch must be >= 1, got {n_ubatch}")
        self.n_ubatch = n_ubatch  # a decode runs the forward on at most n_ubatch tokens at a time
        self.model_path = resolve_model_path(model_path)
        cfg = EngineConfig.from_kwargs(self.model_path, dtype=dtype, device=device)
        self.device = cfg.resolve_device()
        self.dtype = cfg.model_config.torch_dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.hf_config = load_hf_config(self.model_path)
        if is_hybrid(self.hf_config):  # its recurrent state has no per-cell form to copy, remove or shift
            raise NotImplementedError(
                f"{self.hf_config.architectures[0]} has linear-attention layers, which the "
                "core API's cell cache does not support; use the engine (LLM) instead"
            )
        self.model = load_model(self.model_path, self.hf_config, self.dtype, self.device)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.max_pos = int(self.hf_config.max_position_embeddings)
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        a = layers[0]
        # [k|v, layer, cell, 1, kv_heads, head_dim]: block size 1, so a cell index is a cache slot (flat where
        # the layers' shapes differ, as Gemma 4's; their rope differs per layer too, so keys never move there)
        self.kv_data = allocate_kv_cache(layers, n_cells, 1, self.dtype, self.device, torch_backend)
        self.cache = SlotKvCache(n_cells, n_seq_max)
        self.outputs = OutputBuffer(self.vocab_size, self.device)
        self.inv_freq = self._shared_inv_freq(a.head_dim)  # the model's rotary frequencies
        self._abort: Callable[[], bool] | None = None
        self._last: tuple[BatchView, SlotInfo] | None = None
        self._tokenizer: Any = None

    @property
    def n_cells(self) -> int:
        return self.cache.n_cells

    @property
    def n_seq_max(self) -> int:
        return self.cache.n_seq_max

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer

    def set_abort_callback(self, callback: Callable[[], bool] | None) -> None:
        """callback() -> True stops a decode before its next ubatch: it returns ABORTED (2), cache as before."""
        self._abort = callback

    # ---- decode ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, batch: Batch) -> Status:
        """Run the batch: 0 ok, 1 no free cell, 2 aborted, -1 invalid input, -2 forward failed.

        Every non-zero status leaves cell metadata and the K/V of used cells as they were, and keeps the
        previous decode's outputs readable. All cells are planned and committed up front; ubatches then
        run in order (a later token of a shared sequence has a higher pos, so no query sees a cell whose
        K/V are not written yet), and the abort callback is polled before each one.
        """
        view, reason = resolve_batch(batch, self.n_seq_max, self.vocab_size, self.max_pos, self.cache.seq_pos_max)
        if view is None:
            logger.error("decode: invalid batch: %s", reason)
            return Status.INVALID_INPUT
        slots = self.cache.find_slots(view)
        if slots is None:
            logger.warning(
                "decode: the batch needs %d cells but only %d of %d are free",
                view.n_tokens,
                self.n_cells - self.cache.n_used,
                self.n_cells,
            )
            return Status.NO_KV_SLOT
        if self._aborted():
            return Status.ABORTED
        flagged = np.flatnonzero(view.outputs)
        self.output_reserve(len(flagged))
        saved = self.cache.snapshot()
        self.cache.commit_slots(view, slots)  # the forward's mask includes the batch's own cells
        try:
            logits = self._forward(view, slots)
        except Exception:
            self.cache.restore(saved)
            logger.exception("decode: the forward failed; cell metadata rolled back")
            return Status.COMPUTE_FAILED
        except BaseException:
            self.cache.restore(saved)
            raise
        if logits is None:
            self.cache.restore(saved)
            return Status.ABORTED
        self.outputs.store(flagged, view.n_tokens, logits)
        self._last = (view, slots)
        return Status.OK

    def build_attention_metadata(self, view: BatchView, slots: SlotInfo) -> SlotAttentionMetadata:
        """Slot-mode metadata: where each token's K/V go and which cells each query sees."""
        cells, visible = self.cache.visible_cells(view)
        return SlotAttentionMetadata(
            slot_mapping=torch.as_tensor(slots.idxs, dtype=torch.long, device=self.device),
            cells=torch.as_tensor(cells, dtype=torch.long, device=self.device),
            visible=torch.as_tensor(visible, device=self.device),
            query_pos=torch.as_tensor(view.pos, device=self.device),
            cell_pos=torch.as_tensor(self.cache.pos[cells], device=self.device),
        )

    def _aborted(self) -> bool:
        if self._abort is not None and self._abort():
            logger.info("decode: aborted by the abort callback")
            return True
        return False

    def _forward(self, view: BatchView, slots: SlotInfo) -> torch.Tensor | None:
        """Logits of the flagged tokens in batch order, ubatch by ubatch; None when aborted between ubatches."""
        rows = [torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)]
        for start in range(0, view.n_tokens, self.n_ubatch):
            if start > 0 and self._aborted():
                return None
            part = view.slice(start, start + self.n_ubatch)
            meta = self.build_attention_metadata(part, SlotInfo(slots.idxs[start : start + self.n_ubatch]))
            with attention_metadata(meta):
                hidden = self.model(
                    torch.as_tensor(part.tokens, device=self.device), torch.as_tensor(part.pos, device=self.device)
                )
            flagged = np.flatnonzero(part.outputs)
            if len(flagged):
                index = torch.as_tensor(flagged, dtype=torch.long, device=self.device)
                rows.append(self.model.compute_logits(hidden[index]).float())
        return torch.cat(rows)

    def infer(self, token_ids: Sequence[int]) -> int:
        """Compatibility helper (the old infer): append tokens to sequence 0, return the greedy next token."""
        rc = self.decode(Batch.get_one(token_ids))
        if rc != Status.OK:
            raise RuntimeError(f"decode failed with status {int(rc)} ({Status(rc).name})")
        return int(self.get_logits_ith(-1).argmax())

    # ---- output rows -----------------------------------------------------------------------------
    def output_reserve(self, n_outputs: int) -> bool:
        """Size the output buffers for n_outputs rows before a decode writes them."""
        self.outputs.reserve(n_outputs)
        return True

    def get_logits(self) -> torch.Tensor:
        """[n_outputs, vocab] float32: one row per flagged token of the last decode, in batch order."""
        return self.outputs.get()

    def get_logits_ith(self, i: int) -> torch.Tensor:
        """Logits of batch token i (it must have been flagged); negative i counts output rows from the end."""
        return self.outputs.get_ith(i)

    def n_outputs(self) -> int:
        return self.outputs.n_outputs

    def output_ids(self) -> np.ndarray:
        """output_ids()[j] is the batch index of the token behind logits row j."""
        return self.outputs.output_ids()

    # ---- KV management (half-open [p0, p1); p0 < 0 means 0, p1 < 0 means no end) -----------------
    def _check_seqs(self, op: str, *seq_ids: int) -> bool:
        bad = [s for s in seq_ids if not self.cache.valid_seq(s)]
        if bad:
            logger.error("%s: seq_id %d outside [0, %d)", op, bad[0], self.n_seq_max)
        return not bad

    def kv_seq_cp(self, dst_seq: int, src_seq: int, p0: int, p1: int) -> Status:
        """Share src_seq's cells in [p0, p1) with dst_seq (destination first, as llama.cpp's llama_kv_self_seq_cp)."""
        if not self._check_seqs("kv_seq_cp", dst_seq, src_seq):
            return Status.INVALID_INPUT
        self.cache.seq_cp(dst_seq, src_seq, p0, p1)
        return Status.OK

    def kv_seq_rm(self, seq_id: int, p0: int, p1: int) -> Status:
        """Detach seq_id (all sequences when seq_id < 0) from its cells in [p0, p1); empty cells are freed."""
        if seq_id >= 0 and not self._check_seqs("kv_seq_rm", seq_id):
            return Status.INVALID_INPUT
        self.cache.seq_rm(seq_id, p0, p1)
        return Status.OK

    def kv_seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> Status:
        """Move seq_id's cells in [p0, p1) by delta positions, re-rotating their cached keys to match."""
        if not self._check_seqs("kv_seq_add", seq_id):
            return Status.INVALID_INPUT
        if delta != 0 and self.inv_freq is None:  # refused before anything moves
            raise NotImplementedError(
                "kv_seq_add cannot move cached keys of this model: its layers do not share "
                "one set of rotary frequencies (per-layer rope bases or LongRoPE)"
            )
        if delta != 0:
            self._rotate_keys(self.cache.seq_add(seq_id, p0, p1, delta), delta)
        return Status.OK

    def kv_seq_keep(self, seq_id: int) -> Status:
        """Keep only seq_id: other sequences are detached everywhere, cells without seq_id freed."""
        if not self._check_seqs("kv_seq_keep", seq_id):
            return Status.INVALID_INPUT
        self.cache.seq_keep(seq_id)
        return Status.OK

    def kv_seq_pos_max(self, seq_id: int) -> int:
        """The sequence's largest position in the cache, -1 when it has none."""
        return self.cache.seq_pos_max(seq_id)

    def kv_seq_pos_min(self, seq_id: int) -> int:
        return self.cache.seq_pos_min(seq_id)

    def kv_clear(self) -> None:
        """Free every cell."""
        self.cache.clear()

    def _shared_inv_freq(self, head_dim: int) -> torch.Tensor | None:
        """The rotary frequencies every layer shares; None where layers differ (Gemma 3's local and global
        bases) or frequencies depend on the position (LongRoPE): moving keys is then refused."""
        if rope_parameters(self.hf_config)["rope_type"] == "longrope":
            return None
        freqs = [
            compute_inv_freq(self.hf_config, head_dim, t)[0]
            for t in sorted(set(getattr(self.hf_config, "layer_types", None) or []))
        ] or [compute_inv_freq(self.hf_config, head_dim)[0]]
        return freqs[0] if all(torch.equal(f, freqs[0]) for f in freqs) else None

    @torch.inference_mode()
    def _rotate_keys(self, cells: np.ndarray, delta: int) -> None:
        """Cached keys carry rotary at their old pos; rotating by delta (angles add) gives them at pos + delta."""
        if len(cells) == 0:
            return
        angles = float(delta) * self.inv_freq.double()
        emb = torch.cat((angles, angles))
        cos, sin = emb.cos().float().to(self.device), emb.sin().float().to(self.device)
        idx = torch.as_tensor(cells, dtype=torch.long, device=self.device)
        keys = self.kv_data[0][:, idx].float()  # [layers, m, 1, kv_heads, head_dim]
        self.kv_data[0][:, idx] = RotaryEmbedding._rotate(keys, cos, sin).to(self.dtype)

    # ---- diagnostics -----------------------------------------------------------------------------
    def dump_cells(self, all_cells: bool = False) -> str:
        """Print (and return) `cell[idx] = {seq_ids, pos, used}` and the last batch's `token[i] -> cell[idx]`."""
        view, slots = self._last if self._last is not None else (None, None)
        text = self.cache.dump(view, slots, all_cells)
        print(text)
        return text
