#!/usr/bin/env bash
# Build the offline wheelhouse for the GPU host (CPython 3.12, CUDA torch 2.11 preinstalled; see README
# "GPU host") as parts of a size-limited transfer:
#   infra/wheelhouse/build_wheelhouse.sh [OUT_DIR] [PART_SIZE]        defaults: .wheelhouse 60M
# What it holds: every package of requirements/gpu-host.lock that the host does not already have
# (gpu-host-present.txt) and that is not excluded (gpu-host-exclude.txt). vLLM and Ray stay wheels; the
# rest is pre-installed here into one folder (--target, cp312 manylinux wheels) and xz-compressed, with
# pycocoevalcap's Java data (SPICE, METEOR paraphrases; only --coco-java uses them) left out.
# On the host: infra/wheelhouse/install_wheelhouse.sh OUT_DIR SITE_DIR, then PYTHONPATH=SITE_DIR.
set -euo pipefail
OUT=${1:-.wheelhouse}
PART=${2:-60M}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PLATFORMS=""
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS="$PLATFORMS --platform $p"
done
python3 - "$ROOT/requirements/gpu-host.lock" "$HERE/gpu-host-present.txt" "$HERE/gpu-host-exclude.txt" > "$WORK/need.txt" <<'PY'
import re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
words = lambda f: {norm(w) for line in open(f) if not line.startswith("#") for w in line.split()}
skip = words(sys.argv[2]) | words(sys.argv[3])
for line in open(sys.argv[1]):
    m = re.match(r"^([A-Za-z0-9_.\-]+)(\[.*\])?==(\S+)", line)
    if m and norm(m.group(1)) not in skip:
        print(f"{m.group(1)}=={m.group(3)}")
PY
mkdir -p "$WORK/wheels" "$WORK/site" "$WORK/pack"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
  -d "$WORK/wheels" -r "$WORK/need.txt"
python3 -m pip install -q --no-deps --no-compile --no-index --only-binary=:all: --python-version 3.12 \
  --implementation cp $PLATFORMS --target "$WORK/site" \
  $(ls "$WORK"/wheels/*.whl | grep -v -e '/vllm-' -e '/ray-')
rm -rf "$WORK/site/bin" "$WORK/site/pycocoevalcap/spice" "$WORK/site/pycocoevalcap/meteor/data" \
  "$WORK"/site/pycocoevalcap/meteor/*.jar "$WORK"/site/pycocoevalcap/tokenizer/*.jar
tar -C "$WORK/site" -cf - . | xz -T0 -6 > "$WORK/pack/site.tar.xz"
cp "$WORK"/wheels/vllm-*.whl "$WORK"/wheels/ray-*.whl "$WORK/pack/"
mkdir -p "$OUT"
rm -f "$OUT"/wheelhouse.tar.part-* "$OUT/SHA256SUMS"
tar -C "$WORK/pack" -cf - . | split -b "$PART" -d -a 2 - "$OUT/wheelhouse.tar.part-"
(cd "$OUT" && sha256sum wheelhouse.tar.part-* > SHA256SUMS)
ls -l "$OUT"
