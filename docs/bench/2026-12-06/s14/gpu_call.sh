#!/usr/bin/env bash
# One lent-GPU call of the fourteenth session (2026-12-06): run from the repository root on the device machine
# with $OUT set. Wheels the machine lacks come from .whl/, the tree before the change from .bench/base (a
# `git archive e9e59ed novainfer benchmarks tests`); both git-ignored and carried. Each step has its own time
# limit so the call ends inside the lender's 600 s; every log lands under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee $OUT/gpu.txt
python3 -c "import triton, triton.language as tl; print('triton', triton.__version__, 'gdc', hasattr(tl.extra.cuda, 'gdc_wait'))" | tee -a $OUT/gpu.txt
step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    echo "=== $name ($(date +%T))"
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"
    tail -n 12 "$OUT/$name.log"
}
case "${1:-a}" in
a)
    # programmatic dependent launch of the GEMVs: the batch-1 stack's kernels against the layer kernels and
    # transformers, then the 9B's batch-1 decode from this tree and the tree before, taking turns
    step decode_stack 150 python3 tests/gpu/gpu_check.py --only decode_stack
    step ab_9b 400 python3 benchmarks/tree_ab.py --base .bench/base --rounds 2 --key decode_tok_s --json "$OUT/ab_9b.json" -- \
        benchmarks/latency.py --model random:qwen3.5-9b --repeat 3 --output-len 128
    ;;
b)
    # the 7B's batch-1 decode in bf16 and block FP8 from both trees; the hybrid models' tokens and graphs with PDL
    step ab_7b 330 python3 benchmarks/tree_ab.py --base .bench/base --rounds 2 --key decode_tok_s --json "$OUT/ab_7b.json" -- \
        benchmarks/latency.py --model random:qwen2.5-7b --repeat 3 --output-len 128
    step qwen35_checks 220 python3 tests/gpu/qwen35_checks.py --skip bench
    ;;
c)
    # which part of the PDL change moves the 7B and the 9B: this tree (wait + release + the first K step's weights
    # prefetched to L2), .bench/nopf (the same without the prefetch) and .bench/base, taking turns; the 7B only
    # (the 9B was 1.03x in two calls), two rounds; MODELS="qwen3.5-9b:2" for the 9B in a second call
    for model in ${MODELS:-qwen2.5-7b:2}; do
        for r in $(seq 1 ${model#*:}); do
            for tree in . .bench/nopf .bench/base; do
                label=${tree##*/}; [ "$tree" = . ] && label=new; name=lat_${model%:*}_${label}_$r
                (cd $tree && timeout 95 python3 benchmarks/latency.py --model random:${model%:*} --repeat 3 \
                    --output-len 128 --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1)
                echo "$model round $r $tree: $(python3 -c "import json; print(json.load(open('$OUT/$name.json'))['decode_tok_s'])" 2>&1 | tail -1)"
            done
        done
    done
    ;;
esac
