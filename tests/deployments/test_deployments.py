"""Deployments and the checkpoint watcher against a real Prefect API server."""

from __future__ import annotations

import time
import uuid

import pytest

from captionflow.config import GROUPS, RunConfig


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
        # one run at a time on the pool, across both deployments (each deployment's own limit let them overlap)
        assert client.read_work_pool(nightly.work_pool_name).concurrency_limit == 1
        assert nightly.parameters["data"]["output"] == str(tmp_path / "out")
        schema = nightly.parameter_openapi_schema
        props, groups = schema["properties"], schema["definitions"]
        # the form is grouped: a parameter per group in GROUPS order, each a described box of its fields in
        # GROUPS order, every field of RunConfig once
        in_form = sorted(props, key=lambda k: props[k]["position"])
        assert in_form == [g.lower() for g in GROUPS]
        fields = {}
        for g, names in GROUPS.items():
            assert props[g.lower()]["$ref"] == f"#/definitions/{g}" and groups[g]["description"]
            assert list(groups[g]["properties"]) == list(names)
            fields.update(groups[g]["properties"])
        assert sorted(fields) == sorted(RunConfig.model_fields)
        assert "hub id" in fields["model"]["description"] and fields["device"]["enum"] == ["auto", "cpu", "gpu"]
        # every bound RunConfig has is in the form, and the server refuses a value outside it
        keywords = {"Ge": "minimum", "Le": "maximum", "Gt": "exclusiveMinimum", "Lt": "exclusiveMaximum"}
        for name, field in RunConfig.model_fields.items():
            for m in field.metadata:
                if type(m).__name__ in keywords:
                    assert keywords[type(m).__name__] in str(fields[name]), (name, fields[name])
        assert fields["max_tokens"]["minimum"] == 1 and fields["top_p"]["exclusiveMinimum"] == 0
        for bad in ({"max_tokens": 0}, {"top_p": 0}, {"seed": -1}, {"no_such_field": 1}):
            with pytest.raises(Exception, match="Validation failed|validation"):
                client.create_flow_run_from_deployment(nightly.id, parameters={"generation": bad})
        # a deadline that is neither a duration nor a time is refused by the server, not 1.5 s into the run
        assert "pattern" in str(fields["deadline"])
        for bad in ("8 hours", "tomorrow 6am"):
            with pytest.raises(Exception, match="Validation failed|validation"):
                client.create_flow_run_from_deployment(nightly.id, parameters={"reliability": {"deadline": bad}})
        for good in ("8h", "2026-11-29T06:00:00+00:00"):
            run = client.create_flow_run_from_deployment(nightly.id, parameters={"reliability": {"deadline": good}})
            client.delete_flow_run(run.id)
        on_ckpt = client.read_deployment(ids["on-checkpoint"])
        automations = client.read_resource_related_automations(f"prefect.deployment.{on_ckpt.id}")
        assert len(automations) == 1
        trig = automations[0].trigger
        assert EVENT in trig.expect
        action = automations[0].actions[0]
        assert action.parameters == {"model": {"model": "{{ event.payload.uri }}"}}  # the rest: the deployment's


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
    (prefix / "lora-step-500").mkdir()  # a LoRA adapter: its adapter_config.json, written after its weights
    (prefix / "lora-step-500" / "adapter_config.json").write_text("{}")
    assert watch_once(str(prefix)) == [str(prefix / "lora-step-500")]
    _flush_events()
    uris = set()
    with get_client(sync_client=True) as client:
        deadline = time.time() + 30
        while time.time() < deadline and len(uris) < 4:
            r = client.request(
                "POST",
                "/events/filter",
                json={"filter": {"event": {"name": ["captionflow.checkpoint.created"]}}, "limit": 50},
            )
            uris = {e["payload"]["uri"] for e in r.json()["events"] if str(prefix) in e["payload"].get("uri", "")}
            time.sleep(0.5)
    assert uris == {str(prefix / s) for s in ("step-1000", "step-2000", "step-3000-incomplete", "lora-step-500")}


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
            runs = [r for r in all_runs if r.parameters.get("model", {}).get("model") == uri]
            time.sleep(1)
    assert len(runs) == 1, "the checkpoint event did not create exactly one flow run"
    assert runs[0].parameters["model"]["model"] == uri
    assert runs[0].parameters["data"]["output"] == str(tmp_path / "out")  # the deployment's, kept


