#!/usr/bin/env bash
# One GPU-host lease (README, GPU benchmark), everything in the background from a copy of the checkout
# (/tmp/cf-repo), results and phase logs under /tmp/cf-results (copied there as they are written):
#  1. the inference stage with the GPU preset, profiled (bench/gpu_profile.sh: an engine actor and its
#     EngineCore while the GPU is busy)                                       -> prof-stage.json, *.folded
#  2. the stage with max_num_batched_tokens 4096                              -> tune-mbt4k.json
#  3. raw and stage at a 224x224 pixel budget (shared/GPU-HOST.md's image size), raw profiled -> tune-px224.json
# The full benchmark (raw, stage, flow) ran in the lease before (bench/results/gpu_throughput-h100.json).
#   bench/gpu_host_session.sh PARTS_DIR        then wait for /tmp/final.done
set -uo pipefail
PARTS=${1:?parts folder}
rm -rf /tmp/cf-repo /tmp/final.done && mkdir -p /tmp/cf-results && cp -r "$PWD" /tmp/cf-repo
cd /tmp/cf-repo || exit 1
python3 -m pip install --no-index --no-deps --target /tmp/pyspy "$PARTS"/py_spy-*.whl > /dev/null 2>&1
export PATH=/tmp/pyspy/bin:$PATH VLLM_LOG_STATS_INTERVAL=1
run() {  # NAME WORK ARGS...: one benchmark invocation, its JSON and phase logs into /tmp/cf-results
  local name=$1 work=$2; shift 2
  echo "=== $name $(date +%T)"
  BENCH_WORK=$work BENCH_JSON=/tmp/cf-results/$name.json bash bench/gpu_host_run.sh "$PARTS" "$@"
  for f in "$work"/phase-*.log; do [ -f "$f" ] && tail -c 2000000 "$f" > "/tmp/cf-results/$name-$(basename "$f")"; done
  pkill -9 -f "raylet|gcs_server|ray::|EngineCore" ; sleep 3
}
setsid nohup bash -c "$(declare -f run); PARTS='$PARTS'
  (bash bench/gpu_profile.sh 'MapWorker[(]MapBatches[(]vLLMEngine' '/tmp/ray/session_latest/logs/worker-*.out' 12 25 /tmp/cf-results/stage-actor.folded &)
  run prof-stage /tmp/cf-prof --phases stage --phase-timeout 400
  run tune-mbt4k /tmp/cf-tune-mbt --phases stage --engine-kwargs '{\"max_num_batched_tokens\": 4096}' --phase-timeout 400
  (bash bench/gpu_profile.sh 'gpu_throughput[.]py --child raw' '/tmp/cf-tune-224/phase-raw.log' 8 20 /tmp/cf-results/raw-224.folded &)
  run tune-px224 /tmp/cf-tune-224 --phases raw,stage --max-pixels 50176 --phase-timeout 400
  touch /tmp/final.done" > /tmp/cf-results/final.log 2>&1 < /dev/null &
echo "session started in the background: tail /tmp/cf-results/final.log, wait for /tmp/final.done"
