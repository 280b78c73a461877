"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest
from ray_cluster import two_nodes


@pytest.fixture
def two_node_cluster():
    """(address, env) of a fresh 2-node Ray cluster on loopback, 2 CPUs a node."""
    with two_nodes(num_cpus=2) as cluster:
        yield cluster
