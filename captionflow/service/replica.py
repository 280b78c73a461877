"""What runs inside a warm engine: a Ray Serve replica holding the stages of a Ray Data LLM processor.

``CaptionEngine`` builds the very processor a run builds (``processor.build_vlm_processor``: Ray Data LLM's
``build_processor`` with captionflow's settings) and instantiates its stages' own UDFs - the vLLM engine
stage, which takes the run's requests as they come (``request_format.py``) - once, in this process. A batch
of request rows then goes through them exactly as Ray Data would send it through the stage actors of a run,
so a warm run's captions equal a cold run's, while nothing is imported, loaded or compiled again. It outlives
runs (``service/controller.py``) and swaps checkpoints of the same architecture in place with vLLM's
``reload_weights``; ``weights_digest`` reads back a slice of the loaded embedding so a swap is checked
against the checkpoint's file before use. A run hands it its request rows a block at a time (``caption_block``;
``service/feed.py``). Every row it returns carries the fingerprint of the checkpoint that produced it (``served_by``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from typing import Any, Optional

DATA = "__data"  # Ray Data LLM's Processor.DATA_COLUMN
ENGINE = "caption-engine"  # the Serve deployment of every engine
PAYLOAD = ("multimodal_data", "prompt")  # what a run does not need back
DIGEST_ROWS = 64  # embedding rows compared after a swap
# Testing hook: seconds each swap takes longer (set in the service's environment), so that a run's first requests
# are built while its checkpoint is still being swapped in.
SWAP_DELAY_ENV = "CAPTIONFLOW_INJECT_SWAP_DELAY_S"


def _embedding_digest(worker, rows: int = DIGEST_ROWS) -> tuple[str, str]:
    """Runs in each vLLM worker (``collective_rpc``): (dtype, sha256) of the first ``rows`` rows of the token
    embedding as loaded. Rows 0..rows sit in rank 0's shard under tensor parallelism."""
    import torch

    for name, param in worker.model_runner.model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            part = param.detach()[:rows].to("cpu").contiguous()
            return str(part.dtype).replace("torch.", ""), hashlib.sha256(part.view(torch.uint8).numpy()).hexdigest()
    return "", ""


MARKED = ("float16", "bfloat16", "float32")  # the weight dtypes a reload is checked for (``_mark_weights``)


def _marked(param) -> bool:
    return str(param.dtype).replace("torch.", "") in MARKED


def _mark_weights(worker) -> int:
    """Runs in each vLLM worker before a reload: every weight of a ``MARKED`` dtype set to NaN, so that one the reload
    does not write is found after it (``_unwritten``); returns how many. (vLLM 0.32's ``reset_weights`` zeroes them
    instead, and ``compute_weight_checksums`` hashes each: zero is a weight a checkpoint may hold, NaN is not.)"""
    n = 0
    for param in worker.model_runner.model.parameters():
        if _marked(param):
            param.data.fill_(float("nan"))
            n += 1
    return n


def _unwritten(worker, most: int = 5) -> tuple[int, list[str]]:
    """Runs in each vLLM worker after a reload: how many ``MARKED`` weights are still NaN, and the first ``most``
    names."""
    import torch

    names = [
        name
        for name, param in worker.model_runner.model.named_parameters()
        if _marked(param) and bool(torch.isnan(param.detach()).any())
    ]
    return len(names), names[:most]


def checkpoint_digest(model_path: str, dtype: str, rows: int = DIGEST_ROWS) -> str:
    """The same digest computed from a checkpoint's safetensors files, cast to the engine's dtype."""
    from pathlib import Path

    import torch
    from safetensors import safe_open

    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open handles are not containers
                if key.endswith("embed_tokens.weight"):
                    part = fh.get_slice(key)[:rows].to(getattr(torch, dtype)).contiguous()
                    return hashlib.sha256(part.view(torch.uint8).numpy()).hexdigest()
    return ""


def weights_problem(model_path: str, loaded: tuple[str, str]) -> Optional[str]:
    """None when ``loaded`` (``weights_digest``'s (dtype, digest) of an engine) is ``model_path``'s embedding,
    else why not."""
    dtype, got = loaded
    if not got:
        return "the engine's embedding could not be read"
    want = checkpoint_digest(model_path, dtype)
    if not want:
        return f"no embedding in {model_path}'s safetensors files to check against"
    return None if got == want else f"the engine's embedding ({got[:12]}) is not {model_path}'s ({want[:12]})"


