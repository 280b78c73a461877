"""Create captionflow's Prefect deployments (what ``captionflow deploy`` runs).

Two deployments of the ``captionflow`` flow, both with every run parameter (a RunConfig field, in its group:
``flows/parameters.py``) as a default (``enforce_parameter_schema``: the UI's Custom run form is the typed
RunConfig, a box per group, with titles, descriptions and bounds) and a concurrency limit of 1 whose collision
strategy is ENQUEUE: a run that arrives while another runs waits for it. A run cannot hold that slot forever:
preflight fails at once when the cluster cannot place the engines, and a stage that goes ``stall_timeout_s``
without a result fails the run.

- ``golden-nightly``: a cron schedule (default 02:00 UTC) over the golden set with the configured
  model (point ``model`` at the "latest" checkpoint path or alias);
- ``on-checkpoint``: an event trigger on ``captionflow.checkpoint.created``; the event's
  ``payload.uri`` becomes the run's model (every other field keeps the deployment's value).

Emit that event from a training script (``prefect event emit captionflow.checkpoint.created
--resource-id captionflow.checkpoint.<name> --payload '{"uri": "s3://.../step-2000"}'`` or
``prefect.events.emit_event``), or let ``captionflow watch`` emit it for stores that cannot call
webhooks.

With ``notify_block`` (a saved Prefect notification block, ``TYPE/NAME``), three automations send to it:
``captionflow: checkpoint regressed`` on each ``captionflow.checkpoint.regressed`` event (a run whose CIDEr fell
below the best comparable run's by more than ``regression_threshold``), ``captionflow: run failed`` when a flow run
of captionflow's flows ends Failed, Crashed or TimedOut, and ``captionflow: automation failed`` when an action of
any ``captionflow: ...`` automation fails (a checkpoint event that started no run).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from captionflow.config import RunConfig
from flows.parameters import flow_parameters

ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = "flows/caption_flow.py:caption_flow"
EVENT = "captionflow.checkpoint.created"
REGRESSED_AUTOMATION = "captionflow: checkpoint regressed"
FAILED_AUTOMATION = "captionflow: automation failed"
RUN_FAILED_AUTOMATION = "captionflow: run failed"
SLA_AUTOMATION = "captionflow: run at risk of missing its deadline"
BACKSTOP_AUTOMATION = "captionflow: run not completed by its deadline"
FLOWS = ("captionflow", "captionflow-compare", "captionflow-compare-parallel", "captionflow-evaluate")
# the states in which a flow run ended without a result
RUN_FAILED_EVENTS = {"prefect.flow-run.Failed", "prefect.flow-run.Crashed", "prefect.flow-run.TimedOut"}
NIGHTLY_CRON = "0 2 * * *"


def checkpoint_trigger(base: RunConfig):
    """A deployment trigger: each checkpoint event starts a run with the event's URI as the model."""
    from prefect.events import DeploymentEventTrigger

    # the model only: every other field is the deployment's (flows/parameters.py: a field a run's group leaves
    # out takes the deployment's value)
    params: dict[str, Any] = {"model": {"model": "{{ event.payload.uri }}"}}
    return DeploymentEventTrigger(
        name="captionflow: new checkpoint",
        expect={EVENT},
        match={"prefect.resource.id": "captionflow.checkpoint.*"},
        parameters=params,
    )


POOL_TYPES = ("process", "docker", "kubernetes")


