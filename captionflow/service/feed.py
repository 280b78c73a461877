"""How a warm run's request rows reach the warm engine service: from its driver, a block at a time.

A warm run builds its request rows as a cold run does - a Ray Data LLM ``Processor`` whose preprocess makes each
row ready for the engine stage (the rendered prompt, the image array, sampling parameters), in the run's worker
tasks - but has no engine stage of its own: the engine stages run in the service's replicas
(``service/replica.CaptionEngine``). The driver iterates the request dataset's blocks as object references
(Ray Data's ``RefBundle``s: the rows never pass through the driver) and hands each block to the
service's engine with the fewest of its blocks in flight; the replica reads the block from the object store, runs
its rows through the stages a cold run's processor would (vLLM's engine stage) and returns the result rows without
their images. The driver then applies the processor's own postprocess (Ray Data LLM's: error rows pass as they
are) and the run's fixed schema, and the ledger commits them.

Why not a Ray Data stage in the run (as Ray Data LLM's ``ServeDeploymentProcessorConfig`` has): that stage is an
actor, and Ray 2.60 starts a new process for every actor of a new job - on the H100 host 2-3.5 s to start it and
import Ray Data, Ray Data LLM and Ray Serve, on the 2-core VM 6-8 s, before the first row could go out. The driver
is up, and has imported Ray Serve while the run's first stages ran (``compat/driver_imports``).

The first block goes out only once the run's checkpoint is in every engine and checked (``WarmEngine.wait``: the
swap runs in the background while the dataset starts); a row served by another checkpoint than the run's is an
error row, never a caption; a replica that fails or is gone fails the pass (``ledger``: EngineFailed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("captionflow.warm")

GATE = "warm engines: the run's checkpoint is in the engines"  # the run's log, and the verdict bench, read these
FIRST_BUILT = "warm engines: first block of requests built"
FIRST_BACK = "warm engines: first block back"
_END = object()
CLOSE_WAIT_S = 60.0  # the most a pass waits, once it ends, for its request dataset's execution to end


class WarmRows:
    """The result rows of one warm pass, as ``ledger.drain`` pulls them (``iter_rows``); ``map`` adds a function
    applied to each row in the driver, in order, as ``Dataset.map`` would in a task; ``then`` sends each result
    row on to the service's judge engines first."""

    def __init__(
        self,
        requests,
        warm,
        processor,
        blocks_per_engine: int,
        batch_rows: int,
        steps: tuple[Callable, ...] = (),
        ordered: bool = False,
        judge=None,
    ):
        self.requests, self.warm, self.processor = requests, warm, processor
        self.blocks_per_engine, self.batch_rows = max(1, blocks_per_engine), max(1, batch_rows)
        self.steps = steps
        self.ordered = ordered
        self.judge = judge  # (the judge's processor, expand): ``then``

    def _with(self, **changed: Any) -> WarmRows:
        keep = ("requests", "warm", "processor", "blocks_per_engine", "batch_rows", "steps", "ordered", "judge")
        return WarmRows(**{**{k: getattr(self, k) for k in keep}, **changed})

    def map(self, fn: Callable[[dict], dict], **_ray_options: Any) -> WarmRows:
        return self._with(steps=(*self.steps, fn))

    def then(self, judge_processor, expand: Callable[[dict], list[dict]] | None = None) -> WarmRows:
        """These rows judged by the service's judge engines (``WarmEngine.judges``) as the captioner's engines make
        them: each result row, still in its engine's process with its image, becomes the judge's request rows
        (``judge_requests``: ``expand``, e.g. both orders of a pair, then ``judge_processor``'s preprocess) and goes
        to a judge engine; the judge's rows come back, and ``judge_processor``'s postprocess runs on them here, as
        a cold pass's processor after the captioner's (``judge.SequentialJudging.after``) would."""
        return self._with(judge=(judge_processor, expand))

    def _finish(self, row: dict) -> dict:
        processor = self.judge[0] if self.judge else self.processor
        if not row.get("__inference_error__"):
            judge = self.warm.judge["model_fingerprint"] if self.judge else None
            if self.judge and row.get("captioned_by") != self.warm.model_fingerprint:
                row.pop("caption", None)  # not this run's caption: the row is the caption's failure
                row["__inference_error__"] = (
                    f"captioned by checkpoint {row.get('captioned_by')!r}, not this run's "
                    f"{self.warm.model_fingerprint!r}: not taken"
                )
            elif row.get("served_by") != (judge or self.warm.model_fingerprint):
                row["__inference_error__"] = (
                    f"served by checkpoint {row.get('served_by')!r}, not "
                    f"{'the judge' if judge else 'this run'}'s {judge or self.warm.model_fingerprint!r}: not taken"
                )
        out = processor.postprocess({processor.DATA_COLUMN: row})
        for fn in self.steps:
            out = fn(out)
        return out

    def iter_rows(self) -> Iterator[dict]:
        results: queue.Queue = queue.Queue()
        stop, closed = threading.Event(), threading.Event()
        started: list = []  # the request dataset's (blocks, executor), once it runs
        feeder = threading.Thread(
            target=self._feed_thread, args=(results, stop, closed, started), name="captionflow-warm-feed", daemon=True
        )
        feeder.start()
        try:
            while True:
                item = results.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                for row in item:
                    yield self._finish(row)
        finally:
            stop.set()
            # the request dataset's execution ends here, before the pass does, not once the feed has seen the stop
            # (after its next block back): the blocks still in the engines after an early stop come back to nobody.
            # An executor left running was shut down when Python collected it at exit, which hung there (it asked
            # for Ray, which had gone: a thread started at exit).
            if started:
                _end(started[0])
            elif not closed.wait(CLOSE_WAIT_S):
                log.warning("warm engines: the request dataset did not end within %.0f s", CLOSE_WAIT_S)

    def _feed_thread(self, results: queue.Queue, stop: threading.Event, closed: threading.Event, started: list):
        try:
            asyncio.run(self._feed(results, stop, started))
        except BaseException as e:
            results.put(e)
        else:
            results.put(_END)
        finally:
            closed.set()

    async def _feed(self, results: queue.Queue, stop: threading.Event, box: list) -> None:
        """Hand the request blocks to the engines; ``box``: the request dataset's (blocks, executor) go there once it
        runs."""
        t0 = time.perf_counter()
        # the dataset starts, and its first block is built, while the checkpoint may still be going in
        starting = asyncio.ensure_future(asyncio.to_thread(self._start, t0))
        try:
            await asyncio.to_thread(self.warm.wait)  # raises why the checkpoint did not get in
        except BaseException:
            with contextlib.suppress(Exception):  # the load's reason is the one to report
                await _close(await starting)
            raise
        t_gate = time.perf_counter()
        log.info("%s (waited %.1f s)", GATE, t_gate - t0)
        started = await starting
        box.append(started)
        bundles = started[0]
        apps, handles = list(self.warm.apps), self.warm.handles()
        judges: list[str] = []
        if self.judge:  # the judge's request function goes to the object store once, not with every block
            import ray

            judges = list(self.warm.judge["apps"])
            judge_processor, expand = self.judge
            requests = ray.put(
                functools.partial(
                    judge_requests,
                    captions=self.processor.postprocess,
                    expand=expand,
                    requests=judge_processor.preprocess,
                    column=self.processor.DATA_COLUMN,
                )
            )
        in_flight = [0] * len(handles)
        slots = asyncio.Semaphore(self.blocks_per_engine * len(handles))
        # An ordered run (a sequential verdict's) sends a batch of rows per engine first (the order's first window:
        # processor.read_pending) and as many rows more as come back, up to the most: the requests in an engine run
        # together and finish together, and with the most in flight from the start the order's first rows came back
        # with the first wave of all of them (~9 s after the gate on one H200: all 5,000 rows in 4 engines at once,
        # 512 running in each). A window's rows come in small blocks, one per shard read: a block per engine
        # at first sent ~16 rows, and a verdict after 15 images came 6.1 s after the gate.
        budget = {"out": 0, "allowed": self.batch_rows * len(handles) if self.ordered else float("inf")}
        window = asyncio.Condition()
        sent: set[asyncio.Task] = set()
        turn = 0
        first_back = [False]

        async def send(i: int, ref, n: int) -> None:
            try:
                then = [judges[i % len(judges)], [requests]] if judges else None  # the judge engine i's pair
                rows = await handles[i].caption_block.remote([ref], then)
                if not first_back[0]:
                    first_back[0] = True
                    log.info("%s (%d rows) %.1f s after the gate", FIRST_BACK, len(rows), time.perf_counter() - t_gate)
                results.put(rows)
            except BaseException as e:
                stop.set()
                results.put(RuntimeError(f"warm engine {apps[i]}: {type(e).__name__}: {str(e)[:500]}"))
            finally:
                in_flight[i] -= 1
                slots.release()
                async with window:
                    budget["out"] -= n
                    budget["allowed"] += n
                    window.notify_all()

        try:
            bundle = await asyncio.to_thread(next, bundles, None)
            while bundle is not None and not stop.is_set():
                for ref, meta in zip(bundle.block_refs, bundle.metadata):
                    n = meta.num_rows or self.batch_rows
                    async with window:
                        await window.wait_for(lambda n=n: budget["out"] == 0 or budget["out"] + n <= budget["allowed"])
                        budget["out"] += n
                    await slots.acquire()
                    if stop.is_set():  # not sent: neither in flight nor in the window
                        slots.release()
                        async with window:
                            budget["out"] -= n
                        break
                    order = [(turn + k) % len(handles) for k in range(len(handles))]
                    turn = (turn + 1) % len(handles)
                    i = min(order, key=lambda k: in_flight[k])  # the fewest in flight (ties: in turn)
                    in_flight[i] += 1
                    task = asyncio.ensure_future(send(i, ref, n))
                    sent.add(task)
                    task.add_done_callback(sent.discard)
                bundle = None if stop.is_set() else await asyncio.to_thread(next, bundles, None)
            if sent:
                await asyncio.gather(*sent)
        finally:
            await _close(started)

    def _start(self, t0: float):
        """The request dataset's blocks (an iterator of Ray Data ``RefBundle``s; Ray Data returns it once the first
        block is built) and its executor. ``Dataset.iter_internal_ref_bundles`` is this without the executor, which
        then runs on after an early stop until it is garbage-collected (at Ray's shutdown: a fatal error in Ray)."""
        bundles, _, executor = self.requests._execute_to_iterator(capture_executor=False)
        log.info("%s %.1f s after the dataset was asked for", FIRST_BUILT, time.perf_counter() - t0)
        return bundles, executor


