"""vLLM's engine warm-up samples with the sampling settings of the requests the engine will get, not with all of them.

vLLM 0.26's V2 model runner (the default for Qwen2.5-VL on the GPU host) warms up its kernels with a prefill and a
decode step whose requests use ``SamplingParams.for_sampler_warmup()``: temperature, top-p, top-k, min-p, three
penalties, a logit bias, bad words and logprobs at once, so that Triton compiles every sampler kernel before the
first request. On an empty Triton cache that is the largest part of an engine's start after loading: in a cold run
on the H100 host (py-spy, bench/host/stacks.sh) the core spent ~12 s compiling the penalties' ``bincount``, the logit
bias and the top-k/top-p kernels - none of which a greedy caption request runs. captionflow knows its requests'
sampling settings before the engine starts (the run's temperature, top-p and seed): ``environment`` puts them in the
engines' environment, and ``install``, run in the engine core's process before the core starts
(``core_prestart``), makes the warm-up use them, so the kernels those requests need are compiled and the others are
not. A request with other settings later (another run through a warm engine) compiles what it needs on first use,
as every kernel was before vLLM warmed them up; the Triton cache keeps them (``compile_cache_dir``).

Nothing changes where the variable is not set or vLLM has no ``for_sampler_warmup``. Can go when vLLM lets an
engine say which sampling features to warm up.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

ENV = "CAPTIONFLOW_WARMUP_SAMPLING"


def environment(sampling: Mapping[str, Any]) -> dict[str, str]:
    """The engines' environment that makes their warm-up sample with ``sampling`` (SamplingParams keyword
    arguments: the run's temperature, top-p and seed)."""
    return {ENV: json.dumps(dict(sampling), sort_keys=True)}


def install() -> bool:
    """In an engine core's process: the warm-up's sampling settings are the ones in ``ENV``. Returns whether it
    patched."""
    raw = os.environ.get(ENV)
    if not raw:
        return False
    kwargs = json.loads(raw)
    from vllm.sampling_params import SamplingParams

    if not hasattr(SamplingParams, "for_sampler_warmup"):
        return False

    def for_sampler_warmup() -> SamplingParams:
        return SamplingParams(**kwargs)

    SamplingParams.for_sampler_warmup = staticmethod(for_sampler_warmup)
    return True
