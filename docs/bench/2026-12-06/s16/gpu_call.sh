#!/usr/bin/env bash
# The sixteenth session's lent-GPU call (2026-12-06): the fp8 KV cache's float16 products (issue 38) against the
# tree before. Run from the repository root on the device machine with $OUT set; .whl/ holds the wheels the
# machine lacks, .bench/base is `git archive 43a4210 novainfer benchmarks tests` (the tree before the change),
# .bench/new the same tree with fp8_kv_float16_products.patch applied.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee $OUT/gpu.txt
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    echo "=== $name ($(date +%T))"
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"
    tail -n 14 "$OUT/$name.log"
}
# kernels against the torch reference, the decode kernel's time over bf16 and fp8, capacity, bench throughput
(cd .bench/new && step fp8kv_new 240 python3 tests/gpu/fp8_kv_check.py)
(cd .bench/base && step fp8kv_base 240 python3 tests/gpu/fp8_kv_check.py)
