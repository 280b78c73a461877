#!/usr/bin/env bash
# The GPU benchmark on the offline GPU host (shared/GPU-HOST.md), from the wheelhouse parts of
# infra/wheelhouse/build_wheelhouse.sh already copied to PARTS_DIR; installs once into /tmp/cf-site.
#   bench/host/run.sh PARTS_DIR [NAME=VALUE ...] [bench/gpu_throughput.py options]
#   (NAME=VALUE words: environment for this run, e.g. VLLM_USE_V2_MODEL_RUNNER=0; the engines inherit it)
# Results: $BENCH_WORK/gpu_throughput.json (default /tmp/cf-bench; and $OUT/ with the phases' logs, when OUT is set).
set -uo pipefail
PARTS=${1:?parts folder}
shift
# NAME=VALUE words anywhere among the options: this run's environment
args=()
for x in "$@"; do if [[ $x =~ ^[A-Z_][A-Z0-9_]*= ]]; then export "$x"; else args+=("$x"); fi; done
set -- "${args[@]}"
source bench/host/env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
WORK=${BENCH_WORK:-/tmp/cf-bench}
JSON=${BENCH_JSON:-$WORK/gpu_throughput.json}
python3 bench/gpu_throughput.py --work "$WORK" --json "$JSON" "$@"
rc=$?
if [ -n "${OUT:-}" ]; then
  cp "$WORK"/gpu_throughput*.json "$OUT/" 2>/dev/null
  for f in "$WORK"/phase-*.log; do [ -f "$f" ] && tail -c 3000000 "$f" > "$OUT/$(basename "$f")"; done
fi
exit $rc
