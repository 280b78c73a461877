"""Shared fixtures: one Prefect test harness (a real API server) for the whole session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    """The end-to-end tests first (whole flows: up to minutes each), then the other slow ones (a vLLM engine), then
    the rest, each in its order: `make test` hands the modules to its two workers in this order
    (--no-loadscope-reorder; pytest-xdist's own order, most tests first, started the one- and two-test e2e modules
    last, and the warm engines' test ran alone at the end), so that the short tests fill the end."""
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, "e2e" not in item.path.parts))


@pytest.fixture(scope="session", autouse=True)
def s3_server():
    """A real S3-protocol server (moto) on loopback for the whole session.

    Started before anything else so that the environment it sets (endpoint, dummy credentials)
    is inherited by every process started later - Ray workers and vLLM engines included.
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env["AWS_ENDPOINT_URL"]
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server):
    import uuid

    import boto3

    name = f"cf-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API server (SQLite) for the session; yields a client factory."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def builtin_model_dir(tmp_path_factory):
    from captionflow.builtin.model import ensure_builtin_model

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
