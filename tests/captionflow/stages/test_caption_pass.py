"""The caption pass (one object from the run folder's lease to the result) and what plugs into it: a consumer sees
the captions block by block as they are committed, in its order, and ends the pass when it has what it needs; a
rerun hands it what is committed first. On the real CPU engine with the built-in model."""

from __future__ import annotations

import pytest
from PIL import Image

from captionflow.config import RunConfig
from captionflow.data.layout import read_captions
from captionflow.data.sources import ingest
from captionflow.preflight import preflight
from captionflow.stages.caption_pass import CaptionPass, Consumer
from captionflow.stages.preprocess import preprocess

pytestmark = pytest.mark.slow


class Order:
    """What a consumer's verdict gives the pass: an order of the images; in once ``needed`` have been seen."""

    def __init__(self, order: list[str], needed: int):
        self.order, self.needed, self.seen = order, needed, []
        self.finished: set | None = None

    @property
    def decided(self) -> bool:
        return len(self.seen) >= self.needed

    @property
    def stopped_early(self) -> bool:
        return self.decided and len(self.seen) < len(self.order)

    def record(self) -> dict:  # in a verdict record's shape (what the pass logs and hands on)
        return {
            "decision": "better" if self.decided else "continue", "images_used": len(self.seen),
            "images_total": len(self.order), "score": "test", "mean_difference": 0.0, "lower": 0.0, "upper": 0.0,
            "alpha": 0.05, "against": "the test",
        }  # fmt: skip

    def finish(self, failed: set) -> None:
        self.finished = failed


class Taker(Consumer):
    def __init__(self, verdict: Order):
        self.verdict, self.blocks, self.resumed = verdict, [], None

    def resume(self, store, run) -> bool:
        self.resumed = read_captions(store, run)
        self.verdict.seen += [i for i in self.verdict.order if i in self.resumed]
        return self.verdict.decided

    def observe(self, rows: list[dict]) -> bool:
        self.blocks.append([r["image_id"] for r in rows])
        self.verdict.seen += [r["image_id"] for r in rows]
        return self.verdict.decided


def test_a_consumer_sees_each_block_in_its_order_and_ends_the_pass_once_it_has_what_it_needs(tmp_path):
    (tmp_path / "ds").mkdir()
    for k in range(24):
        Image.new("RGB", (40, 30), (10 * k, 0, 0)).save(tmp_path / "ds" / f"img{k:02d}.png")
    cfg = RunConfig(dataset=str(tmp_path / "ds"), output=str(tmp_path / "out"), device="cpu", batch_size=2,
                    max_concurrent_batches=1, commit_rows=2)  # fmt: skip
    checked = preflight(cfg)
    manifest = preprocess(ingest(cfg), cfg)

    first = CaptionPass(cfg, manifest, checked.model, checked.engine)
    order = sorted(first.ids, reverse=True)  # not the shards' order
    taker = Taker(Order(order, needed=6))
    result = first.run_with(lambda p: taker)

    seen = [i for block in taker.blocks for i in block]
    assert taker.resumed == {}  # a new folder: nothing committed before
    assert seen == order[: len(seen)] and len(seen) >= 6  # the captions came in its order, as committed
    committed = read_captions(first.store, first.run)
    assert set(seen) <= set(committed) and len(committed) < 24  # the pass ended once it had what it needed
    assert result.passes[-1].stopped and result.failed == 0 and result.captioned == len(committed)
    assert result.verdict == taker.verdict.record()  # the result carries its verdict's record
    assert taker.verdict.finished == set(order) - set(committed)  # the rest leaves its order (not failures)

    # a rerun with a consumer that needs every image: handed what is committed, it captions only the rest
    again = Taker(Order(order, needed=24))
    rerun = CaptionPass(cfg, manifest, checked.model, checked.engine).run_with(lambda p: again)
    assert again.resumed == committed and rerun.resumed_from == len(committed)
    assert sorted(i for block in again.blocks for i in block) == sorted(set(order) - set(committed))
    assert rerun.captioned == 24 and [p.sent for p in rerun.passes] == [24 - len(committed)]
