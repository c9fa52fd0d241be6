"""One Qwen3.5-0.8B DeltaNet layer's prefill in the C kernel (16 key / 16 value heads of 128, conv 4), T tokens,
per ISA, states carried between calls: python gdn_prefill_isa.py 512 scalar avx2 [avx512]; N=calls (10)."""
import time, torch, sys, os
sys.path.insert(0, os.getcwd())
from novainfer.kernels.cpu import gated_delta as G
torch.manual_seed(0)
nk, nv, dk, dv, width, T = 16, 16, 128, 128, 4, int(sys.argv[1])
c = 2*nk*dk + nv*dv
x = torch.randn(T, c); weight = torch.randn(c,1,width)*0.5
g = -torch.rand(T, nv); beta = torch.rand(T, nv)
slots = torch.tensor([0]); cu = torch.tensor([0, T], dtype=torch.int32)
conv = torch.zeros(2, width-1, c); ssm = torch.zeros(2, nv, dk, dv)
for isa in sys.argv[2:]:
    G.set_isa(isa)
    for r in range(2): G.prefill(x, conv, ssm, slots, cu, weight, g, beta, nk, dk)
    t=time.perf_counter()
    for r in range(int(os.environ.get("N", "10"))): G.prefill(x, conv, ssm, slots, cu, weight, g, beta, nk, dk)
    print(f"prefill {isa}: {(time.perf_counter()-t)*1e3/int(os.environ.get('N', '10')):.2f} ms per layer (T={T})")