def test_a_custom_run_that_sets_one_field_keeps_the_deployments_others(prefect_api, tmp_path):
    """Prefect merges top-level parameters: a run that gives ``generation: {max_tokens: 16}`` replaces the
    deployment's whole generation group, and must still run with the deployment's prompt, dataset and output.
    The run is executed in this process by Prefect's own flow engine, as the deployment's run."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    from deployments.deploy import deploy
    from flows.parameters import with_config_parameters

    @flow(name="captionflow-config-probe")
    @with_config_parameters()
    def probe(config: RunConfig) -> dict:
        return config.model_dump(mode="json")

    base = RunConfig(
        output=str(tmp_path / "out"), dataset=str(tmp_path / "golden"), max_tokens=48, prompt="Name the colours."
    )
    ids = deploy(base, work_pool=f"pool-{uuid.uuid4().hex[:6]}")
    with get_client(sync_client=True) as client:
        given = {"generation": {"max_tokens": 16}}
        run = client.create_flow_run_from_deployment(uuid.UUID(ids["golden-nightly"]), parameters=given)
        run = client.read_flow_run(run.id)
    assert run.parameters["generation"] == {"max_tokens": 16}  # the server's merge: the group replaced
    assert run.parameters["data"]["output"] == str(tmp_path / "out")  # the groups it did not give: the deployment's
    config = run_flow(probe, flow_run=run, parameters=run.parameters)
    assert config == {**base.model_dump(mode="json"), "max_tokens": 16}  # every other field the deployment's
    # outside a deployment's run, a field left out is RunConfig's default
    assert probe(generation={"max_tokens": 16}) == {**RunConfig().model_dump(mode="json"), "max_tokens": 16}


def test_the_custom_run_form_in_a_browser_shows_a_box_per_group_with_its_fields(tmp_path):
    """The UI's Custom run page of a deployment, as a real chromium renders it from a real ``prefect server
    start`` (the test harness's server serves no UI): each group a titled box holding its fields (the flat form
    was one list of 56 "(Optional)" fields with no headers)."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.request

    from ports import free_port
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from deployments.deploy import deploy
    from tests.support.browser import FormLabels, rendered_dom

    ui = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "PREFECT_API_URL": f"{ui}/api"}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", ui.rsplit(":", 1)[1]],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{ui}/api/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, (tmp_path / "server.log").read_text()
                time.sleep(0.5)
        with temporary_settings({PREFECT_API_URL: f"{ui}/api"}):
            ids = deploy(RunConfig(output=str(tmp_path / "out")), work_pool=f"pool-{uuid.uuid4().hex[:6]}")
        dom = rendered_dom(f"{ui}/deployments/deployment/{ids['golden-nightly']}/run", tmp_path / "profile")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    expected = []  # (label, boxes around it): the parameters' own box holds the groups' boxes
    for g, names in GROUPS.items():
        expected.append((f"{g.lower()} (Optional)", 1))
        expected += [(f"{RunConfig.model_fields[n].title} (Optional)", 2) for n in names]
    assert FormLabels(dom).labels == expected
    assert "Where the images (and reference captions) come from" in dom  # the group's description under its name


