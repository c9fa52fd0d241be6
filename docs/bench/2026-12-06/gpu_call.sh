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
    # issue 38: the MoE formats end to end on an H200 (INT4 with the per-pair GEMV, untimed on an H200)
    step moe_e2e 560 python3 benchmarks/quant_gpu.py --part moe-e2e --formats bf16,int4-gptq --repeat 1 --out "$OUT/moe_e2e"
    ;;
esac
