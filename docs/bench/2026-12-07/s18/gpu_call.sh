#!/usr/bin/env bash
# The eighteenth session's lent-GPU call (2026-12-07). Run from the repository root on the device machine with $OUT
# set; .whl/ holds the wheels the machine lacks (msgspec, pyzmq, gguf, xxhash for its Python), .bench/base is
# `git archive HEAD novainfer benchmarks tests` (the tree as committed), .bench/new the same tree with
# docs/bench/2026-12-06/s16/fp8_kv_float16_products.patch applied.
#   1. issue 33: Qwen3.5-9B-shape batch-1 decode on the tree as committed (c68aeeb's gating in the recurrence
#      kernel was never timed on an H200), against the card's weight-read floor;
#   2. issue 38: the fp8 KV cache's float16 products against the tree before (kernel times, capacity, bench-shape
#      throughput, greedy agreement), each tree's tests/gpu/fp8_kv_check.py.
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
(cd .bench/base && step lat_9b 150 python3 benchmarks/latency.py --model random:qwen3.5-9b --repeat 3 \
    --output-len 128 --json $OUT/lat_9b.json)
(cd .bench/new && step fp8kv_new 190 python3 tests/gpu/fp8_kv_check.py --num-prompts 128)
(cd .bench/base && step fp8kv_base 190 python3 tests/gpu/fp8_kv_check.py --num-prompts 128)
