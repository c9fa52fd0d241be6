#!/usr/bin/env bash
# Session 22's second GPU call: the sliced dequantization (branch l2-sliced, kernels/sliced_dequant.py) end to end
# against the tree before it, in one call. .bench/base: `git archive <main> novainfer benchmarks tests`;
# .bench/sliced: the same of the l2-sliced branch. .whl/ holds py3.12 wheels of msgspec, pyzmq, gguf and xxhash.
# 1. GGUF Q4_K_M (Qwen2.5-7B shape, written once): 32 streams and the bench shape, kept quantized, both trees;
# 2. GPTQ INT4 (Qwen2.5-7B shape): the bench shape and batch-1, both trees, and bf16 once.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
for tree in base sliced; do
  t0=$SECONDS
  (cd .bench/$tree && PYTHONPATH=/tmp/site:. timeout 240 python3 benchmarks/gguf_gpu.py --part e2e --modes quantized \
    --path /tmp/q4km-7b.gguf --repeat 2 > $OUT/gguf_$tree.log 2>&1; echo "rc=$?" >> $OUT/gguf_$tree.log)
  echo "gguf $tree $((SECONDS - t0)) s"; grep -E "^\||rc=" $OUT/gguf_$tree.log | cut -c1-200 | tail -n 12
done
for tree in base sliced; do
  t0=$SECONDS
  fmts=int4-gptq; [ $tree = base ] && fmts=bf16,int4-gptq
  (cd .bench/$tree && PYTHONPATH=/tmp/site:. timeout 200 python3 benchmarks/quant_gpu.py --part e2e --formats $fmts \
    --repeat 2 > $OUT/int4_$tree.log 2>&1; echo "rc=$?" >> $OUT/int4_$tree.log)
  echo "int4 $tree $((SECONDS - t0)) s"; grep -E "^\||rc=" $OUT/int4_$tree.log | cut -c1-200 | tail -n 12
done
