"""The commit ledger and the pass loop, with a stand-in for the Ray dataset (only ``iter_rows`` is used)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from captionflow.data.layout import CAPTIONS, FAILURES
from captionflow.data.storage import Store
from captionflow.runs.ledger import Ledger, run_passes
from captionflow.workers.llm_rows import CAPTION_SCHEMA


class Rows:
    """What the ledger needs of a Ray dataset: its rows, in the order they finish."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def iter_rows(self):
        yield from self.rows


def _row(image_id: str, attempt: int, error: str = "") -> dict:
    return {
        "image_id": image_id,
        "caption": "" if error else f"caption of {image_id}",
        "finish_reason": "stop",
        "num_input_tokens": 3,
        "num_output_tokens": 2,
        "model_fingerprint": "m",
        "error": error,
        "attempt": attempt,
    }


def test_rows_are_committed_in_bounded_shards_and_failures_apart(tmp_path):
    store = Store(str(tmp_path))
    ledger = Ledger(store, ("run",), CAPTIONS, CAPTION_SCHEMA, commit_rows=3)
    done: set[str] = set()
    commits = []
    rows = [_row(f"id{i}", 0) for i in range(7)] + [_row("bad", 0, "engine said no")]
    n_ok, n_failed, first = ledger.drain(Rows(rows), done, on_rows=lambda seen, n, rate: commits.append(n))
    assert (n_ok, n_failed) == (7, 1) and first is not None
    assert done == {f"id{i}" for i in range(7)}
    shards = store.ls("run", CAPTIONS, suffix=".parquet")
    assert [pq.read_metadata(store.path("run", CAPTIONS, s.rsplit("/", 1)[-1])).num_rows for s in shards] == [3, 3, 1]
    assert sorted(set(commits)) == [0, 3, 6, 7]  # committed counts as rows arrive: 0 before the first commit
    assert ledger.committed() == done
    failed = store.read_tables(store.ls("run", FAILURES, suffix=".parquet")).to_pylist()
    assert [(r["image_id"], r["error"]) for r in failed] == [("bad", "engine said no")]
    assert not list(tmp_path.rglob(".*tmp*"))  # every shard was committed atomically


def test_failed_rows_are_retried_in_later_passes_never_counted_done(tmp_path):
    store = Store(str(tmp_path))
    ledger = Ledger(store, ("run",), CAPTIONS, CAPTION_SCHEMA, commit_rows=2)
    todo = {"a", "b", "c", "d"}
    done = {"a"}  # committed by an earlier run
    sent = []

    def rows_for(attempt, pending):
        sent.append(list(pending))
        return Rows([_row(i, attempt, "flaky" if attempt == 0 and i == "c" else "") for i in pending])

    progress = []
    passes = run_passes(
        ledger,
        todo,
        done,
        row_retries=2,
        rows_for=rows_for,
        progress=lambda seen, committed, total, rate: progress.append((seen, committed, total)),
    )
    assert sent == [["b", "c", "d"], ["c"]]  # never "a"; the third pass is not needed
    assert [(p.attempt, p.sent, p.ok, p.failed) for p in passes] == [(0, 3, 2, 1), (1, 1, 1, 0)]
    assert done == todo
    assert progress[-1] == (4, 4, 4) and all(total == 4 for *_, total in progress)
    assert (2, 1, 4) in progress  # "b" arrived (committed with the next row): reported before its commit
    assert all(committed <= seen for seen, committed, _ in progress)
    ids = store.read_tables(store.ls("run", CAPTIONS, suffix=".parquet")).column("image_id").to_pylist()
    assert sorted(ids) == ["b", "c", "d"]  # each once


def test_rows_failing_every_pass_stay_pending(tmp_path):
    ledger = Ledger(Store(str(tmp_path)), ("run",), CAPTIONS, CAPTION_SCHEMA, commit_rows=8)
    done: set[str] = set()
    passes = run_passes(
        ledger,
        {"x", "y"},
        done,
        row_retries=1,
        rows_for=lambda attempt, pending: Rows([_row(i, attempt, "no" if i == "y" else "") for i in pending]),
    )
    assert [p.sent for p in passes] == [2, 1] and done == {"x"}


