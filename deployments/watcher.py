"""Checkpoint watcher: announce each new checkpoint under a storage prefix, exactly once.

For stores that cannot call webhooks: list ``prefix`` (local or ``s3://``), treat every folder
that holds a ``config.json`` as a checkpoint, and emit ``captionflow.checkpoint.created`` (payload
``{"uri": ...}``) for each one not announced before. What was announced is remembered in a JSON
file written atomically (default ``<prefix>/.captionflow-announced.json``), so reruns, overlapping
schedules and restarts announce nothing twice. A checkpoint is announced only once its
``config.json`` exists: write it last when saving.
"""

from __future__ import annotations

import json
import posixpath

from captionflow.fingerprint import digest
from captionflow.storage import Store
from deployments.deploy import EVENT

STATE_NAME = ".captionflow-announced.json"


def find_checkpoints(prefix: str) -> list[str]:
    store = Store(prefix)
    found = []
    for path in sorted(store.fs.find(store.root)):
        if posixpath.basename(path) == "config.json":
            folder = posixpath.dirname(path)
            found.append(folder if store.is_local else f"{store.protocol}://{folder}")
    return found


def watch_once(prefix: str, state: str | None = None) -> list[str]:
    """Emit one event per checkpoint not yet announced; returns the URIs announced now."""
    from prefect.events import emit_event

    store = Store(prefix)
    state_store, state_name = (
        (Store(posixpath.dirname(state)), posixpath.basename(state)) if state else (store, STATE_NAME)
    )
    announced: list[str] = json.loads(state_store.read_bytes(state_name)) if state_store.exists(state_name) else []
    new = [c for c in find_checkpoints(prefix) if c not in set(announced)]
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
            raise RuntimeError("Prefect events are not enabled: set PREFECT_API_URL to your Prefect server")
        announced.append(uri)
        state_store.write_json(announced, state_name)  # after each event: a crash re-announces nothing
    return new
