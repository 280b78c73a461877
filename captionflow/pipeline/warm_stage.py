"""The Ray Data LLM stage that sends a run's request rows to the warm engine service.

A warm run's processor is a Ray Data LLM ``Processor`` with one stage: this one takes the request rows the
run's preprocess makes (the rendered prompt, the image array, sampling parameters) a batch at a time and
hands each batch to the service's engine with the fewest of its batches in flight, whose replica
(``engine_server.CaptionEngine``) runs them through the stages a cold run's processor would have - vLLM's
engine stage - and returns the same output rows. Its actor imports neither
vLLM nor transformers, so a warm run starts in seconds. It starts while the run's checkpoint is still being
swapped in, and sends its first row only once the service's controller says the checkpoint is in every engine
and checked (``ServiceController.wait_ready``). A row served by another checkpoint than the run's is an error
row, never a caption; a replica that is gone fails the pass (``ledger``: EngineFailed).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from ray.llm._internal.batch.stages.base import StatefulStage, StatefulStageUDF

from captionflow.processes import process_started
from captionflow.workers.worker_log import say

READY = "warm stage: handles to"  # the run's log, and the verdict benchmark's timeline, read these
GATE = "warm stage: the run's checkpoint is in the engines"
FIRST_BACK = "warm stage: first batch back"


class WarmEngineStageUDF(StatefulStageUDF):
    def __init__(
        self,
        data_column: str,
        expected_input_keys: list[str],
        app_names: list[str],
        deployment_name: str,
        model_fingerprint: str,
        token: str,
        controller: tuple[str, str],
        wait_s: float,
    ):
        t0 = time.time()
        super().__init__(data_column, expected_input_keys)
        self.deployment_name = deployment_name
        self._use(app_names)
        self.next = 0
        self.model_fingerprint = model_fingerprint
        self.token, self.wait_s, self.controller_name = token, wait_s, controller
        try:  # looked up now, so that the first batch only waits for the answer; if gone, the gate says so
            self.controller = self._controller(*controller)
        except Exception:
            self.controller = None
        self.gate: asyncio.Future | None = None
        self.started = time.perf_counter()
        self.first_back = False
        process_t0 = process_started(os.getpid())
        engines = f"{len(app_names)} engine{'s' if len(app_names) != 1 else ''} ({', '.join(app_names)})"
        took = f" in {time.time() - t0:.1f} s; worker process up {t0 - process_t0:.1f} s before" if process_t0 else ""
        say(f"{READY} {engines}{took}")

    def _use(self, app_names: list[str]) -> None:
        """Send to the engines of ``app_names`` (a handle each, none of this actor's batches in flight yet)."""
        from ray import serve

        self.app_names = list(app_names)
        self.handles = [serve.get_deployment_handle(self.deployment_name, app) for app in self.app_names]
        self.in_flight = [0] * len(self.handles)

    @staticmethod
    def _controller(name: str, namespace: str):
        import ray

        return ray.get_actor(name, namespace=namespace)

    async def _open_gate(self) -> None:
        """Wait until the run's checkpoint is in every engine and checked; the engines to use then."""
        t0 = time.perf_counter()
        controller = self.controller or self._controller(*self.controller_name)
        got = await controller.wait_ready.remote(self.token, self.wait_s)
        if "error" in got:
            raise RuntimeError(f"warm engines: {got['error']}")
        if got["apps"] != self.app_names:  # the engines were replaced by others
            self._use(got["apps"])
        say(f"{GATE} (waited {time.perf_counter() - t0:.1f} s)")

    def _pick(self) -> int:
        """The engine with the fewest of this actor's batches in flight (ties: in turn)."""
        n = len(self.handles)
        order = [(self.next + i) % n for i in range(n)]
        self.next = (self.next + 1) % n
        return min(order, key=lambda i: self.in_flight[i])

    async def udf(self, batch: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        if self.gate is None:  # the first batch opens it; the others wait on the same answer
            self.gate = asyncio.ensure_future(self._open_gate())
        await self.gate
        idx = [row[self.IDX_IN_BATCH_COLUMN] for row in batch]
        engine = self._pick()
        self.in_flight[engine] += 1
        try:
            out = await self.handles[engine].caption_batch.remote(
                [{k: v for k, v in r.items() if k != self.IDX_IN_BATCH_COLUMN} for r in batch]
            )
        finally:
            self.in_flight[engine] -= 1
        if not self.first_back:
            self.first_back = True
            say(f"{FIRST_BACK} ({len(out)} rows) {time.perf_counter() - self.started:.1f} s after the handles")
        for i, row in zip(idx, out):  # the replica keeps the order of the rows it was given
            row[self.IDX_IN_BATCH_COLUMN] = i
            if not row.get("__inference_error__") and row.get("served_by") != self.model_fingerprint:
                row["__inference_error__"] = (
                    f"served by checkpoint {row.get('served_by')!r}, not this run's "
                    f"{self.model_fingerprint!r}: not taken"
                )
            yield row


class WarmEngineStage(StatefulStage):
    """Takes the request rows a run's preprocess makes; gives what Ray Data LLM's engine stage gives."""

    fn: type[StatefulStageUDF] = WarmEngineStageUDF

    def get_required_input_keys(self) -> dict[str, str]:
        return {
            "prompt": "The rendered prompt.",
            "multimodal_data": "The image, as an array.",
            "sampling_params": "vLLM's sampling parameters.",
        }