def judge_requests(
    rows: list[dict],
    captioned_by: str,
    *,
    captions: Callable,
    expand: Callable | None,
    requests: Callable,
    column: str,
) -> list[dict]:
    """Runs in a captioner's engine (``replica.caption_block``): its result ``rows`` as the judge's request rows,
    each with ``captioned_by``: the captioner's postprocess (``captions``, as Ray Data LLM wraps it, around the row
    under ``column``: a failed row passes as it is, without its image), ``expand`` (None: the row once), the judge's
    preprocess (``requests``, wrapped: a failed row passes unjudged)."""
    from captionflow.workers.llm_rows import JUDGE_IMAGE

    out = []
    for row in rows:
        caption = {**captions({column: row}), "captioned_by": captioned_by}
        if caption.get("__inference_error__"):
            for k in (JUDGE_IMAGE, "multimodal_data", "prompt"):
                caption.pop(k, None)
        for one in expand(caption) if expand else [caption]:
            out.append(requests(one)[column])
    return out


async def _close(started) -> None:
    """End the dataset's execution: done already when its blocks have all been taken, not after an early stop."""
    await asyncio.to_thread(_end, started)


def _end(started) -> None:
    _, executor = started
    if executor is not None:
        executor.shutdown(True)  # once: a second call returns at once


