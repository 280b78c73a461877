"""Leases: one writer at a time on a local disk and on S3 (moto), stale holders taken over, fencing."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from captionflow.data.lease import LEASES, Lease, LeaseLost, LeaseTimeout
from captionflow.data.storage import Store


def _roots(tmp_path, s3_bucket):
    return [str(tmp_path / "out"), f"s3://{s3_bucket}/out"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_one_holder_at_a_time_and_the_next_takes_over_on_release(tmp_path, s3_bucket, where):
    root = dict(zip(["local", "s3"], _roots(tmp_path, s3_bucket)))[where]
    store = Store(root)
    inside, overlaps, order = [0], [], []
    lock = threading.Lock()

    def writer(i: int) -> None:
        with Lease(store, "runs/a/b/c", what="the run folder", owner=f"writer {i}", poll_s=0.05):
            with lock:
                inside[0] += 1
                overlaps.append(inside[0])
            time.sleep(0.2)
            order.append(i)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(order) == [0, 1, 2] and max(overlaps) == 1  # all wrote, never two at once
    assert store.ls(LEASES, "runs", "a", "b", "c", suffix=".json") == []  # released


def test_a_holder_whose_process_is_gone_is_taken_over_at_once(tmp_path):
    store = Store(str(tmp_path))
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_hold_and_die, args=(str(tmp_path),))
    p.start()
    p.join(timeout=60)
    assert p.exitcode == 9  # it died holding the lease (no release)
    assert store.ls(LEASES, "ds", suffix=".json")
    t0 = time.monotonic()
    with Lease(store, "ds", what="the dataset folder", ttl_s=600) as lease:
        assert time.monotonic() - t0 < 120  # did not wait for its heartbeat to expire (ttl 600 s)
        assert lease.number == 2


def _hold_and_die(root: str) -> None:
    import os

    Lease(Store(root), "ds", what="the dataset folder", ttl_s=600).acquire()
    os._exit(9)


def test_a_writer_presumed_dead_finds_out_before_it_writes(tmp_path):
    store = Store(str(tmp_path))
    first = Lease(store, "run", what="the run folder", ttl_s=0.5).acquire()
    first._stop.set()  # it stops heartbeating (a long pause): its lease goes stale
    time.sleep(0.6)
    with Lease(store, "run", what="the run folder", owner="the second run", poll_s=0.05):
        with pytest.raises(LeaseLost, match="the second run"):
            first.check()


def test_waiting_gives_up_naming_the_holder(tmp_path):
    store = Store(str(tmp_path))
    with Lease(store, "run", what="the run folder", owner="flow run 'brave-otter'"):
        with pytest.raises(LeaseTimeout, match="brave-otter.*waited"):
            Lease(store, "run", what="the run folder", wait_s=0.3, poll_s=0.05).acquire()


def test_a_heartbeat_that_fails_says_so_in_the_runs_log(tmp_path, caplog):
    """A stalled store left the lease's heartbeat failing silently (debug level) for minutes: it warns, naming
    the lease, the error and how long ago it was last renewed."""
    import logging

    store = Store(str(tmp_path))
    lease = Lease(store, "run", what="the run folder", ttl_s=0.4).acquire()
    try:
        with caplog.at_level(logging.WARNING, logger="captionflow.data.lease"):
            held = tmp_path / LEASES / "run" / lease._name(lease.number)
            held.unlink()
            held.mkdir()  # the lease is still listed, and every write of its heartbeat fails from now on
            deadline = time.monotonic() + 30
            while not [r for r in caplog.records if "heartbeat failed" in r.getMessage()]:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.05)
    finally:
        lease._stop.set()
    line = next(r.getMessage() for r in caplog.records if "heartbeat failed" in r.getMessage())
    assert line.startswith("the run folder: lease heartbeat failed (") and "it lapses after 0.4 s" in line
    assert "last renewed" in line
