#!/usr/bin/env bash
# Session 20's third GPU call (an H100): the first call's Qwen2.5-7B pair (new 205 against base 196 tok/s, one run
# each, new first) again, interleaved base, m1, m2, m2, m1, base (as many as 190 s allow), to tell PDL's effect on the llama decode stack from
# run-to-run drift. Trees as gpu_call2.sh. $OUT set; .whl/ holds py3.12 wheels of msgspec, pyzmq, gguf and xxhash.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
S=docs/bench/2026-12-07/s20
lat() {  # tree tag model; skipped once the call is 190 s old
  if [ $SECONDS -gt 190 ]; then echo "$2: skipped (time)"; return; fi
  (cd $1 && PYTHONPATH=/tmp/site:. timeout 60 python3 benchmarks/latency.py --model random:$3 --repeat 3 \
    --output-len 128 --json $OUT/lat_$2.json > $OUT/lat_$2.log 2>&1; echo "rc=$?" >> $OUT/lat_$2.log)
  echo "$2: $(python3 -c "import json; d=json.load(open('$OUT/lat_$2.json')); print(f\"{d['decode_tok_s']:.1f} tok/s, {1e3/d['decode_tok_s']:.3f} ms\")" 2>&1 | tail -1) $(grep rc= $OUT/lat_$2.log)"
}
lat .bench/base 7b_base1 qwen2.5-7b
lat .bench/m1 7b_m1_1 qwen2.5-7b
lat . 7b_m2_1 qwen2.5-7b
lat . 7b_m2_2 qwen2.5-7b
lat .bench/m1 7b_m1_2 qwen2.5-7b
lat .bench/base 7b_base2 qwen2.5-7b
