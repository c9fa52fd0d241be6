#!/usr/bin/env bash
# Session 21's GPU call, for an H200 (issue 33's 75%-of-floor target is stated there):
# 1. Qwen3.5-9B batch-1 decode at 5fdb85d (.bench/head: `git archive 5fdb85d novainfer benchmarks tests`) (no H200 figure since `61aa818`: 72.9%) against .bench/m2 (the same tree +
#    s20/pdl_m2.patch: the GEMV launched with PDL), interleaved new, m2, new, m2;
# 2. a device timeline of the 9B at batch 1 with a 512-token prompt (where the step goes now; the prefill step's
#    time, for session 20's unexplained TTFT spread).
# $OUT set; .whl/ holds py3.12 wheels of msgspec, pyzmq, gguf and xxhash.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,clocks.max.sm --format=csv | tee $OUT/gpu.txt
python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1
lat() {  # tree tag; skipped once the call is 6.5 minutes old
  if [ $SECONDS -gt 390 ]; then echo "$2: skipped (time)"; return; fi
  local t0=$SECONDS
  (cd $1 && PYTHONPATH=/tmp/site:. timeout 150 python3 benchmarks/latency.py --model random:qwen3.5-9b --repeat 3 \
    --output-len 128 --json $OUT/lat_$2.json > $OUT/lat_$2.log 2>&1; echo "rc=$?" >> $OUT/lat_$2.log)
  echo "$2: $(grep -E '^\| NovaInfer|rc=' $OUT/lat_$2.log | tr '\n' ' ') $((SECONDS - t0)) s"
}
lat .bench/head new1
lat .bench/m2 m2_1
lat .bench/head new2
lat .bench/m2 m2_2
lat .bench/head new3
if [ $SECONDS -lt 480 ]; then
  (cd .bench/head && PYTHONPATH=/tmp/site:. timeout $((590 - SECONDS)) python3 benchmarks/tuning/device_timeline.py --model random:qwen3.5-9b --num-prompts 1 \
    --max-len 512 --top 30 > $OUT/timeline.log 2>&1; echo "rc=$?" >> $OUT/timeline.log)
  grep -v -i warn $OUT/timeline.log | tail -n 75
fi