def _event_of(client, resource_id: str, name: str, timeout_s: float = 60) -> dict:
    """The server's stored event ``name`` about ``resource_id`` (it persists events asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = {"filter": {"resource": {"id": [resource_id]}, "event": {"name": [name]}}, "limit": 1}
        found = client.request("POST", "/events/filter", json=body).json()["events"]
        if found or time.monotonic() > deadline:
            assert found, (resource_id, name)
            return found[0]
        time.sleep(0.5)


def test_deploy_installs_the_regression_and_failure_automations(prefect_api, tmp_path):
    import pytest
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client

    from captionflow.preflight import OptionError
    from deployments.deploy import (
        BACKSTOP_AUTOMATION,
        FAILED_AUTOMATION,
        REGRESSED_AUTOMATION,
        RUN_FAILED_AUTOMATION,
        RUN_FAILED_EVENTS,
        SLA_AUTOMATION,
        deploy,
    )
    from flows.watch import FINAL_STATES

    base = RunConfig(output=str(tmp_path / "out"), dataset="demo", deadline="8h")
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
            (REGRESSED_AUTOMATION, {"captionflow.checkpoint.regressed"}),
            (RUN_FAILED_AUTOMATION, RUN_FAILED_EVENTS),
            (FAILED_AUTOMATION, {"prefect.automation.action.failed"}),
            (SLA_AUTOMATION, {"captionflow.run.sla-at-risk"}),
            (BACKSTOP_AUTOMATION, {f"prefect.flow-run.{state}" for state in FINAL_STATES}),
        ):
            autos = client.read_automations_by_name(auto_name)
            assert len(autos) == 1 and str(autos[0].id) == ids[auto_name]
            assert autos[0].trigger.expect == expected
            assert autos[0].actions[0].type == "send-notification"
            assert autos[0].actions[0].block_document_id == block_id
        backstop = client.read_automations_by_name(BACKSTOP_AUTOMATION)[0].trigger
        # proactive: fires when a run that started with the deployments' 8 h deadline reached no final state 8 h
        # later (killed runs never report); a failed run did (flows/watch.py)
        assert backstop.posture == "Proactive" and backstop.after == {"captionflow.run.watched.28800"}
        assert backstop.within.total_seconds() == 8 * 3600 and backstop.for_each == {"prefect.resource.id"}
        dep = client.read_deployment(ids["golden-nightly"])
        assert dep.concurrency_options is not None and dep.concurrency_options.collision_strategy == "ENQUEUE"
        # the run-failure trigger covers the event the server emits when a captionflow run fails (it was not
        # notified at all), and not a finished run's
        from prefect.server.events.schemas.automations import EventTrigger as ServerTrigger
        from prefect.server.events.schemas.events import ReceivedEvent
        from prefect.states import Completed, Failed

        trigger = ServerTrigger.model_validate(
            client.read_automations_by_name(RUN_FAILED_AUTOMATION)[0].trigger.model_dump(mode="json")
        )
        covered = {}
        for name, state in (("failed", Failed(message="inference stalled")), ("completed", Completed())):
            run = client.create_flow_run_from_deployment(dep.id, name=f"{name}-{uuid.uuid4().hex[:4]}")
            client.set_flow_run_state(run.id, state, force=True)
            event = _event_of(client, f"prefect.flow-run.{run.id}", f"prefect.flow-run.{state.name}")
            covered[name] = trigger.covers(ReceivedEvent.model_validate(event))
        assert covered == {"failed": True, "completed": False}


def test_deploy_to_docker_and_kubernetes_pools_runs_the_image_without_a_host_path(prefect_api, tmp_path):
    import pytest
    from prefect.client.orchestration import get_client

    from captionflow.preflight import OptionError
    from deployments.deploy import deploy

    base = RunConfig(output="s3://bucket/out", dataset="s3://bucket/golden")
    for pool_type in ("docker", "kubernetes"):
        pool = f"{pool_type}-{uuid.uuid4().hex[:6]}"
        with pytest.raises(OptionError, match="--image"):
            deploy(base, work_pool=pool, pool_type=pool_type)
        ids = deploy(base, work_pool=pool, pool_type=pool_type, image="registry.example/captionflow:1.2")
        with get_client(sync_client=True) as client:
            wp = client.read_work_pool(pool)
            assert wp.type == pool_type
            props = wp.base_job_template["variables"]["properties"]
            assert "image" in props and "command" in props  # the worker type's real template
            for name in ("golden-nightly", "on-checkpoint"):
                d = client.read_deployment(ids[name])
                assert d.job_variables["image"] == "registry.example/captionflow:1.2"
                assert d.entrypoint == "flows.caption_flow.caption_flow" and not d.pull_steps and not d.path
                assert d.parameters["data"]["output"] == "s3://bucket/out"
        if pool_type == "kubernetes":
            pod = wp.base_job_template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
            assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"
            assert pod["containers"][0]["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
            assert {"gpu_limit", "shm_size", "namespace", "service_account_name"} <= set(props)
    with pytest.raises(OptionError, match="exists with type 'kubernetes'"):
        deploy(base, work_pool=pool, pool_type="docker", image="x:1")
    with pytest.raises(OptionError, match="process pool runs this checkout"):
        deploy(base, work_pool=f"p-{uuid.uuid4().hex[:6]}", pool_type="process", image="x:1")


def _snapshot(client, dep_id) -> dict:
    d = client.read_deployment(dep_id)
    (auto,) = client.read_resource_related_automations(f"prefect.deployment.{d.id}") or [None]
    return {
        "name": d.name,
        "description": d.description,
        "entrypoint": d.entrypoint,
        "pull_steps": d.pull_steps or [],
        "job_variables": d.job_variables,
        "parameters": d.parameters,
        "tags": d.tags,
        "enforce_parameter_schema": d.enforce_parameter_schema,
        "work_pool": d.work_pool_name,
        "concurrency": (d.global_concurrency_limit.limit, d.concurrency_options.collision_strategy.value),
        "crons": [(s.schedule.cron, s.schedule.timezone or "UTC") for s in d.schedules],
        "trigger": auto and (sorted(auto.trigger.expect), auto.trigger.match.model_dump(), auto.actions[0].parameters),
    }


def test_prefect_yaml_deploys_exactly_what_captionflow_deploy_creates(prefect_api, tmp_path):
    """One source of deployment truth: the prefect.yaml captionflow writes, deployed by `prefect deploy`,
    gives the same deployments as `captionflow deploy` through the API."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from deployments.deploy import deploy, prefect_yaml

    base = RunConfig(output="s3://bucket/out", dataset="s3://bucket/golden", max_tokens=48)
    pool, image = f"docker-{uuid.uuid4().hex[:6]}", "registry.example/captionflow:7"
    ids = deploy(base, work_pool=pool, pool_type="docker", image=image, cron="15 4 * * *")
    with get_client(sync_client=True) as client:
        by_api = {name: _snapshot(client, i) for name, i in ids.items()}
        for i in ids.values():
            client.delete_deployment(i)
    spec = tmp_path / "prefect.yaml"
    spec.write_text(prefect_yaml(base, pool, "15 4 * * *", pool_type="docker", image=image))
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", str(spec), "--all"],
        cwd=root,
        env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with get_client(sync_client=True) as client:
        by_yaml = {name: _snapshot(client, client.read_deployment_by_name(f"captionflow/{name}").id) for name in ids}
    assert by_yaml == by_api
    assert by_api["on-checkpoint"]["trigger"][2] == {"model": {"model": "{{ event.payload.uri }}"}}


