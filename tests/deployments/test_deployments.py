"""Deployments and the checkpoint watcher against a real Prefect API server."""

from __future__ import annotations

import time
import uuid

from captionflow.config import RunConfig


def _flush_events():
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()


def test_deploy_creates_schedule_trigger_and_typed_form(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client

    from deployments.deploy import EVENT, deploy

    base = RunConfig(output=str(tmp_path / "out"), dataset="demo")
    ids = deploy(base, work_pool=f"pool-{uuid.uuid4().hex[:6]}", cron="0 3 * * *")
    with get_client(sync_client=True) as client:
        nightly = client.read_deployment(ids["golden-nightly"])
        assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"]
        assert nightly.enforce_parameter_schema
        assert nightly.global_concurrency_limit is not None and nightly.global_concurrency_limit.limit == 1
        assert nightly.parameters["output"] == str(tmp_path / "out")
        props = nightly.parameter_openapi_schema["properties"]
        assert set(props) == set(RunConfig.model_fields)  # one parameter per field, each described
        assert all(p.get("description") for p in props.values())
        assert "hub id" in props["model"]["description"] and props["device"]["enum"] == ["auto", "cpu", "gpu"]
        on_ckpt = client.read_deployment(ids["on-checkpoint"])
        automations = client.read_resource_related_automations(f"prefect.deployment.{on_ckpt.id}")
        assert len(automations) == 1
        trig = automations[0].trigger
        assert EVENT in trig.expect
        action = automations[0].actions[0]
        assert action.parameters == {"model": "{{ event.payload.uri }}"}  # the rest: the deployment's


def test_watcher_announces_each_checkpoint_once(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client

    from deployments.watcher import watch_once

    prefix = tmp_path / "ckpts"
    for step in ("step-1000", "step-2000"):
        (prefix / step).mkdir(parents=True)
        (prefix / step / "config.json").write_text("{}")
    (prefix / "step-3000-incomplete").mkdir()  # no config.json yet: not a checkpoint
    first = watch_once(str(prefix))
    assert sorted(first) == [str(prefix / "step-1000"), str(prefix / "step-2000")]
    assert watch_once(str(prefix)) == []
    (prefix / "step-3000-incomplete" / "config.json").write_text("{}")
    assert watch_once(str(prefix)) == [str(prefix / "step-3000-incomplete")]
    _flush_events()
    uris = set()
    with get_client(sync_client=True) as client:
        deadline = time.time() + 30
        while time.time() < deadline and len(uris) < 3:
            r = client.request(
                "POST",
                "/events/filter",
                json={"filter": {"event": {"name": ["captionflow.checkpoint.created"]}}, "limit": 50},
            )
            uris = {e["payload"]["uri"] for e in r.json()["events"] if str(prefix) in e["payload"].get("uri", "")}
            time.sleep(0.5)
    assert uris == {str(prefix / s) for s in ("step-1000", "step-2000", "step-3000-incomplete")}


def test_checkpoint_event_starts_a_run_with_that_model(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.events import emit_event

    from deployments.deploy import EVENT, deploy

    ids = deploy(RunConfig(output=str(tmp_path / "out")), work_pool=f"pool-{uuid.uuid4().hex[:6]}")
    uri = str(tmp_path / "checkpoints" / "step-4000")
    time.sleep(2)  # let the server load the new automation
    emit_event(event=EVENT, resource={"prefect.resource.id": "captionflow.checkpoint.step-4000"}, payload={"uri": uri})
    _flush_events()
    runs = []
    with get_client(sync_client=True) as client:
        deadline = time.time() + 60
        while time.time() < deadline and not runs:
            all_runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[uuid.UUID(ids["on-checkpoint"])]))
            )
            runs = [r for r in all_runs if r.parameters.get("model") == uri]
            time.sleep(1)
    assert len(runs) == 1, "the checkpoint event did not create exactly one flow run"
    assert runs[0].parameters["model"] == uri
    assert runs[0].parameters["output"] == str(tmp_path / "out")  # the deployment's, kept


def test_a_custom_run_that_sets_one_parameter_keeps_the_deployments_others(prefect_api, tmp_path):
    """Prefect merges top-level parameters: setting max_tokens alone must not drop the deployment's dataset,
    model or output (it did with one nested config parameter)."""
    from prefect.client.orchestration import get_client

    from deployments.deploy import deploy

    base = RunConfig(output=str(tmp_path / "out"), dataset=str(tmp_path / "golden"), max_tokens=48)
    ids = deploy(base, work_pool=f"pool-{uuid.uuid4().hex[:6]}")
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(uuid.UUID(ids["golden-nightly"]), parameters={"max_tokens": 16})
        params = client.read_flow_run(run.id).parameters
    assert params["max_tokens"] == 16
    assert params["output"] == str(tmp_path / "out") and params["dataset"] == str(tmp_path / "golden")
    assert RunConfig(**params).model == base.model


def test_deploy_installs_the_regression_and_failure_automations(prefect_api, tmp_path):
    import pytest
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client

    from captionflow.preflight import OptionError
    from deployments.deploy import FAILED_AUTOMATION, REGRESSED_AUTOMATION, deploy

    base = RunConfig(output=str(tmp_path / "out"), dataset="demo")
    pool = f"pool-{uuid.uuid4().hex[:6]}"
    with pytest.raises(OptionError, match="no saved Prefect block 'custom-webhook/nobody'"):
        deploy(base, work_pool=pool, notify_block="custom-webhook/nobody")  # refused before anything is created
    with get_client(sync_client=True) as client:
        assert not [p for p in client.read_work_pools() if p.name == pool]
    name = f"team-{uuid.uuid4().hex[:6]}"
    block_id = CustomWebhookNotificationBlock(name="team", url="http://127.0.0.1:9/hook").save(name)
    for _ in range(2):  # deploying again replaces them, never duplicates
        ids = deploy(base, work_pool=pool, notify_block=f"custom-webhook/{name}")
    with get_client(sync_client=True) as client:
        for auto_name, expected in (
            (REGRESSED_AUTOMATION, "captionflow.checkpoint.regressed"),
            (FAILED_AUTOMATION, "prefect.automation.action.failed"),
        ):
            autos = client.read_automations_by_name(auto_name)
            assert len(autos) == 1 and str(autos[0].id) == ids[auto_name]
            assert autos[0].trigger.expect == {expected}
            assert autos[0].actions[0].type == "send-notification"
            assert autos[0].actions[0].block_document_id == block_id
        dep = client.read_deployment(ids["golden-nightly"])
        assert dep.concurrency_options is not None and dep.concurrency_options.collision_strategy == "ENQUEUE"
