#!/usr/bin/env bash
# Session 20's first GPU call: programmatic dependent launch (PDL) for the batch-1 GEMVs.
# 1. the lab chain of GEMVs (pdl_gemv.py: four launch forms of one plain GEMV, 9B and 7B shapes);
# 2. Qwen3.5-9B batch-1 decode, this tree (the GEMV launched with PDL, and the attention and gated-norm kernels letting
#    it start) against .bench/base (`git archive 5437e60 novainfer benchmarks tests`) and .bench/gemv (the GEMV alone
#    with PDL), interleaved; Qwen2.5-7B new then base;
# 3. the decode stack checks (GEMVs, greedy against transformers with the stack in CUDA graphs) and the Qwen3.5 checks
#    against transformers in float32 (the batch-1 hybrid stack in graphs).
# $OUT set; .whl/ holds py3.12 wheels of msgspec, pyzmq, gguf and xxhash.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
S=docs/bench/2026-12-07/s20
timeout 120 python3 $S/pdl_gemv.py > $OUT/pdl_gemv.log 2>&1; echo "rc=$?" >> $OUT/pdl_gemv.log
cat $OUT/pdl_gemv.log | grep -v Warn
lat() {  # tree model tag; skipped once the call is 8.5 minutes old
  if [ $SECONDS -gt 510 ]; then echo "$3: skipped (time)"; return; fi
  (cd $1 && PYTHONPATH=/tmp/site:. timeout 150 python3 benchmarks/latency.py --model random:$2 --repeat 3 --output-len 128 \
    --json $OUT/lat_$3.json > $OUT/lat_$3.log 2>&1; echo "rc=$?" >> $OUT/lat_$3.log)
  echo "$3: $(grep -E '^\| NovaInfer|rc=' $OUT/lat_$3.log | tr '\n' ' ')"
}
lat .bench/base qwen3.5-9b 9b_base1
lat . qwen3.5-9b 9b_new1
lat .bench/gemv qwen3.5-9b 9b_gemv1
lat . qwen3.5-9b 9b_new2
lat .bench/base qwen3.5-9b 9b_base2
[ $SECONDS -lt 480 ] && timeout 100 python3 tests/gpu/gpu_check.py --only decode_stack > $OUT/decode_stack.log 2>&1; echo "rc=$?" >> $OUT/decode_stack.log
tail -n 8 $OUT/decode_stack.log
lat . qwen2.5-7b 7b_new
lat .bench/base qwen2.5-7b 7b_base
[ $SECONDS -lt 480 ] && timeout 110 python3 tests/gpu/qwen35_checks.py --skip bench graphs > $OUT/qwen35_hf.log 2>&1; echo "rc=$?" >> $OUT/qwen35_hf.log
tail -n 8 $OUT/qwen35_hf.log
