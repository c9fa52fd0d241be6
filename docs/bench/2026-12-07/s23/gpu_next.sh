#!/usr/bin/env bash
# Prepared for the next session that gets a device (not run in session 23). $OUT set; .whl/ holds py3.12 wheels of
# msgspec, pyzmq, gguf and xxhash; .bench/base is `git archive HEAD novainfer benchmarks`, .bench/new the same with
# int4_gemm_folded.patch and gguf_gemm_rows.patch applied (patch -p1).
# 1. the INT4 GEMM folded or not at 48-127 rows (the rows session 23 did not time; its tree with the patches ran the
#    bench shape 1.10x in one run each);
# 2. GGUF's own GEMM against dequantize + cuBLAS at 2-32 rows (gguf_gemm_rows.patch routes 2-32 rows to it);
# 3. the end-to-end pairs: INT4 bench shape, base and new interleaved twice; GGUF 32 streams, base and new.
# Two calls, each under the 600 s limit: `gpu_next.sh a` (1, 2 and one INT4 pair), `gpu_next.sh b` (the rest).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
int4_pair() {  # int4_pair ROUND: the INT4 bench shape from base, then new
  for tree in base new; do
    (cd .bench/$tree && PYTHONPATH=/tmp/site:. timeout 90 python3 benchmarks/quant_gpu.py --part e2e --formats int4-gptq \
      --repeat 1 > $OUT/int4_${tree}_$1.log 2>&1)
    echo "int4 $tree $1"; grep -E "^int4-gptq +\|" $OUT/int4_${tree}_$1.log
  done
}
case "${1:-a}" in
a)
  timeout 120 python3 docs/bench/2026-12-07/s23/w4_wide.py --rows 48 64 96 127 --iters 5 > $OUT/w4_wide.log 2>&1
  echo "w4_wide rc=$?"; grep -E "^\||worst" $OUT/w4_wide.log | cut -c1-300
  timeout 90 python3 benchmarks/tuning/w4_gemm_tiles.py --formats Q4_K,Q6_K --rows 2 8 32 --iters 5 > $OUT/gguf_gemm.log 2>&1
  echo "gguf gemm rc=$?"; grep -E "M=" $OUT/gguf_gemm.log | cut -c1-220
  int4_pair 1
  ;;
b)
  int4_pair 2
  for tree in base new; do
    (cd .bench/$tree && PYTHONPATH=/tmp/site:. timeout 150 python3 benchmarks/gguf_gpu.py --part e2e --modes quantized \
      --path /tmp/q4km-7b.gguf --repeat 1 > $OUT/gguf_$tree.log 2>&1)
    echo "gguf $tree"; grep -E "^\|" $OUT/gguf_$tree.log | tail -n 4
  done
  ;;
esac
