"""The overlapped step loop's pieces: a launched step (StepHandle) that is read back later, the last step that
sampled (PreviousStep), whose ids feed the next step's pending inputs on the device (step_inputs.TokenFeed), and
the sampler's outputs copied to pinned host memory in stream order (HostCopy)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

import torch

from novainfer.layers.sampling_metadata import SamplerOutput
from novainfer.spec_decode.rejection_sampler import split_verified
from novainfer.step_types import ModelRunnerOutput
from novainfer.worker.step_inputs import StepInputs, nvtx_range


class PreviousStep:
    """The last launched step that sampled, and which row of its sampled ids belongs to each sequence."""

    def __init__(self, handle: StepHandle, rows: dict[int, int]):
        self.handle, self.rows = handle, rows

    def sampled_ids(self) -> torch.Tensor:
        """Its sampled ids, still on the device (on the CPU: once its step thread has produced them)."""
        return self.handle.sampled().sampled_token_ids


class HostCopy:
    """A step's sampler outputs copied into pinned host memory in stream order, and the event that marks them
    done: reading them back waits for this step only. (tolist() on a device tensor would synchronize the
    whole stream, which by then holds the next step too, and undo the overlap.)"""

    def __init__(self, sampled: SamplerOutput | None):
        self.out = None
        if sampled is not None:
            self.out = type(sampled)(
                **{
                    f.name: None
                    if (t := getattr(sampled, f.name)) is None
                    else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                    for f in dataclasses.fields(sampled)
                }
            )
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> SamplerOutput | None:
        self.event.synchronize()
        return self.out


class StepHandle:
    """A launched step. It keeps the step's inputs and outputs alive until get() has read them back."""

    def __init__(self, inp: StepInputs, sampled: Any, host_copy: HostCopy | None = None, nvtx: bool = False):
        self.inp, self._sampled, self.host_copy, self.nvtx = inp, sampled, host_copy, nvtx
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
                with nvtx_range("sample/to_host", self.nvtx):
                    self._output = runner_output(self.inp, sampled)
        return self._output


def runner_output(inp: StepInputs, sampled: SamplerOutput) -> ModelRunnerOutput:
    """A step's sampler outputs on the host, per sampled sequence: the step's one device-to-host copy."""
    out = ModelRunnerOutput(inp.sample_seq_ids, sampled.sampled_token_ids.tolist(), prompt_logprobs=inp.prompt_logprobs)
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
        split_verified(out, inp.spec_num_drafts, sampled.accepted.tolist())
    return out
