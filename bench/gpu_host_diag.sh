#!/usr/bin/env bash
# On the GPU host: bench/diag_processor_cache.py with the Qwen2.5-VL-3B stand-in (dummy weights) and
# the GPU preset's engine kwargs, through AsyncLLM (as Ray Data LLM's engine stage) and LLM (a script).
# Then the stage phase of bench/gpu_throughput.py (N images) with bench/diag_site/ on every worker's path.
#   bench/gpu_host_diag.sh PARTS_DIR [N]      results: $OUT/diag-{async,sync}.json, $OUT/diag-stage.tgz
#   MODES="async" (or "") picks the direct runs; STAGE=0 skips the stage run.
set -uo pipefail
PARTS=${1:?parts folder}
N=${2:-200}
source bench/gpu_host_env.sh
MODEL=/tmp/cf-bench/standin-qwen2.5-vl-3b
[ -d "$MODEL" ] || python3 -c "from captionflow.standin_model import build_standin; build_standin('qwen2.5-vl-3b', '$MODEL')"
EK=$(python3 -c "import json; from captionflow.presets import PRESETS
print(json.dumps({'load_format': 'dummy', **PRESETS['gpu'].engine_kwargs, 'gpu_memory_utilization': 0.6}))")
for mode in ${MODES-async sync}; do
  flag=""; [ $mode = sync ] && flag=--sync
  python3 bench/diag_processor_cache.py --model "$MODEL" --n "$N" $flag --engine-kwargs "$EK" \
    --json "${OUT:-/tmp}/diag-$mode.json" > "${OUT:-/tmp}/diag-$mode.log" 2>&1
  echo "$mode rc=$?"; tail -5 "${OUT:-/tmp}/diag-$mode.log"
done
# The same record from inside Ray Data LLM's engine actors (the stage phase, N images):
if [ "${STAGE:-1}" = 1 ]; then
  mkdir -p /tmp/cf-diag
  CF_DIAG_DIR=/tmp/cf-diag PYTHONPATH=$PWD/bench/diag_site:$PYTHONPATH BENCH_WORK=/tmp/cf-bench \
    timeout 400 python3 bench/gpu_throughput.py --work /tmp/cf-bench --json /tmp/cf-diag/stage.json --n "$N" \
    --phases stage --phase-timeout 360 > /tmp/cf-diag/stage.log 2>&1
  echo "stage rc=$?"; tail -3 /tmp/cf-diag/stage.log
  tar czf "${OUT:-/tmp}/diag-stage.tgz" -C /tmp cf-diag
fi
