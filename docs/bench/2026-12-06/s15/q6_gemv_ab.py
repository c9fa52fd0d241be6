"""One Q6_K layer (random blocks, N x 1024) at one row: two kernel builds in one process taking turns, 16 rounds.
Run from the new tree: python q6_gemv_ab.py BASE_TREE N (248320: the Qwen3.5 LM head)."""
import sys, time, torch, ctypes, os, statistics
sys.path.insert(0, os.getcwd())
torch.set_num_threads(2)
import numpy as np
from gguf import GGMLQuantizationType as T
from novainfer.kernels.cpu import library as L, qgemm
from novainfer.kernels.cpu.repack import repack
base_files = [os.path.join(sys.argv[1], 'novainfer/kernels/cpu/csrc', n) for n in L._SOURCES + L._HEADERS]
libs = {'base': L._bind(ctypes.CDLL(L._build(base_files))), 'new': L._library()}
N, K = int(sys.argv[2]), 1024
b = np.random.default_rng(0).integers(0, 256, (N, K // 256, 210), dtype=np.uint8)
b[:, :, 208:210] = np.frombuffer(np.array([0.01], np.float16).tobytes(), np.uint8)
w = repack(b.reshape(N, -1), T.Q6_K, (N, K))
x = torch.randn(1, K)
ys = {}
res = {'base': [], 'new': []}
for r in range(16):
    for name in (('base', 'new') if r % 2 == 0 else ('new', 'base')):
        qgemm.library = lambda: libs[name]
        ys[name] = qgemm.quant_gemm(x, w)
        best = 1e9
        for _ in range(5):
            t = time.perf_counter(); qgemm.quant_gemm(x, w); best = min(best, time.perf_counter() - t)
        res[name].append(best * 1e3)
print({k: round(statistics.median(v), 3) for k, v in res.items()}, "ratio median", round(statistics.median([a / b for a, b in zip(res['base'], res['new'])]), 3), "equal", torch.equal(ys['base'], ys['new']))
