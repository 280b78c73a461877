#!/usr/bin/env bash
# One GPU-host lease (README, GPU benchmark), everything in the background from a copy of the checkout
# (/tmp/cf-repo), results under /tmp/cf-results:
#  1. the benchmark (raw, stage, flow) with the GPU preset as it ships (cuda_mps auto: captionflow starts
#     CUDA MPS itself for its 4 engines)                       -> gpu_throughput.json
#  2. tuning on the same kind of images: the stage without MPS  -> tune-mps-off.json
#  3. raw and stage at a 224x224 pixel budget (the GPU-HOST.md baseline's image size) -> tune-px224.json
#  4. the stage with 2 engines instead of 4                   -> tune-k2.json
#  5. the stage with max_num_batched_tokens 8192 (not 16384)  -> tune-mbt8k.json
#   bench/gpu_host_session.sh PARTS_DIR        then wait for /tmp/final.done
set -uo pipefail
PARTS=${1:?parts folder}
rm -rf /tmp/cf-repo /tmp/final.done && mkdir -p /tmp/cf-results && cp -r "$PWD" /tmp/cf-repo
cd /tmp/cf-repo || exit 1
run() {  # NAME WORK ARGS...: one benchmark invocation, its JSON and phase logs into /tmp/cf-results
  local name=$1 work=$2; shift 2
  echo "=== $name $(date +%T)"
  BENCH_WORK=$work BENCH_JSON=/tmp/cf-results/$name.json bash bench/gpu_host_run.sh "$PARTS" "$@"
  for f in "$work"/phase-*.log; do [ -f "$f" ] && tail -c 2000000 "$f" > "/tmp/cf-results/$name-$(basename "$f")"; done
  pkill -9 -f "raylet|gcs_server|ray::|EngineCore" ; sleep 3
}
setsid nohup bash -c "$(declare -f run); PARTS='$PARTS'
  run gpu_throughput /tmp/cf-bench --phases raw,stage,flow --phase-timeout 480
  run tune-mps-off /tmp/cf-tune-mps --phases stage --cuda-mps off --phase-timeout 400
  run tune-px224 /tmp/cf-tune-224 --phases raw,stage --max-pixels 50176 --phase-timeout 400
  run tune-k2 /tmp/cf-tune-k2 --phases stage --engines-per-gpu 2 --phase-timeout 400
  run tune-mbt8k /tmp/cf-tune-mbt --phases stage --engine-kwargs '{\"max_num_batched_tokens\": 8192}' --phase-timeout 400
  touch /tmp/final.done" > /tmp/final.log 2>&1 < /dev/null &
echo "session started in the background: tail /tmp/final.log, wait for /tmp/final.done"
