"""New prefills on a cadence in a single engine: vLLM's own ``prefill_schedule_interval``, which vLLM honours only
in its data-parallel engine core (to line ranks up), applied to any engine.

With ``prefill_schedule_interval: k`` > 1 in the engine arguments, a step admits new requests (and continues
prefills) only every k-th step while other requests are decoding; the steps between are pure decode. An engine fed
a few requests at a time (a Ray Data LLM engine actor adds a batch as it arrives) otherwise puts a handful of new
images into nearly every step - the vision encoder and a mixed prefill on every step - where an engine that drains
a full queue admits hundreds at once and then only decodes (docs/sizing.md). vLLM's data-parallel version stops
throttling while requests are waiting (it balances ranks, so a saturated rank need not wait); here that is exactly
when it should throttle, so it throttles whenever something is decoding. An idle engine admits at once.

The engine resolves ``scheduler_cls`` in its core's process: ``SCHEDULER`` names ``scheduler`` below, which builds
vLLM's own scheduler class for the engine's settings (async scheduling or not) with this one method added. Only
the order of work changes, not what is computed (speed-only: not part of the captions' fingerprint; vLLM's compile
cache key does not include it either).
"""

from __future__ import annotations

from typing import Any

SCHEDULER = f"{__name__}.scheduler"

_classes: dict[type, type] = {}


class _Cadence:
    def schedule(self, throttle_prefills: bool = False):  # type: ignore[no-untyped-def]
        k = self.scheduler_config.prefill_schedule_interval  # type: ignore[attr-defined]
        if k > 1 and not throttle_prefills:
            # vLLM stops throttling on a rank whose last admitting step left requests waiting; never here
            self.prefill_capacity_bound = False
            throttle_prefills = (self.current_step + 1) % k != 0  # type: ignore[attr-defined]
        return super().schedule(throttle_prefills)  # type: ignore[misc]


def scheduler(*args: Any, vllm_config: Any, **kwargs: Any) -> Any:
    """vLLM's scheduler for these settings, admitting prefills every ``prefill_schedule_interval`` steps."""
    if vllm_config.scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as base
    from captionflow.workers import worker_log

    cls = _classes.get(base)
    if cls is None:
        cls = _classes[base] = type(f"Cadenced{base.__name__}", (_Cadence, base), {})
    k = vllm_config.scheduler_config.prefill_schedule_interval
    worker_log.say(f"prefill cadence: new requests join the running ones every {k} steps ({cls.__name__})")
    return cls(*args, vllm_config=vllm_config, **kwargs)


def engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with this scheduler named where they ask for a prefill cadence (and name no scheduler)."""
    if int(kwargs.get("prefill_schedule_interval") or 1) > 1 and not kwargs.get("scheduler_cls"):
        return {**kwargs, "scheduler_cls": SCHEDULER}
    return kwargs
