"""The warm engine service's lease: a run that stops renewing its hold (SIGKILL, a lost node) loses it; a hold taken at
preflight goes to the run's inference stage, or back to the service. The controller is the real class (as a Ray actor
in the second test); the engines' load is a stand-in (the real one: tests/e2e/test_warm_engines.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from captionflow.config import RunConfig
from captionflow.engines.engine import resolve_engine
from captionflow.engines.presets import CPU
from captionflow.engines.session import ray_session
from captionflow.model_source import resolve_model
from captionflow.service import controller as service
from captionflow.service import hold


def test_a_hold_that_is_not_renewed_lapses_and_the_next_run_gets_the_engines():
    async def scenario():
        c = service.ServiceController(idle_timeout_s=0)
        first = (await c.try_acquire("run A", ttl_s=0.3))["token"]
        assert (await c.try_acquire("run B"))["holder"]["owner"] == "run A"
        await asyncio.sleep(0.2)
        assert await c.renew(first)  # renewed in time: still A's
        await asyncio.sleep(0.2)
        assert (await c.try_acquire("run B"))["holder"]["owner"] == "run A"
        await asyncio.sleep(0.4)  # A died: no renewal
        second = await c.try_acquire("run B")
        assert "token" in second and not await c.renew(first)
        state = await c.describe()
        assert state["lapsed"] == 1 and state["last_lapsed"] == "run A" and state["holder"]["owner"] == "run B"
        with pytest.raises(service.ServiceError, match="does not hold the warm engines"):
            await c.swap(first, "/a/checkpoint", "fp")  # A's swap, had it come late, would not touch B's engines
        await c.release(second["token"])
        assert (await c.describe())["holder"] is None

    asyncio.run(scenario())


@pytest.fixture
def controller(builtin_model_dir, monkeypatch):
    """A real controller actor on a local Ray, an engine load that only tells it; the run's model and engine."""
    import ray

    cfg = RunConfig(device="cpu")
    ray_session(cfg)
    model = resolve_model("builtin")
    engine = resolve_engine(cfg, model, CPU)
    loads: list[str] = []

    def load(c, model, engine, info, spec, warm):
        loads.append(warm.token)
        ray.get(c.loaded.remote(["captionflow-0"], spec, model.source, model.path, model.fingerprint, True))
        warm.apps, warm.how = ["captionflow-0"], "swapped"
        warm.done.set()

    monkeypatch.setattr(hold, "_load", load)
    actor = ray.remote(service.ServiceController).options(name=service.CONTROLLER, namespace=service.NAMESPACE)
    c = actor.remote(0)
    yield c, cfg, model, engine, loads
    ray.kill(c)


def test_a_hold_taken_at_preflight_goes_to_the_inference_stage_or_back(controller, monkeypatch):
    import ray

    c, cfg, model, engine, loads = controller
    assert hold.start_early(cfg, model, engine)
    held = ray.get(c.describe.remote())["holder"]
    assert held and loads == [held["token"]]  # loading at preflight
    with hold.use(model, engine, "the same run", wait_s=5) as warm:
        assert warm.token == held["token"] and warm.wait().how == "swapped"
        assert loads == [held["token"]]  # taken over: not acquired or loaded again
    assert ray.get(c.describe.remote())["holder"] is None

    # a hold no inference stage takes: given back by the run's end (its inference was cached) ...
    assert hold.start_early(cfg, model, engine)
    owner = ray.get(c.describe.remote())["holder"]["owner"]
    hold.end_early(owner)
    assert ray.get(c.describe.remote())["holder"] is None
    # ... or once EARLY_HOLD_S has passed (the run failed before its inference stage)
    monkeypatch.setattr(hold, "EARLY_HOLD_S", 0.5)
    assert hold.start_early(cfg, model, engine)
    deadline = time.monotonic() + 30
    while ray.get(c.describe.remote())["holder"] is not None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # the service held by another run: preflight does not wait for it
    other = ray.get(c.try_acquire.remote("another run"))["token"]
    assert not hold.start_early(cfg, model, engine)
    ray.get(c.release.remote(other))


def test_a_run_takes_the_services_judge_engines_only_where_they_hold_its_judge_with_its_settings(
    builtin_model_dir, tmp_path
):
    from captionflow.builtin.model import build_builtin_model

    judge = resolve_model("builtin")
    engine = resolve_engine(RunConfig(device="cpu"), judge, CPU)
    kept = {"apps": ["captionflow-judge-0"], "model": "builtin", "model_fingerprint": judge.fingerprint}
    kept["spec"] = service.engine_spec(judge, engine)
    warm = hold.WarmEngine(["captionflow-0"], "fp", "token", kept)
    assert warm.judges(judge, engine) is None
    judges = warm.judge_engines()
    assert judges.apps == ["captionflow-judge-0"] and judges.model_fingerprint == judge.fingerprint
    assert judges.done.is_set() and judges.token == "token"  # the run's hold
    other = resolve_model(str(build_builtin_model(tmp_path / "other", seed=3)))
    assert "judge engines hold builtin, not" in warm.judges(other, engine)
    pixels = resolve_engine(RunConfig(device="cpu", max_pixels=64 * 64), judge, CPU)  # settings that change answers
    assert "judge engines hold builtin" in warm.judges(judge, pixels)
    assert "keeps no judge engines" in hold.WarmEngine(["captionflow-0"], "fp", "token").judges(judge, engine)
