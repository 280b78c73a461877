"""A warm run's driver hands its request blocks to the service's engines (``feed.py``): real Ray Data and the run's
own processor (``build_vlm_processor`` with a warm engine); the engines' Serve handles are stand-ins that read each
block from the object store and answer as a replica would (the real replicas: tests/e2e/test_warm_engines.py)."""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import pytest

from captionflow.config import RunConfig
from captionflow.engines.engine import resolve_engine
from captionflow.engines.presets import CPU
from captionflow.engines.processor import build_vlm_processor
from captionflow.engines.session import ray_session
from captionflow.model_source import resolve_model
from captionflow.service import hold
from captionflow.service.feed import GATE
from captionflow.workers.llm_rows import caption_fixed_schema, to_caption


class Engine:
    """Answers ``caption_block.remote([ref], then)`` as a replica does: the block's rows without their images; with
    ``then`` (a judge engine, the run's ``feed.judge_requests``), those rows made the judge's requests there and
    answered by that judge engine (``run_rows``)."""

    def __init__(
        self,
        name: str,
        served_by: str,
        log: list,
        fail: bool = False,
        received: list | None = None,
        delays_s: tuple = (0.3,),  # each block's time in the engine, the last for every later block
    ):
        self.name, self.served_by, self.log, self.fail, self.delays_s = name, served_by, log, fail, list(delays_s)
        self.received = received if received is not None else []  # the image ids, as they came
        self.caption_block = self

    def remote(self, refs: list, then=None):
        async def chained():
            rows = await self.remote(refs)
            app, (requests,) = then
            return Warm.engines[app].run_rows(requests_fn := await requests, requests_fn(rows, self.served_by))

        if then is not None:
            return chained()

        async def answer():
            from ray.data.block import BlockAccessor

            block = await refs[0]  # arrives as an object reference, not as rows through the driver
            rows = BlockAccessor.for_block(block).to_batch_format("default")["__data"].tolist()
            self.log.append((self.name, time.monotonic(), len(rows)))
            self.received.extend(r["image_id"] for r in rows)
            await asyncio.sleep(self.delays_s.pop(0) if len(self.delays_s) > 1 else self.delays_s[0])
            self.log.append((self.name, time.monotonic(), -len(rows)))  # back
            if self.fail:
                raise RuntimeError("the replica died")
            assert all(r["multimodal_data"]["image"].ndim == 3 for r in rows)  # the request's image array
            return [
                {
                    "image_id": r["image_id"],
                    "generated_text": f"caption of {r['image_id']}",
                    "num_generated_tokens": 2,
                    "num_input_tokens": 5,
                    "served_by": self.served_by,
                }
                for r in rows
            ]

        return answer()

    def run_rows(self, _fn, rows: list[dict]) -> list[dict]:
        """A judge engine: each request row answered, its other columns kept (as the stages keep them)."""
        assert all("multimodal_data" not in r for r in rows if r.get("__inference_error__"))
        return [
            r
            if r.get("__inference_error__")
            else {**r, "generated_text": f"judged {r['caption']}", "served_by": self.served_by}
            for r in rows
        ]


class Warm:
    """``service.WarmEngine`` as the feed sees it: the engines and their handles, the run's checkpoint, ``wait`` for
    its load."""

    engines: dict[str, Engine] = {}

    def __init__(
        self,
        apps: list[str],
        fingerprint: str,
        load_s: float = 0.0,
        error: Exception | None = None,
        judge: dict | None = None,
    ):
        self.apps, self.model_fingerprint, self.error, self.judge = apps, fingerprint, error, judge
        self.loaded_at = None
        self.done = threading.Event()
        threading.Timer(load_s, self._loaded).start()

    def _loaded(self):
        self.loaded_at = time.monotonic()
        self.done.set()

    def handles(self):
        return [self.engines[app] for app in self.apps]

    def wait(self):
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self

    processor = hold.WarmEngine.processor  # the real one: the warm processor over these engines


