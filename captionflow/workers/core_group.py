"""The front ends of one GPU and the engine core they share: their meeting place, and the process that hosts
the core.

A *group* is the set of engine-stage actors (front ends) on one GPU of one node (on CPU: one node). They meet
in a node-local folder (``state.json`` under ``state.lock``). The engine core does not live in any of them:
Ray Data stops idle actors once its inputs are handed out, and a core that was a front end's child would die
with it, under the others' feet. The first front end of a generation starts a *host*: a process of its own
session (no Ray worker's child) that loads the engine core (``compat/vllm_core.py``) with client slots for
the front ends, publishes where it listens, and stops it once no front end of the group has been alive for
``LINGER_S`` (so the next pass of the same run finds it still warm), or when the core dies.

A core is shared only by front ends of the same *spec* (the Ray job, the model and the engine arguments): a
front end of another spec, or of a core that is closing, waits until the host is gone before starting its
own - two cores never hold one GPU's memory at once. A slot is used once (the core's start-up message to a
slot is delivered once): a front end that comes back after a crash takes a fresh one; a group out of slots
waits for its core to close and starts a new one. Nothing waits forever: every wait has a deadline and says
what it waited for.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from captionflow.processes import alive, process_started
from captionflow.workers import worker_log

SLOTS_PER_FRONT_END = 4  # client slots per front end: passes of one run, and front ends that came back
LINGER_S = 20.0  # the host keeps the core this long after the group's last front end is gone
CORE_WAIT_S = 900.0  # how long a front end waits for a core (another's to close, then its own to start)
HOST_START_S = 120.0  # how long a host may take to say it runs once spawned


def say(msg: str) -> None:
    worker_log.say(f"shared engine core: {msg}")


def groups_root() -> Path:
    """Node-local folder of the groups (short: the IPC socket paths live in it too)."""
    return Path(tempfile.gettempdir()) / "cf-cores"


def _alive(entry: list | None) -> bool:
    """``entry`` is [pid, start time] (``processes``): that very process runs."""
    return bool(entry) and alive(*entry)


def me() -> list:
    return [os.getpid(), process_started(os.getpid())]


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[dict[str, Any]]:
    """The group's state, read and (if changed) written back under the group's lock."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "state.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = folder / "state.json"
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            state = {}
        before = json.dumps(state, sort_keys=True)
        yield state
        after = json.dumps(state, sort_keys=True)
        if after != before:
            tmp = folder / f"state.{os.getpid()}.tmp"
            tmp.write_text(after)
            os.replace(tmp, path)


def _host_running(state: dict[str, Any]) -> bool:
    """A host of the current generation runs, or is being started by a front end that is still alive."""
    if state.get("host"):
        return _alive(state["host"])
    spawner = state.get("spawner")
    return bool(spawner) and _alive(spawner) and time.time() - state.get("spawned_at", 0) < HOST_START_S


@dataclass
class Member:
    """A front end's place in its group: client ``index`` of the core of generation ``generation``."""

    folder: Path
    index: int
    slots: int
    generation: int
    spawns: bool  # this front end starts the host

    def addresses(self) -> tuple[list[str], list[str]]:
        with locked(self.folder) as state:
            return list(state["inputs"]), list(state["outputs"])


def join(folder: Path, spec: str, front_ends: int, wait_s: float = CORE_WAIT_S) -> Member:
    """Take a client slot of the group's core for ``spec``; the first front end of a new core is the one that
    spawns its host (``spawn_host``). Waits while another spec's core or a closing one holds the GPU."""
    slots = front_ends * SLOTS_PER_FRONT_END
    deadline = time.monotonic() + wait_s
    said = 0.0
    while True:
        with locked(folder) as state:
            running = _host_running(state)
            if running and state.get("spec") == spec and not state.get("closing"):
                free = [i for i in range(state["slots"]) if i not in state["used"]]
                if free:
                    state["used"].append(free[0])
                    state["front_ends"].append(me())
                    return Member(folder, free[0], state["slots"], state["generation"], False)
                why = "its core has no client slot left"
            elif not running:
                from captionflow.compat.vllm_core import ipc_addresses

                generation = int(state.get("generation", 0)) + 1
                addresses = ipc_addresses(slots, str(folder))
                state.clear()
                state.update(
                    generation=generation,
                    spec=spec,
                    slots=slots,
                    spawner=me(),
                    spawned_at=time.time(),
                    host=None,
                    core=None,
                    closing=False,
                    error=None,
                    inputs=list(addresses.inputs),
                    outputs=list(addresses.outputs),
                    used=[0],
                    front_ends=[me()],
                )
                return Member(folder, 0, slots, generation, True)
            else:
                why = "the core there is closing" if state.get("closing") else "another model or run holds it"
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {wait_s:.0f} s for the GPU's engine core in {folder}: {why}")
        if time.monotonic() - said > 30:
            say(f"waiting for {folder.name}: {why}")
            said = time.monotonic()
        time.sleep(0.5)


