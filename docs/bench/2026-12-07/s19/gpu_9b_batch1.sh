#!/usr/bin/env bash
# Qwen3.5-9B shape batch-1 decode on the committed tree (issue 33's 75%-of-the-weight-read-floor target is stated on
# an H200: 16.0 GB a token at 4.8 TB/s = 3.33 ms, so 75% is 4.44 ms, 225 tok/s). $OUT set; .whl/ as gpu_call.sh.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu_9b.txt
timeout 200 python3 benchmarks/latency.py --model random:qwen3.5-9b --repeat 3 --output-len 128 \
  --json $OUT/lat_9b.json > $OUT/lat_9b.log 2>&1; echo "rc=$?" >> $OUT/lat_9b.log
tail -n 12 $OUT/lat_9b.log