class CaptionEngine:
    """A Ray Serve deployment class: a run's processor stages, kept warm between runs."""

    def __init__(self, model_path: str, model_fingerprint: str, engine):
        from captionflow.compat import vllm_warmup

        # A Serve replica does not run the job's worker setup hook: without it the first request of a new
        # service built the HF processor again on the front end (vllm_warmup), as an engine actor would.
        vllm_warmup.install()
        from captionflow.engines.processor import build_vlm_processor

        t0 = time.perf_counter()
        processor = build_vlm_processor(engine, model_path, preprocess=None, postprocess=None)
        self.udfs = []
        for stage in processor.stages.values():
            kwargs = stage.get_dataset_map_batches_kwargs(batch_size=engine.batch_size, data_column=DATA)
            self.udfs.append(stage.fn(**kwargs["fn_constructor_kwargs"]))
        self.llm = self.udfs[-1].llm  # the engine stage's vLLM engine wrapper
        self.model_path, self.model_fingerprint = model_path, model_fingerprint
        # every weight checked after a swap (``_mark_weights``), not only the embedding; a quantized engine's
        # weights are re-derived at load (scales, packed layouts): the embedding alone there
        self.marks = not engine.engine_kwargs.get("quantization")
        self.started_s = round(time.perf_counter() - t0, 2)
        self.rows = 0  # rows captioned since the replica started
        self._judges: dict[str, Any] = {}  # a judge engine's application -> its handle (``caption_block``'s then)
        self._requests: tuple[str, Any] = ("", None)  # the last run's ``feed.judge_requests`` and its object's id

    async def caption_block(self, blocks: list, then: Optional[tuple[str, Any]] = None) -> list[dict[str, Any]]:
        """A block of a run's request rows (``blocks``: its object reference, in a list so that it reaches this
        method unresolved and is read here from the object store, not through the run's driver) through every
        stage, as Ray Data would give it to a cold run's engine stage; the rows as the stages leave them, in the
        order given, without the requests' images and prompts, each with ``served_by``: the checkpoint that
        served it. ``then``: (a judge engine's application, [``feed.judge_requests``' object]): the rows go on to that
        engine as the judge's requests (they hold the image arrays, which stay out of the driver) and its rows
        come back instead, each with ``captioned_by`` too: the checkpoint that made its caption."""
        from ray.data.block import BlockAccessor

        block = await blocks[0]
        rows = BlockAccessor.for_block(block).to_batch_format("default")[DATA].tolist()
        if then is None:
            return await self.run_rows(rows)
        served_by = self.model_fingerprint
        rows = await self._stages(rows)
        self.rows += len(rows)
        app, (ref,) = then
        if app not in self._judges:
            from ray import serve

            self._judges[app] = serve.get_deployment_handle(ENGINE, app)
        if self._requests[0] != ref.hex():  # a run's function, read once
            self._requests = (ref.hex(), await ref)
        return await self._judges[app].run_rows.remote(self._requests[1](rows, served_by))

    async def run_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Request rows through every stage: ``caption_block``'s rows, for rows given here."""
        served_by = self.model_fingerprint
        rows = await self._stages(rows)
        done = [{**{k: v for k, v in row.items() if k not in PAYLOAD}, "served_by": served_by} for row in rows]
        self.rows += len(done)
        return done

    async def _stages(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for udf in self.udfs:
            async for out in udf({DATA: rows}):
                rows = out[DATA]
        return rows

    async def reload(self, model_path: str, model_fingerprint: str) -> float:
        """Load another checkpoint of the same architecture into the running engine; returns the seconds."""
        t0 = time.perf_counter()
        self.model_fingerprint = ""  # nothing this replica serves from now until the swap ends is attributed
        delay = float(os.environ.get(SWAP_DELAY_ENV) or 0)
        if delay:
            await asyncio.sleep(delay)
        engine = self.llm.engine
        if self.marks:
            await engine.collective_rpc(_mark_weights)
        await engine.collective_rpc("reload_weights", kwargs={"weights_path": model_path})
        # what the engine computed with the old weights must go: the prefix cache (the system prompt's KV) and
        # the image encoder's outputs (the same images come again) would be reused for the new ones
        await engine.reset_prefix_cache()
        await engine.reset_encoder_cache()
        await engine.reset_mm_cache()
        self.model_path, self.model_fingerprint = model_path, model_fingerprint
        return round(time.perf_counter() - t0, 3)

    async def weights_digest(self) -> tuple[str, str]:
        """(dtype, digest) of the loaded embedding (rank 0)."""
        results = await self.llm.engine.collective_rpc(_embedding_digest)
        return tuple(results[0])

    async def check(self, model_path: str) -> Optional[str]:
        """None when this engine holds ``model_path``'s weights, else why not: the loaded embedding against the
        file's, both read here, where torch is loaded already (a run's driver need not import it), and after a
        swap every weight written by it (``_unwritten``)."""
        problem = weights_problem(model_path, await self.weights_digest())
        if problem is None and self.marks:
            found = await self.llm.engine.collective_rpc(_unwritten)
            n = sum(count for count, _ in found)
            if n:
                names = [name for _, some in found for name in some]
                problem = f"the reload did not write {n} of the engine's weights ({', '.join(names[:3])}, ...)"
        return problem

    async def loaded(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "model_fingerprint": self.model_fingerprint,
            "started_s": self.started_s,
            "rows": self.rows,
        }
