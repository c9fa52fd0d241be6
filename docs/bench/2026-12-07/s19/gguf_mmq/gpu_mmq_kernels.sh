#!/usr/bin/env bash
# GGUF int8 GEMM (gguf_mmq, 1ec93a7) on Qwen2.5-7B's layers: every tile candidate at 2-256 rows beside the
# dequantize + cuBLAS path it replaces and bf16 F.linear, each checked against the torch reference. $OUT set; .whl/
# holds py3.12 wheels of msgspec, pyzmq, gguf and xxhash.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu_mmq.txt
timeout 560 python3 benchmarks/gguf_gpu.py --part kernels --rows 2 16 32 64 128 256 --out $OUT/k > $OUT/mmq_kernels.log 2>&1
echo "rc=$?" >> $OUT/mmq_kernels.log
grep -A80 "^layer " $OUT/mmq_kernels.log | cut -c1-150 | head -70; tail -n 3 $OUT/mmq_kernels.log
