#!/usr/bin/env bash
# The session's GPU call: the 9B memory printout from the committed tree (f48be4c, the launch fallbacks' fix), the
# Qwen3.5 checks' bench part (Qwen3.5-9B and Qwen2.5-7B, max_model_len 4,096) from it, then the same printout from
# the tree before (.bench/base = `git archive 04798c3 novainfer benchmarks tests` plus mem9b.py). $OUT set; .whl/
# holds py3.12 wheels of msgspec, pyzmq, gguf and xxhash.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
M=docs/bench/2026-12-07/s19/mem9b.py
timeout 150 python3 $M > $OUT/mem9b_new.log 2>&1; echo "rc=$?" >> $OUT/mem9b_new.log
grep -v "^ \|^\[" $OUT/mem9b_new.log | tail -n 9
timeout 250 python3 tests/gpu/qwen35_checks.py --skip hf graphs > $OUT/qwen35_bench.log 2>&1; echo "rc=$?" >> $OUT/qwen35_bench.log
tail -n 7 $OUT/qwen35_bench.log
cd .bench/base
timeout 150 python3 mem9b.py > $OUT/mem9b_base.log 2>&1; echo "rc=$?" >> $OUT/mem9b_base.log
grep -v "^ \|^\[" $OUT/mem9b_base.log | tail -n 9
