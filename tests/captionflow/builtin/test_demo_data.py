from __future__ import annotations

import json

from captionflow.builtin.demo_data import DEMO_CAPTIONS, FAULTY_FILES, build_demo_dataset
from captionflow.workers.images import Rejected, normalise_image


def test_demo_set_has_captioned_photos_and_faulty_files(tmp_path):
    d = build_demo_dataset(tmp_path / "demo")
    images = [p for p in d.iterdir() if p.name in DEMO_CAPTIONS]
    assert len(images) >= 24
    assert all(len(c) >= 2 for c in DEMO_CAPTIONS.values())
    for name in FAULTY_FILES:
        assert (d / name).exists()
    sidecar = [json.loads(line) for line in (d / "captions.jsonl").read_text().splitlines()]
    assert {r["file_name"] for r in sidecar} == set(DEMO_CAPTIONS)
    ok = 0
    for p in images:
        normalise_image(p.read_bytes(), max_side=448)  # raises if a demo photo is not usable
        ok += 1
    assert ok == len(DEMO_CAPTIONS)
    reasons = {}
    for name in FAULTY_FILES:
        try:
            normalise_image((d / name).read_bytes(), max_side=448)
        except Rejected as r:
            reasons[name] = r.reason
    assert reasons == {
        "empty.jpg": "empty_file",
        "truncated_rocket.jpg": "decode_error",
        "random_bytes.png": "not_an_image",
        "error_page.jpg": "not_an_image",
    }
