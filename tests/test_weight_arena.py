"""The huge-page weight arena moves packed CPU weights without changing a value or a result."""

import torch

from novainfer.kernels.cpu.qgemm import quant_gemm
from novainfer.kernels.cpu.repack import PackedWeight
from novainfer.kernels.cpu.weight_arena import ALIGN, HUGE_PAGE, move_to_arena


def _packed(n: int, k: int, zeros: bool, seed: int) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.rand(n, k // 32, generator=g) * 0.01
    z = -torch.rand(n, k // 32, generator=g) * 0.05 if zeros else None
    return PackedWeight.from_rows("q4", q, s, z, 32, (n, k))


def test_arena_keeps_values_and_results_and_moves_a_tied_weight_once():
    a, b = _packed(37, 96, True, 0), _packed(11, 64, False, 1)
    before = [(p.qweight.clone(), p.scales.clone(), None if p.zeros is None else p.zeros.clone()) for p in (a, b)]
    x = torch.randn(3, 96)
    y_before = quant_gemm(x, a)
    size = move_to_arena([a, b, a])  # a listed twice (a tied embedding / lm_head): moved once
    assert size > 0
    for p, (q, s, z) in zip((a, b), before):
        assert torch.equal(p.qweight, q) and torch.equal(p.scales, s)
        assert (p.zeros is None and z is None) or torch.equal(p.zeros, z)
    ptrs = [t.data_ptr() for p in (a, b) for t in (p.qweight, p.scales, p.zeros) if t is not None]
    assert ptrs[0] % HUGE_PAGE == 0 and all(p % ALIGN == 0 for p in ptrs)
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < size  # one mapping, in the order given
    assert torch.equal(quant_gemm(x, a), y_before)
