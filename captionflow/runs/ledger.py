"""The commit ledger of an LLM stage (captioning, judging) and the pass loop they share.

The driver pulls result rows from the Ray Data pipeline as they finish and commits them in shards of
at most ``commit_rows`` rows, each written atomically: rows without an error under ``<base>/<ok kind>/``
(their ids are done), rows the engine rejected under ``<base>/failures/``. A rerun reads the
``image_id`` column of the committed shards and sends only the other rows: a killed run loses at most
the uncommitted rows and never commits a row twice. Failed rows are retried in later passes, up to
``row_retries`` extra passes, and never counted as done.

Ray Data's own job checkpointing (``CheckpointConfig``) tracks rows written by a ``write_*`` sink; here
rows must also be routed by outcome and retried pass by pass, on any fsspec store: one ledger does it.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Optional

import pyarrow as pa

from captionflow.data.layout import FAILURES
from captionflow.data.lease import Lease
from captionflow.data.storage import Store
from captionflow.engines import run_log
from captionflow.errors import CaptionflowError, EngineFailed
from captionflow.results import PassResult
from captionflow.runs.watchdog import Watchdog

# progress(results, committed, total, rows per second since the pass's first result): once when the stage holds
# its folder (nothing new yet, rate 0), then as each result row arrives (engine batch by engine batch) and after
# every commit; ``results`` counts the rows done, committed or still in memory.
Progress = Callable[[int, int, int, float], None]


_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit)\w*): (.+)$")


def root_cause(e: BaseException) -> str:
    """The innermost error named in a Ray exception's text (an engine actor's traceback ends with it), e.g.
    ``SafetensorError: invalid header length``, with the lines that continue its message, instead of the
    wrapper (``ActorDiedError: ...``)."""
    lines = str(e).splitlines()
    found = [i for i, line in enumerate(lines) if _ERROR_LINE.match(line)]
    if not found:
        last = next((line.strip() for line in reversed(lines) if line.strip()), "")
        return f"{type(e).__name__}: {last[:400]}"
    i = found[-1]
    name, message = _ERROR_LINE.match(lines[i]).groups()
    rest = []
    for line in lines[i + 1 : i + 4]:
        if not line.strip() or line.lstrip().startswith(("File ", "Traceback")):
            break
        rest.append(line.strip())
    return f"{name}: {' '.join([message.strip(), *rest])[:400]}"


class Ledger:
    """The committed shards of one stage's results under ``store/base``. With a ``lease``, every commit first
    checks that this writer still holds the folder (``Lease.check``), so a writer presumed dead and replaced
    never writes beside its replacement; readers take each ``image_id`` once anyway (``Store.read_unique``)."""

    def __init__(
        self,
        store: Store,
        base: tuple[str, ...],
        ok_kind: str,
        schema: pa.Schema,
        commit_rows: int,
        lease: Optional[Lease] = None,
        stall_timeout_s: float = 1800.0,
        what: str = "results",
    ):
        self.store, self.base, self.ok_kind, self.schema, self.commit_rows = store, base, ok_kind, schema, commit_rows
        self.lease, self.stall_timeout_s, self.what = lease, stall_timeout_s, what
        self.stopped = False  # the last pass ended early (drain's stop)

    @staticmethod
    def key(row: dict):
        """What a result row is done for: its image."""
        return row["image_id"]

    def committed(self) -> set:
        return self.store.ids(self.store.ls(*self.base, self.ok_kind, suffix=".parquet"))

    def commit_rows_now(self, rows: list[dict]) -> int:
        """Commit rows that came from elsewhere (reused from another run) as one shard."""
        return self._commit(self.ok_kind, list(rows))

    def _commit(self, kind: str, rows: list[dict]) -> int:
        if not rows:
            return 0
        n = len(rows)
        if self.lease is not None:
            self.lease.check()
        self.store.write_table(
            pa.Table.from_pylist(rows, schema=self.schema),
            *self.base,
            kind,
            f"part-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet",
        )
        rows.clear()
        return n

    def drain(
        self,
        out,
        done: set,
        on_rows: Optional[Callable[[int, int, float], None]] = None,
        stop: Optional[Callable[[list[dict]], bool]] = None,
        side: Optional[Ledger] = None,
    ) -> tuple[int, int, Optional[float]]:
        """Pull the rows of Ray dataset ``out`` and commit them; ids of committed rows join ``done``.
        Returns (committed, failed, seconds to the first row); ``on_rows(results, committed, rows/s)`` as each
        result row arrives and after each commit; ``stop(rows)`` with each batch of rows without an error as it
        arrives: when it says True, what arrived is committed at once and the pass ends there (``self.stopped``),
        its Ray job shut down. ``side``: each row carries a result of a second stage of the same pass under
        ``judged`` (a judge's, of the caption: ``judge.SequentialJudging``; several rows may carry the same image's
        row, one result each), committed to ``side`` right after each of this ledger's commits, and ``stop`` is
        given those results instead."""
        t0 = time.perf_counter()
        self.stopped = False
        ok_rows: list[dict] = []
        failed_rows: list[dict] = []
        side_rows: list[dict] = []
        side_failed: list[dict] = []
        seen: set[str] = set()  # this pass's image ids, with a side: an image's row comes once per side result
        first_row_s = t_first = None
        n_ok = 0

        def report() -> None:
            if on_rows and t_first is not None:
                seen = n_ok + len(ok_rows)
                # over at least a second: the first engine batch arrives at once, not at "80,000 rows/s"
                on_rows(seen, n_ok, seen / max(time.perf_counter() - t_first, 1.0))

        def commit() -> None:
            nonlocal n_ok
            ids = [self.key(r) for r in ok_rows]
            n_ok += self._commit(self.ok_kind, ok_rows)
            done.update(ids)
            if side is not None:  # after the rows they are results of
                side._commit(side.ok_kind, side_rows)
                side._commit(FAILURES, side_failed)
            report()

        status = lambda: f"{n_ok + len(ok_rows)} {self.ok_kind} so far in this pass"
        try:
            with run_log.engines_at_work(), Watchdog(self.what, self.stall_timeout_s, status) as watchdog:
                rows = iter(out.iter_rows())
                try:
                    for row in rows:
                        watchdog.tick()
                        if t_first is None:
                            t_first = time.perf_counter()
                            first_row_s = round(t_first - t0, 2)
                        carried = row.pop("judged", None) if side is not None else None
                        judged = [carried] if carried is not None else []
                        for r in judged:
                            (side_failed if r["error"] else side_rows).append(r)
                        if side is None:
                            (failed_rows if row["error"] else ok_rows).append(row)
                        elif row["image_id"] not in seen:
                            seen.add(row["image_id"])
                            (failed_rows if row["error"] else ok_rows).append(row)
                        given = [r for r in judged if not r["error"]] if side is not None else [row]
                        if stop is not None and not row["error"] and given and stop(given):
                            self.stopped = True
                            commit()
                            break
                        if len(ok_rows) >= self.commit_rows:
                            commit()
                        elif not row["error"]:
                            report()
                finally:
                    getattr(rows, "close", lambda: None)()  # a pass stopped early: Ray Data ends its job here
        except CaptionflowError:
            raise
        except Exception as e:  # the pipeline itself failed (an engine that would not start, an actor that died)
            commit()  # what arrived is kept
            raise EngineFailed(f"{self.what}: {root_cause(e)} ({n_ok} rows committed in this pass are kept)") from e
        commit()
        n_failed = self._commit(FAILURES, failed_rows)
        return n_ok, n_failed, first_row_s


class Ledgers(Ledger):
    """The ledgers of several checkpoints' run folders, filled from one pass (``stages/shared_pass.py``): each
    result row commits to its checkpoint's (by ``model_fingerprint``), and is done for (fingerprint, image id)."""

    def __init__(self, ledgers: dict[str, Ledger]):
        first = next(iter(ledgers.values()))
        super().__init__(first.store, first.base, first.ok_kind, first.schema, first.commit_rows,
                         stall_timeout_s=first.stall_timeout_s, what=first.what)  # fmt: skip
        self.ledgers = ledgers

    @staticmethod
    def key(row: dict):
        return row["model_fingerprint"], row["image_id"]

    def committed(self) -> set:
        return {(fp, i) for fp, ledger in self.ledgers.items() for i in ledger.committed()}

    def _commit(self, kind: str, rows: list[dict]) -> int:
        stray = {r["model_fingerprint"] for r in rows} - set(self.ledgers)
        if stray:  # a row no checkpoint of the pass made: never dropped without a word
            raise CaptionflowError(f"{self.what}: rows of checkpoints not in this pass: {sorted(stray)}")
        n = sum(ledger._commit(kind, [r for r in rows if r["model_fingerprint"] == fp])
                for fp, ledger in self.ledgers.items())  # fmt: skip
        rows.clear()
        return n