def spawn_host(member: Member) -> None:
    """Start the host of ``member``'s generation: a process of its own session, so that no Ray worker's exit
    takes it along; its output goes to this process's log. It imports vLLM while this front end does, then
    waits for the engine arguments (``hand_over``)."""
    cmd = [sys.executable, "-m", "captionflow.workers.core_group", str(member.folder), str(member.generation)]
    package_root = str(Path(__file__).resolve().parents[2])  # captionflow importable however this process found it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    # the shell backgrounds the host and exits: the host is nobody's child (a Ray worker kills its children)
    subprocess.run(
        ["/bin/sh", "-c", 'setsid "$@" </dev/null & exit 0', "sh", *cmd],
        check=True,
        stdin=subprocess.DEVNULL,
        env=env,
    )


def _args_file(folder: Path, generation: int) -> Path:
    return folder / f"engine-args-{generation}.pkl"


def hand_over(member: Member, engine_args) -> None:
    """Give the host the engine arguments (vLLM's ``AsyncEngineArgs``) to start the core with."""
    path = _args_file(member.folder, member.generation)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(engine_args))
    os.replace(tmp, path)


def wait_for_core(member: Member, timeout_s: float = CORE_WAIT_S) -> list[list]:
    """The core's processes ([pid, start time] each), once its host has started it."""
    deadline = time.monotonic() + timeout_s
    while True:
        with locked(member.folder) as state:
            if int(state.get("generation", 0)) != member.generation:
                raise RuntimeError("the shared engine core was replaced while this front end waited for it")
            if state.get("error"):
                raise RuntimeError(f"the shared engine core did not start: {state['error']}")
            if state.get("core"):
                return state["core"]
            if not _host_running(state):
                raise RuntimeError(
                    "the process hosting the shared engine core is gone before the core started (its output "
                    "is in the log of the front end that started it)"
                )
        if time.monotonic() > deadline:
            raise TimeoutError(f"the shared engine core did not come up within {timeout_s:.0f} s")
        time.sleep(0.5)


def watch_core(core: list[list], index: int, period_s: float = 1.0):
    """End this process as soon as the engine core it feeds is gone: its requests would otherwise wait forever.
    Ray then reports the actor's death, and the pass fails with it (committed rows stay)."""
    import threading

    def run() -> None:
        while all(_alive(c) for c in core):
            time.sleep(period_s)
        say(f"front end {index}: the engine core (pid {core[0][0]}) is gone; this front end exits")
        os._exit(70)

    t = threading.Thread(target=run, name="captionflow-core-watch", daemon=True)
    t.start()
    return t


# ---------------------------------------------------------------- the host process
def host(folder: Path, generation: int) -> int:
    """Load the core for the generation's slots, publish it, keep it while the group lives."""
    from captionflow.compat.vllm_core import CoreAddresses, core_pids, launch_core, preload

    with locked(folder) as state:
        if state.get("generation") != generation:
            return 0
        state["host"] = me()
        inputs, outputs, slots, spawner = state["inputs"], state["outputs"], state["slots"], state["spawner"]
    t0 = time.perf_counter()
    manager = None
    try:
        preload()  # while the front end that spawned this imports vLLM too, not after it

        args_file = _args_file(folder, generation)
        while not args_file.exists():
            if not _alive(spawner) or time.perf_counter() - t0 > CORE_WAIT_S:
                raise RuntimeError("the front end that started this host never handed over its engine arguments")
            time.sleep(0.2)
        engine_args = pickle.loads(args_file.read_bytes())
        manager = launch_core(engine_args, CoreAddresses(tuple(inputs), tuple(outputs)))
        core = [[p, process_started(p)] for p in core_pids(manager)]
        with locked(folder) as state:
            state["core"] = core
        say(f"started in {time.perf_counter() - t0:.1f} s (generation {generation}, {slots} client slots)")
        last_seen = time.monotonic()
        while all(_alive(c) for c in core):
            with locked(folder) as state:
                if any(_alive(f) for f in state.get("front_ends", [])):
                    last_seen = time.monotonic()
                elif time.monotonic() - last_seen > LINGER_S:
                    state["closing"] = True
                    break
            time.sleep(1.0)
        else:
            say(f"generation {generation}: the engine core died")
    except Exception as e:  # the front ends waiting for it say this
        with locked(folder) as state:
            if state.get("generation") == generation:
                state["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        if manager is not None:
            manager.shutdown()
        for addr in inputs + outputs:
            with contextlib.suppress(OSError):
                os.unlink(addr.removeprefix("ipc://"))
        with contextlib.suppress(OSError):
            _args_file(folder, generation).unlink()
        with locked(folder) as state:  # what it held is released: the next core may start
            if state.get("generation") == generation:
                state["closing"] = True
                state["core"] = None
    say(f"generation {generation} closed")
    return 0


if __name__ == "__main__":
    sys.exit(host(Path(sys.argv[1]), int(sys.argv[2])))
