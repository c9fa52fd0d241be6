"""Runs one scheduled step on the device in five stages (design doc 003).

prepare_step_inputs -> build_attention_metadata -> run_model_forward -> sample -> postprocess.
The model itself only maps (input_ids, positions) to hidden states; everything that differs between
prefill, chunked prefill and decode is in the step inputs and the attention metadata.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from novainfer.attention import cpu_backend, torch_backend
from novainfer.attention.metadata import AttentionMetadata, attention_metadata
from novainfer.config import EngineConfig, default_cpu_dtype, resolve_cache_dtype
from novainfer.engine.faults import FaultInjector
from novainfer.engine.scheduler import SchedulerOutput
from novainfer.layers.attention import Attention
from novainfer.layers.quantization.selector import get_quant_config
from novainfer.layers.sampler import Sampler, SamplingMetadata, SamplingRow
from novainfer.loader.model_loader import load_model
from novainfer.sampling_params import SamplingParams
from novainfer.worker.cuda_graph import DecodeGraphs, batch_size_ladder, bucket
from novainfer.worker.step_inputs import HostBuffers, StepInputs, nvtx_range

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    """What the step produced, on the host: one entry per sampled sequence."""

    seq_ids: list[int]
    sampled_token_ids: list[int]
    logprobs: list[list[tuple[int, float, int]]] | None = None  # [(token_id, logprob, rank)] per row


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, device: torch.device):
        self.config = config
        self.hf_config = hf_config
        self.device = device
        mc = config.model_config
        self.dtype = mc.dtype or (torch.bfloat16 if device.type == "cuda" else default_cpu_dtype())
        self.kv_dtype = resolve_cache_dtype(config, self.dtype, device)
        self.block_size = config.cache_config.block_size
        quant = get_quant_config(mc, device, config.parallel_config.tensor_parallel_size)
        self.model = load_model(mc.model, hf_config, self.dtype, device, quant)
        self._attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.sampler = Sampler()
        self.faults = FaultInjector(config.fault_injection)
        self.generators: dict[int, torch.Generator] = {}
        self._tables: dict[int, tuple[list[int], np.ndarray]] = {}  # seq_id -> (block table, as an array)
        self._last_sampling: tuple[tuple[int, ...], SamplingMetadata] | None = None
        self._rows: dict[int, SamplingRow] = {}  # seq_id -> its sampling row, while it never changes
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        self.nvtx = device.type == "cuda"
        self.attn_backend = self._select_attention_backend(config.attention_backend)
        sc = config.scheduler_config
        self.max_blocks_per_seq = self.blocks_for(self.max_model_len)
        self.host = HostBuffers(sc.max_num_batched_tokens,
                                sc.max_num_seqs, self.max_blocks_per_seq, pin=device.type == "cuda")
        self.graphs: DecodeGraphs | None = None
        self.ladder = batch_size_ladder(sc.max_num_seqs)  # the decode batch sizes graphs are captured for
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1

    def _select_attention_backend(self, name: str):
        """'auto': the Triton kernels on CUDA, the batched CPU decode path elsewhere."""
        if name == "auto":
            name = "triton" if self.device.type == "cuda" else "cpu"
        if name == "torch" and self.kv_dtype == self.dtype:
            return torch_backend
        if name in ("cpu", "torch"):  # the torch reference needs the cache in the activations' dtype
            return cpu_backend
        if name == "triton":
            from novainfer.attention import triton_backend
            return triton_backend
        raise ValueError(f"attention_backend must be auto, cpu, torch or triton; got {name!r}")

    # ---- KV cache --------------------------------------------------------------------------------
    def attention_layers(self) -> list[Attention]:
        return self._attention_layers

    def kv_bytes_per_block(self) -> int:
        layers = self.attention_layers()
        a = layers[0]
        return 2 * len(layers) * self.block_size * a.num_kv_heads * a.head_dim * self.kv_dtype.itemsize

    def determine_num_blocks(self) -> int:
        """Blocks that fit: configured, else free GPU memory after a profiling forward, else the CPU budget."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks is not None:
            return cc.num_gpu_blocks
        if self.device.type != "cuda":
            return max(1, cc.cpu_kv_cache_tokens // self.block_size)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        torch.cuda.empty_cache()  # give the profile's scratch back, so it is counted once (as the peak)
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free  # weights, the CUDA context, anything else on the device
        peak_activations = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        budget = total * cc.gpu_memory_utilization - used - peak_activations
        num_blocks = int(budget // self.kv_bytes_per_block())
        if num_blocks < 1:
            raise RuntimeError(
                f"the model does not leave room for a KV cache: {used / 2**30:.2f} GiB used of "
                f"{total / 2**30:.2f} GiB with gpu_memory_utilization={cc.gpu_memory_utilization}; "
                "raise gpu_memory_utilization or use a smaller model")
        return num_blocks

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward over a full token budget and a sampling pass over max_num_seqs rows, with a
        scratch cache, to measure the peak memory of a step."""
        n = min(self.config.scheduler_config.max_num_batched_tokens, self.max_model_len)
        self.allocate_kv_cache(self.blocks_for(n))
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            slot_mapping=torch.arange(n, device=self.device),
            block_tables=torch.arange(self.blocks_for(n), dtype=torch.int32, device=self.device)[None],
            max_query_len=n, max_seq_len=n, query_start_loc_cpu=[0, n], seq_lens_cpu=[n])
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        with attention_metadata(meta):
            hidden = self.model(ids, torch.arange(n, device=self.device))
        rows = min(n, self.config.scheduler_config.max_num_seqs)
        logits = self.model.compute_logits(hidden[-rows:]).float()
        worst = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.1, repetition_penalty=1.1,
                               presence_penalty=0.1, logprobs=20)
        self.sampler(logits, SamplingMetadata.build([SamplingRow(worst, [0], [0])] * rows, logits.shape[-1],
                                                    self.device))
        self.kv_cache = None
        for layer in self.attention_layers():
            layer.k_cache = layer.v_cache = torch.tensor([])

    @property
    def max_model_len(self) -> int:
        return self.config.model_config.max_model_len or self.hf_config.max_position_embeddings

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One tensor [2, layers, blocks, block_size, kv_heads, head_dim]; each layer gets views."""
        layers = self.attention_layers()
        a = layers[0]
        shape = (2, len(layers), num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        nbytes = self.kv_dtype.itemsize * int(np.prod(shape))
        # A large CPU cache is taken fresh from mmap, whose pages are zero and become resident only when
        # written, so RSS grows with the tokens cached, not the capacity (the same zeros torch.zeros writes).
        lazy = self.device.type == "cpu" and nbytes >= 64 << 20
        self.kv_cache = (torch.empty if lazy else torch.zeros)(shape, dtype=self.kv_dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            layer.backend = self.attn_backend
        self.num_blocks = num_blocks

    def capture_cudagraphs(self) -> None:
        """Capture decode graphs (CUDA only; enforce_eager turns them off)."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        sc = self.config.scheduler_config
        self.graphs = DecodeGraphs(self.model, sc.max_num_seqs, self.max_blocks_per_seq,
                                   self.hf_config.hidden_size, self.dtype, self.device, self.num_splits)
        self.graphs.capture()

    def num_splits(self, num_seqs: int) -> int:
        """Split-K parts for a decode batch: enough programs to fill the GPU, each part >= 256 tokens of the
        longest allowed context. A function of the batch size's graph bucket only, so eager and replayed
        steps of one batch compute the same sums."""
        if self.attn_backend in (torch_backend, cpu_backend):
            return 1
        num_seqs = bucket(self.ladder, num_seqs)
        kv_heads = self.attention_layers()[0].num_kv_heads
        want = -(-2 * self.num_sms // (num_seqs * kv_heads))
        splits = 1
        while splits * 2 <= min(want, self.max_model_len // 256, 32):
            splits *= 2
        return splits

    # ---- the five stages -------------------------------------------------------------------------
    def prepare_step_inputs(self, sched: SchedulerOutput) -> StepInputs:
        """Token ids, positions, slots, offsets and block tables on the host; sampling parameters on the device."""
        for seq_id in sched.finished_seq_ids:
            self.generators.pop(seq_id, None)
            self._tables.pop(seq_id, None)
            self._rows.pop(seq_id, None)
        if self.faults:  # tests only: before any input is written
            for s in sched.scheduled:
                self.faults.check("prepare", s.seq.request_id)
        bs = self.block_size
        num_tokens, num_seqs = sched.num_tokens, len(sched.scheduled)
        width = max(len(s.seq.block_table) for s in sched.scheduled)
        h = self.host
        ids, pos, slots = h.input_ids.numpy(), h.positions.numpy(), h.slot_mapping.numpy()
        tables = h.block_tables[:num_seqs * width].numpy().reshape(num_seqs, width)
        qsl, seq_lens, logits_indices, sample_seq_ids, rows = [0], [], [], [], []
        t = max_query_len = 0
        for i, s in enumerate(sched.scheduled):
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            table = seq.block_table
            tables[i, :len(table)] = self._table_array(seq.seq_id, table)
            if n == 1:
                ids[t], pos[t] = seq.token_ids[start], start
                slots[t] = table[start // bs] * bs + start % bs
            else:
                p = np.arange(start, start + n)
                ids[t:t + n] = seq.token_ids[start:start + n]
                pos[t:t + n] = p
                slots[t:t + n] = tables[i, p // bs].astype(np.int64) * bs + p % bs
            t += n
            max_query_len = max(max_query_len, n)
            qsl.append(t)
            seq_lens.append(start + n)
            if s.samples:
                logits_indices.append(t - 1)
                sample_seq_ids.append(seq.seq_id)
                rows.append(self._sampling_row(seq))
        h.seq_lens.numpy()[:num_seqs] = seq_lens
        h.query_start_loc.numpy()[:num_seqs + 1] = qsl
        inp = StepInputs(h.input_ids[:num_tokens], h.positions[:num_tokens], h.slot_mapping[:num_tokens], qsl,
                         seq_lens, h.block_tables[:num_seqs * width].view(num_seqs, width),
                         h.seq_lens[:num_seqs], h.query_start_loc[:num_seqs + 1], max_query_len,
                         logits_indices, sample_seq_ids, rows)
        if rows:  # uploaded now, while the device is idle, so the forward is not waited on later
            inp.sampling_metadata = self._sampling_metadata(rows, sample_seq_ids)
        return inp

    def _sampling_metadata(self, rows: list[SamplingRow], seq_ids: list[int]) -> SamplingMetadata:
        """Built and uploaded again only when the rows' parameters may have changed: decode steps of the same
        sequences without penalties or min_tokens blocking reuse the last step's tensors."""
        static = all(not r.blocked_token_ids and not r.output_token_ids and not r.prompt_token_ids for r in rows)
        key = tuple(seq_ids)
        if static and self._last_sampling is not None and self._last_sampling[0] == key:
            return self._last_sampling[1]
        meta = SamplingMetadata.build(rows, self.hf_config.vocab_size, self.device)
        self._last_sampling = (key, meta) if static else None
        return meta

    def _table_array(self, seq_id: int, table: list[int]) -> np.ndarray:
        """The block table as an array, converted again only when it changed: it grows by one block every
        block_size tokens, and the block manager gives a sequence a new list when it frees its blocks."""
        cached = self._tables.get(seq_id)
        if cached is None or cached[0] is not table or len(cached[1]) != len(table):
            cached = (table, np.array(table, dtype=np.int32))
            self._tables[seq_id] = cached
        return cached[1]

    def _sampling_row(self, seq) -> SamplingRow:
        """The row's sampling inputs; a row without penalties or blocked ids is the same every step (cached)."""
        row = self._rows.get(seq.seq_id)
        if row is not None:
            return row
        params = seq.sampling_params
        gen = None
        if params.seed is not None:
            gen = self.generators.get(seq.seq_id)
            if gen is None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed + seq.index)
                self.generators[seq.seq_id] = gen
        penalised = params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
        row = SamplingRow(params=params,  # token histories are copied only for rows that are penalised
                          prompt_token_ids=seq.prompt_token_ids if penalised else [],
                          output_token_ids=seq.output_token_ids if penalised else [], generator=gen,
                          blocked_token_ids=seq.min_tokens_blocked)
        if not penalised and not seq.min_tokens_blocked:
            self._rows[seq.seq_id] = row
        return row

    def use_cudagraph(self, inp: StepInputs) -> bool:
        return self.graphs is not None and inp.max_query_len == 1 and self.graphs.can_run(len(inp.seq_lens))

    def build_attention_metadata(self, inp: StepInputs) -> AttentionMetadata:
        """Upload the step's inputs once (asynchronously from pinned memory) and describe them for attention."""
        def up(x: torch.Tensor) -> torch.Tensor:
            return x.to(self.device, non_blocking=True)
        max_query_len = inp.max_query_len
        return AttentionMetadata(
            query_start_loc=up(inp.query_start_loc_t), seq_lens=up(inp.seq_lens_t),
            slot_mapping=up(inp.slot_mapping), block_tables=up(inp.block_tables),
            max_query_len=max_query_len, max_seq_len=max(inp.seq_lens),
            query_start_loc_cpu=inp.query_start_loc, seq_lens_cpu=inp.seq_lens,
            num_splits=self.num_splits(len(inp.seq_lens)) if max_query_len == 1 else 1)

    def run_model_forward(self, inp: StepInputs) -> torch.Tensor | None:
        """Logits [num_sampled_rows, vocab] in float32; None when no row samples (a prefill chunk).

        A pure decode step copies its inputs straight into a captured graph's buffers and replays it;
        any other step builds its attention metadata and runs eagerly."""
        if self.use_cudagraph(inp):
            with nvtx_range("attn_meta/graph_inputs", self.nvtx):
                self.graphs.load_inputs(inp.input_ids, inp.positions, inp.slot_mapping, inp.seq_lens_t,
                                        inp.block_tables)
            with nvtx_range("forward/graph_replay", self.nvtx):
                hidden = self.graphs.replay(len(inp.seq_lens))
        else:
            with nvtx_range("attn_meta/build", self.nvtx):
                meta = self.build_attention_metadata(inp)
            ids = inp.input_ids.to(self.device, non_blocking=True)
            pos = inp.positions.to(self.device, non_blocking=True)
            with nvtx_range("forward/eager", self.nvtx), attention_metadata(meta):
                hidden = self.model(ids, pos)
        if not inp.logits_indices:
            return None
        with nvtx_range("forward/logits", self.nvtx):
            n = len(inp.logits_indices)
            if n != hidden.shape[0]:  # a step with prefill chunks: only each sequence's last row is sampled
                rows = self.host.logits_indices[:n]
                rows.numpy()[:] = inp.logits_indices
                hidden = hidden[rows.to(self.device, non_blocking=True)]
            return self.model.compute_logits(hidden).float()

    def sample(self, logits: torch.Tensor, inp: StepInputs):
        return self.sampler(logits, inp.sampling_metadata)

    def postprocess(self, inp: StepInputs, sampled) -> ModelRunnerOutput:
        """The step's one device-to-host copy."""
        out = ModelRunnerOutput(inp.sample_seq_ids, sampled.sampled_token_ids.tolist())
        if sampled.logprobs is not None:
            ids, lps = sampled.logprob_token_ids.tolist(), sampled.logprobs.tolist()
            ranks = sampled.sampled_token_ranks.tolist()
            out.logprobs = []
            for r, row in enumerate(inp.sampling_rows):
                k = row.params.logprobs
                if k is None:
                    out.logprobs.append([])
                    continue
                entries = [(ids[r][0], lps[r][0], ranks[r])]
                entries += [(ids[r][j], lps[r][j], j) for j in range(1, k + 1)]
                out.logprobs.append(entries)
        return out

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        with nvtx_range("prepare/step_inputs", self.nvtx):
            inp = self.prepare_step_inputs(sched)
        logits = self.run_model_forward(inp)
        if logits is None:  # a prefill chunk: no tokens to copy back, but the pinned inputs are reused next step
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            return ModelRunnerOutput([], [])
        with nvtx_range("sample/sampler", self.nvtx):
            sampled = self.sample(logits, inp)
        with nvtx_range("sample/to_host", self.nvtx):
            return self.postprocess(inp, sampled)