class Broken(Rows):
    """A pipeline whose engine dies after some rows (or never starts): Ray raises from the iterator."""

    def iter_rows(self):
        yield from self.rows
        raise RuntimeError(
            "ray.exceptions.ActorDiedError: The actor died because of an error raised in its creation task\n"
            '  File "engine.py", line 9, in __init__\n'
            "safetensors_rust.SafetensorError: Error while deserializing header: invalid header length"
        )


def test_a_failing_engine_keeps_what_arrived_and_names_the_root_cause(tmp_path):
    from captionflow.errors import EngineFailed

    store = Store(str(tmp_path))
    ledger = Ledger(store, ("run",), CAPTIONS, CAPTION_SCHEMA, commit_rows=10, what="inference")
    done: set[str] = set()
    with pytest.raises(EngineFailed, match=r"^inference: SafetensorError: Error while deserializing header: invalid"):
        ledger.drain(Broken([_row("a", 0), _row("b", 0)]), done)
    assert done == {"a", "b"} and ledger.committed() == {"a", "b"}  # committed before the failure surfaced


def test_a_side_ledger_commits_each_rows_results_after_it_and_the_stop_sees_only_them(tmp_path):
    from captionflow.workers.llm_rows import PAIRWISE_SCHEMA

    store = Store(str(tmp_path))
    captions = Ledger(store, ("run",), CAPTIONS, CAPTION_SCHEMA, commit_rows=2)
    judged = Ledger(store, ("run", "pairwise", "fp"), "scores", PAIRWISE_SCHEMA, commit_rows=2)

    def pair(image_id, order, error=""):
        return {"image_id": f"{image_id}#{order}", "winner": None if error else "A", "reason": "", "raw": "",
                "candidate_score": None if error else 1.0, "error": error, "attempt": 0}  # fmt: skip

    rows = [
        {**_row("a", 0), "judged": pair("a", "ab")},
        {**_row("b", 0), "judged": pair("b", "ab", "judge said no")},
        {**_row("bad", 0, "engine said no"), "judged": None},  # the caption failed: never judged
        {**_row("bad", 0, "engine said no"), "judged": None},  # its second order's row
        {**_row("a", 0), "judged": pair("a", "ba")},  # the same caption, its other order's judgement
        {**_row("c", 0), "judged": pair("c", "ab")},
        {**_row("d", 0), "judged": pair("d", "ab")},
    ]
    seen = []

    def stop(results):
        seen.extend(results)
        return any(r["image_id"] == "c#ab" for r in results)

    done: set[str] = set()
    n_ok, n_failed, _ = captions.drain(Rows(rows), done, stop=stop, side=judged)
    # the pass ends at c's judgement: its caption and everything before it committed, d's never pulled
    assert captions.stopped and (n_ok, n_failed) == (3, 1) and done == {"a", "b", "c"}
    committed = store.read_tables(store.ls("run", CAPTIONS, suffix=".parquet")).to_pylist()
    assert sorted(r["image_id"] for r in committed) == ["a", "b", "c"]  # a once, though two rows carried it
    assert "judged" not in committed[0]
    assert judged.committed() == {"a#ab", "a#ba", "c#ab"}
    failed = store.read_tables(store.ls("run", "pairwise", "fp", FAILURES, suffix=".parquet")).to_pylist()
    assert [(r["image_id"], r["error"]) for r in failed] == [("b#ab", "judge said no")]
    bad = store.read_tables(store.ls("run", FAILURES, suffix=".parquet")).to_pylist()
    assert [r["image_id"] for r in bad] == ["bad"]  # once
    assert [r["image_id"] for r in seen] == ["a#ab", "a#ba", "c#ab"]  # the judgements without an error, only
