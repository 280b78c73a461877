"""A run's deadline through a real Prefect API, Ray Data and vLLM on CPU: a run that cannot make it says so once,
while there is still time (the sla-at-risk event, which the automation `captionflow deploy --notify-block` installs
covers); a run that can is checked in tests/e2e/test_sequential_verdict.py (its summary's margin, no event)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

from processes import wait_engines_gone

from captionflow.builtin.synthetic import make_images

CLI = [sys.executable, "-m", "flows.cli"]
EVENT = "captionflow.run.sla-at-risk"


def _events(client, deadline_iso: str) -> list[dict]:
    body = {"filter": {"event": {"name": [EVENT]}}, "limit": 50}
    found = client.request("POST", "/events/filter", json=body).json()["events"]
    return [e for e in found if e["payload"].get("deadline") == deadline_iso]


def test_a_run_projected_past_its_deadline_emits_sla_at_risk_once_before_the_deadline(prefect_api, tmp_path):
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client
    from prefect.server.events.schemas.automations import EventTrigger as ServerTrigger
    from prefect.server.events.schemas.events import ReceivedEvent
    from prefect.settings import PREFECT_API_URL

    from deployments.deploy import SLA_AUTOMATION, ensure_automations

    # 800 images of 128 tokens each, one at a time: over 10 min of captioning on 2 cores, due in 3 min
    data = make_images(tmp_path / "set", 800, size=(48, 36))
    due = datetime.now(UTC) + timedelta(minutes=3)
    args = ["run", "--device", "cpu", "--dataset", str(data), "--output", str(tmp_path / "out"), "--batch-size", "1"]
    args += ["--max-concurrent-batches", "1", "--max-tokens", "128", "--ignore-eos", "--deadline", due.isoformat()]
    args += ["--deadline-margin-s", "0"]
    args += ["--warm-engines", "off"]
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    log = tmp_path / "run.log"
    started = time.time()
    out = open(log, "w")  # noqa: SIM115 - the run's output, read as it grows
    run = subprocess.Popen([*CLI, *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with get_client(sync_client=True) as client:
            while not (found := _events(client, due.isoformat())):
                assert run.poll() is None and datetime.now(UTC) < due + timedelta(minutes=2), log.read_text()[-3000:]
                time.sleep(2)
            time.sleep(8)  # the run goes on captioning, projected late all along: still one event
            found = _events(client, due.isoformat())
            assert run.poll() is None, log.read_text()[-3000:]
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # the run and its Ray, at once
        run.wait(timeout=60)
    # the engine core and its vLLM worker end with their engine actor (they lived on, ~1.3 GB, re-parented)
    wait_engines_gone(since=started, timeout_s=60)
    assert len(found) == 1, found
    event = found[0]
    p = event["payload"]
    assert datetime.fromisoformat(event["occurred"].replace("Z", "+00:00")) < due  # while there was time
    assert p["projected_late_s"] > 0 and p["rows_left"] > 0 and p["rows_per_s"] > 0 and "late" not in p["model"]
    assert event["resource"]["prefect.resource.id"].startswith("captionflow.run.")
    assert "projected" in log.read_text() and EVENT in log.read_text()  # the log line says so too
    # what captionflow deploy --notify-block installs covers this very event
    block_id = CustomWebhookNotificationBlock(name="team", url="http://127.0.0.1:9/hook").save(f"sla-{os.getpid()}")
    ensure_automations(block_id)
    with get_client(sync_client=True) as client:
        trigger = ServerTrigger.model_validate(
            client.read_automations_by_name(SLA_AUTOMATION)[0].trigger.model_dump(mode="json")
        )
    assert trigger.covers(ReceivedEvent.model_validate(event))