@pytest.fixture(scope="module")
def caption_rows(builtin_model_dir, tmp_path_factory):
    """``rows(warm, ordered, built)``: the warm processor's result rows for 12 small images, in blocks of 2 rows
    (``built``: the request blocks built before they are fed)."""
    import numpy as np
    import ray

    cfg = RunConfig(device="cpu", batch_size=2, max_concurrent_batches=4)
    ray_session(cfg)
    model = resolve_model("builtin")
    engine = resolve_engine(cfg, model, CPU)

    def request(row, slow: frozenset = frozenset()):
        if row["image_id"] in slow:
            time.sleep(1.0)
        return {
            "image_id": row["image_id"],
            "prompt": "<image> describe",
            "multimodal_data": {"image": np.zeros((28, 28, 3), np.uint8)},
            "sampling_params": {"max_tokens": 4},
        }

    def judge_request(row):
        return {"prompt": f"is {row['caption']!r} right?", "sampling_params": {"max_tokens": 4}}

    def judged(row):
        return {"image_id": row["image_id"], "caption": row["caption"], "judged": row["generated_text"]}

    def rows(warm, ordered: bool = False, built: bool = False, slow: frozenset = frozenset()):
        processor = build_vlm_processor(
            engine,
            model.path,
            preprocess=functools.partial(request, slow=slow),
            postprocess=functools.partial(to_caption, max_tokens=4, model_fp=warm.model_fingerprint, attempt=0),
            warm=warm,
            ordered=ordered,
        )
        ds = ray.data.from_items([{"image_id": f"img{i:02d}"} for i in range(12)]).repartition(
            target_num_rows_per_block=2
        )
        if ordered:  # as an ordered read_pending's dataset: its stages hand blocks on in order
            ds.context.execution_options.preserve_order = True
        if warm.judge:  # each caption judged on by the judge's engines (a judge's processor: ``WarmRows.then``)
            judges = Warm(warm.judge["apps"], warm.judge["model_fingerprint"])
            judge = build_vlm_processor(engine, model.path, preprocess=judge_request, postprocess=judged, warm=judges)
            return (
                processor(ds)
                .then(judge.processor)
                .map(
                    lambda r: {**dict.fromkeys(("caption", "judged")), **r, "error": r.get("__inference_error__") or ""}
                )
            )
        out = processor(ds).map(functools.partial(caption_fixed_schema, model_fp=warm.model_fingerprint, attempt=0))
        if built:  # every request block built before the feed starts: it sends as many as it may at once
            out.requests = out.requests.materialize()
        return out

    return rows


def _engines(monkeypatch, engines: dict[str, Engine]) -> None:
    monkeypatch.setattr(Warm, "engines", engines)


def test_blocks_go_out_only_after_the_checkpoint_is_in_and_spread_over_the_engines(caption_rows, monkeypatch, caplog):
    log: list = []
    _engines(monkeypatch, {a: Engine(a, "fp-b", log) for a in ("e0", "e1")})
    warm = Warm(["e0", "e1"], "fp-b", load_s=2.0)
    with caplog.at_level("INFO", logger="captionflow.warm"):
        out = list(caption_rows(warm, built=True).iter_rows())
    assert sorted(r["image_id"] for r in out) == [f"img{i:02d}" for i in range(12)]
    assert all(r["error"] == "" and r["caption"] == f"caption of {r['image_id']}" for r in out)
    assert min(t for _, t, _ in log) >= warm.loaded_at  # nothing was sent while the checkpoint was swapped in
    blocks = sum(1 for *_, n in log if n > 0)
    assert _sent_before_the_first_back(log) == min(blocks, 8)  # max_concurrent_batches (4) blocks per engine
    assert {name for name, _, _ in log} == {"e0", "e1"} and sum(n for *_, n in log if n > 0) == 12
    assert any(GATE in m for m in caplog.messages)


def _sent_before_the_first_back(log: list, rows: bool = False) -> int:
    """Blocks (or their rows) sent before the first block came back."""
    events = sorted(log, key=lambda e: e[1])
    first_back = next(k for k, (_, _, n) in enumerate(events) if n < 0)
    return sum(n for *_, n in events[:first_back]) if rows else first_back


def _most_in_flight(log: list) -> tuple[int, int]:
    """The most blocks, and the most rows, in the engines at once."""
    blocks = rows = most_blocks = most_rows = 0
    for _, _, n in sorted(log, key=lambda e: e[1]):
        blocks, rows = blocks + (1 if n > 0 else -1), rows + n
        most_blocks, most_rows = max(most_blocks, blocks), max(most_rows, rows)
    return most_blocks, most_rows


def test_an_ordered_run_sends_a_batch_of_rows_per_engine_first_and_as_many_more_as_come_back(caption_rows, monkeypatch):
    log: list = []
    _engines(monkeypatch, {a: Engine(a, "fp-b", log) for a in ("e0", "e1")})
    out = list(caption_rows(Warm(["e0", "e1"], "fp-b"), ordered=True, built=True).iter_rows())
    assert sorted(r["image_id"] for r in out) == [f"img{i:02d}" for i in range(12)]
    assert _sent_before_the_first_back(log, rows=True) == 4  # a batch (2 rows) per engine: the order's first window
    most_blocks, most_rows = _most_in_flight(log)
    assert most_rows > 4 and most_blocks <= 8  # then more as rows came back, up to max_concurrent_batches (4) each


