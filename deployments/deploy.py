"""Create captionflow's Prefect deployments (what ``captionflow deploy`` runs).

Two deployments of the ``captionflow`` flow, both with every run parameter (a RunConfig field) as a default
(``enforce_parameter_schema``: the UI's Custom run form is the typed RunConfig, with titles and
descriptions) and a concurrency limit of 1 whose collision strategy is ENQUEUE: a run that arrives while
another runs waits for it. A run cannot hold that slot forever: preflight fails at once when the cluster
cannot place the engines, and a stage that goes ``stall_timeout_s`` without a result fails the run.

- ``golden-nightly``: a cron schedule (default 02:00 UTC) over the golden set with the configured
  model (point ``model`` at the "latest" checkpoint path or alias);
- ``on-checkpoint``: an event trigger on ``captionflow.checkpoint.created``; the event's
  ``payload.uri`` becomes the run's ``model`` parameter (every other parameter keeps the deployment's default).

Emit that event from a training script (``prefect event emit captionflow.checkpoint.created
--resource-id captionflow.checkpoint.<name> --payload '{"uri": "s3://.../step-2000"}'`` or
``prefect.events.emit_event``), or let ``captionflow watch`` emit it for stores that cannot call
webhooks.

With ``notify_block`` (a saved Prefect notification block, ``TYPE/NAME``), two automations send to it:
``captionflow: checkpoint regressed`` on each ``captionflow.checkpoint.regressed`` event (a run whose CIDEr fell
below the best comparable run's by more than ``regression_threshold``), and ``captionflow: automation failed``
when an action of any ``captionflow: ...`` automation fails (a checkpoint event that started no run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from captionflow.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = "flows/caption_flow.py:caption_flow"
EVENT = "captionflow.checkpoint.created"
REGRESSED_AUTOMATION = "captionflow: checkpoint regressed"
FAILED_AUTOMATION = "captionflow: automation failed"
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


def notification_block_id(slug: str):
    """The id of the saved notification block ``TYPE/NAME``; a clear error when there is none."""
    from prefect.blocks.core import Block
    from prefect.blocks.notifications import NotificationBlock

    from captionflow.preflight import OptionError

    if "/" not in slug:
        raise OptionError(
            f"notify_block: expected TYPE/NAME of a saved Prefect block (e.g. slack-webhook/team), got {slug!r}"
        )
    try:
        block = Block.load(slug)
    except ValueError as e:
        raise OptionError(f"notify_block: no saved Prefect block {slug!r} ({e})") from None
    if not isinstance(block, NotificationBlock):
        raise OptionError(f"notify_block: {slug!r} is a {type(block).__name__}, not a notification block")
    return block._block_document_id


def ensure_automations(block_id) -> dict[str, str]:
    """Create (or replace) the regression and automation-failure automations; returns {name: id}."""
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import EventTrigger, Posture

    from captionflow.regression import EVENT as REGRESSED

    wanted = {
        REGRESSED_AUTOMATION: (
            EventTrigger(
                expect={REGRESSED},
                match={"prefect.resource.id": "captionflow.checkpoint.*"},
                posture=Posture.Reactive,
                threshold=1,
            ),
            "captionflow: {{ event.payload.model }} regressed",
            "{{ event.payload.metric }} {{ event.payload.value }} is below the best comparable run's "
            "{{ event.payload.best_value }} ({{ event.payload.best_model }}) by {{ event.payload.relative_drop }} "
            "(threshold {{ event.payload.threshold }}). Run: {{ event.payload.run_dir }}",
        ),
        FAILED_AUTOMATION: (
            EventTrigger(
                expect={"prefect.automation.action.failed"},
                match={"prefect.resource.name": "captionflow: *"},
                posture=Posture.Reactive,
                threshold=1,
            ),
            "captionflow: an automation action failed",
            "{{ event.resource.name }}: {{ event.payload.reason }}",
        ),
    }
    ids = {}
    with get_client(sync_client=True) as client:
        for name, (trigger, subject, body) in wanted.items():
            for old in client.read_automations_by_name(name):
                client.delete_automation(old.id)
            auto = Automation(
                name=name,
                trigger=trigger,
                actions=[SendNotification(block_document_id=block_id, subject=subject, body=body)],
            ).create()
            ids[name] = str(auto.id)
    return ids


def deploy(
    base: RunConfig,
    work_pool: str = "captionflow",
    cron: str = NIGHTLY_CRON,
    pool_type: str = "process",
    image: str | None = None,
    notify_block: str | None = None,
) -> dict[str, str]:
    """Create or update both deployments (and with ``notify_block`` the two automations); returns
    {deployment or automation name: id}."""
    from prefect import flow as prefect_flow
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    block_id = notification_block_id(notify_block) if notify_block else None  # before anything is created
    ensure_work_pool(work_pool, pool_type)
    source = prefect_flow.from_source(source=str(ROOT), entrypoint=ENTRYPOINT)
    common: dict[str, Any] = {
        "work_pool_name": work_pool,
        "parameters": base.model_dump(mode="json"),
        "concurrency_limit": ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
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
    out = {k: str(v) for k, v in ids.items()}
    if block_id is not None:
        out.update(ensure_automations(block_id))
    return out
