#!/usr/bin/env bash
# One GPU-host lease (docs/benchmarks.md), in the background from a copy of the checkout
# (/tmp/cf-repo); results and phase logs go to /tmp/cf-results as they are written:
#   the benchmark (raw, stage, flow) with the GPU preset as it ships, the stage phase profiled by
#   bench/host/profile.sh (py-spy: an engine actor and its EngineCore, once the engines are up).
#   bench/host/session.sh PARTS_DIR [NAME=OPTIONS ...]   then wait for /tmp/final.done  (PROFILE=0: no py-spy;
#   PROFILE_TRIGGER: what profile.sh waits for, PROFILE_DELAY and PROFILE_SECONDS: when and how long it records;
#   STACKS=SECONDS: bench/host/stacks.sh dumps the first flow run's driver and engine actor every 2 s for that long;
#   STACKS_WARM=SECONDS: the verdict's warm-engine run (checkpoint-seed2) and a warm engine (Serve replica), every 1 s)
# Each NAME=OPTIONS is one benchmark invocation, one after the other (sharing /tmp/cf-bench: the images and the
# stand-in are made once), with gpu_throughput.py OPTIONS
# (default: "h100=--phases raw,stage,flow"): /tmp/cf-results/gpu_throughput-NAME.json, NAME-phase-*.log.
# OPTIONS may start with NAME=VALUE words, the environment of that invocation alone (bench/host/run.sh), e.g.
# "v1=VLLM_USE_V2_MODEL_RUNNER=0 --phases stage".
set -uo pipefail
PARTS=${1:?parts folder}
shift
[ $# -gt 0 ] || set -- "h100=--phases raw,stage,flow"
rm -rf /tmp/cf-repo /tmp/final.done && mkdir -p /tmp/cf-results && cp -r "$PWD" /tmp/cf-repo
cd /tmp/cf-repo || exit 1
python3 -m pip install --no-index --no-deps --target /tmp/pyspy "$PARTS"/py_spy-*.whl > /dev/null 2>&1
export PATH=/tmp/pyspy/bin:$PATH VLLM_LOG_STATS_INTERVAL=1
printf '%s\n' "$@" > /tmp/cf-runs
setsid nohup bash -c "
  [ -z \"${STACKS:-}\" ] || (bash bench/host/stacks.sh 'flows[.]cli run' 'MapWorker[(]MapBatches[(]vLLMEngine' ${STACKS:-0} 2 /tmp/cf-results/stacks.txt &)
  [ -z \"${STACKS_WARM:-}\" ] || (bash bench/host/stacks.sh 'flows[.]cli run .*checkpoint-seed2' 'ServeReplica' ${STACKS_WARM:-0} 1 /tmp/cf-results/stacks-warm.txt &)
  [ \"${PROFILE:-1}\" = 0 ] || (bash bench/host/profile.sh 'MapWorker[(]MapBatches[(]vLLMEngine' '/tmp/ray/session_latest/logs/worker-*' ${PROFILE_DELAY:-12} ${PROFILE_SECONDS:-25} /tmp/cf-results/stage-actor.folded &)
  while IFS='=' read -r name opts; do
    echo \"=== \$name: \$opts\"
    BENCH_WORK=/tmp/cf-bench BENCH_JSON=/tmp/cf-results/gpu_throughput-\$name.json \
      bash bench/host/run.sh '$PARTS' --phase-timeout 400 \$opts < /dev/null
    for f in /tmp/cf-bench/phase-*.log; do tail -c 2000000 \$f > /tmp/cf-results/\$name-\$(basename \$f); rm -f \$f; done
  done < /tmp/cf-runs
  touch /tmp/final.done" > /tmp/cf-results/final.log 2>&1 < /dev/null &
echo "session started in the background: tail /tmp/cf-results/final.log, wait for /tmp/final.done"
