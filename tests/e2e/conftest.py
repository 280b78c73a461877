"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import os

import pytest
from ray_cluster import two_nodes


@pytest.fixture
def two_node_cluster():
    """(address, env) of a fresh 2-node Ray cluster on loopback, 2 CPUs a node."""
    with two_nodes(num_cpus=2) as cluster:
        yield cluster


@pytest.fixture
def env(prefect_api, tmp_path):
    """The environment of a service and the runs that use it."""
    from prefect.settings import PREFECT_API_URL

    # a cache of its own: the service's address file lives there, apart from any other service on this machine
    return {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PYTHONUNBUFFERED": "1",
        "CAPTIONFLOW_CACHE": str(tmp_path / "cache"),
    }
