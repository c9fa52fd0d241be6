#!/usr/bin/env bash
# Session 23's GPU call (one call: the device budget left after refusals allows one start). $OUT set; .whl/ holds
# py3.12 wheels of msgspec, pyzmq, gguf and xxhash; .bench/base is `git archive HEAD novainfer benchmarks`,
# .bench/new the same with int4_gemm_folded.patch, int4_dequant_rows.patch and gguf_gemm_rows.patch applied.
# 1. w4_wide.py: INT4 GEMMs at 32 / 128 / 256 rows on the 7B layers (the package's paths, the faster dequantization,
#    the folded and the wide kernels) against bf16;
# 2. Qwen2.5-7B shape GPTQ INT4 end to end, bench shape and batch-1: new, then base, then bf16 (from base).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
t0=$SECONDS
timeout 170 python3 docs/bench/2026-12-07/s23/w4_wide.py --rows 32 128 256 --iters 5 > $OUT/w4_wide.log 2>&1
echo "w4_wide rc=$? $((SECONDS - t0)) s"
grep -E "^\||worst" $OUT/w4_wide.log | cut -c1-300
# the INT4 A/B first (new, then base), bf16 last: the device budget may end the call early
for run in new:int4-gptq base:int4-gptq base:bf16; do
  tree=${run%%:*}; fmt=${run#*:}
  t0=$SECONDS
  (cd .bench/$tree && PYTHONPATH=/tmp/site:. timeout 110 python3 benchmarks/quant_gpu.py --part e2e --formats $fmt \
    --repeat 2 > $OUT/e2e_${tree}_$fmt.log 2>&1; echo "rc=$?" >> $OUT/e2e_${tree}_$fmt.log)
  echo "$tree $fmt $((SECONDS - t0)) s"; grep -E "^[a-z0-9-]+ +\||rc=|\{" $OUT/e2e_${tree}_$fmt.log | cut -c1-220 | tail -n 4
done
