"""Runs one scheduled step on the device in five stages, conducting the worker's pieces:

prepare_step_inputs (step_inputs.py) -> build_attention_metadata -> run_model_forward (decode_strategy.py,
cuda_graph.py) -> sample (spec_decode/ for verify steps) -> read back (overlap.py). The model itself only maps
(input_ids, positions) to hidden states; everything that differs between prefill, chunked prefill and decode is
in the step inputs and the attention metadata. KV sizing: kv_cache.py.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from novainfer.attention import cpu_backend, get_attn_backend, torch_backend
from novainfer.attention.metadata import AttentionMetadata, attention_metadata
from novainfer.config import EngineConfig, resolve_cache_dtype
from novainfer.layers.attention import Attention
from novainfer.layers.fused_moe.layer import FusedMoE
from novainfer.layers.linear_attention import GatedDeltaNet
from novainfer.layers.quantization.selector import get_quant_config
from novainfer.layers.sampler import Sampler, sampling_threads
from novainfer.loader.model_loader import load_model
from novainfer.platform import default_cpu_dtype
from novainfer.worker.draft_model_runner import DraftModelRunner
from novainfer.spec_decode.rejection_sampler import rejection_sample
from novainfer.step_types import ModelRunnerOutput, SchedulerOutput
from novainfer.worker.kernel_warmup import warm_up_kernels
from novainfer.worker.kv_layout import log_kv_layout
from novainfer.worker.kv_cache import (
    allocate_kv_cache,
    kv_bytes_per_block,
    kv_layout_of,
    num_blocks_that_fit,
    profile_blocks,
    profile_lens,
    profile_step,
    release_kv_cache,
)
from novainfer.worker.prompt_logprobs import compute_prompt_logprobs
from novainfer.worker.cuda_graph import DecodeGraphs, batch_size_ladder, bucket, graphs_for_step, split_k_parts
from novainfer.worker.decode_strategy import DecodeStrategy, decode_forward, select_decode_strategy
from novainfer.worker.overlap import HostCopy, PreviousStep, StepHandle
from novainfer.worker.state_cache import StateCache
from novainfer.worker.step_inputs import StepInputBuilder, StepInputs, nvtx_range

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, device: torch.device):
        config = config.with_token_budget()  # the engine core's is resolved already; a runner built alone's not
        self.config = config
        self.hf_config = hf_config
        self.device = device
        mc = config.model_config
        quant = get_quant_config(mc, device, config.parallel_config.tensor_parallel_size)
        self.dtype = mc.torch_dtype or (
            torch.bfloat16 if device.type == "cuda" else getattr(quant, "activation_dtype", None) or default_cpu_dtype()
        )
        self.kv_dtype = resolve_cache_dtype(config, self.dtype, device)
        self.block_size = config.cache_config.block_size
        spec = config.speculative_config
        self.drafter: DraftModelRunner | None = None  # the draft model of speculative_config (its own KV cache)
        if spec is not None and spec.method == "draft_model":  # first: a bad draft fails before the target loads
            self.drafter = DraftModelRunner(config, hf_config, self.dtype, self.kv_dtype, device, self.max_model_len)
        self.model = load_model(mc.model, hf_config, self.dtype, device, mc.load_format, quant)
        self._attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # sliding-window layers: the grouped layout (kv_layout.py) that keeps only their window; the whole-context
        # layout with a draft model, which addresses the target's blocks with the target's one table
        self.kv_layout = kv_layout_of(self._attention_layers, self.block_size) if self.drafter is None else None
        # hybrid models (linear-attention layers): their per-sequence state slots
        self.state_cache = StateCache.for_model(
            self.model, config, self.dtype, device, self.kv_bytes_per_block() // self.block_size
        )
        self.sampler = Sampler()
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        self.decode_strategy: DecodeStrategy | None = None  # a whole-stack decode path, chosen with the KV cache
        self.nvtx = device.type == "cuda"
        self.attn_backend = get_attn_backend(config.attention_backend, device, self.kv_dtype, self.dtype)
        sc = config.scheduler_config
        self.max_blocks_per_seq = self.blocks_for(self.max_model_len)
        self.inputs = StepInputBuilder(
            self.block_size,
            hf_config.vocab_size,
            device,
            sc.max_num_batched_tokens,
            sc.max_num_seqs,
            self.max_blocks_per_seq,
            self.state_cache,
            [g.block_size for g in self.kv_layout.groups] if self.kv_layout is not None else None,
        )
        self._prev: PreviousStep | None = None  # the last step that sampled: its ids stay on the device
        # on the CPU a step's forward and sampling run on this thread, so the host can plan the next step meanwhile
        self._device_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="novainfer-step")
            if device.type != "cuda" and config.use_async_scheduling()
            else None
        )
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None  # speculative decoding's verify step (CUDA)
        self.ladder = batch_size_ladder(sc.max_num_seqs)  # the decode batch sizes graphs are captured for
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        if device.type == "cuda":
            from novainfer.kernels import batch_invariant

            if config.batch_invariant and any(isinstance(m, (FusedMoE, GatedDeltaNet)) for m in self.model.modules()):
                raise ValueError(
                    "batch_invariant covers dense attention models (MoE and DeltaNet kernels tile by batch)"
                )
            batch_invariant.set_enabled(config.batch_invariant)

    # ---- KV cache --------------------------------------------------------------------------------
    def attention_layers(self) -> list[Attention]:
        return self._attention_layers

    def kv_bytes_per_block(self) -> int:
        """The target's cache per block, plus the draft model's (it has as many blocks)."""
        if self.kv_layout is not None:
            return self.kv_layout.bytes_per_block(self.block_size, self.kv_dtype.itemsize)
        draft = self.drafter.kv_bytes_per_block() if self.drafter is not None else 0
        return kv_bytes_per_block(self.attention_layers(), self.block_size, self.kv_dtype) + draft

    def determine_num_blocks(self) -> int:
        """Blocks that fit: configured, else free GPU memory after a profiling forward, else the CPU budget."""
        state = self.state_cache.nbytes() if self.state_cache is not None else 0  # the CPU budget holds it too
        whole = kv_bytes_per_block(self.attention_layers(), self.block_size, self.kv_dtype)
        num_blocks = num_blocks_that_fit(
            self.config.cache_config,
            self.device,
            self.block_size,
            self.kv_bytes_per_block(),
            self.profile_run,
            state,
            whole,
        )
        if self.kv_layout is not None:
            log_kv_layout(self.kv_layout, num_blocks, num_blocks * self.kv_bytes_per_block() // whole, self.block_size)
        return num_blocks

    def profile_run(self) -> None:
        """The peak memory of a step, with a scratch cache (worker/kv_cache.py)."""
        sc = self.config.scheduler_config
        lens = profile_lens(sc.max_num_batched_tokens, self.max_model_len, sc.max_num_seqs)
        self.allocate_kv_cache(profile_blocks(lens, self.block_size))
        rows = min(sum(lens), sc.max_num_seqs)
        profile_step(self.model, self.sampler, self.drafter, lens, rows, self.block_size, self.device)
        self.kv_cache = None
        release_kv_cache(self.attention_layers())
        if self.drafter is not None:
            self.drafter.release_kv_cache()

    @property
    def max_model_len(self) -> int:
        return self.config.model_config.max_model_len or self.hf_config.max_position_embeddings

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One tensor [2, layers, blocks, block_size, kv_heads, head_dim]; each layer gets views. A draft model
        gets its own cache of as many blocks, so the target's block tables address it too."""
        self.kv_cache = allocate_kv_cache(
            self.attention_layers(),
            num_blocks,
            self.block_size,
            self.kv_dtype,
            self.device,
            self.attn_backend,
            self.kv_layout,
        )
        # the whole-stack paths read one block table (not a cache of several KV groups) unless they say they read
        # the groups' (kv_groups), and batch-invariant mode takes no batch-1 GEMV stack (its sums differ from the
        # GEMM's a batch takes)
        several = self.kv_layout is not None and len(self.kv_layout.groups) > 1
        invariant_gpu = self.config.batch_invariant and self.device.type == "cuda"
        strategy = None if invariant_gpu else select_decode_strategy(self.model, self.attn_backend)
        self.decode_strategy = None if several and not getattr(strategy, "kv_groups", False) else strategy
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks, self.attn_backend)
        if self.state_cache is not None:  # allocated once: on CUDA the profile run's measure includes it
            self.state_cache.allocate()
        self.num_blocks = num_blocks

    def shutdown(self) -> None:
        """Give the KV caches, graphs and the last step back now, not when the collector finds a dropped engine."""
        if self._device_thread is not None:
            self._device_thread.shutdown(wait=True)
        self._prev = None
        self.graphs = self.verify_graphs = None
        self.kv_cache = None
        release_kv_cache(self.attention_layers())
        if self.drafter is not None:
            self.drafter.release_kv_cache()
        if self.state_cache is not None:
            self.state_cache.release()

    def warm_up_kernels(self) -> None:
        """Compile the Triton kernels a step may need beyond the profile run's and the graphs' (kernel_warmup.py)."""
        if self.device.type == "cuda" and self.attn_backend not in (torch_backend, cpu_backend):
            warm_up_kernels(self.model, self.sampler, self.block_size, self.device)

    def capture_cudagraphs(self) -> None:
        """Capture decode graphs (CUDA only; enforce_eager turns them off)."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        logger.info(
            "batch-1 decode stack (fused kernels): %s",
            "on" if self.decode_strategy is not None else "off (the model has layers it does not fuse)",
        )
        sc = self.config.scheduler_config
        self.graphs = DecodeGraphs(
            self.forward,
            sc.max_num_seqs,
            self.max_blocks_per_seq,
            self.hf_config.hidden_size,
            self.dtype,
            self.device,
            self.num_splits,
            state_slots=self.state_cache is not None,
            num_groups=len(self.inputs.group_batches),
        )
        self.graphs.capture()
        spec = self.config.speculative_config
        if spec is not None:  # verify steps where every sequence checks num_speculative_tokens guesses
            self.verify_graphs = DecodeGraphs(
                self.forward,
                sc.max_num_seqs,
                self.max_blocks_per_seq,
                self.hf_config.hidden_size,
                self.dtype,
                self.device,
                self.num_splits,
                query_len=spec.num_speculative_tokens + 1,
                num_groups=len(self.inputs.group_batches),
            )
            self.verify_graphs.capture()

    def num_splits(self, num_seqs: int) -> int:
        """Split-K parts for a decode batch: enough programs to fill the GPU, each part >= 256 tokens of the
        longest allowed context. A function of the batch size's graph bucket only, so eager and replayed
        steps of one batch compute the same sums."""
        if self.attn_backend in (torch_backend, cpu_backend) or self.config.batch_invariant:
            return 1  # batch-invariant mode: one part whatever the batch
        return split_k_parts(
            bucket(self.ladder, num_seqs), self.attention_layers()[0].num_kv_heads, self.num_sms, self.max_model_len
        )

    # ---- the five stages -------------------------------------------------------------------------
    def prepare_step_inputs(self, sched: SchedulerOutput) -> StepInputs:
        """The step's inputs on the host, sampling parameters on the device (worker/step_inputs.py)."""
        return self.inputs.build(sched, self._prev)

    def build_attention_metadata(self, inp: StepInputs) -> AttentionMetadata:
        """The step's inputs uploaded and described for attention."""
        return self.inputs.attention_metadata(inp, self.num_splits(len(inp.seq_lens)), self.attn_backend is cpu_backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model's hidden states for a step, through the decode strategy where it takes the step."""
        return decode_forward(self.model, self.decode_strategy, input_ids, positions)

    def run_model_forward(self, inp: StepInputs) -> torch.Tensor | None:
        """Logits [num_sampled_rows, vocab] in float32; None when no row samples (a prefill chunk).

        A pure decode step copies its inputs straight into a captured graph's buffers and replays it;
        any other step builds its attention metadata and runs eagerly."""
        graphs = graphs_for_step(self.graphs, self.verify_graphs, inp) if self.graphs is not None else None
        state = inp.state_slots
        if state is not None:
            self.state_cache.zero_fresh(state)
        if graphs is not None:
            with nvtx_range("attn_meta/graph_inputs", self.nvtx):
                graphs.load_inputs(
                    inp.input_ids,
                    inp.positions,
                    inp.slot_mapping if inp.group_slot_mapping is None else inp.group_slot_mapping,
                    inp.seq_lens_t,
                    inp.block_tables if inp.group_block_tables is None else inp.group_block_tables,
                    None if state is None else state.slots,
                )
                if inp.feed is not None:
                    inp.feed.apply(graphs.input_ids, self.device)
            with nvtx_range("forward/graph_replay", self.nvtx):
                hidden = graphs.replay(len(inp.seq_lens))
        else:
            with nvtx_range("attn_meta/build", self.nvtx):
                meta = self.build_attention_metadata(inp)
            ids = inp.input_ids.to(self.device, non_blocking=True)
            if inp.feed is not None:
                if ids.data_ptr() == inp.input_ids.data_ptr():  # on the CPU: do not write into the host buffer
                    ids = ids.clone()
                inp.feed.apply(ids, self.device)
            pos = inp.positions.to(self.device, non_blocking=True)
            with nvtx_range("forward/eager", self.nvtx), attention_metadata(meta):
                hidden = self.forward(ids, pos)
        if inp.prompt_logprob_rows:
            inp.prompt_logprobs = compute_prompt_logprobs(self.model, hidden, inp.prompt_logprob_rows)
        if not inp.logits_indices:
            return None
        with nvtx_range("forward/logits", self.nvtx):
            n = len(inp.logits_indices)
            if n != hidden.shape[0]:  # a step with prefill chunks: only each sequence's last row is sampled
                hidden = hidden[inp.logits_indices_t.to(self.device, non_blocking=True)]
            return self.model.compute_logits(hidden).float()

    def sample(self, logits: torch.Tensor, inp: StepInputs):
        """The sampler over the step's rows; constrained rows (structured outputs) get their grammar's bitmask."""
        token_bitmask = None
        if inp.grammar_bitmask is not None:
            firsts = (
                range(len(inp.sample_seq_ids))
                if inp.spec_num_drafts is None
                else np.cumsum([0] + [d + 1 for d in inp.spec_num_drafts]).tolist()
            )
            row_of = dict(zip(inp.sample_seq_ids, firsts))  # a constrained sequence has one row: it never guesses
            rows = torch.tensor([row_of[s] for s in inp.grammar_bitmask.seq_ids], device=self.device)
            token_bitmask = (rows, inp.grammar_bitmask.bitmask.to(self.device, non_blocking=True))
        with sampling_threads(logits):
            if inp.spec_num_drafts is not None:
                draft_ids = torch.tensor(inp.spec_draft_ids, device=self.device)
                return rejection_sample(self.sampler, logits, inp.sampling_metadata, draft_ids, token_bitmask)
            return self.sampler(logits, inp.sampling_metadata, token_bitmask)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step, waited for: its sampled tokens on the host."""
        return self.execute_model_async(sched).get()

    @torch.inference_mode()
    def execute_model_async(self, sched: SchedulerOutput) -> StepHandle:
        """Prepare and launch one step; the handle's get() waits for it and copies its tokens to the host.

        On CUDA the launch is asynchronous by nature; on the CPU the forward and sampling run on the step
        thread. Either way a later step may be prepared (and launched) before this one's get()."""
        with nvtx_range("prepare/step_inputs", self.nvtx):
            inp = self.prepare_step_inputs(sched)
        if self._device_thread is None:
            sampled = self._forward_and_sample(inp)
            handle = StepHandle(inp, sampled, HostCopy(sampled) if self.device.type == "cuda" else None, self.nvtx)
        else:
            handle = StepHandle(inp, self._device_thread.submit(self._forward_and_sample, inp), nvtx=self.nvtx)
        if inp.sample_seq_ids:
            self._prev = PreviousStep(handle, {seq_id: i for i, seq_id in enumerate(inp.sample_seq_ids)})
        return handle

    @torch.inference_mode()
    def _forward_and_sample(self, inp: StepInputs):
        """The device's part of a step: forward, logits and sampling (None for a step that samples nothing)."""
        logits = self.run_model_forward(inp)
        if logits is None:  # a prefill chunk: no tokens, but its pinned inputs are reused two steps later
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            return None
        with nvtx_range("sample/sampler", self.nvtx):
            return self.sample(logits, inp)
