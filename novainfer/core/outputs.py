"""Output rows of the last decode: logits for the flagged tokens only, packed in batch order.

The buffers are reserved before the forward (output_reserve) and only grow, so the tensors handed out
stay valid (and, for as many rows as before, at the same address) until the next decode writes them.
"""

from __future__ import annotations

import numpy as np
import torch


class OutputBuffer:
    """logits [capacity, vocab] float32 and output_ids [capacity] (row j -> batch token index)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.logits = torch.empty(0, vocab_size, dtype=torch.float32, device=device)
        self.ids = np.empty(0, dtype=np.int32)
        self.n_outputs = 0
        self.row_of_token = np.empty(0, dtype=np.int32)  # batch index -> row, -1 for tokens without logits

    @property
    def capacity(self) -> int:
        return self.logits.shape[0]

    def reserve(self, n_outputs: int) -> None:
        """Make room for n_outputs rows; the rows of the previous decode survive a growth."""
        if n_outputs <= self.capacity:
            return
        logits = torch.empty(n_outputs, self.vocab_size, dtype=torch.float32, device=self.device)
        logits[: self.n_outputs] = self.logits[: self.n_outputs]
        ids = np.empty(n_outputs, dtype=np.int32)
        ids[: self.n_outputs] = self.ids[: self.n_outputs]
        self.logits, self.ids = logits, ids

    def store(self, flagged: np.ndarray, n_tokens: int, logits: torch.Tensor) -> None:
        """Write the rows of the batch tokens `flagged` (in batch order); needs a reserve() first."""
        n = len(flagged)
        assert n <= self.capacity, "output_reserve was not called for this decode"
        self.logits[:n] = logits
        self.ids[:n] = flagged
        self.n_outputs = n
        self.row_of_token = np.full(n_tokens, -1, dtype=np.int32)
        self.row_of_token[flagged] = np.arange(n, dtype=np.int32)

    def get(self) -> torch.Tensor:
        return self.logits[: self.n_outputs]

    def output_ids(self) -> np.ndarray:
        return self.ids[: self.n_outputs]

    def get_ith(self, i: int) -> torch.Tensor:
        """Logits of batch token i; a negative i counts output rows from the end (-1: the last row)."""
        if i < 0:
            if -i > self.n_outputs:
                raise IndexError(f"output row {i} out of range: the last decode produced {self.n_outputs} rows")
            return self.logits[self.n_outputs + i]
        if i >= len(self.row_of_token):
            raise IndexError(f"token {i} out of range: the last decode had {len(self.row_of_token)} tokens")
        row = int(self.row_of_token[i])
        if row < 0:
            raise IndexError(f"token {i} of the last batch did not ask for logits (batch.logits[{i}] == 0)")
        return self.logits[row]
