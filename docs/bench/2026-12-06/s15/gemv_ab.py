"""Two builds of the CPU kernels in one process, taking turns on the same weights: the few-row GEMMs at M = 1.
Run from the new tree: python gemv_ab.py FILE.gguf ROUNDS BASE_TREE (a git archive of the base commit)."""
import sys, time, torch, gc, ctypes, os
sys.path.insert(0, os.getcwd())
torch.set_num_threads(2)
from novainfer.kernels.cpu import library as L, qgemm
from novainfer import LLM
from novainfer.kernels.cpu.repack import PackedWeight
base_files = [os.path.join(os.path.join(sys.argv[3], 'novainfer/kernels/cpu/csrc'), n) for n in L._SOURCES + L._HEADERS]
libs = {'base': L._bind(ctypes.CDLL(L._build(base_files))), 'new': L._library()}
llm = LLM(sys.argv[1])
ws = {}
for o in gc.get_objects():
    if isinstance(o, PackedWeight) and not o.wide:
        ws.setdefault((o.kind, o.shape), []).append(o)
def total(name):
    qgemm.library = lambda: libs[name]
    out = {}
    for key, lst in ws.items():
        x = torch.randn(1, key[1][1])
        best = 1e9
        for _ in range(3):
            t = time.perf_counter()
            for w in lst[:4]: qgemm.quant_gemm(x, w)
            best = min(best, (time.perf_counter() - t) / len(lst[:4]))
        out[key] = best * len(lst)
    return out
res = {'base': [], 'new': []}
for r in range(int(sys.argv[2])):
    for name in ('base', 'new') if r % 2 == 0 else ('new', 'base'):
        res[name].append(total(name))
import statistics
for name in res:
    tot = [sum(d.values()) * 1e3 for d in res[name]]
    lm = [d[('q6', (248320, 1024))] * 1e3 for d in res[name]]
    print(f"{name}: all GEMVs a token ms {[round(t,2) for t in tot]} median {statistics.median(tot):.2f}; LM head ms median {statistics.median(lm):.2f}")
ratios = [sum(b.values()) / sum(n.values()) for b, n in zip(res['base'], res['new'])]
print("per-round base/new:", [round(x, 3) for x in ratios], "median", round(statistics.median(ratios), 3))
