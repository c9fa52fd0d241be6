#!/usr/bin/env bash
# The Qwen2.5-7B-shape Q4_K_M GGUF kept quantized on the GPU end to end (batch-1 decode, 32 streams, 64 bench-shape
# prompts) from the tree with the int8 GEMM and from the tree before it (.bench/base = `git archive 8e04412
# novainfer benchmarks tests`), same file, same call. $OUT set; .whl/ as gpu_mmq_kernels.sh.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu_e2e.txt
P=/tmp/q4km/qwen2.5-7b-random-q4_k_m.gguf
mkdir -p /tmp/q4km
A="--part e2e --modes quantized --num-prompts 64 --repeat 3 --path $P"
timeout 290 python3 benchmarks/gguf_gpu.py $A --out $OUT/new > $OUT/e2e_new.log 2>&1; echo "rc=$?" >> $OUT/e2e_new.log
grep -A4 "^mode " $OUT/e2e_new.log; tail -n 2 $OUT/e2e_new.log
cd .bench/base
timeout 200 python3 benchmarks/gguf_gpu.py $A --out $OUT/base > $OUT/e2e_base.log 2>&1; echo "rc=$?" >> $OUT/e2e_base.log
grep -A4 "^mode " $OUT/e2e_base.log; tail -n 2 $OUT/e2e_base.log
