# Sourced by the GPU-host scripts: installs the wheelhouse parts in PARTS (once, into /tmp/cf-site) and
# exports the environment that vLLM, Ray and Prefect need there (offline, no usage stats).
# Bytecode: the host sets PYTHONDONTWRITEBYTECODE=1 and its packages carry none, so every process (the driver, each
# Ray worker, each engine and vLLM's subprocesses) compiled every module it imported from source, at every start.
# Here it is compiled once, at install, into PYTHONPYCACHEPREFIX (the host's files stay as they are), as an image
# built by infra/Dockerfile carries it.
SITE=/tmp/cf-site
PYC=/tmp/cf-pycache
if [ ! -f "$SITE/.installed" ]; then
  t0=$(date +%s)
  bash infra/wheelhouse/install_wheelhouse.sh "$PARTS" "$SITE" || exit 1
  echo "wheelhouse installed in $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  # shellcheck disable=SC2046
  PYTHONPYCACHEPREFIX=$PYC python3 -m compileall -q -j 0 "$SITE" "$PWD/captionflow" "$PWD/flows" "$PWD/tasks" \
    $(python3 -c 'import os, sys; print(" ".join(p for p in sys.path[1:] if os.path.isdir(p)))') > /dev/null 2>&1
  echo "bytecode compiled in $(( $(date +%s) - t0 )) s"
  touch "$SITE/.installed"
fi
export PYTHONPATH=$SITE:$PWD PYTHONPYCACHEPREFIX=$PYC PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 DO_NOT_TRACK=1 PREFECT_HOME=/tmp/cf-prefect
