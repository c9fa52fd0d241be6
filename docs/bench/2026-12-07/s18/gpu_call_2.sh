#!/usr/bin/env bash
# The session's second call: the committed tree (.bench/base = `git archive HEAD novainfer benchmarks tests`) on the
# Qwen3.5 checks' bench part, which ran out of memory on an H100 before aa9e24f (the memory profile's step), and the
# Gated DeltaNet kernel check whose decode-tile sweep had a stale launch (5b38b62). $OUT set; .whl/ as gpu_call.sh.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
cd .bench/base
timeout 240 python3 tests/gpu/qwen35_checks.py --skip hf graphs > $OUT/qwen35_bench.log 2>&1; echo "rc=$?" >> $OUT/qwen35_bench.log
tail -n 8 $OUT/qwen35_bench.log
timeout 100 python3 tests/gpu/gdn_check.py > $OUT/gdn_check.log 2>&1; echo "rc=$?" >> $OUT/gdn_check.log
tail -n 30 $OUT/gdn_check.log
