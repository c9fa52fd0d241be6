#!/bin/bash
# Seconds from launching `novainfer serve MODEL` (CPU, float32) to its first 200 on /health, five starts.
# Run from the repository root with the venv active: bash docs/bench/2026-12-07/s17/serve_start.sh /path/to/tiny-model
model=${1:?a model folder}
for i in 1 2 3 4 5; do
    port=$((18200 + i))
    start=$(date +%s.%N)
    python -m novainfer.entrypoints.cli serve "$model" --port $port --device cpu --dtype float32 > /tmp/serve_start_$i.log 2>&1 &
    pid=$!
    until curl -s localhost:$port/health > /dev/null; do sleep 0.05; done
    echo "$(echo "$(date +%s.%N) - $start" | bc)"
    kill $pid; wait $pid 2> /dev/null
done
