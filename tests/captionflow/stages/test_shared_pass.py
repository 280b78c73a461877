"""A shared pass: the base and two LoRA adapters of it captioned in one pass on one real CPU engine, each caption in
its checkpoint's own run folder, equal to what that checkpoint's own engine gives; a checkpoint already captioned
is not captioned again, and a row that failed goes back to its own checkpoint's failures and is retried."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from PIL import Image

from captionflow.config import RunConfig
from captionflow.data.layout import FAILURES, read_captions
from captionflow.data.sources import ingest
from captionflow.engines.engine import resolve_engine
from captionflow.engines.presets import CPU
from captionflow.model_source import resolve_model
from captionflow.stages.caption_pass import INJECT_ENV, CaptionPass
from captionflow.stages.preprocess import preprocess
from captionflow.stages.shared_pass import SharedPass, shareable
from captionflow.workers.images import content_id

pytestmark = pytest.mark.slow


def test_the_base_and_two_adapters_in_one_pass_each_as_its_own_engine_gives_it(tmp_path, monkeypatch):
    from captionflow.builtin.adapter import build_adapter

    (tmp_path / "ds").mkdir()
    for k in range(6):
        Image.new("RGB", (40, 30), (40 * k, 255 - 40 * k, 90)).save(tmp_path / "ds" / f"img{k}.png")
    cfg = RunConfig(dataset=str(tmp_path / "ds"), output=str(tmp_path / "out"), device="cpu", batch_size=3,
                    max_tokens=8, ignore_eos=True, commit_rows=4)  # fmt: skip
    manifest = preprocess(ingest(cfg), cfg)
    base = resolve_model("builtin")
    a1, a2 = (resolve_model(str(build_adapter(tmp_path / f"a{s}", seed=s))) for s in (1, 2))
    assert shareable([base, a1, a2]) is None and shareable([base, base]) and shareable([base])

    # a1 captioned first by its own run
    alone = CaptionPass(cfg, manifest, a1, resolve_engine(cfg, a1, CPU))
    alone.run_with()
    a1_own = read_captions(alone.store, alone.run)

    # then the three in one pass, one image failing its first attempt for each checkpoint that needs it
    bad = content_id((tmp_path / "ds" / "img3.png").read_bytes())
    monkeypatch.setenv(INJECT_ENV, bad)
    engine = resolve_engine(cfg, base, CPU, together=[base, a1, a2])
    assert engine.engine_kwargs["max_loras"] == 3  # two adapters and the CPU's spare slot
    shared = SharedPass(cfg, manifest, [base, a1, a2], engine)
    results = shared.run()
    monkeypatch.delenv(INJECT_ENV)

    assert [p.run for p in shared.passes][1] == alone.run  # each checkpoint's own run folder
    r_base, r_a1, r_a2 = results
    assert r_a1.resumed_from == 6 and r_base.resumed_from == r_a2.resumed_from == 0
    assert [(p.sent, p.ok, p.failed) for p in r_base.passes] == [(12, 10, 2), (2, 2, 0)]  # a1's not sent again
    assert all(r.captioned == 6 and r.failed == 0 for r in results)
    captions = [read_captions(p.store, p.run) for p in shared.passes]
    assert captions[1] == a1_own
    for image_id in captions[0]:
        assert len({c[image_id] for c in captions}) == 3, image_id  # each checkpoint its own caption
    for p in shared.passes:  # each failure in its own checkpoint's folder, of its own fingerprint
        failed = [
            row
            for f in p.store.ls(*p.run, FAILURES, suffix=".parquet")
            for row in pq.read_table(p.store.fs.open(f, "rb")).to_pylist()
        ]
        assert [(r["image_id"], r["model_fingerprint"]) for r in failed] == (
            [] if p.model is a1 else [(bad, p.model.fingerprint)]
        )

    # the base and a2 as their own engines give them (another output root: the same run folders otherwise)
    other = cfg.model_copy(update={"output": str(tmp_path / "other")})
    listed = preprocess(ingest(other), other)
    for model, got in ((base, captions[0]), (a2, captions[2])):
        own = CaptionPass(other, listed, model, resolve_engine(other, model, CPU))
        assert own.run[1:] == shared.passes[[base, a1, a2].index(model)].run[1:]
        own.run_with()
        assert read_captions(own.store, own.run) == got
