"""How the front ends of one GPU meet around one engine core: who starts it, who joins, who waits and why.
(The core itself, started by a real host process with vLLM, is exercised in tests/e2e/test_shared_core.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from captionflow.processes import process_started
from captionflow.workers import core_group
from captionflow.workers.core_group import Member, join, locked, me, wait_for_core


def _dead_process() -> list:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    entry = [p.pid, process_started(p.pid)]
    p.wait()
    return entry


def test_the_first_front_end_starts_a_core_and_the_next_of_the_same_spec_joins_it(tmp_path):
    first = join(tmp_path, "spec-a", front_ends=2)
    assert (first.index, first.spawns, first.generation) == (0, True, 1)
    second = join(tmp_path, "spec-a", front_ends=2)
    assert (second.index, second.spawns, second.generation) == (1, False, 1)
    assert first.slots == second.slots == 2 * core_group.SLOTS_PER_FRONT_END
    inputs, outputs = first.addresses()
    assert len(set(inputs)) == len(set(outputs)) == first.slots and not set(inputs) & set(outputs)
    assert all(a.startswith(f"ipc://{tmp_path}/") for a in inputs)
    with locked(tmp_path) as state:
        assert state["used"] == [0, 1] and len(state["front_ends"]) == 2


def test_another_spec_waits_for_the_running_core_and_says_why(tmp_path):
    join(tmp_path, "spec-a", front_ends=1)
    with pytest.raises(TimeoutError, match="another model or run holds it"):
        join(tmp_path, "spec-b", front_ends=1, wait_s=1)


def test_a_closing_core_is_waited_for_before_the_next_one_starts(tmp_path):
    join(tmp_path, "spec-a", front_ends=1)
    with locked(tmp_path) as state:
        state["host"], state["closing"] = me(), True  # its host still runs (holds the GPU's memory)
    with pytest.raises(TimeoutError, match="the core there is closing"):
        join(tmp_path, "spec-a", front_ends=1, wait_s=1)


def test_a_group_whose_host_is_gone_starts_a_new_generation(tmp_path):
    join(tmp_path, "spec-a", front_ends=1)
    with locked(tmp_path) as state:
        state["host"] = _dead_process()
    again = join(tmp_path, "spec-a", front_ends=1, wait_s=1)
    assert (again.index, again.spawns, again.generation) == (0, True, 2)
    # process numbers are reused: a live process that is not the one recorded does not count as the host
    with locked(tmp_path) as state:
        state["host"] = [me()[0], me()[1] - 1000]
    assert join(tmp_path, "spec-a", front_ends=1, wait_s=1).generation == 3


def test_each_client_slot_is_used_once(tmp_path):
    slots = core_group.SLOTS_PER_FRONT_END
    members = [join(tmp_path, "spec-a", front_ends=1) for _ in range(slots)]
    assert [m.index for m in members] == list(range(slots))
    with pytest.raises(TimeoutError, match="no client slot left"):
        join(tmp_path, "spec-a", front_ends=1, wait_s=1)


def test_waiting_for_the_core_ends_with_its_pids_or_with_why_not(tmp_path):
    member = join(tmp_path, "spec-a", front_ends=1)
    with locked(tmp_path) as state:
        state["host"], state["core"] = me(), [me()]
    assert wait_for_core(member, timeout_s=1) == [me()]
    with locked(tmp_path) as state:
        state["core"], state["error"] = None, "ValueError: no such model"
    with pytest.raises(RuntimeError, match="did not start: ValueError: no such model"):
        wait_for_core(member, timeout_s=1)
    with locked(tmp_path) as state:
        state["error"], state["host"] = None, _dead_process()
    with pytest.raises(RuntimeError, match="gone before the core started"):
        wait_for_core(member, timeout_s=1)
    with locked(tmp_path) as state:
        state["host"] = me()
    with pytest.raises(TimeoutError, match="did not come up within 1 s"):
        wait_for_core(member, timeout_s=1)
    stale = Member(tmp_path, 0, member.slots, member.generation - 1, False)
    with pytest.raises(RuntimeError, match="replaced"):
        wait_for_core(stale, timeout_s=1)


def test_a_host_without_its_engine_arguments_gives_up_when_its_spawner_is_gone(tmp_path):
    """The host process itself, for real: its spawner died before handing over the engine arguments."""
    member = join(tmp_path, "spec-a", front_ends=1)
    with locked(tmp_path) as state:
        state["spawner"] = _dead_process()
    proc = subprocess.run(
        [sys.executable, "-m", "captionflow.workers.core_group", str(tmp_path), str(member.generation)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "never handed over its engine arguments" in proc.stderr
    with locked(tmp_path) as state:
        assert "never handed over" in state["error"] and state["closing"] and state["core"] is None
    with pytest.raises(RuntimeError, match="did not start: RuntimeError: the front end"):
        wait_for_core(member, timeout_s=1)