def base_job_template(pool_type: str) -> dict[str, Any]:
    """The worker type's own base job template (from its installed worker, else Prefect's bundled collection
    registry); for Kubernetes with captionflow's two additions: a GPU limit and a memory-backed ``/dev/shm``
    (Ray's object store and vLLM's workers need more than the container's 64 MiB default)."""
    from prefect.utilities.asyncutils import run_coro_as_sync
    from prefect.workers.utilities import get_default_base_job_template_for_infrastructure_type

    from captionflow.preflight import OptionError

    template = run_coro_as_sync(get_default_base_job_template_for_infrastructure_type(pool_type))
    if not template:
        raise OptionError(f"work pool type {pool_type!r}: Prefect knows no base job template for it")
    if pool_type == "kubernetes":
        props = template["variables"]["properties"]
        props["gpu_limit"] = {
            "title": "GPU limit",
            "description": "nvidia.com/gpu limit of the flow-run pod, e.g. '1' for a run that starts its own "
            "engines; leave empty when the run uses a Ray cluster's GPUs (ray_address)",
            "type": "string",
        }
        props["shm_size"] = {
            "title": "/dev/shm size",
            "description": "size of the memory-backed /dev/shm of the flow-run pod (Ray's object store)",
            "type": "string",
            "default": "8Gi",
        }
        pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        container["resources"]["limits"]["nvidia.com/gpu"] = "{{ gpu_limit }}"
        container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        pod["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "{{ shm_size }}"}}]
    return template


POOL_CONCURRENCY = 1  # flow runs at once on a pool: each run sizes its engines for the whole machine or GPU


def ensure_work_pool(name: str, pool_type: str = "process", concurrency: int | None = POOL_CONCURRENCY) -> None:
    """Create the pool with its type's real base job template and a limit of ``concurrency`` flow runs at once
    (None: none): each deployment's own limit of 1 let the nightly and an on-checkpoint run overlap on one worker,
    each sizing its engines for the whole GPU. A pool of that name and type gets the template (older captionflow
    created it without one) and the limit; a pool of another type is an error."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    from captionflow.preflight import OptionError

    template = base_job_template(pool_type)
    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(
                WorkPoolCreate(name=name, type=pool_type, base_job_template=template, concurrency_limit=concurrency)
            )
            return
        if pool.type != pool_type:
            raise OptionError(
                f"work pool {name!r} exists with type {pool.type!r}, not {pool_type!r}: "
                "name another pool (--work-pool) or delete that one"
            )
        update: dict[str, Any] = {}
        if not pool.base_job_template.get("variables", {}).get("properties"):
            update["base_job_template"] = template
        if pool.concurrency_limit != concurrency:
            update["concurrency_limit"] = concurrency
        if update:
            client.update_work_pool(name, WorkPoolUpdate(**update))


def check_block_slug(slug: str) -> None:
    from captionflow.preflight import OptionError

    if "/" not in slug:
        raise OptionError(
            f"notify_block: expected TYPE/NAME of a saved Prefect block (e.g. slack-webhook/team), got {slug!r}"
        )


def require_server() -> None:
    """A Prefect server to deploy to: without ``PREFECT_API_URL`` Prefect starts a temporary one for the command,
    which takes the deployments and ends with it (``captionflow deploy`` said it had deployed, exit 0)."""
    from prefect.settings import get_current_settings

    from captionflow.preflight import OptionError

    if not get_current_settings().api.url:
        raise OptionError(
            "deploy needs a Prefect server: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api after `prefect "
            "server start`); without one the deployments would go to a temporary server that ends with this command"
        )


def notification_block_id(slug: str):
    """The id of the saved notification block ``TYPE/NAME``; a clear error when there is none."""
    from prefect.blocks.core import Block
    from prefect.blocks.notifications import NotificationBlock

    from captionflow.preflight import OptionError

    check_block_slug(slug)
    try:
        block = Block.load(slug)
    except ValueError as e:
        raise OptionError(f"notify_block: no saved Prefect block {slug!r} ({e})") from None
    if not isinstance(block, NotificationBlock):
        raise OptionError(f"notify_block: {slug!r} is a {type(block).__name__}, not a notification block")
    return block._block_document_id


def ensure_automations(block_id, deadline: str | None = None) -> dict[str, str]:
    """Create (or replace) the regression, run-failure, deadline and automation-failure automations; returns
    {name: id}. ``deadline``: the deployments' default deadline; as a duration it also gets a backstop, a proactive
    automation that notifies when a run that started with that deadline (``flows/watch.py``) reached no final state
    within it - for runs that never report (killed, lost with their node), whose sla-at-risk event never comes. A
    run that failed reached one: only the failure's alert."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.orchestration import get_client
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import EventTrigger, Posture

    from captionflow.deadline import EVENT as AT_RISK
    from captionflow.deadline import duration_s
    from captionflow.evaluation.regression import EVENT as REGRESSED
    from flows.watch import FINAL_STATES, watched_event

    def on(expect: set[str], resource: dict, related: dict | None = None) -> EventTrigger:
        """Fires on each event of ``expect`` whose resource matches ``resource`` (and a related one ``related``)."""
        return EventTrigger(
            expect=expect, match=resource, match_related=related or {}, posture=Posture.Reactive, threshold=1
        )

    flows = {"prefect.resource.role": "flow", "prefect.resource.name": list(FLOWS)}
    wanted = {
        REGRESSED_AUTOMATION: (
            on({REGRESSED}, {"prefect.resource.id": "captionflow.checkpoint.*"}),
            "captionflow: {{ event.payload.model }} regressed",
            "{{ event.payload.metric }} {{ event.payload.value | round(4) }} is below the best comparable run's "
            "{{ event.payload.best_value | round(4) }} ({{ event.payload.best_model }}) by "
            "{{ (100 * event.payload.relative_drop) | round(1) }}% (threshold "
            "{{ (100 * event.payload.threshold) | round(1) }}%). Run: {{ event.payload.run_dir }}",
        ),
        RUN_FAILED_AUTOMATION: (
            on(RUN_FAILED_EVENTS, {"prefect.resource.id": "prefect.flow-run.*"}, flows),
            "captionflow: {{ flow.name }} run {{ flow_run.name }} {{ flow_run.state.name }}",
            "Flow run {{ flow_run.name }} of {% if deployment and deployment.name %}the deployment "
            "{{ deployment.name }}{% else %}{{ flow.name }} (no deployment){% endif %} ended "
            "{{ flow_run.state.name }}: {{ flow_run.state.message }}",
        ),
        SLA_AUTOMATION: (
            on({AT_RISK}, {"prefect.resource.id": "captionflow.run.*"}),
            "captionflow: {{ event.resource.name }} is projected {{ event.payload.projected_late }} late",
            "{{ event.payload.model }}: deadline {{ event.payload.deadline }}, projected "
            "{{ event.payload.projected_late }} late{% if event.payload.rows_per_s %} at "
            "{{ event.payload.rows_per_s }} rows/s with {{ event.payload.rows_left }} rows left. "
            "Run: {{ event.payload.run_dir }}{% else %}: the deadline passed {{ event.payload.stage }}.{% endif %}",
        ),
        FAILED_AUTOMATION: (
            on({"prefect.automation.action.failed"}, {"prefect.resource.name": "captionflow: *"}),
            "captionflow: an automation action failed",
            "{{ event.resource.name }}: {{ event.payload.reason }}",
        ),
    }
    watched = watched_event(deadline)
    if watched:
        wanted[BACKSTOP_AUTOMATION] = (
            EventTrigger(
                after={watched},
                expect={f"prefect.flow-run.{state}" for state in FINAL_STATES},
                for_each={"prefect.resource.id"},
                match={"prefect.resource.id": "prefect.flow-run.*"},
                posture=Posture.Proactive,
                threshold=1,
                within=timedelta(seconds=duration_s(deadline)),
            ),
            "captionflow: run {{ flow_run.name }} is not Completed by its deadline",
            f"Flow run {{{{ flow_run.name }}}} of {{{{ flow.name }}}} started {deadline} ago with the deployments' "
            "deadline and has not ended: it is late, or its process is gone. Its state in Prefect now: "
            "{{ flow_run.state.name }}.",
        )
    ids = {}
    with get_client(sync_client=True) as client:
        for name in (SLA_AUTOMATION, BACKSTOP_AUTOMATION):  # a deadline no longer given: its backstop goes
            if name not in wanted:
                for old in client.read_automations_by_name(name):
                    client.delete_automation(old.id)
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


def results_env(output: str, save: bool = False) -> dict[str, str]:
    """The worker-side environment that sends a flow run's own persisted result (the run summary) under
    ``output`` (``.prefect-cache``, beside the stages' results) instead of the worker's PREFECT_HOME, lost with a
    container or a pod: a local root by its path; an object store by the filesystem block that
    ``tasks/results.result_storage`` saves under its name (saved here with ``save``: a run on that server loads it
    when it starts, before its own stages save it)."""
    from captionflow.data.fingerprint import digest
    from captionflow.data.layout import RESULTS_CACHE
    from captionflow.data.storage import Store

    store = Store(output)
    if store.is_local:
        return {"PREFECT_LOCAL_STORAGE_PATH": store.path(RESULTS_CACHE)}
    if save:
        from tasks.results import result_storage

        result_storage(output)
    return {"PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": f"remote-file-system/captionflow-results-{digest(store.url())}"}


def runner_deployments(
    base: RunConfig, work_pool: str, cron: str = NIGHTLY_CRON, pool_type: str = "process", image: str | None = None
) -> list:
    """The two deployments as Prefect ``RunnerDeployment`` objects, not yet applied: what ``deploy`` creates
    and what ``prefect_yaml`` writes.

    A ``process`` pool runs the flow from this checkout (its path is the deployment's working directory);
    ``docker`` and ``kubernetes`` pools run ``image`` (required), which carries the code: the flow is imported
    from the installed package, with no host path and no pull step."""
    from prefect import flow as prefect_flow
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.deployments.runner import EntrypointType

    from captionflow.preflight import OptionError

    if pool_type not in POOL_TYPES:
        raise OptionError(f"pool_type: expected one of {', '.join(POOL_TYPES)}, got {pool_type!r}")
    if pool_type == "process" and image:
        raise OptionError("--image is for docker and kubernetes pools: a process pool runs this checkout")
    if pool_type != "process" and not image:
        raise OptionError(
            f"a {pool_type} pool runs the flow in a container: pass --image (docs/operations.md says how to build it)"
        )
    # the flow's own persisted result (the run summary) under the output root, beside the stages' results, not in
    # the worker's PREFECT_HOME (lost with a container or a pod)
    env = results_env(base.output)
    common: dict[str, Any] = {
        "parameters": flow_parameters(base),
        "concurrency_limit": ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
        "enforce_parameter_schema": True,
        "tags": ["captionflow"],
        "work_pool_name": work_pool,
    }
    if image:
        from flows.caption_flow import caption_flow

        def to_deployment(**kw):
            return caption_flow.to_deployment(
                entrypoint_type=EntrypointType.MODULE_PATH, job_variables={"image": image, "env": env}, **kw, **common
            )
    else:
        source = prefect_flow.from_source(source=str(ROOT), entrypoint=ENTRYPOINT)

        def to_deployment(**kw):
            return source.to_deployment(job_variables={"env": env}, **kw, **common)

    return [
        to_deployment(
            name="golden-nightly",
            cron=cron,
            description="Nightly evaluation of the configured checkpoint on the golden set",
        ),
        to_deployment(
            name="on-checkpoint",
            triggers=[checkpoint_trigger(base)],
            description=f"Evaluate each checkpoint announced by a {EVENT} event",
        ),
    ]


def prefect_yaml(
    base: RunConfig, work_pool: str, cron: str = NIGHTLY_CRON, pool_type: str = "process", image: str | None = None
) -> str:
    """``prefect.yaml`` for ``prefect deploy --all``: the deployments ``deploy`` would create, field for field
    (``captionflow deploy --prefect-yaml FILE`` writes it; the pool must exist: ``captionflow deploy`` or
    ``prefect work-pool create`` makes it; so must, for an object-store output, the results block its runs load:
    ``captionflow deploy`` saves it, ``results_env``)."""
    import prefect
    import yaml

    entries = []
    for d in runner_deployments(base, work_pool, cron, pool_type, image):
        entry: dict[str, Any] = {
            "name": d.name,
            "description": d.description,
            "entrypoint": d.entrypoint,
            "tags": d.tags,
            "parameters": copy.deepcopy(d.parameters),  # no YAML anchors between the two
            "enforce_parameter_schema": d.enforce_parameter_schema,
            "concurrency_limit": {
                "limit": d.concurrency_limit,
                "collision_strategy": d.concurrency_options.collision_strategy.value,
            },
        }
        if d.schedules:
            entry["schedules"] = [{"cron": sch.schedule.cron, "timezone": "UTC"} for sch in d.schedules]
        if d.triggers:
            entry["triggers"] = [
                {"type": "event", "enabled": True, **t.model_dump(mode="json", exclude_unset=True)} for t in d.triggers
            ]
        entry["pull"] = [d.storage.to_pull_step()] if d.storage else []
        entry["work_pool"] = {"name": work_pool, "work_queue_name": "default"}
        if d.job_variables:
            entry["work_pool"]["job_variables"] = copy.deepcopy(d.job_variables)  # no YAML anchors
        entries.append(entry)
    head = (
        "# Generated by `captionflow deploy --prefect-yaml` from the same code that creates the deployments through\n"
        "# the API: edit the options there and regenerate rather than editing this file. Deploy with\n"
        "#   prefect deploy --prefect-file THIS_FILE --all\n"
        "# (the work pool must exist: `captionflow deploy` creates it with its base job template)\n"
    )
    body = {"name": "captionflow", "prefect-version": prefect.__version__, "deployments": entries}
    return head + yaml.safe_dump(body, sort_keys=False, width=120)


def deploy(
    base: RunConfig,
    work_pool: str = "captionflow",
    cron: str = NIGHTLY_CRON,
    pool_type: str = "process",
    image: str | None = None,
    notify_block: str | None = None,
    pool_concurrency: int | None = POOL_CONCURRENCY,
) -> dict[str, str]:
    """Create or update the pool (with its type's base job template and ``pool_concurrency`` runs at once), both
    deployments and, with ``notify_block``, the two automations; returns {deployment or automation name: id}."""
    from prefect.deployments.runner import deploy as prefect_deploy

    deployments = runner_deployments(base, work_pool, cron, pool_type, image)  # checks the options first
    if notify_block:
        check_block_slug(notify_block)
    require_server()
    block_id = notification_block_id(notify_block) if notify_block else None  # before anything is created
    ensure_work_pool(work_pool, pool_type, pool_concurrency)
    results_env(base.output, save=True)  # an object store's results block exists before the first run loads it
    ids = prefect_deploy(
        *deployments, work_pool_name=work_pool, image=image, build=False, push=False, print_next_steps_message=False
    )
    out = {d.name: str(i) for d, i in zip(deployments, ids)}
    if block_id is not None:
        out.update(ensure_automations(block_id, base.deadline))
    return out
