# Sourced by the GPU-host scripts: installs the wheelhouse parts in PARTS (once, into /tmp/cf-site) and
# exports the environment that vLLM, Ray and Prefect need there (offline, no usage stats).
SITE=/tmp/cf-site
if [ ! -f "$SITE/.installed" ]; then
  t0=$(date +%s)
  bash infra/wheelhouse/install_wheelhouse.sh "$PARTS" "$SITE" || exit 1
  touch "$SITE/.installed"
  echo "wheelhouse installed in $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 DO_NOT_TRACK=1 PREFECT_HOME=/tmp/cf-prefect