def test_an_ordered_runs_blocks_reach_the_engines_in_order_even_when_the_first_are_built_last(
    caption_rows, monkeypatch
):
    received: list = []
    _engines(monkeypatch, {a: Engine(a, "fp-b", [], received=received) for a in ("e0", "e1")})
    slow = frozenset({"img00", "img01"})  # the first block's requests take a second to build
    out = list(caption_rows(Warm(["e0", "e1"], "fp-b"), ordered=True, slow=slow).iter_rows())
    assert len(out) == 12
    assert received == [f"img{i:02d}" for i in range(12)]


def test_a_row_served_by_another_checkpoint_is_an_error_row_never_a_caption(caption_rows, monkeypatch):
    log: list = []
    _engines(monkeypatch, {"e0": Engine("e0", "fp-b", log), "e1": Engine("e1", "fp-a", log)})
    out = list(caption_rows(Warm(["e0", "e1"], "fp-b")).iter_rows())
    stale = [r for r in out if r["error"]]
    assert stale and len(stale) < len(out) == 12
    assert all("served by checkpoint 'fp-a'" in r["error"] and r["caption"] == "" for r in stale)


def test_a_judged_pass_takes_a_caption_only_from_this_runs_checkpoint_and_a_judgement_only_from_its_judge(
    caption_rows, monkeypatch
):
    judge = {"apps": ["j0", "j1"], "model_fingerprint": "fp-j"}
    # each captioner sends its captions on to a judge engine of its own (e0 -> j0, e1 -> j1)
    for stale, engines in {
        "e1": [Engine("e0", "fp-b", []), Engine("e1", "fp-a", []), Engine("j0", "fp-j", []), Engine("j1", "fp-j", [])],
        "j1": [Engine("e0", "fp-b", []), Engine("e1", "fp-b", []), Engine("j0", "fp-j", []), Engine("j1", "fp-x", [])],
    }.items():
        _engines(monkeypatch, {e.name: e for e in engines})
        out = list(caption_rows(Warm(["e0", "e1"], "fp-b", judge=judge)).iter_rows())
        assert sorted(r["image_id"] for r in out) == [f"img{i:02d}" for i in range(12)]
        good = [r for r in out if not r["error"]]
        assert good and all(r["judged"] == f"judged caption of {r['image_id']}" for r in good)
        bad = [r for r in out if r["error"]]
        assert bad and len(bad) < 12
        if stale == "e1":  # another checkpoint's caption: the row is the caption's failure, the caption not kept
            assert all("captioned by checkpoint 'fp-a'" in r["error"] and r["caption"] is None for r in bad)
        else:  # another judge's judgement: the caption is kept, the judgement is the judge's failure
            assert all("served by checkpoint 'fp-x', not the judge's 'fp-j'" in r["error"] for r in bad)
            assert all(r["caption"] == f"caption of {r['image_id']}" and r["judged"] is None for r in bad)


def test_a_pass_stopped_early_ends_its_request_dataset_before_it_returns_not_once_the_blocks_in_flight_are_back(
    caption_rows, monkeypatch
):
    from captionflow.service import feed

    log: list = []
    slow = {"e0": Engine("e0", "fp-b", log, delays_s=(0.3, 4.0)), "e1": Engine("e1", "fp-b", log, delays_s=(4.0,))}
    _engines(monkeypatch, slow)
    ended: list = []
    end = feed._end

    def ending(started):
        end(started)
        ended.append(time.monotonic())

    monkeypatch.setattr(feed, "_end", ending)
    # ordered: the feed sends a block per engine, then one more per block back, and waits for the next one back
    rows = caption_rows(Warm(["e0", "e1"], "fp-b"), ordered=True, built=True).iter_rows()
    next(rows)  # e0's first block is back; the others are in the engines for seconds more
    rows.close()  # the pass stops (a verdict is in)
    returned = time.monotonic()
    # the dataset's execution had ended when the pass returned (left running, it hung the process at exit) ...
    assert ended and ended[0] <= returned
    time.sleep(4.5)
    # ... and the pass did not wait for the blocks still in the engines (4 s each), nor for the next one back
    first_back = min(t for _, t, n in log if n < 0)
    assert returned - first_back < 2.0 and sum(1 for _, t, n in log if n < 0 and t > returned) >= 2


def test_an_engine_that_fails_or_a_load_that_fails_ends_the_pass_with_the_reason(caption_rows, monkeypatch):
    _engines(monkeypatch, {"e0": Engine("e0", "fp-b", [], fail=True)})
    with pytest.raises(RuntimeError, match="warm engine e0: RuntimeError: the replica died"):
        list(caption_rows(Warm(["e0"], "fp-b")).iter_rows())
    sent: list = []
    _engines(monkeypatch, {"e0": Engine("e0", "fp-b", sent)})
    with pytest.raises(ValueError, match="the swap did not check"):
        list(caption_rows(Warm(["e0"], "fp-b", load_s=0.5, error=ValueError("the swap did not check"))).iter_rows())
    assert sent == []  # nothing went to an engine without the run's checkpoint
