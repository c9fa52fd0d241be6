#!/usr/bin/env bash
# One call for the GGUF int8 GEMM (1ec93a7): the kernel sweep of gpu_mmq_kernels.sh on fewer row counts, then the
# end-to-end A/B of gpu_mmq_e2e.sh (.bench/base = `git archive 8e04412 novainfer benchmarks tests`). $OUT set.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
timeout 170 python3 benchmarks/gguf_gpu.py --part kernels --rows 2 32 256 --out $OUT/k > $OUT/mmq_kernels.log 2>&1
echo "rc=$?" >> $OUT/mmq_kernels.log
grep "M=" $OUT/mmq_kernels.log | cut -c1-210; tail -n 2 $OUT/mmq_kernels.log
P=/tmp/q4km/qwen2.5-7b-random-q4_k_m.gguf
mkdir -p /tmp/q4km
A="--part e2e --modes quantized --num-prompts 64 --repeat 2 --path $P"
timeout 170 python3 benchmarks/gguf_gpu.py $A --out $OUT/new > $OUT/e2e_new.log 2>&1; echo "rc=$?" >> $OUT/e2e_new.log
grep "^quantized\|wrote" $OUT/e2e_new.log | cut -c1-400; tail -n 1 $OUT/e2e_new.log
cd .bench/base
timeout 110 python3 benchmarks/gguf_gpu.py $A --out $OUT/base > $OUT/e2e_base.log 2>&1; echo "rc=$?" >> $OUT/e2e_base.log
grep "^quantized" $OUT/e2e_base.log | cut -c1-400; tail -n 1 $OUT/e2e_base.log
