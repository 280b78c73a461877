"""Shared fixtures: one Prefect test harness (a real API server) for the whole session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API server (SQLite) for the session; yields a client factory."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def builtin_model_dir(tmp_path_factory):
    from captionflow.builtin_model import ensure_builtin_model

    return ensure_builtin_model()


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray():
    yield
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except ImportError:
        pass
