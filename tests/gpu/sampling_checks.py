"""Checks of the one-pass sampling kernel (novainfer/kernels/sampling.py), shared by the CPU test (Triton's
interpreter, small shapes) and gpu_check.py (real vocabulary, timing against the torch path)."""

from __future__ import annotations

import torch

from novainfer.kernels.sampling import gumbel_sample
from tests.gpu.checks import check


def greedy_rows_are_argmax(device: str, rows: int, vocab: int, chunk: int = 8192, block: int = 512) -> None:
    """Greedy rows: torch.argmax exactly, ties (within and across the kernel's blocks and chunks) to the first
    index."""
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g, device=device)
    logits[1, [3, vocab - 1]] = 50.0  # a tie across chunks
    logits[4, [chunk - 1, chunk]] = 50.0  # a tie across the boundary of two chunks
    logits[2, [vocab // 2, vocab // 2 + 1]] = 50.0  # a tie inside a block
    logits[3, : vocab - 1] = float("-inf")  # one token left
    greedy = torch.ones(rows, dtype=torch.bool, device=device)
    got = gumbel_sample(logits, torch.ones(rows, device=device), greedy, chunk=chunk, block=block)
    check(
        f"gumbel sampler greedy rows == argmax, vocab {vocab}, chunks of {chunk}",
        f"{rows} rows with ties",
        torch.equal(got, logits.argmax(dim=-1)),
    )


def draws_follow_softmax(device: str, rows: int, calls: int, chunk: int = 8192, block: int = 512) -> None:
    """Random rows: each token's frequency over rows x calls draws within 4.5 sigma of softmax(logits / T);
    tokens at -inf never drawn; greedy rows mixed in keep their argmax."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), 1.5], device=device)
    for t in (0.5, 1.0, 2.0):
        batch = logits.repeat(rows, 1)
        greedy = torch.zeros(rows, dtype=torch.bool, device=device)
        greedy[::7] = True
        temp = torch.full((rows,), t, device=device)
        counts = torch.zeros(logits.numel(), device=device)
        argmax_ok = True
        for c in range(calls):
            out = gumbel_sample(batch, temp, greedy, seed=1000 * c + int(10 * t), chunk=chunk, block=block)
            argmax_ok &= bool((out[greedy] == 0).all())
            counts += torch.bincount(out[~greedy], minlength=logits.numel()).float()
        n = counts.sum().item()
        p = torch.softmax(logits / t, dim=-1)
        sigma = (p * (1 - p) / n).sqrt()
        z = ((counts / n - p).abs() / sigma.clamp_min(1e-12)).nan_to_num(0.0)
        worst = z[p > 0].max().item()
        check(
            f"gumbel sampler draws ~ softmax(logits / {t})",
            f"{int(n)} draws, worst {worst:.1f} sigma, -inf drawn {int(counts[5].item())}x",
            worst < 4.5 and counts[5] == 0 and argmax_ok,
        )


def speed_against_the_torch_path(rows: int, vocab: int) -> None:
    """CUDA: the kernel against the Sampler's torch path (temperature, softmax, exponential race) per call."""
    from novainfer.layers.sampler import Sampler

    logits = torch.randn(rows, vocab, device="cuda")
    temp = torch.full((rows,), 0.6, device="cuda")
    greedy = torch.zeros(rows, dtype=torch.bool, device="cuda")

    class Meta:  # what Sampler.sample_random reads
        temperature, top_k, top_p, min_p, generators = temp, None, None, None, [None] * rows

    times = {}
    for name, fn in (
        ("torch", lambda: torch.where(greedy, logits.argmax(-1), Sampler.sample_random(logits, Meta))),
        ("kernel", lambda: gumbel_sample(logits, temp, greedy)),
    ):
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 20 * 1e3
    check(
        f"gumbel sampler speed, {rows} x {vocab}",
        f"torch path {times['torch']:.0f} us, kernel "
        f"{times['kernel']:.0f} us ({times['torch'] / times['kernel']:.1f}x)",
        times["kernel"] < times["torch"],
    )


def sampling_kernel_checks(device: str = "cuda") -> None:
    if device == "cuda":
        greedy_rows_are_argmax(device, 64, 151936)
        draws_follow_softmax(device, 4096, 25)
        speed_against_the_torch_path(256, 151936)
    else:  # Triton's interpreter: small shapes; several chunks a row, several blocks a chunk
        greedy_rows_are_argmax(device, 5, 4096 + 37, chunk=1000, block=128)
        draws_follow_softmax(device, 64, 6, chunk=7, block=2)  # the 7 tokens: 4 blocks of 2, the last one masked
