#!/usr/bin/env bash
# One GPU-host lease as it ran for bench/results/gpu_throughput-h100-80gb-hbm3.json (see README, GPU benchmark):
#  1. tuning: the inference stage with 4 engines on the GPU under CUDA MPS (kernels of several processes run
#     concurrently instead of time-sliced), logs kept in /tmp/cf-tune;
#  2. the full benchmark (raw, stage, flow) in the background with the faster engine layout: MPS + 4 engines
#     if it beat 2 engines without MPS (40.6 images/s, measured in an earlier lease), else the latter.
#   bench/gpu_host_session.sh PARTS_DIR        then wait for /tmp/final.done
set -uo pipefail
PARTS=${1:?parts folder}
export CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
MPS_ENV=(--pipeline-env CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe --pipeline-env CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log)
mkdir -p /tmp/mps-pipe /tmp/mps-log
CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe nvidia-cuda-mps-control -d && echo "MPS daemon started"
BENCH_WORK=/tmp/cf-tune BENCH_JSON=/tmp/cf-tune/gpu_throughput-tune-mps-k4.json \
  bash bench/gpu_host_run.sh "$PARTS" --phases stage --phase-timeout 400 --engines-per-gpu 4 "${MPS_ENV[@]}"
pkill -9 -f "raylet|gcs_server|ray::|EngineCore" ; sleep 3
rate=$(python3 -c "import json;print(json.load(open('/tmp/cf-tune/gpu_throughput-tune-mps-k4.json'))['stage'].get('images_per_s') or 0)" 2>/dev/null || echo 0)
echo "tuning: MPS, 4 engines: $rate images/s"
if python3 -c "import sys; sys.exit(0 if float('$rate') > 44 else 1)"; then
  FINAL=(--engines-per-gpu 4 "${MPS_ENV[@]}")
else
  FINAL=(--engines-per-gpu 2)
  echo quit | CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe nvidia-cuda-mps-control
fi
echo "final run: ${FINAL[*]}"
rm -f /tmp/final.done
OUT= setsid nohup bash -c "bash bench/gpu_host_run.sh '$PARTS' --phases raw,stage,flow --phase-timeout 480 ${FINAL[*]}; touch /tmp/final.done" > /tmp/final.log 2>&1 < /dev/null &
echo "final run started in the background"
