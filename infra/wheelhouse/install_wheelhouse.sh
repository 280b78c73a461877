#!/usr/bin/env bash
# Reassemble the parts made by build_wheelhouse.sh and install them with no index at all.
#   infra/wheelhouse/install_wheelhouse.sh PARTS_DIR TARGET_DIR
set -euo pipefail
PARTS=${1:?parts folder}
TARGET=${2:?install target}
(cd "$PARTS" && sha256sum -c SHA256SUMS)
WORK=$(mktemp -d)
cat "$PARTS"/wheelhouse.tar.part-* | tar -C "$WORK" -xf -
python3 -m pip install --no-index --no-deps --target "$TARGET" "$WORK"/wheels/*.whl
rm -rf "$WORK"
echo "installed into $TARGET: export PYTHONPATH=$TARGET"
