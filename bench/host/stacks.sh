#!/usr/bin/env bash
# A timeline of where start-up goes on the GPU host: every STEP s for SECONDS, py-spy dumps (non-blocking) the
# stacks of the driver (the first process matching DRIVER_PATTERN) and of the first process matching PATTERN with
# all its descendants (an engine actor: its prestarted engine core, vLLM's registry subprocess...), each dump
# headed by the Unix time, the pid and the command line. Starts when DRIVER_PATTERN first matches (waits up to
# 15 min). Write the patterns so they do not match their own text (e.g. 'flows[.]cli run').
#   bench/host/stacks.sh DRIVER_PATTERN PATTERN SECONDS STEP OUT_FILE      (py-spy on PATH)
set -uo pipefail
driver_pat=${1:?driver pattern}; pat=${2:?process pattern}; secs=${3:-180}; step=${4:-2}; out=${5:?output file}
descendants() {
  local p
  for p in $(pgrep -P "$1"); do
    echo "$p"
    descendants "$p"
  done
}
for _ in $(seq 900); do
  pgrep -f "$driver_pat" > /dev/null && break
  sleep 1
done
end=$(( $(date +%s) + secs ))
: > "$out"
while [ "$(date +%s)" -lt "$end" ]; do
  pids=$(pgrep -f "$driver_pat" | head -1)
  root=$(pgrep -f "$pat" | head -1)
  [ -n "$root" ] && pids="$pids $root $(descendants "$root")"
  for pid in $pids; do
    {
      echo "=== $(date +%s.%N) pid $pid: $(ps -o args= -p "$pid" 2> /dev/null | cut -c1-160)"
      timeout 10 py-spy dump --nonblocking -p "$pid" 2>&1 | grep -v -e '^ *\(Process\|Python v\|Thread .* (idle)\)' -e 'frozen importlib._bootstrap>' -e '^ *exec_module (<frozen' | head -80
    } >> "$out"
  done
  sleep "$step"
done
