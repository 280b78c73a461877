"""The engines' warm-up samples with the run's sampling settings (captionflow/compat/sampler_warmup.py), with real
vLLM's SamplingParams (CPU build)."""

from __future__ import annotations

import json

from captionflow.builtin.model import ensure_builtin_model
from captionflow.compat import sampler_warmup
from captionflow.config import RunConfig
from captionflow.engines.engine import resolve_engine
from captionflow.engines.presets import CPU
from captionflow.model_source import resolve_model


def test_the_warm_up_samples_as_the_runs_requests_do(monkeypatch):
    from vllm.sampling_params import SamplingParams

    everything = SamplingParams.for_sampler_warmup()  # vLLM's own: every sampling feature at once
    assert everything.top_k > 0 and everything.repetition_penalty != 1.0 and everything.logit_bias
    # restored after the test, whatever install does
    monkeypatch.setattr(SamplingParams, "for_sampler_warmup", SamplingParams.__dict__["for_sampler_warmup"])

    monkeypatch.delenv(sampler_warmup.ENV, raising=False)
    assert sampler_warmup.install() is False  # not asked: vLLM's own warm-up
    assert SamplingParams.for_sampler_warmup().top_k == everything.top_k

    env = sampler_warmup.environment({"temperature": 0.0, "top_p": 1.0, "seed": 7})
    monkeypatch.setenv(sampler_warmup.ENV, env[sampler_warmup.ENV])
    assert sampler_warmup.install() is True
    greedy = SamplingParams.for_sampler_warmup()
    assert greedy.temperature == 0.0 and greedy.top_p == 1.0 and greedy.seed == 7
    # none of the features a caption request does not use: no top-k, no penalties, no logit bias, no logprobs
    assert greedy.top_k in (0, -1) and greedy.min_p == 0.0 and greedy.repetition_penalty == 1.0
    assert greedy.frequency_penalty == 0.0 and not greedy.logit_bias and greedy.logprobs is None


def test_the_engines_environment_carries_the_runs_sampling_settings(builtin_model_dir):
    ensure_builtin_model()
    cfg = RunConfig(device="cpu", temperature=0.7, top_p=0.9, seed=3)
    engine = resolve_engine(cfg, resolve_model("builtin"), CPU)
    assert json.loads(engine.env[sampler_warmup.ENV]) == {"temperature": 0.7, "top_p": 0.9, "seed": 3}
