#!/usr/bin/env bash
# One lent-GPU call of the thirteenth session (2026-12-06): run from the repository root on the device machine
# with $OUT set. Wheels the machine lacks come from .whl/ (git-ignored). Each step has its own time limit so the
# call ends inside the lender's 600 s; every log lands under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee $OUT/gpu.txt
git log --oneline -1 2>/dev/null | tee -a $OUT/gpu.txt
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    echo "=== $name ($(date +%T))"
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"
    tail -n 12 "$OUT/$name.log"
}
case "${1:-a}" in
a)
    # issue 33: the 9B's batch-1 decode against the H200's weight-read floor (c68aeeb's gating fusion untimed there)
    step lat_9b 200 python3 benchmarks/latency.py --model random:qwen3.5-9b --repeat 3 --output-len 128 --json "$OUT/lat_9b.json"
    # issue 38: the INT4 MoE GEMV's tile candidates and the FP8 MoE's error bound on an H200
    step moe_kernels 300 python3 benchmarks/quant_gpu.py --part moe-kernels --moe-tokens 1 2 4 16 256 --out "$OUT/moe_kernels"
    ;;
b)
    # issue 38: INT4 in the batch-1 decode stack (b7e7654): its CPU test on a real GPU (float32, stack against the
    # layer path), then the 7B batch-1 INT4 against bf16 from this tree and INT4 from the tree before (.bench/base,
    # a `git archive e4f6b6f novainfer benchmarks tests`), one after the other
    step int4_stack_test 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_decoder.py -k int4
    step e2e_new 220 python3 benchmarks/quant_gpu.py --part e2e --formats bf16,int4-gptq --repeat 1 --num-prompts 32 --out "$OUT/e2e_new"
    (cd .bench/base && step e2e_base 130 python3 benchmarks/quant_gpu.py --part e2e --formats int4-gptq --repeat 1 --num-prompts 32 --out "$OUT/e2e_base")
    ;;
c)
    # issue 38: the one-row INT4 GEMV with two K steps' loads in flight (lab kernel) against the package's, 7B/30B layers
    step gemv_unrolled 200 python3 benchmarks/tuning/int4_gemv_tiles.py --rows 1 --kernels docs/bench/2026-12-06/int4_gemv_unrolled.py --out "$OUT/gemv_unrolled.json"
    step gemv_package 200 python3 benchmarks/tuning/int4_gemv_tiles.py --rows 1 --out "$OUT/gemv_package.json"
    ;;
esac
