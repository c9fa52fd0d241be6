"""The AVX2 panel GEMM (512 rows) in GMAC/s by layer shape, random Q4_K blocks (finite d, dmin), 1 and 2 threads:
python panel_gemm_by_k.py from the repository root."""
import sys, time, os, numpy as np, torch
sys.path.insert(0, os.getcwd())
from gguf import GGMLQuantizationType as T
from novainfer.kernels.cpu.repack import repack
from novainfer.kernels.cpu import qgemm, library
M = 512
for (N, K) in [(3584, 1024), (1024, 3584), (1024, 12288), (6144, 1536), (1536, 6144)]:
    b = np.random.default_rng(0).integers(0, 256, (N, K // 256, 144), dtype=np.uint8)
    b[:, :, 0:4] = np.frombuffer(np.array([0.01, 0.001], np.float16).tobytes(), np.uint8)
    pw = repack(b.reshape(N, -1), T.Q4_K, (N, K))
    x = torch.randn(M, K)
    for th in (1, 2):
        library.set_num_threads(th)
        qgemm.quant_gemm(x, pw)
        best = 1e9
        for _ in range(4):
            t = time.perf_counter(); qgemm.quant_gemm(x, pw); best = min(best, time.perf_counter() - t)
        print(f"N={N} K={K} threads={th}: {best*1e3:.1f} ms, {M*N*K/best/1e9:.1f} GMAC/s")
