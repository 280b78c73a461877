"""The warm engine service's controller: a run's warm stage sends no row before the controller says that run's
checkpoint is in every engine and checked, and is told why not when it never will be.

The controller class runs here in one event loop, as in its Ray actor (an async actor runs its methods on one
loop); the service end to end, its Ray actor included, is tests/e2e/test_warm_engines.py."""

from __future__ import annotations

import asyncio

from captionflow.pipeline.service import ServiceController


def _run(coro):
    return asyncio.run(coro)


async def _held(c: ServiceController, owner: str = "run-a") -> str:
    got = await c.try_acquire(owner)
    return got["token"]


async def _waiting(c: ServiceController, token: str, settle_s: float = 0.2) -> asyncio.Future:
    """A run's warm stage asking for ``token``'s engines, given ``settle_s`` to answer if it would at once."""
    waiter = asyncio.ensure_future(c.wait_ready(token, timeout_s=30))
    await asyncio.sleep(settle_s)
    return waiter


def test_a_run_waits_until_its_checkpoint_is_loaded_and_gets_the_engines():
    async def main():
        c = ServiceController(idle_timeout_s=0)
        token = await _held(c)
        waiter = await _waiting(c, token)
        assert not waiter.done()  # the swap is still running
        await c.loaded(["captionflow-0", "captionflow-1"], "spec", "ckpt-b", "/ckpt/b", "fp-b", True, token)
        got = await asyncio.wait_for(waiter, 5)
        # a wait that starts after the load returns at once
        again = await asyncio.wait_for(c.wait_ready(token, timeout_s=30), 1)
        return got, again, c.state

    got, again, state = _run(main())
    assert got == again == {"apps": ["captionflow-0", "captionflow-1"]}
    assert state["model_fingerprint"] == "fp-b" and state["swaps"] == 1


def test_an_earlier_runs_load_does_not_open_the_gate_for_the_next_run():
    async def main():
        c = ServiceController(idle_timeout_s=0)
        first = await _held(c, "run-a")
        await c.loaded(["captionflow-0"], "spec", "ckpt-a", "/ckpt/a", "fp-a", False, first)
        await c.release(first)
        second = await _held(c, "run-b")
        waiter = await _waiting(c, second)
        pending = not waiter.done()
        await c.loaded(["captionflow-0"], "spec", "ckpt-b", "/ckpt/b", "fp-b", True, second)
        return pending, await asyncio.wait_for(waiter, 5), await c.wait_ready(first, timeout_s=1)

    pending, got, stale = _run(main())
    assert pending and got == {"apps": ["captionflow-0"]}
    assert stale == {"error": "the run no longer holds the warm engines"}


def test_a_failed_load_a_release_a_stop_or_the_time_limit_ends_the_wait_with_the_reason():
    async def main():
        c = ServiceController(idle_timeout_s=0)
        token = await _held(c)
        waiter = await _waiting(c, token, 0.1)
        await c.load_failed(token, "EngineFailed: warm engines: loading ckpt-b failed: disk full")
        failed = await asyncio.wait_for(waiter, 5)
        await c.release(token)

        token = await _held(c)
        waiter = await _waiting(c, token, 0.1)
        await c.release(token)  # the run ended (crashed) before its checkpoint got in
        released = await asyncio.wait_for(waiter, 5)

        token = await _held(c)
        timed_out = await asyncio.wait_for(c.wait_ready(token, timeout_s=0.3), 5)
        waiter = await _waiting(c, token, 0.1)
        await c.stop("asked to stop")
        stopped = await asyncio.wait_for(waiter, 5)
        return failed, released, timed_out, stopped

    failed, released, timed_out, stopped = _run(main())
    assert failed == {"error": "EngineFailed: warm engines: loading ckpt-b failed: disk full"}
    assert released == {"error": "the run no longer holds the warm engines"}
    assert timed_out == {"error": "its checkpoint was not in the engines within 0 s"}
    assert stopped == {"error": "the warm engine service has stopped"}
