"""One vLLM engine per GPU, fed by several front ends: the engine stage's actors share an engine core.

Why: a vLLM engine is a front end (one Python process: the HF image processor, tokenising, detokenising) and
an engine core (the scheduler and the model on the GPU). One front end prepares ~120 images/s at 224 px on an
H100 while the core could take ~230; several whole engines on one GPU feed it, but each reads all the weights
every step for its own small batches. Here each GPU runs one engine core with the whole GPU's memory, and
``front_ends`` Ray Data LLM engine-stage actors - each holding ``1/front_ends`` of the GPU in Ray's books, so
that Ray places that many on each GPU - are its clients, as vLLM's own ``--api-server-count`` does for its
HTTP server (``compat/vllm_core.py``). The actors of one GPU find each other and the core through
``workers/core_group.py``, which also hosts the core outside any actor.

The UDF is Ray Data LLM's own ``vLLMEngineStageUDF``: only the engine's construction differs, so requests,
outputs, errors and batching are those of a run with one engine per actor.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

from ray.llm._internal.batch.stages.base import StatefulStageUDF
from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMEngineStage, vLLMEngineStageUDF

from captionflow.fingerprint import digest
from captionflow.workers import core_group


def attach_engine(member: core_group.Member):
    """A replacement for ``AsyncLLM.from_engine_args`` that makes this front end's engine a client of the
    group's core (the member that spawned the host first hands it the engine arguments)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor import Executor

    def from_engine_args(cls, engine_args, start_engine_loop=True, usage_context=None, stat_loggers=None):
        if member.spawns:
            core_group.hand_over(member, engine_args)
        core = core_group.wait_for_core(member)
        inputs, outputs = member.addresses()
        engine_args._api_process_count, engine_args._api_process_rank = member.slots, 0
        extra = {} if usage_context is None else {"usage_context": usage_context}
        vllm_config = engine_args.create_engine_config(*([usage_context] if usage_context else []))
        engine = AsyncLLM(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_requests=engine_args.enable_log_requests,
            log_stats=not engine_args.disable_log_stats,
            start_engine_loop=start_engine_loop,
            stat_loggers=stat_loggers,
            client_addresses={"input_address": inputs[member.index], "output_address": outputs[member.index]},
            client_count=member.slots,
            client_index=member.index,
            **extra,
        )
        core_group.watch_core(core, member.index)
        return engine

    return classmethod(from_engine_args)


@contextlib.contextmanager
def engines_attached(member: core_group.Member) -> Iterator[None]:
    """While in the block, an ``AsyncLLM`` built from engine arguments (as Ray Data LLM builds its engine) is
    a client of the group's shared core."""
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.__dict__["from_engine_args"]
    AsyncLLM.from_engine_args = attach_engine(member)
    try:
        yield
    finally:
        AsyncLLM.from_engine_args = original


def group_folder() -> str:
    """This actor's group: its node and the GPUs Ray gave it."""
    import ray

    gpus = "-".join(str(g) for g in ray.get_gpu_ids()) or "cpu"
    return f"{ray.get_runtime_context().get_node_id()[:12]}-{gpus}"


class SharedCoreEngineUDF(vLLMEngineStageUDF):
    """Ray Data LLM's vLLM engine stage, its engine a client of the GPU's shared engine core."""

    captionflow_own_core = False  # the core runs in the group's host process: nothing to prestart here

    def __init__(self, *args, front_ends: int, **kwargs):
        import ray

        # a core is shared by the front ends of one run (Ray job), model and engine arguments
        spec = digest([ray.get_runtime_context().get_job_id(), kwargs.get("model"), kwargs.get("engine_kwargs")])
        self.member = core_group.join(core_group.groups_root() / group_folder(), spec, front_ends)
        if self.member.spawns:  # the host imports vLLM while this actor does
            core_group.spawn_host(self.member)
        role = "starts" if self.member.spawns else "joins"
        core_group.say(f"front end {self.member.index} {role} {self.member.folder.name} ({front_ends} front ends)")
        with engines_attached(self.member):
            super().__init__(*args, **kwargs)


class SharedCoreEngineStage(vLLMEngineStage):
    """Ray Data LLM's vLLM engine stage with the shared-core UDF."""

    fn: type[StatefulStageUDF] = SharedCoreEngineUDF


def share_engine_cores(processor, front_ends: int, placement_group_config: dict[str, Any] | None) -> None:
    """Make ``processor``'s engine stage the shared-core one (``front_ends`` actors per engine core), built
    from the same arguments (the stage resolves its resources from ``placement_group_config`` again)."""
    stage = processor.stages["vLLMEngineStage"]
    kwargs = dict(stage.fn_constructor_kwargs)
    kwargs["front_ends"] = front_ends
    if placement_group_config is not None:
        kwargs["placement_group_config"] = copy.deepcopy(placement_group_config)
    processor.stages["vLLMEngineStage"] = SharedCoreEngineStage(
        fn_constructor_kwargs=kwargs, map_batches_kwargs=dict(stage.map_batches_kwargs)
    )
