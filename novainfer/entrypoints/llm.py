"""The offline API, named as vLLM's: LLM(model).generate(prompts, SamplingParams) and LLM.chat(messages)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence as Seq

from tqdm import tqdm

from novainfer.config import EngineConfig
from novainfer.engine.gc_heap import frozen_heap
from novainfer.engine.llm_engine import LLMEngine
from novainfer.server.chat_utils import apply_chat_template
from novainfer.outputs import RequestOutput
from novainfer.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """Loads a model (HF folder or .gguf; None = the default model) and generates from batches of prompts.

    Keyword arguments are the engine settings, vLLM's names (max_model_len, max_num_seqs, dtype, ...): every
    field novainfer.config.engine_arg_fields() lists, with the defaults and help `novainfer serve --help` shows.
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any):
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_metrics(self) -> dict[str, float]:
        """The engine's counters since start (SchedulerStats' fields), plus speculation's acceptance rate and
        mean accepted length (emitted tokens per verified sequence-step) when it is on."""
        stats = self.llm_engine.make_stats()
        metrics = {f: getattr(stats, f) for f in stats.__struct_fields__}
        if stats.spec_num_drafts:
            metrics["spec_acceptance_rate"] = stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
            metrics["spec_mean_accepted_length"] = stats.spec_num_emitted_tokens / stats.spec_num_drafts
        return metrics

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        # only finished outputs are read here: the engine can skip per-step outputs and detokenization
        sampling_params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in sampling_params]
        engine = self.llm_engine
        order: dict[str, int] = {}
        for prompt, params in zip(prompts, sampling_params):
            request_id = str(next(self._ids))
            engine.add_request(request_id, prompt, params)
            order[request_id] = len(order)
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        tokens_before = engine.num_generated_tokens
        remaining = len(prompts)
        try:
            with frozen_heap():  # the loaded engine's objects stay out of the collector's full passes meanwhile
                while remaining:
                    for out in engine.step():
                        if out.finished and out.request_id in order:
                            results[order[out.request_id]] = out
                            remaining -= 1
                            bar.update(1)
                    if use_tqdm and (elapsed := bar.format_dict["elapsed"]) > 0:
                        rate = (engine.num_generated_tokens - tokens_before) / elapsed
                        bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
        finally:
            bar.close()
            for request_id in order:
                engine.abort_request(request_id)  # no-op for finished ones; frees the rest after an error
        return results  # type: ignore[return-value]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = [
            {
                "prompt_token_ids": apply_chat_template(
                    tokenizer, conv, add_generation_prompt, **(chat_template_kwargs or {})
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
