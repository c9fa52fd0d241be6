"""Prompt lookup (n-gram) speculation: no extra model, the guesses are copied from the sequence itself.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens are searched for earlier in the
prompt and output; at the latest earlier match, the tokens that followed it are the guesses. Text that
repeats or edits its input (code, quotes, rewrites) continues an earlier span often, and then one target
forward accepts several tokens.

Where checking a guess costs a real share of a step (the CPU: the quantized GEMM is compute-bound past one
row), the draft is cut to 2^(n-1) tokens for a match of n tokens: a longer match predicts a longer copied run,
and a 1-token match rarely continues far (benchmarks/ngram_policy.py replays the benchmark's outputs to
compare such rules). On a GPU, where a verify step costs about what a decode step does, every match drafts k.
"""

from __future__ import annotations

import numpy as np

from novainfer.sequence import Sequence
from novainfer.spec_decode.proposer import Proposer


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int, scale_by_match: bool = False) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix n-gram (with
    scale_by_match, up to 2^(n-1) of them for a match of n tokens)."""
    last = len(tokens) - 1
    if last < 1:
        return []
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # earlier positions where a match could end
    if not len(ends):
        return []
    lengths = np.ones(len(ends), dtype=np.int64)  # how far back each one matches the suffix, up to max_n
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, min(max_n, last)):
        alive &= (ends >= j) & (tokens[np.maximum(ends - j, 0)] == tokens[last - j])
        if not alive.any():
            break
        lengths += alive
    best = int(lengths.max())
    if best < min_n:
        return []
    start = int(ends[np.flatnonzero(lengths == best)[-1]]) + 1
    if scale_by_match:
        k = min(k, 1 << (best - 1))
    return tokens[start : start + k].tolist()


class NgramProposer(Proposer):
    """Keeps each sequence's tokens as a growing numpy array, so a step converts only the new tokens."""

    def __init__(self, min_n: int, max_n: int, scale_by_match: bool = False):
        self.min_n, self.max_n, self.scale_by_match = min_n, max_n, scale_by_match
        self._tokens: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> (buffer, tokens in it)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        return [
            propose_ngram(self._array(seq), self.min_n, self.max_n, k, self.scale_by_match) if k > 0 else []
            for seq, k in zip(seqs, num_tokens)
        ]

    def _array(self, seq: Sequence) -> np.ndarray:
        buf, n = self._tokens.get(seq.seq_id, (None, 0))
        length = len(seq.token_ids)
        if buf is None or n > length or len(buf) < length:
            buf = np.empty(max(2 * length, 64), dtype=np.int64)
            n = 0
        buf[n:length] = seq.token_ids[n:length]
        self._tokens[seq.seq_id] = (buf, length)
        return buf[:length]

    def remove(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._tokens.pop(seq_id, None)
