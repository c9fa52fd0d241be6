#!/usr/bin/env bash
# Session 22's GPU call (needs_h200), not run in session 22 (no device was lent): issue 33's batch-1 target on an
# H200, where the 9B's short-prompt prefill step spends its host time, and one INT4 GEMV experiment.
# 1. Qwen3.5-9B batch-1 decode, twice (latency.py, 3 repeats each; no H200 figure since `61aa818`: 72.9%);
# 2. the INT4 decode GEMV with its loads one K step ahead (int4_gemv_prefetch.patch) against the package's, same call;
# 3. 4-bit weights dequantized slice by slice into an L2-resident scratch before cuBLAS (l2_sliced.py) against
#    today's whole-weight dequantization and bf16, 7B layers at 32 / 128 / 256 rows, INT4 and Q4_K;
# 4. cProfile of five 512-token prefills one at a time (profile_step.py --rounds 5), by own and cumulative time.
# Seven files come back (the limit is 8): gpu.txt, lat1/2.log, int4_base/prefetch.log, l2_sliced.log, prof.log.
# $OUT set; .whl/ holds py3.12 wheels of msgspec, pyzmq, gguf and xxhash.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,clocks.max.sm --format=csv | tee $OUT/gpu.txt
for i in 1 2; do
  t0=$SECONDS
  timeout 200 python3 benchmarks/latency.py --model random:qwen3.5-9b --repeat 3 --output-len 128 \
    > $OUT/lat$i.log 2>&1
  echo "lat$i rc=$? $((SECONDS - t0)) s"
  grep -E '^\|' $OUT/lat$i.log
done
t0=$SECONDS
timeout 150 python3 benchmarks/tuning/int4_gemv_tiles.py --rows 1 > $OUT/int4_base.log 2>&1
echo "int4 base rc=$? $((SECONDS - t0)) s"
grep -E "m=1|total" $OUT/int4_base.log | cut -c1-150
# the stand-in: the package's kernels file with int4_gemv_prefetch.patch applied (no copy kept in the lab)
patch -s -o /tmp/int4_gemv_prefetch.py novainfer/kernels/int4_gemm.py docs/bench/2026-12-07/s22/int4_gemv_prefetch.patch
timeout 150 python3 benchmarks/tuning/int4_gemv_tiles.py --rows 1 \
  --kernels /tmp/int4_gemv_prefetch.py > $OUT/int4_prefetch.log 2>&1
echo "int4 prefetch rc=$?"
grep -E "m=1|total" $OUT/int4_prefetch.log | cut -c1-150
t0=$SECONDS
timeout 240 python3 docs/bench/2026-12-07/s22/l2_sliced.py --rows 32 128 256 --iters 5 > $OUT/l2_sliced.log 2>&1
echo "l2_sliced rc=$? $((SECONDS - t0)) s"
grep -E "^\||worst" $OUT/l2_sliced.log | cut -c1-240
t0=$SECONDS
timeout 240 python3 benchmarks/tuning/profile_step.py --model random:qwen3.5-9b --num-prompts 1 --input-len 512 \
  --output-len 1 --rounds 5 --top 30 --sort tottime cumulative > $OUT/prof.log 2>&1
echo "prof rc=$? $((SECONDS - t0)) s"
grep -v -i "warn\|Loading" $OUT/prof.log | cut -c1-150 | tail -n 40
