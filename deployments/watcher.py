"""Checkpoint watcher: announce each new checkpoint under a storage prefix, exactly once.

For stores that cannot call webhooks: list ``prefix`` (local or ``s3://``), treat every folder that holds a
``config.json`` (or a LoRA adapter's ``adapter_config.json``) as a checkpoint, and emit
``captionflow.checkpoint.created`` (payload ``{"uri": ...}``) for each one not announced before. What was announced
is remembered in a JSON file written atomically (default ``<prefix>/.captionflow-announced.json``), so reruns,
overlapping schedules and restarts announce nothing twice. A checkpoint is announced only once that file exists:
write it last when saving.

Nothing is lost silently: the watcher refuses to run without a reachable Prefect API (without
``PREFECT_API_URL`` Prefect would send the events to a temporary in-process server, and no run would
ever start), and a checkpoint is recorded as announced only once the server has stored its event.
"""

from __future__ import annotations

import json
import posixpath

from captionflow.data.fingerprint import digest
from captionflow.data.storage import Store
from captionflow.errors import CaptionflowError
from deployments.deploy import EVENT

STATE_NAME = ".captionflow-announced.json"
CONFIRM_S = 60.0  # how long the server may take to store an event


class WatchError(CaptionflowError):
    """The watcher cannot announce checkpoints; what it says tells why, and nothing was recorded."""


def api_problem() -> str | None:
    """Why there is no Prefect API to talk to (None: ``PREFECT_API_URL`` is set and answers)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return (
            "PREFECT_API_URL is not set: the checkpoint events would go to a temporary in-process Prefect server "
            "and no run would ever start. Point it at your server (prefect config set PREFECT_API_URL=http://"
            "host:4200/api)"
        )
    with get_client(sync_client=True) as client:
        problem = client.api_healthcheck()
    return None if problem is None else f"the Prefect API at {url} does not answer ({problem})"


def require_api() -> None:
    """WatchError unless the Prefect API answers."""
    problem = api_problem()
    if problem:
        raise WatchError(f"{problem}; nothing was announced")


def stored_events(ids: list[str], timeout_s: float = CONFIRM_S) -> set[str]:
    """The ids among ``ids`` of events the server has stored, waiting up to ``timeout_s`` for all of them."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()  # sent, not only queued in this process
    found: set[str] = set()
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            r = client.request("POST", "/events/filter", json={"filter": {"id": {"id": ids}}, "limit": len(ids)})
            found = {e["id"] for e in r.json()["events"]}
            if found >= set(ids) or time.monotonic() > deadline:
                return found
            time.sleep(0.5)


# what makes a folder a checkpoint: a full one's config, or a LoRA adapter's (PEFT writes it after the weights)
MARKERS = ("config.json", "adapter_config.json")


def find_checkpoints(prefix: str) -> list[str]:
    store = Store(prefix)
    found = []
    for path in sorted(store.fs.find(store.root)):
        if posixpath.basename(path) in MARKERS:
            folder = posixpath.dirname(path)
            uri = folder if store.is_local else f"{store.protocol}://{folder}"
            if uri not in found:
                found.append(uri)
    return found


def watch_once(prefix: str, state: str | None = None) -> list[str]:
    """Emit one event per checkpoint not yet announced; returns the URIs announced now (the server stored
    their events). Raises WatchError without a reachable API or when the server did not store an event (the
    others are recorded; the next watch announces the rest)."""
    from prefect.events import emit_event

    require_api()
    store = Store(prefix)
    state_store, state_name = (
        (Store(posixpath.dirname(state)), posixpath.basename(state)) if state else (store, STATE_NAME)
    )
    announced: list[str] = json.loads(state_store.read_bytes(state_name)) if state_store.exists(state_name) else []
    new = [c for c in find_checkpoints(prefix) if c not in set(announced)]
    sent: dict[str, str] = {}
    for uri in new:
        event = emit_event(
            event=EVENT,
            resource={
                "prefect.resource.id": f"captionflow.checkpoint.{digest(uri)}",
                "prefect.resource.name": posixpath.basename(uri),
            },
            payload={"uri": uri},
        )
        if event is None:
            raise WatchError("Prefect events are not enabled in this process: set PREFECT_API_URL to your server")
        sent[str(event.id)] = uri
    if not sent:
        return []
    stored = stored_events(list(sent))
    done = [uri for i, uri in sent.items() if i in stored]
    state_store.write_json(announced + done, state_name)
    if len(done) < len(sent):
        missing = sorted(uri for i, uri in sent.items() if i not in stored)
        raise WatchError(
            f"the Prefect server did not store the events of {missing} within {CONFIRM_S:.0f} s: not recorded as "
            "announced; the next watch announces them again"
        )
    return done
