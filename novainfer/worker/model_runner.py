"""Runs one scheduled step on the device in five stages (design doc 003).

prepare_step_inputs -> build_attention_metadata -> run_model_forward -> sample -> postprocess.
The model itself only maps (input_ids, positions) to hidden states; everything that differs between
prefill, chunked prefill and decode is in the step inputs and the attention metadata.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain

import numpy as np
import torch

from novainfer.attention import cpu_backend, torch_backend
from novainfer.attention.metadata import AttentionMetadata, attention_metadata
from novainfer.config import EngineConfig, default_cpu_dtype, resolve_cache_dtype
from novainfer.engine.faults import FaultInjector
from novainfer.engine.scheduler import SchedulerOutput
from novainfer.layers.attention import Attention
from novainfer.layers.quantization.selector import get_quant_config
from novainfer.layers.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow, sampling_threads
from novainfer.loader.model_loader import load_model
from novainfer.sampling_params import SamplingParams
from novainfer.spec_decode.draft_model_runner import DraftModelRunner
from novainfer.spec_decode.rejection_sampler import emitted_rows, rejection_sample
from novainfer.spec_decode.verify_inputs import per_token_metadata, verify_rows
from novainfer.worker.input_batch import InputBatch
from novainfer.worker.kernel_warmup import one_sequence_metadata, warm_up_kernels
from novainfer.worker.kv_cache import allocate_kv_cache, kv_bytes_per_block, release_kv_cache
from novainfer.worker.prompt_logprobs import compute_prompt_logprobs, plan_prompt_logprobs
from novainfer.worker.cuda_graph import DecodeGraphs, batch_size_ladder, bucket
from novainfer.worker.state_cache import StateCache
from novainfer.worker.step_inputs import HostBuffers, StepInputs, nvtx_range

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    """What the step produced, on the host: one entry per sampled sequence."""

    seq_ids: list[int]
    sampled_token_ids: list[int]
    logprobs: list[list[tuple[int, float, int]]] | None = None  # [(token_id, logprob, rank)] per row
    # seq_id -> (first prompt position, [(token_id, logprob, rank), ...] per next prompt token); see prompt_logprobs.py
    prompt_logprobs: dict[int, tuple[int, list[list[tuple[int, float, int]]]]] | None = None
    # a verify step (speculative decoding): per sampled sequence, the accepted guesses that come before its
    # sampled token, and their logprobs
    spec_accepted_token_ids: list[list[int]] | None = None
    spec_logprobs: list[list[list[tuple[int, float, int]]]] | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, device: torch.device):
        config.resolve_token_budget()  # set by the engine core already, except for a runner built on its own
        self.config = config
        self.hf_config = hf_config
        self.device = device
        mc = config.model_config
        quant = get_quant_config(mc, device, config.parallel_config.tensor_parallel_size)
        self.dtype = mc.torch_dtype or (torch.bfloat16 if device.type == "cuda"
                                        else getattr(quant, "activation_dtype", None) or default_cpu_dtype())
        self.kv_dtype = resolve_cache_dtype(config, self.dtype, device)
        self.block_size = config.cache_config.block_size
        spec = config.speculative_config
        self.drafter: DraftModelRunner | None = None  # the draft model of speculative_config (its own KV cache)
        if spec is not None and spec.method == "draft_model":  # first: a bad draft fails before the target loads
            self.drafter = DraftModelRunner(config, hf_config, self.dtype, self.kv_dtype, device, self.max_model_len)
        self.model = load_model(mc.model, hf_config, self.dtype, device, mc.load_format, quant)
        self._attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # hybrid models (linear-attention layers): their per-sequence state slots
        self.state_cache = StateCache.for_model(self.model, config, self.dtype, device,
                                                self.kv_bytes_per_block() // self.block_size)
        self.sampler = Sampler()
        self.faults = FaultInjector(config.fault_injection)
        self.generators: dict[int, torch.Generator] = {}
        self._last_sampling: tuple[tuple[int, ...], SamplingMetadata] | None = None
        self._rows: dict[int, SamplingRow] = {}  # seq_id -> its sampling row, while it never changes
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        self.nvtx = device.type == "cuda"
        self.attn_backend = self._select_attention_backend(config.attention_backend)
        sc = config.scheduler_config
        self.max_blocks_per_seq = self.blocks_for(self.max_model_len)
        self.input_batch = InputBatch(sc.max_num_seqs, self.max_blocks_per_seq)
        # two sets, alternating per step: with overlap the host fills step N+1's while step N still reads its own
        self._host_sets = [HostBuffers(sc.max_num_batched_tokens, sc.max_num_seqs, self.max_blocks_per_seq,
                                       pin=device.type == "cuda") for _ in range(2)]
        self.host = self._host_sets[0]
        self._num_steps = 0
        self._prev: PreviousStep | None = None  # the last step that sampled: its ids stay on the device
        # on the CPU a step's forward and sampling run on this thread, so the host can plan the next step meanwhile
        self._device_thread = ThreadPoolExecutor(1, thread_name_prefix="novainfer-step") \
            if device.type != "cuda" and config.use_async_scheduling() else None
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None  # speculative decoding's verify step (CUDA)
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
        """The target's cache per block, plus the draft model's (it has as many blocks)."""
        draft = self.drafter.kv_bytes_per_block() if self.drafter is not None else 0
        return kv_bytes_per_block(self.attention_layers(), self.block_size, self.kv_dtype) + draft

    def determine_num_blocks(self) -> int:
        """Blocks that fit: configured, else free GPU memory after a profiling forward, else the CPU budget."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks is not None:
            return cc.num_gpu_blocks
        if self.device.type != "cuda":  # the budget holds the state slots too
            state = self.state_cache.nbytes() if self.state_cache is not None else 0
            return max(1, cc.cpu_kv_cache_tokens // self.block_size - -(-state // self.kv_bytes_per_block()))
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
        meta = one_sequence_metadata(n, self.block_size, self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        rows = min(n, self.config.scheduler_config.max_num_seqs)
        if self.drafter is not None:  # its forwards run apart from the target's, so its peak is measured alone
            self.drafter.profile_run(ids, meta, rows)
        with attention_metadata(meta):
            hidden = self.model(ids, torch.arange(n, device=self.device))
        logits = self.model.compute_logits(hidden[-rows:]).float()
        worst = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.1, repetition_penalty=1.1,
                               presence_penalty=0.1, logprobs=20)
        self.sampler(logits, SamplingMetadata.build([SamplingRow(worst, [0], [0])] * rows, logits.shape[-1],
                                                    self.device))
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
        self.kv_cache = allocate_kv_cache(self.attention_layers(), num_blocks, self.block_size, self.kv_dtype,
                                          self.device, self.attn_backend)
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
        if self.config.model_config.gpu_decode_stack:  # graphs only: enabled once, with the graphs that take it
            from novainfer.layers.gpu_decoder import enable_gpu_decode_stack
            logger.info("batch-1 decode stack (fused kernels): %s", "on" if enable_gpu_decode_stack(self.model)
                        else "off (the model has layers it does not fuse)")
        sc = self.config.scheduler_config
        self.graphs = DecodeGraphs(self.model, sc.max_num_seqs, self.max_blocks_per_seq,
                                   self.hf_config.hidden_size, self.dtype, self.device, self.num_splits,
                                   state_slots=self.state_cache is not None)
        self.graphs.capture()
        spec = self.config.speculative_config
        if spec is not None:  # verify steps where every sequence checks num_speculative_tokens guesses
            self.verify_graphs = DecodeGraphs(self.model, sc.max_num_seqs, self.max_blocks_per_seq,
                                              self.hf_config.hidden_size, self.dtype, self.device, self.num_splits,
                                              query_len=spec.num_speculative_tokens + 1)
            self.verify_graphs.capture()

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
        """Token ids, positions, slots, offsets and block tables on the host; sampling parameters on the device.

        Block tables come from the persistent input batch (updated by deltas); positions, slots and
        offsets are vectorized over the step, so a decode step costs a few list reads per sequence."""
        for seq_id in sched.finished_seq_ids:
            self.generators.pop(seq_id, None)
            self.input_batch.remove(seq_id)
            self._rows.pop(seq_id, None)
        if self.faults:  # tests only: before any input is written
            for s in sched.scheduled:
                self.faults.check("prepare", s.seq.request_id)
        scheduled, batch = sched.scheduled, self.input_batch
        num_seqs = len(scheduled)
        rows, starts, counts = batch.gather(scheduled)
        num_tokens = int(counts.sum())
        self._num_steps += 1
        h = self.host = self._host_sets[self._num_steps % 2]
        ids, pos, slots = h.input_ids.numpy(), h.positions.numpy(), h.slot_mapping.numpy()
        ends = np.cumsum(counts)
        feed = None
        if num_tokens == num_seqs:  # one new token per sequence: a decode step
            known = [s.seq.token_ids[s.start] if s.start < len(s.seq.token_ids) else -1 for s in scheduled]
            if -1 in known:  # sampled by the step still in flight: taken from its ids on the device
                feed = self._feed_from_previous(scheduled, known)
            ids[:num_tokens] = known
            positions, token_rows = starts, rows
        elif sched.num_spec_tokens:  # a verify step: a sequence's last token, then its guesses
            known = list(chain.from_iterable(
                (s.seq.token_ids[s.start:s.start + s.num_new_tokens - len(s.spec_token_ids)] or [-1])
                + s.spec_token_ids for s in scheduled))
            if -1 in known:
                raise RuntimeError("speculative decoding runs with async scheduling off")
            ids[:num_tokens] = known
            positions = np.arange(num_tokens) + np.repeat(starts - (ends - counts), counts)
            token_rows = np.repeat(rows, counts)
        else:
            known = list(chain.from_iterable(
                s.seq.token_ids[s.start:s.start + s.num_new_tokens] or [-1] for s in scheduled))  # [] only for a decode whose input is pending: one token
            if -1 in known:
                feed = self._feed_from_previous([scheduled[i] for i in np.repeat(np.arange(num_seqs), counts)],
                                                known)
            ids[:num_tokens] = known
            positions = np.arange(num_tokens) + np.repeat(starts - (ends - counts), counts)
            token_rows = np.repeat(rows, counts)
        pos[:num_tokens] = positions
        slots[:num_tokens] = batch.slots(token_rows, positions, self.block_size)
        width = int(batch.num_blocks[rows].max())
        h.block_tables[:num_seqs * width].numpy().reshape(num_seqs, width)[:] = batch.block_tables[rows, :width]
        seq_lens = starts + counts
        h.seq_lens.numpy()[:num_seqs] = seq_lens
        qsl = h.query_start_loc.numpy()
        qsl[0] = 0
        qsl[1:num_seqs + 1] = ends
        logits_indices, sample_seq_ids, sampling_rows = [], [], []
        spec = None
        if sched.num_spec_tokens:
            spec = verify_rows(scheduled, ends.tolist(), self._sampling_row, logits_indices, sample_seq_ids,
                               sampling_rows)
        else:
            for s, end in zip(scheduled, ends.tolist()):
                if s.samples:
                    logits_indices.append(end - 1)
                    sample_seq_ids.append(s.seq.seq_id)
                    sampling_rows.append(self._sampling_row(s.seq))
        h.logits_indices.numpy()[:len(logits_indices)] = logits_indices
        prompt_lp = [plan for s, end in zip(scheduled, ends.tolist())
                     if s.seq.sampling_params.prompt_logprobs is not None and s.start < s.seq.num_prompt_tokens
                     and (plan := plan_prompt_logprobs(s.seq, s.start, s.num_new_tokens, end - s.num_new_tokens))]
        inp = StepInputs(h.input_ids[:num_tokens], h.positions[:num_tokens], h.slot_mapping[:num_tokens],
                         qsl[:num_seqs + 1].tolist(), seq_lens.tolist(),
                         h.block_tables[:num_seqs * width].view(num_seqs, width), h.seq_lens[:num_seqs],
                         h.query_start_loc[:num_seqs + 1], int(counts.max()), logits_indices, sample_seq_ids,
                         sampling_rows, feed=feed, logits_indices_t=h.logits_indices[:len(logits_indices)],
                         prompt_logprob_rows=prompt_lp, grammar_bitmask=sched.grammar_bitmask)
        if spec is not None:
            inp.spec_num_drafts, inp.spec_draft_ids = spec
        if self.state_cache is not None:
            inp.state_slots = self.state_cache.step_metadata(scheduled)
        if sampling_rows:  # uploaded now, while the device is idle, so the forward is not waited on later
            inp.sampling_metadata = self._sampling_metadata(sampling_rows, sample_seq_ids if spec is None else None)
        return inp

    def _feed_from_previous(self, scheduled, known: list[int]) -> TokenFeed:
        """Where each pending input token (-1 in known) lies in the previous step's sampled ids."""
        prev = self._prev
        if prev is None:
            raise RuntimeError("a step's input token is pending but no earlier step sampled it")
        dst = [i for i, t in enumerate(known) if t < 0]
        src = [prev.rows[scheduled[i].seq.seq_id] for i in dst]
        h = self.host
        h.feed_dst.numpy()[:len(dst)] = dst
        h.feed_src.numpy()[:len(src)] = src
        return TokenFeed(h.feed_dst[:len(dst)], h.feed_src[:len(src)], prev)

    def _sampling_metadata(self, rows: list[SamplingRow], seq_ids: list[int] | None) -> SamplingMetadata:
        """Built and uploaded again only when the rows' parameters may have changed: decode steps of the same
        sequences without penalties or min_tokens blocking reuse the last step's tensors (seq_ids None: the
        rows are not one per sequence, as in a verify step; always built)."""
        static = seq_ids is not None and \
            all(not r.blocked_token_ids and not r.output_token_ids and not r.prompt_token_ids for r in rows)
        key = tuple(seq_ids or ())
        if static and self._last_sampling is not None and self._last_sampling[0] == key:
            return self._last_sampling[1]
        meta = SamplingMetadata.build(rows, self.hf_config.vocab_size, self.device)
        self._last_sampling = (key, meta) if static else None
        return meta

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

    def cudagraphs_for(self, inp: StepInputs) -> DecodeGraphs | None:
        """The captured graphs that can run this step: a pure decode step, or a verify step in which every
        sequence checks the full number of guesses; None runs it eagerly."""
        num_seqs = len(inp.seq_lens)
        graphs = self.graphs if inp.max_query_len == 1 else self.verify_graphs
        if graphs is None or not graphs.can_run(num_seqs) or inp.max_query_len != graphs.query_len:
            return None
        if inp.state_slots is not None and (inp.state_slots.restores or inp.state_slots.saves):
            return None  # a state checkpoint copy: the layers' eager prefill path does it
        if inp.max_query_len > 1 and (inp.spec_num_drafts is None or len(inp.spec_num_drafts) != num_seqs
                                      or inp.input_ids.shape[0] != num_seqs * graphs.query_len):
            return None
        return graphs

    def build_attention_metadata(self, inp: StepInputs) -> AttentionMetadata:
        """Upload the step's inputs once (asynchronously from pinned memory) and describe them for attention."""
        def up(x: torch.Tensor) -> torch.Tensor:
            return x.to(self.device, non_blocking=True)
        max_query_len = inp.max_query_len
        meta = AttentionMetadata(
            query_start_loc=up(inp.query_start_loc_t), seq_lens=up(inp.seq_lens_t),
            slot_mapping=up(inp.slot_mapping), block_tables=up(inp.block_tables),
            max_query_len=max_query_len, max_seq_len=max(inp.seq_lens),
            query_start_loc_cpu=inp.query_start_loc, seq_lens_cpu=inp.seq_lens,
            num_splits=self.num_splits(len(inp.seq_lens)) if max_query_len == 1 else 1,
            state_slots=inp.state_slots.on(self.device) if inp.state_slots is not None else None)
        num_tokens = inp.input_ids.shape[0]
        if self.attn_backend is cpu_backend and inp.spec_num_drafts is not None and \
                sum(inp.spec_num_drafts) + len(inp.spec_num_drafts) == num_tokens:  # only sequences that verify
            meta.per_token = per_token_metadata(inp.query_start_loc, inp.positions, meta.slot_mapping,
                                                meta.block_tables)
        return meta

    def run_model_forward(self, inp: StepInputs) -> torch.Tensor | None:
        """Logits [num_sampled_rows, vocab] in float32; None when no row samples (a prefill chunk).

        A pure decode step copies its inputs straight into a captured graph's buffers and replays it;
        any other step builds its attention metadata and runs eagerly."""
        graphs = self.cudagraphs_for(inp) if self.graphs is not None else None
        state = inp.state_slots
        if state is not None:
            self.state_cache.zero_fresh(state)
        if graphs is not None:
            with nvtx_range("attn_meta/graph_inputs", self.nvtx):
                graphs.load_inputs(inp.input_ids, inp.positions, inp.slot_mapping, inp.seq_lens_t, inp.block_tables,
                                   None if state is None else state.slots)
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
                hidden = self.model(ids, pos)
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
            firsts = range(len(inp.sample_seq_ids)) if inp.spec_num_drafts is None else \
                np.cumsum([0] + [d + 1 for d in inp.spec_num_drafts]).tolist()
            row_of = dict(zip(inp.sample_seq_ids, firsts))  # a constrained sequence has one row: it never guesses
            rows = torch.tensor([row_of[s] for s in inp.grammar_bitmask.seq_ids], device=self.device)
            token_bitmask = (rows, inp.grammar_bitmask.bitmask.to(self.device, non_blocking=True))
        with sampling_threads(logits):
            if inp.spec_num_drafts is not None:
                draft_ids = torch.tensor(inp.spec_draft_ids, device=self.device)
                return rejection_sample(self.sampler, logits, inp.sampling_metadata, draft_ids, token_bitmask)
            return self.sampler(logits, inp.sampling_metadata, token_bitmask)

    def postprocess(self, inp: StepInputs, sampled) -> ModelRunnerOutput:
        """The step's one device-to-host copy."""
        out = ModelRunnerOutput(inp.sample_seq_ids, sampled.sampled_token_ids.tolist(),
                                prompt_logprobs=inp.prompt_logprobs)
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
        if inp.spec_num_drafts is not None:
            self._split_verified(out, inp.spec_num_drafts, sampled.accepted.tolist())
        return out

    @staticmethod
    def _split_verified(out: ModelRunnerOutput, num_drafts: list[int], accepted: list[bool]) -> None:
        """Rows of a verify step -> per sequence: the accepted guesses, then the one sampled token after them."""
        tokens, logprobs = out.sampled_token_ids, out.logprobs
        out.sampled_token_ids, out.spec_accepted_token_ids = [], []
        out.logprobs = [] if logprobs is not None else None
        out.spec_logprobs = [] if logprobs is not None else None
        first = 0
        for d in num_drafts:
            n = emitted_rows(accepted, first, d)
            out.spec_accepted_token_ids.append(tokens[first:first + n - 1])
            out.sampled_token_ids.append(tokens[first + n - 1])
            if logprobs is not None:
                out.spec_logprobs.append(logprobs[first:first + n - 1])
                out.logprobs.append(logprobs[first + n - 1])
            first += d + 1

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step, waited for: its sampled tokens on the host."""
        return self.execute_model_async(sched).get()

    @torch.inference_mode()
    def execute_model_async(self, sched: SchedulerOutput) -> "StepHandle":
        """Prepare and launch one step; the handle's get() waits for it and copies its tokens to the host.

        On CUDA the launch is asynchronous by nature; on the CPU the forward and sampling run on the step
        thread. Either way a later step may be prepared (and launched) before this one's get()."""
        with nvtx_range("prepare/step_inputs", self.nvtx):
            inp = self.prepare_step_inputs(sched)
        if self._device_thread is None:
            sampled = self._forward_and_sample(inp)
            handle = StepHandle(self, inp, sampled, HostCopy(sampled) if self.device.type == "cuda" else None)
        else:
            handle = StepHandle(self, inp, self._device_thread.submit(self._forward_and_sample, inp))
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


class PreviousStep:
    """The last launched step that sampled, and which row of its sampled ids belongs to each sequence."""

    def __init__(self, handle: "StepHandle", rows: dict[int, int]):
        self.handle, self.rows = handle, rows

    def sampled_ids(self) -> torch.Tensor:
        """Its sampled ids, still on the device (on the CPU: once its step thread has produced them)."""
        return self.handle.sampled().sampled_token_ids


class TokenFeed:
    """Input tokens a step takes from the previous step's sampled ids, on the device (no host round trip)."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, prev: PreviousStep):
        self.dst, self.src, self.prev = dst, src, prev  # host tensors in the step's (pinned) buffers

    def apply(self, input_ids: torch.Tensor, device: torch.device) -> None:
        dst = self.dst.to(device, non_blocking=True)
        src = self.src.to(device, non_blocking=True)
        input_ids[dst] = self.prev.sampled_ids()[src]


class HostCopy:
    """A step's sampler outputs copied into pinned host memory in stream order, and the event that marks them
    done: reading them back waits for this step only. (tolist() on a device tensor would synchronize the
    whole stream, which by then holds the next step too, and undo the overlap.)"""

    def __init__(self, sampled: SamplerOutput | None):
        self.out = None
        if sampled is not None:
            self.out = type(sampled)(**{f.name: None if (t := getattr(sampled, f.name)) is None else
                                        torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                                        for f in dataclasses.fields(sampled)})
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> SamplerOutput | None:
        self.event.synchronize()
        return self.out


class StepHandle:
    """A launched step. It keeps the step's inputs and outputs alive until get() has read them back."""

    def __init__(self, runner: ModelRunner, inp: StepInputs, sampled, host_copy: HostCopy | None = None):
        self.runner, self.inp, self._sampled, self.host_copy = runner, inp, sampled, host_copy
        self._output: ModelRunnerOutput | None = None

    def sampled(self):
        """The sampler's output (device tensors); on the CPU, waits for the step thread."""
        if isinstance(self._sampled, Future):
            self._sampled = self._sampled.result()
        return self._sampled

    def get(self) -> ModelRunnerOutput:
        """Wait for the step and copy its sampled ids (and logprobs) to the host, once."""
        if self._output is None:
            sampled = self.sampled() if self.host_copy is None else self.host_copy.wait()
            if sampled is None:
                self._output = ModelRunnerOutput([], [], prompt_logprobs=self.inp.prompt_logprobs)
            else:
                with nvtx_range("sample/to_host", self.runner.nvtx):
                    self._output = self.runner.postprocess(self.inp, sampled)
            self.runner = None  # the runner keeps its last step (PreviousStep): no cycle once it is read back
        return self._output