def warm_processor(config, warm, engine, preprocess, postprocess, map_kwargs: dict, ordered: bool = False):
    """A Ray Data LLM Processor without an engine stage: its preprocess builds the request rows in the run's
    tasks, and the driver hands them to the warm engine service's replicas, which run the engine stage
    (``WarmRows``); the processor's postprocess then runs on the rows they return."""
    import ray.data
    from ray.llm._internal.batch.processor.base import Processor

    # The requests are built here, by the run, while the service's engines are up from the first second: no
    # backlog builds up while engines start, as in a cold run, so two tasks per engine build them
    # (docs/sizing.md).
    preprocess_kwargs = {
        **map_kwargs,
        "compute": ray.data.TaskPoolStrategy(size=max(engine.map_concurrency, 2 * len(warm.apps))),
    }
    processor = Processor(
        config, [], preprocess=preprocess, postprocess=postprocess, preprocess_map_kwargs=preprocess_kwargs
    )
    # as many blocks (of batch_size rows) in flight to each engine as a cold run's engine actor takes batches
    rows = functools.partial(
        WarmRows,
        warm=warm,
        processor=processor,
        blocks_per_engine=engine.max_concurrent_batches,
        batch_rows=engine.batch_size,
        ordered=ordered,
    )
    return WarmProcessor(processor, rows)


class WarmProcessor:
    """A warm pass's processor: called on a dataset as a Ray Data LLM Processor is, it gives the pass's rows
    (``service/feed.WarmRows``); ``processor``: its preprocess and postprocess (a judge's: ``WarmRows.then``)."""

    def __init__(self, processor, rows: Callable):
        self.processor, self._rows = processor, rows

    def __call__(self, ds):
        return self._rows(ds.map(self.processor.preprocess, **self.processor.preprocess_map_kwargs))
