#!/usr/bin/env bash
# Build an offline wheelhouse of the GPU stack, split into parts that fit a size-limited transfer.
#   infra/wheelhouse/build_wheelhouse.sh [REQUIREMENTS] [OUT_DIR] [PART_SIZE]
# defaults: infra/wheelhouse/gpu-host-py312.txt, .wheelhouse, 50M
# On the offline host: infra/wheelhouse/install_wheelhouse.sh OUT_DIR TARGET_DIR, then PYTHONPATH=TARGET_DIR.
set -euo pipefail
REQ=${1:-infra/wheelhouse/gpu-host-py312.txt}
OUT=${2:-.wheelhouse}
PART=${3:-50M}
PY_VERSION=${PY_VERSION:-3.12}
mkdir -p "$OUT/wheels"
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$OUT/wheels" -r "$REQ"
tar -C "$OUT" -cf - wheels | split -b "$PART" -d -a 3 - "$OUT/wheelhouse.tar.part-"
(cd "$OUT" && sha256sum wheelhouse.tar.part-* > SHA256SUMS)
rm -rf "$OUT/wheels"
ls -l "$OUT"
