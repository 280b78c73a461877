"""Stage results under the output root, cache keys checked against storage, stage records: with a real
Prefect API (the session's test harness) and a tiny flow built from the same pieces as the real one."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task

from captionflow.config import RunConfig
from captionflow.data.layout import RESULTS_CACHE
from tasks.results import CACHE_VERSION, record_stage, stage_results, validated

CALLS: list[str] = []


def _key(cfg: RunConfig, name: str) -> str:
    return name


def _missing(cfg: RunConfig, name: str):
    return None if (Path(cfg.output) / name).exists() else f"{name} is gone"


@task(
    name="make",
    cache_key_fn=validated("make", _key, _missing),
    persist_result=True,
    on_completion=[record_stage],
    on_failure=[record_stage],
)
def make(cfg: RunConfig, name: str) -> str:
    CALLS.append(name)
    (Path(cfg.output) / name).write_text("made")
    return f"made {name}"


@flow
def tiny(cfg: RunConfig, name: str) -> list:
    with stage_results(cfg.output) as stages:
        value = make(cfg, name)
    return [value, [(r.name, r.state) for r in stages.records]]


def test_cached_results_are_reused_only_while_their_outputs_exist(prefect_api, tmp_path):
    cfg = RunConfig(output=str(tmp_path))
    CALLS.clear()
    assert tiny(cfg, "a") == ["made a", [("make", "Completed")]]
    assert (tmp_path / RESULTS_CACHE / f"make-{CACHE_VERSION}-a").exists()  # persisted under the output root
    assert tiny(cfg, "a") == ["made a", [("make", "Cached")]]
    assert CALLS == ["a"]
    (tmp_path / "a").unlink()  # the output the cached result stands for is gone
    assert tiny(cfg, "a") == ["made a", [("make", "Completed")]]
    assert CALLS == ["a", "a"] and (tmp_path / "a").exists()
    assert tiny(cfg, "a")[1] == [("make", "Cached")]