def _reporter(progress: Progress, before: int, total: int) -> Callable[[int, int, float], None]:
    """A pass's results as overall progress: ``before`` rows were done when the pass began."""
    return lambda seen, committed, rate: progress(before + seen, before + committed, total, rate)


def run_passes(
    ledger: Ledger,
    todo: set[str],
    done: set[str],
    row_retries: int,
    rows_for: Callable[[int, list[str]], object],
    progress: Optional[Progress] = None,
    order: Optional[list[str]] = None,
    stop: Optional[Callable[[list[dict]], bool]] = None,
    side: Optional[Ledger] = None,
) -> list[PassResult]:
    """Send the ids (``Ledger.key``) of ``todo`` not yet in ``done`` through ``rows_for(attempt, pending)`` (a Ray
    dataset of fixed-schema result rows) and commit them; again for the rows that failed, up to ``row_retries``
    more passes. ``order``: pending ids go in this order (else sorted); ``stop``, ``side``: see ``Ledger.drain`` -
    once ``stop`` says True, no further pass."""
    passes = []
    for attempt in range(row_retries + 1):
        left = todo - done
        pending = [i for i in order if i in left] + sorted(left - set(order)) if order else sorted(left)
        if not pending:
            break
        t_pass = time.perf_counter()
        on_rows = _reporter(progress, len(done & todo), len(todo)) if progress else None
        n_ok, n_failed, first_row_s = ledger.drain(rows_for(attempt, pending), done, on_rows, stop, side)
        passes.append(
            PassResult(
                attempt=attempt,
                sent=len(pending),
                ok=n_ok,
                failed=n_failed,
                seconds=round(time.perf_counter() - t_pass, 2),
                first_row_s=first_row_s,
                stopped=ledger.stopped,
            )
        )
        if ledger.stopped:
            break
    return passes
