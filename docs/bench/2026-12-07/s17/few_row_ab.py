"""Several builds of the CPU kernels (csrc folders) in one process, taking turns on the same random GGUF-type
weights: the few-row GEMM at M rows (env M, default 1) of type QT (Q4_K, Q6_K, Q8_0), T threads, R rounds; a
2048 x 2048 weight (L3-resident) and eight 4096 x 4096 ones (DRAM). Prints GB/s of weight bytes per build and
each build's per-round ratio to the first; asserts every build gives the first one's bits.
    M=1 QT=Q4_K python few_row_ab.py BASE/csrc NEW/csrc [MORE/csrc ...]"""
import sys, time, ctypes, os, statistics, torch, numpy as np
sys.path.insert(0, '/work/main')
torch.set_num_threads(int(os.environ.get("T", "2")))
from gguf import GGMLQuantizationType as T
from novainfer.kernels.cpu import library as L, qgemm
from novainfer.kernels.cpu.repack import repack
def lib(d): return L._bind(ctypes.CDLL(L._build([os.path.join(d, n) for n in L._SOURCES + L._HEADERS])))
names = [os.path.basename(os.path.dirname(p.rstrip('/'))) for p in sys.argv[1:]]
libs = {n: lib(p) for n, p in zip(names, sys.argv[1:])}
M = int(os.environ.get("M", "1"))
qt = getattr(T, os.environ.get("QT", "Q4_K"))
rng = np.random.default_rng(0)
bs = {T.Q4_K: 144, T.Q6_K: 210, T.Q8_0: 34, T.Q5_K: 176}[qt]; per = 32 if qt == T.Q8_0 else 256
def mk(N, K):
    data = rng.integers(0, 256, (N, K // per, bs), dtype=np.uint8)
    if qt in (T.Q4_K, T.Q5_K): data[:, :, 0:4] = np.frombuffer(np.array([0.01, 0.001], dtype=np.float16).tobytes(), dtype=np.uint8)
    elif qt == T.Q8_0: data[:, :, 0:2] = np.frombuffer(np.array([0.01], dtype=np.float16).tobytes(), dtype=np.uint8)
    else: data[:, :, -2:] = np.frombuffer(np.array([0.01], dtype=np.float16).tobytes(), dtype=np.uint8)
    return repack(data, qt, (N, K))
cases = [(2048, 2048, 1, 60), (4096, 4096, 8, 6)]
ws = {c: [mk(c[0], c[1]) for _ in range(c[2])] for c in cases}
xs = {c: torch.randn(M, c[1]) for c in cases}
ys = {}
res = {(n, c): [] for n in libs for c in cases}
for r in range(int(os.environ.get("R", "12"))):
    for n in (names if r % 2 == 0 else names[::-1]):
        qgemm.library = lambda n=n: libs[n]
        for c in cases:
            nb = sum(w.nbytes() for w in ws[c])
            t = time.perf_counter()
            for _ in range(c[3]):
                for w in ws[c]: y = qgemm.quant_gemm(xs[c], w)
            res[(n, c)].append(nb * c[3] / (time.perf_counter() - t) / 1e9)
            ys.setdefault((n, c), y)
for c in cases:
    base = names[0]
    out = [f"{qt.name} M={M} {c[0]}x{c[1]} x{c[2]}: {base} {statistics.median(res[(base, c)]):.1f} GB/s"]
    for n in names[1:]:
        assert torch.equal(ys[(base, c)], ys[(n, c)]), "outputs differ"
        ratios = [y / x for x, y in zip(res[(base, c)], res[(n, c)])]
        out.append(f"{n} {statistics.median(res[(n, c)]):.1f} ({statistics.median(ratios):.3f}x)")
    print("; ".join(out))
