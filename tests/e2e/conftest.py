"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import shutil

import pytest
from cli_runs import run_cli
from ray_cluster import two_nodes

from captionflow.builtin.demo_data import DEMO_CAPTIONS, ensure_demo_dataset


@pytest.fixture
def two_node_cluster():
    """(address, env) of a fresh 2-node Ray cluster on loopback, 2 CPUs a node."""
    with two_nodes(num_cpus=2) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def plain_golden_run(prefect_api, tmp_path_factory):
    """Eight demo images and a plain CPU run of them: (the options every run of that set shares, the run's summary).
    The baseline that runs of other engine layouts must caption exactly like."""
    tmp = tmp_path_factory.mktemp("plain-golden")
    data = tmp / "golden"
    data.mkdir()
    for n in sorted(DEMO_CAPTIONS)[:8]:
        shutil.copy2(ensure_demo_dataset() / n, data / n)
    common = ["--dataset", str(data), "--device", "cpu", "--batch-size", "2"]
    alone, _ = run_cli([*common, "--output", str(tmp / "alone")], tmp, "alone")
    return common, alone