def test_a_watcher_every_n_seconds_waits_out_an_api_outage_and_announces_after_it(prefect_api, tmp_path):
    """`captionflow watch --every N` exited for good on the first Prefect API outage (a server restart ended it).
    Here the API goes away behind a TCP gate while the watcher runs, a checkpoint lands meanwhile, and the API
    comes back: the watcher says why it waits, keeps going, and announces the checkpoint once the API answers."""
    import os
    import subprocess
    import sys
    import urllib.parse
    from pathlib import Path

    from prefect.settings import PREFECT_API_URL
    from tcp_gate import TcpGate

    api = urllib.parse.urlsplit(PREFECT_API_URL.value())
    gate = TcpGate((api.hostname, api.port)).open()
    prefix = tmp_path / "ckpts"
    (prefix / "step-0500").mkdir(parents=True)
    (prefix / "step-0500" / "config.json").write_text("{}")
    env = {**os.environ, "PREFECT_API_URL": api._replace(netloc=f"127.0.0.1:{gate.port}").geturl()}
    env["PYTHONUNBUFFERED"] = "1"
    log = tmp_path / "watch.log"
    root = Path(__file__).resolve().parents[2]
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "watch", str(prefix), "--every", "1"],
            cwd=root,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while f"announced {prefix / 'step-0500'}" not in log.read_text():  # a first pass with the API up
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        gate.close()  # the outage
        (prefix / "step-1000").mkdir()
        (prefix / "step-1000" / "config.json").write_text("{}")
        deadline = time.monotonic() + 120
        while log.read_text().count("trying again") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        gate.open()  # the API is back
        deadline = time.monotonic() + 180
        while f"announced {prefix / 'step-1000'}" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        gate.close()
    assert "does not answer" in log.read_text() or "Error" in log.read_text()  # it said why it waited
