"""Create captionflow's Prefect deployments (what ``captionflow deploy`` runs).

Two deployments of the ``captionflow`` flow, both with every run parameter (a RunConfig field) as a default
(``enforce_parameter_schema``: the UI's Custom run form is the typed RunConfig, with titles and
descriptions) and a concurrency limit of 1, so two runs never write the same outputs at once:

- ``golden-nightly``: a cron schedule (default 02:00 UTC) over the golden set with the configured
  model (point ``model`` at the "latest" checkpoint path or alias);
- ``on-checkpoint``: an event trigger on ``captionflow.checkpoint.created``; the event's
  ``payload.uri`` becomes the run's ``model`` parameter (every other parameter keeps the deployment's default).

Emit that event from a training script (``prefect event emit captionflow.checkpoint.created
--resource-id captionflow.checkpoint.<name> --payload '{"uri": "s3://.../step-2000"}'`` or
``prefect.events.emit_event``), or let ``captionflow watch`` emit it for stores that cannot call
webhooks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from captionflow.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = "flows/caption_flow.py:caption_flow"
EVENT = "captionflow.checkpoint.created"
NIGHTLY_CRON = "0 2 * * *"


def checkpoint_trigger(base: RunConfig):
    """A deployment trigger: each checkpoint event starts a run with the event's URI as the model."""
    from prefect.events import DeploymentEventTrigger

    # the model only: every other parameter is the deployment's default (Prefect merges top-level parameters)
    params: dict[str, Any] = {"model": "{{ event.payload.uri }}"}
    return DeploymentEventTrigger(
        name="captionflow: new checkpoint",
        expect={EVENT},
        match={"prefect.resource.id": "captionflow.checkpoint.*"},
        parameters=params,
    )


def ensure_work_pool(name: str, pool_type: str = "process") -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type=pool_type))


def deploy(
    base: RunConfig,
    work_pool: str = "captionflow",
    cron: str = NIGHTLY_CRON,
    pool_type: str = "process",
    image: str | None = None,
) -> dict[str, str]:
    """Create or update both deployments; returns {deployment name: id}."""
    from prefect import flow as prefect_flow

    ensure_work_pool(work_pool, pool_type)
    source = prefect_flow.from_source(source=str(ROOT), entrypoint=ENTRYPOINT)
    common: dict[str, Any] = {
        "work_pool_name": work_pool,
        "parameters": base.model_dump(mode="json"),
        "concurrency_limit": 1,
        "enforce_parameter_schema": True,
        "build": False,
        "push": False,
        "print_next_steps": False,
        "tags": ["captionflow"],
    }
    if image:
        common["image"] = image
    ids = {
        "golden-nightly": source.deploy(
            name="golden-nightly",
            cron=cron,
            description="Nightly evaluation of the configured checkpoint on the golden set",
            **common,
        ),
        "on-checkpoint": source.deploy(
            name="on-checkpoint",
            triggers=[checkpoint_trigger(base)],
            description=f"Evaluate each checkpoint announced by a {EVENT} event",
            **common,
        ),
    }
    return {k: str(v) for k, v in ids.items()}
