#!/usr/bin/env bash
# On the offline GPU host: verify and reassemble the parts made by build_wheelhouse.sh and install them
# into SITE_DIR with no index at all (the host's own torch, transformers, numpy... stay as they are).
#   infra/wheelhouse/install_wheelhouse.sh PARTS_DIR SITE_DIR
# then: export PYTHONPATH=SITE_DIR:<captionflow checkout> VLLM_USE_FLASHINFER_SAMPLER=0
set -euo pipefail
PARTS=${1:?parts folder}
SITE=${2:?install target}
(cd "$PARTS" && sha256sum -c --quiet SHA256SUMS)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cat "$PARTS"/wheelhouse.tar.part-* | tar -C "$WORK" -xf -
mkdir -p "$SITE"
tar -C "$SITE" -xJf "$WORK/site.tar.xz"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WORK"/vllm-*.whl "$WORK"/ray-*.whl
echo "installed into $SITE: export PYTHONPATH=$SITE"
