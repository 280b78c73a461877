"""Leases on parts of the output root: one writer at a time, on a local disk or an object store.

A lease on ``key`` is a file ``.leases/<key>/<n>.json`` created exclusively - ``O_EXCL`` on a local
disk, a conditional PUT (``If-None-Match: *``) on S3 and compatible stores - so that of two writers
racing for the same number exactly one wins. The holder is the writer of the highest-numbered lease
while its heartbeat (rewritten every ``ttl_s / 4`` by a thread) is fresh. A lease whose holder stopped
- a process killed on this host (its pid is gone), or no heartbeat for ``ttl_s`` - is taken over by
creating the next number; its old holder finds a higher number at its next ``check()`` and stops
(``LeaseLost``) instead of writing beside the new one. A writer that finds the lease held waits, says
what it waits for every minute, and gives up after ``wait_s`` naming the holder.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Optional

from captionflow.data.storage import Store
from captionflow.errors import CaptionflowError
from captionflow.processes import process_started

log = logging.getLogger("captionflow.data.lease")
LEASES = ".leases"
SETTLE_S = 0.5  # object stores: how long after writing a lease its token is read again (_still_mine)


class LeaseTimeout(CaptionflowError, TimeoutError):
    """The lease stayed held by another writer for longer than the wait allowed."""


class LeaseLost(CaptionflowError, RuntimeError):
    """Another writer took this lease over (this holder was presumed dead): stop writing."""


@dataclass
class Holder:
    owner: str  # who: a Prefect flow run, or a command
    host: str
    pid: int
    pid_started: float  # process start time: a pid reused by another process is not the holder
    since: float
    heartbeat: float
    ttl_s: float
    token: str

    def describe(self) -> str:
        return (
            f"{self.owner} (pid {self.pid} on {self.host}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))})"
        )


def _default_owner() -> str:
    try:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        if ctx and ctx.flow_run:
            return f"flow run {ctx.flow_run.name!r} ({ctx.flow_run.id})"
    except Exception:
        pass
    return "a captionflow process"


class Lease:
    """``with Lease(store, "runs/ds/model/gen", what="the run folder ..."):`` - see the module docstring."""

    def __init__(
        self,
        store: Store,
        key: str,
        what: str,
        ttl_s: float = 120.0,
        wait_s: float = 3600.0,
        owner: Optional[str] = None,
        poll_s: float = 2.0,
    ):
        self.store, self.key, self.what = store, key.strip("/"), what
        self.ttl_s, self.wait_s, self.poll_s = ttl_s, wait_s, poll_s
        self.owner = owner or _default_owner()
        self.number: Optional[int] = None
        self.holder: Optional[Holder] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------ storage
    def _dir(self) -> tuple[str, ...]:
        return (LEASES, *self.key.split("/"))

    def _numbers(self) -> list[int]:
        return sorted(
            int(p.rsplit("/", 1)[-1][:-5])
            for p in self.store.ls(*self._dir(), suffix=".json")
            if p.rsplit("/", 1)[-1][:-5].isdigit()
        )

    def _name(self, n: int) -> str:
        return f"{n:010d}.json"

    def _read(self, n: int) -> Optional[Holder]:
        try:
            return Holder(**json.loads(self.store.read_bytes(*self._dir(), self._name(n))))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):  # a half-written lease from a crashed writer: treat as stale
            return Holder("unknown", "", 0, 0.0, 0.0, 0.0, 0.0, "")

    def _write(self, n: int, holder: Holder, exclusive: bool) -> bool:
        data = json.dumps(asdict(holder)).encode()
        path = self.store.path(*self._dir(), self._name(n))
        if self.store.is_local:
            if not exclusive:
                self.store.write_bytes(data, *self._dir(), self._name(n))
                return True
            # written whole under a temporary name, then linked into place: link() fails if the name exists,
            # so of two writers one wins, and no reader ever sees a half-written lease
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                os.remove(tmp)
            return True
        if exclusive:
            try:
                self.store.fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
            return True
        self.store.fs.pipe_file(path, data)
        return True

    # ------------------------------------------------------------ holders
    def _alive(self, h: Holder) -> bool:
        if h.host == socket.gethostname() and h.pid:
            started = process_started(h.pid)
            if started is None or abs(started - h.pid_started) > 1.0:
                return False  # its process is gone (killed, crashed): no need to wait for the heartbeat
        return time.time() - h.heartbeat < h.ttl_s

    def _still_mine(self, n: int, me: Holder) -> bool:
        """Whether lease ``n`` just written is ``me``'s. A store whose conditional write is not atomic under
        contention (seen with a test S3 server: two writers' PUTs both succeed, the later one's content stays)
        lets two writers "win": each reads back its own token right after its write, so on an object store
        the token is read again once another writer's PUT in flight would have landed (``SETTLE_S``); only the
        one whose lease is there then holds it."""
        if getattr(self._read(n), "token", "") != me.token:
            return False
        if self.store.is_local:  # link() is atomic
            return True
        time.sleep(SETTLE_S)
        return getattr(self._read(n), "token", "") == me.token

    def acquire(self) -> Lease:
        t0 = time.monotonic()
        said = 0.0
        while True:
            numbers = self._numbers()
            top = numbers[-1] if numbers else 0
            current = self._read(top) if top else None
            if current is None or not self._alive(current):
                if current is not None:
                    log.warning(
                        "%s: taking over the lease of %s (no sign of life for %.0f s)",
                        self.what,
                        current.describe(),
                        time.time() - current.heartbeat,
                    )
                now = time.time()
                me = Holder(
                    owner=self.owner,
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    pid_started=process_started(os.getpid()) or 0.0,
                    since=now,
                    heartbeat=now,
                    ttl_s=self.ttl_s,
                    token=uuid.uuid4().hex,
                )
                if self._write(top + 1, me, exclusive=True) and self._still_mine(top + 1, me):
                    self.number, self.holder = top + 1, me
                    self._start_heartbeat()
                    self._forget_below(top + 1)
                    return self
                continue  # another writer took that number first: look again
            waited = time.monotonic() - t0
            if waited >= self.wait_s:
                raise LeaseTimeout(
                    f"{self.what} is held by {current.describe()}; waited {waited:.0f} s "
                    f"(lease files under {self.store.url(*self._dir())})"
                )
            if waited - said >= 60 or said == 0.0:
                log.warning("%s is held by %s: waiting (up to %.0f s)", self.what, current.describe(), self.wait_s)
                said = max(waited, 1e-9)
            time.sleep(self.poll_s)

    def check(self) -> None:
        """Raise LeaseLost if a newer lease exists (this holder was presumed dead and replaced)."""
        if self.number is None:
            raise LeaseLost(f"{self.what}: not held")
        newer = [n for n in self._numbers() if n > self.number]
        if newer:
            h = self._read(newer[-1])
            raise LeaseLost(
                f"{self.what}: taken over by {h.describe() if h else 'another writer'}; this run stops writing there"
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
        if self.number is not None:
            try:
                self.store.remove(*self._dir(), self._name(self.number))
            except Exception:  # an expired lease is harmless: the next writer takes it over
                pass
        self.number = None

    def _forget_below(self, n: int) -> None:
        for old in self._numbers():
            if old < n:
                try:
                    self.store.remove(*self._dir(), self._name(old))
                except Exception:
                    pass

    def _start_heartbeat(self) -> None:
        self._stop.clear()

        def beat() -> None:
            last_ok = time.time()
            while not self._stop.wait(self.ttl_s / 4):
                try:
                    self.holder.heartbeat = time.time()
                    if self.number is not None and max(self._numbers() or [0]) == self.number:
                        self._write(self.number, self.holder, exclusive=False)
                    last_ok = time.time()
                except Exception as e:  # a storage hiccup: the next beat tries again, and the run's log says so
                    silent = time.time() - last_ok
                    log.warning(
                        "%s: lease heartbeat failed (%s: %s); last renewed %.0f s ago, it lapses after %g s",
                        self.what,
                        type(e).__name__,
                        str(e)[:200],
                        silent,
                        self.ttl_s,
                    )

        self._thread = threading.Thread(target=beat, name="captionflow-lease", daemon=True)
        self._thread.start()

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
