"""Runs one scheduled step on the device in five stages (design doc 003).

prepare_step_inputs -> build_attention_metadata -> run_model_forward -> sample -> postprocess.
The model itself only maps (input_ids, positions) to hidden states; everything that differs between
prefill, chunked prefill and decode is in the step inputs and the attention metadata.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from novainfer.attention.metadata import AttentionMetadata, attention_metadata
from novainfer.config import EngineConfig
from novainfer.engine.scheduler import SchedulerOutput
from novainfer.layers.attention import Attention
from novainfer.layers.sampler import Sampler, SamplingMetadata, SamplingRow
from novainfer.loader.model_loader import load_model
from novainfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """Host-side arrays for one step, in packed token order."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]  # packed-token rows whose logits are sampled
    sample_seq_ids: list[int]  # the sequence of each sampled row
    sampling_rows: list[SamplingRow]


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
        self.dtype = mc.dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        self.block_size = config.cache_config.block_size
        self.model = load_model(mc.model, hf_config, self.dtype, device)
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator] = {}
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0

    # ---- KV cache --------------------------------------------------------------------------------
    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def kv_bytes_per_block(self) -> int:
        layers = self.attention_layers()
        a = layers[0]
        return 2 * len(layers) * self.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize

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
            block_tables=torch.arange(self.blocks_for(n), device=self.device)[None],
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
        self.kv_cache = torch.zeros(2, len(layers), num_blocks, self.block_size, a.num_kv_heads, a.head_dim,
                                    dtype=self.dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        self.num_blocks = num_blocks

    # ---- the five stages -------------------------------------------------------------------------
    def prepare_step_inputs(self, sched: SchedulerOutput) -> StepInputs:
        for seq_id in sched.finished_seq_ids:
            self.generators.pop(seq_id, None)
        inp = StepInputs(input_ids=[], positions=[], slot_mapping=[], query_start_loc=[0], seq_lens=[],
                         block_tables=[], logits_indices=[], sample_seq_ids=[], sampling_rows=[])
        bs = self.block_size
        for s in sched.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            inp.input_ids.extend(seq.token_ids[start:end])
            inp.positions.extend(range(start, end))
            inp.slot_mapping.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            inp.query_start_loc.append(inp.query_start_loc[-1] + s.num_new_tokens)
            inp.seq_lens.append(end)
            inp.block_tables.append(seq.block_table)
            if s.samples:
                inp.logits_indices.append(inp.query_start_loc[-1] - 1)
                inp.sample_seq_ids.append(seq.seq_id)
                inp.sampling_rows.append(self._sampling_row(seq))
        return inp

    def _sampling_row(self, seq) -> SamplingRow:
        params = seq.sampling_params
        gen = None
        if params.seed is not None:
            gen = self.generators.get(seq.seq_id)
            if gen is None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed + seq.index)
                self.generators[seq.seq_id] = gen
        return SamplingRow(params=params, prompt_token_ids=seq.prompt_token_ids,
                           output_token_ids=seq.output_token_ids, generator=gen,
                           blocked_token_ids=seq.min_tokens_blocked)

    def build_attention_metadata(self, inp: StepInputs) -> AttentionMetadata:
        width = max(len(t) for t in inp.block_tables)
        tables = [t + [-1] * (width - len(t)) for t in inp.block_tables]
        to = dict(device=self.device)
        return AttentionMetadata(
            query_start_loc=torch.tensor(inp.query_start_loc, dtype=torch.int32, **to),
            seq_lens=torch.tensor(inp.seq_lens, dtype=torch.int32, **to),
            slot_mapping=torch.tensor(inp.slot_mapping, dtype=torch.long, **to),
            block_tables=torch.tensor(tables, dtype=torch.long, **to),
            max_query_len=max(b - a for a, b in zip(inp.query_start_loc, inp.query_start_loc[1:])),
            max_seq_len=max(inp.seq_lens),
            query_start_loc_cpu=inp.query_start_loc, seq_lens_cpu=inp.seq_lens)

    def run_model_forward(self, inp: StepInputs, meta: AttentionMetadata) -> torch.Tensor | None:
        """Logits [num_sampled_rows, vocab] in float32; None when no row samples (a prefill chunk)."""
        ids = torch.tensor(inp.input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(inp.positions, dtype=torch.long, device=self.device)
        with attention_metadata(meta):
            hidden = self.model(ids, pos)
        if not inp.logits_indices:
            return None
        rows = torch.tensor(inp.logits_indices, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows]).float()

    def sample(self, logits: torch.Tensor, inp: StepInputs):
        meta = SamplingMetadata.build(inp.sampling_rows, logits.shape[-1], self.device)
        return self.sampler(logits, meta)

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
        inp = self.prepare_step_inputs(sched)
        meta = self.build_attention_metadata(inp)
        logits = self.run_model_forward(inp, meta)
        if logits is None:
            return ModelRunnerOutput([], [])
        sampled = self.sample(logits, inp)
        return self.postprocess(inp, sampled)
