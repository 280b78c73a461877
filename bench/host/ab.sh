#!/usr/bin/env bash
# One GPU-host lease comparing this checkout with a baseline, invocation by invocation on the same machine
# (docs/benchmarks.md: ratios from one machine are the figures to compare).
#   bench/host/ab.sh PARTS_DIR BASE_TAR NAME=WHICH:OPTIONS ...   then wait for /tmp/final.done
# BASE_TAR: the baseline's tree (git archive REV > base.tar); WHICH: new (this checkout) or base. Both run this
# checkout's bench/gpu_throughput.py, so that they take the same options and report alike; each invocation is
# bench/host/run.sh with OPTIONS (leading NAME=VALUE words: its environment), one after the other, sharing
# /tmp/cf-bench (images and stand-in checkpoints made once). Results in /tmp/cf-results: gpu_throughput-NAME.json,
# NAME-phase-*.log, NAME-pyspy-*.json (CF_BENCH_PYSPY=/tmp/pyspy/bin/py-spy records verdict runs' drivers).
set -uo pipefail
PARTS=${1:?parts folder}
BASE=${2:?baseline tarball}
shift 2
rm -rf /tmp/cf-repo /tmp/cf-base /tmp/final.done && mkdir -p /tmp/cf-results /tmp/cf-base
cp -r "$PWD" /tmp/cf-repo && tar -xf "$BASE" -C /tmp/cf-base && cp /tmp/cf-repo/bench/gpu_throughput.py /tmp/cf-base/bench/ && rm -rf /tmp/cf-base/bench/throughput && cp -r /tmp/cf-repo/bench/throughput /tmp/cf-base/bench/
for tree in /tmp/cf-repo /tmp/cf-base; do  # both trees' bytecode, as env.sh compiles the first's (else base pays it)
  PYTHONPYCACHEPREFIX=/tmp/cf-pycache python3 -m compileall -q -j 0 $tree/captionflow $tree/flows $tree/tasks > /dev/null
done
python3 -m pip install --no-index --no-deps --target /tmp/pyspy "$PARTS"/py_spy-*.whl > /dev/null 2>&1
printf '%s\n' "$@" > /tmp/cf-runs
export VLLM_LOG_STATS_INTERVAL=1
setsid nohup bash -c "
  while IFS='=' read -r name spec; do
    which=\${spec%%:*}; opts=\${spec#*:}
    [ \"\$which\" = base ] && cd /tmp/cf-base || cd /tmp/cf-repo
    echo \"=== \$name (\$which): \$opts\"
    BENCH_WORK=/tmp/cf-bench BENCH_JSON=/tmp/cf-results/gpu_throughput-\$name.json \
      bash bench/host/run.sh '$PARTS' --phase-timeout 400 \$opts < /dev/null
    for f in /tmp/cf-bench/phase-*.log; do tail -c 2000000 \$f > /tmp/cf-results/\$name-\$(basename \$f); rm -f \$f; done
    for f in /tmp/cf-bench/pyspy-*.json; do [ -f \$f ] && mv \$f /tmp/cf-results/\$name-\$(basename \$f); done
  done < /tmp/cf-runs
  touch /tmp/final.done" > /tmp/cf-results/final.log 2>&1 < /dev/null &
echo "started in the background: tail /tmp/cf-results/final.log, wait for /tmp/final.done"
