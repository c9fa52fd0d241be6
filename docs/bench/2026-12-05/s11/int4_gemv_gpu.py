"""INT4 MoE GEMV (helper's branch) on the GPU: correctness vs torch reference and the grouped GEMM, device time per
candidate tile at 1-4 tokens on the Qwen3-30B-A3B layer (128 experts, top-8, hidden 2048, inter 768, g128)."""
import torch, json, sys
from novainfer.kernels.fused_moe_quant import fused_experts_int4, INT4_MOE_TILES
from novainfer.kernels import moe_gemv
from novainfer.layers.quantization.int4 import fused_experts_int4_reference, pack_int4
from novainfer.layers.activation import SiluAndMul
torch.manual_seed(0)
E, H, I, G, TOPK = 128, 2048, 768, 128, 8
def experts(n, k):
    codes = torch.randint(0, 16, (E, n, k), dtype=torch.int32, device="cuda")
    return (pack_int4(codes.view(E * n, k)).view(E, n, k // 8), (torch.rand(E, n, k // G, device="cuda") * 0.01 + 0.001).bfloat16(),
            torch.randint(0, 16, (E, n, k // G), dtype=torch.uint8, device="cuda"))
COPIES = 4
W = [(experts(2 * I, H), experts(H, I)) for _ in range(COPIES)]
act = SiluAndMul()
def time_fn(fn, iters=50):
    g = torch.cuda.CUDAGraph(); s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(2): fn(0)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for i in range(COPIES): fn(i)
    torch.cuda.synchronize(); st, en = torch.cuda.Event(True), torch.cuda.Event(True)
    g.replay(); st.record()
    for _ in range(iters): g.replay()
    en.record(); torch.cuda.synchronize(); return st.elapsed_time(en) * 1e3 / iters / COPIES
rows = []
for T in (1, 2, 3, 4):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(T, E, device="cuda")
    w, ids = torch.topk(torch.softmax(logits, -1), TOPK); ids = ids.to(torch.int32); w = w.float()
    (q13, s13, z13), (q2, s2, z2) = W[0]
    ref = fused_experts_int4_reference(x.float(), q13, s13.float(), z13, q2, s2.float(), z2, G, w, ids, act).float()
    got = fused_experts_int4(x, q13, s13, z13, q2, s2, z2, G, w, ids, act).float()
    grp = fused_experts_int4(x, q13, s13, z13, q2, s2, z2, G, w, ids, act, tiles=next(iter(INT4_MOE_TILES.values()))).float()
    err = ((got - ref).norm() / ref.norm()).item(); errg = ((grp - ref).norm() / ref.norm()).item()
    def run(i, tiles=None, grouped=False):
        (a, b, c), (d, e, f) = W[i]
        if grouped:
            return fused_experts_int4(x, a, b, c, d, e, f, G, w, ids, act, tiles=next(iter(INT4_MOE_TILES.values())))
        if tiles is None:
            return fused_experts_int4(x, a, b, c, d, e, f, G, w, ids, act)
        old = moe_gemv.INT4_TILES; moe_gemv.INT4_TILES = tiles
        try: return fused_experts_int4(x, a, b, c, d, e, f, G, w, ids, act)
        finally: moe_gemv.INT4_TILES = old
    tg = time_fn(lambda i: run(i, grouped=True))
    cands = {}
    for t in moe_gemv.INT4_CANDIDATES:
        try: cands[str(t)] = time_fn(lambda i, t=t: run(i, tiles=t))
        except Exception as ex: cands[str(t)] = f"error {type(ex).__name__}"
    best = min((v, k) for k, v in cands.items() if isinstance(v, float))
    rows.append(dict(tokens=T, rel_err_gemv=err, rel_err_grouped=errg, grouped_us=tg, default_us=cands.get(str(moe_gemv.INT4_TILES)), best=best, cands=cands))
    print(f"tokens {T}: rel err gemv {err:.2e} grouped {errg:.2e}; grouped {tg:.1f} us; gemv default {cands.get(str(moe_gemv.INT4_TILES))} us; best {best[1]} {best[0]:.1f} us", flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1, default=str)
