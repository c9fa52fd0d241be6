#!/usr/bin/env bash
# Session 20's second GPU call (wanted on an H200, where issue 33's 75%-of-floor target is stated): whether PDL
# shortens the Qwen3.5-9B batch-1 step there. The lab GEMV chain (9B shapes), then batch-1 decode from three trees,
# interleaved base, m1, m2, m2, m1, base:
#   base = `git archive 5437e60 novainfer benchmarks tests` (.bench/base);
#   m1   = base + the GEMV launched with PDL, waiting at its start, and the attention and gated-norm kernels
#          triggering their dependents (.bench/m1);
#   m2   = this tree: the same, the GEMV's first weight tile loaded before the wait.
# $OUT set; .whl/ holds py3.12 wheels of msgspec, pyzmq, gguf and xxhash.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
S=docs/bench/2026-12-07/s20
timeout 90 python3 $S/pdl_gemv.py --shapes qwen3.5-9b > $OUT/pdl_gemv.log 2>&1; echo "rc=$?" >> $OUT/pdl_gemv.log
grep -v Warn $OUT/pdl_gemv.log
lat() {  # tree tag; skipped once the call is 4.5 minutes old
  if [ $SECONDS -gt 270 ]; then echo "$2: skipped (time)"; return; fi
  (cd $1 && PYTHONPATH=/tmp/site:. timeout 120 python3 benchmarks/latency.py --model random:qwen3.5-9b --repeat 3 \
    --output-len 128 --json $OUT/lat_$2.json > $OUT/lat_$2.log 2>&1; echo "rc=$?" >> $OUT/lat_$2.log)
  echo "$2: $(python3 -c "import json; d=json.load(open('$OUT/lat_$2.json')); print(f\"{d['decode_tok_s']:.1f} tok/s, {1e3/d['decode_tok_s']:.3f} ms\")" 2>&1 | tail -1) $(grep rc= $OUT/lat_$2.log)"
}
lat .bench/base base1
lat .bench/m1 m1_1
lat . m2_1
lat . m2_2
lat .bench/m1 m1_2
lat .bench/base base2
