#!/usr/bin/env bash
# Profile a benchmark phase on the GPU host: when a vLLM engine has logged "init engine" in any of
# LOG_GLOB's files, wait DELAY s, then py-spy records the first process matching PID_PATTERN and its
# subprocesses (an engine actor and its EngineCore, or raw vLLM's process) for SECONDS, non-blocking,
# as collapsed stacks into OUT_FILE. Write the pattern so it does not match its own text (e.g. 'x[.]py').
#   bench/host/profile.sh PID_PATTERN 'LOG_GLOB' DELAY SECONDS OUT_FILE     (py-spy on PATH)
# PROFILE_TRIGGER (a grep pattern) replaces "init engine (profile", e.g. "Elapsed time for batch" (the first batch
# back: the pipeline is past its start-up). Only log files written after this script started count (a Ray started
# earlier leaves its logs under the same glob).
set -uo pipefail
pat=${1:?pgrep -f pattern}; glob=${2:?log glob}; delay=${3:-10}; secs=${4:-20}; out=${5:?output file}
trigger=${PROFILE_TRIGGER:-init engine (profile}
since=$(mktemp)
for _ in $(seq 900); do
  # shellcheck disable=SC2086
  for f in $glob; do
    [ "$f" -nt "$since" ] && grep -qs "$trigger" "$f" && break 2
  done
  sleep 1
done
sleep "$delay"
pid=$(pgrep -f "$pat" | head -1)
[ -n "$pid" ] || { echo "no process matches $pat" > "$out"; exit 1; }
py-spy record --nonblocking --subprocesses --idle -r 50 -d "$secs" -f raw -o "$out" -p "$pid" > "$out.log" 2>&1
