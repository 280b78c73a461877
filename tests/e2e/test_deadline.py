"""A run's deadline through a real Prefect API, Ray Data and vLLM on CPU: a run that cannot make it says so once,
while there is still time (the sla-at-risk event), and the automations `captionflow deploy --notify-block` installs
deliver it through a real webhook block. Beside it, a run with the deployments' deadline killed with kill -9 soon
after it starts never reports again, and the backstop automation says so, once, when that deadline passes; a run
with the same deadline that failed gets one alert, its failure's, and none from the backstop. A run that can make
its deadline is checked in tests/e2e/test_sequential_verdict.py (its summary's margin, no event)."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from processes import wait_engines_gone

from captionflow.builtin.synthetic import make_images

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "flows.cli"]
EVENT = "captionflow.run.sla-at-risk"


def _events(client, deadline_iso: str) -> list[dict]:
    body = {"filter": {"event": {"name": [EVENT]}}, "limit": 50}
    found = client.request("POST", "/events/filter", json=body).json()["events"]
    return [e for e in found if e["payload"].get("deadline") == deadline_iso]


BACKSTOP_S = 60  # the deployments' deadline: the backstop fires this long after a run with it starts


def _watched(client, run_name: str) -> list[dict]:
    body = {"filter": {"event": {"prefix": ["captionflow.run.watched."]}}, "limit": 50}
    found = client.request("POST", "/events/filter", json=body).json()["events"]
    return [e for e in found if e["resource"].get("prefect.resource.name") == run_name]


class _Hook(http.server.BaseHTTPRequestHandler):
    """A webhook receiver: what each notification POSTs."""

    got: list[str] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).got.append(json.loads(body)["text"])
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def _delivered(text: str, timeout_s: float, log) -> str:
    deadline = time.time() + timeout_s
    while not (found := [t for t in _Hook.got if text in t]):
        assert time.time() < deadline, f"no notification with {text!r}; got {_Hook.got}; run log: {log()[-2000:]}"
        time.sleep(2)
    return found[0]


def test_a_run_projected_past_its_deadline_emits_sla_at_risk_once_and_the_backstop_sees_a_killed_one(
    prefect_api, tmp_path
):
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from deployments.deploy import ensure_automations

    hook = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{hook.server_address[1]}/hook"
    block = CustomWebhookNotificationBlock(name="team", url=url, json_data={"text": "{{subject}}\n{{body}}"})
    automations = ensure_automations(block.save(f"sla-{os.getpid()}"), deadline=f"{BACKSTOP_S}s")

    # 1,600 images of 128 tokens each, one at a time: over 20 min of captioning on 2 cores, due in 6 min (in 3 min,
    # a run beside other tests on a busy machine had not captioned enough to project its end before the deadline)
    data = make_images(tmp_path / "set", 1600, size=(48, 36))
    due = datetime.now(UTC) + timedelta(minutes=6)
    args = ["run", "--device", "cpu", "--dataset", str(data), "--output", str(tmp_path / "out"), "--batch-size", "1"]
    args += ["--max-concurrent-batches", "1", "--max-tokens", "128", "--ignore-eos", "--deadline", due.isoformat()]
    args += ["--deadline-margin-s", "0"]
    args += ["--warm-engines", "off"]
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    log = tmp_path / "run.log"
    started = time.time()
    out = open(log, "w")  # noqa: SIM115 - the run's output, read as it grows
    run = subprocess.Popen([*CLI, *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    # the other run: the deployments' deadline, killed with kill -9 once Running, before that deadline
    killed_log = tmp_path / "killed.log"
    other = ["run", "--device", "cpu", "--dataset", str(data), "--output", str(tmp_path / "other"), "--no-judge"]
    other += ["--deadline", f"{BACKSTOP_S}s"]
    with open(killed_log, "w") as sink:
        killed = subprocess.Popen(
            [*CLI, *other], env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    # a third: the same deadline, a dataset none of whose inputs is an image: it fails within seconds
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jpg").write_text("not an image")
    failed_log = tmp_path / "failed.log"
    failing = ["run", "--device", "cpu", "--dataset", str(bad), "--output", str(tmp_path / "failed")]
    with open(failed_log, "w") as sink:
        failed = subprocess.Popen(
            [*CLI, *failing, "--deadline", f"{BACKSTOP_S}s"], env=env, stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        while not (name := re.search(r"Beginning flow run '([^']+)'", killed_log.read_text())):
            assert killed.poll() is None and time.time() < started + BACKSTOP_S / 2, killed_log.read_text()[-3000:]
            time.sleep(0.5)
        with get_client(sync_client=True) as client:  # it says it is watched (flows/watch.py) as it starts
            while not _watched(client, name.group(1)):
                assert killed.poll() is None and time.time() < started + BACKSTOP_S / 2, killed_log.read_text()[-3000:]
                time.sleep(0.5)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
        killed_after_s = time.time() - started
        with get_client(sync_client=True) as client:
            while not (found := _events(client, due.isoformat())):
                assert run.poll() is None and datetime.now(UTC) < due + timedelta(minutes=2), log.read_text()[-3000:]
                time.sleep(2)
            time.sleep(8)  # the run goes on captioning, projected late all along: still one event
            found = _events(client, due.isoformat())
            assert run.poll() is None, log.read_text()[-3000:]
        os.killpg(run.pid, signal.SIGKILL)  # the run and its Ray, at once
        run.wait(timeout=60)
        # the engine core and its vLLM worker end with their engine actor (they lived on, ~1.3 GB, re-parented)
        wait_engines_gone(since=started, timeout_s=60)
        # the at-risk notification, through the installed automation and the real block
        said = _delivered("is projected", 60, log.read_text)
        assert killed_after_s < BACKSTOP_S  # the other run was killed before the backstop's deadline ...
        backstop = _delivered(f"run {name.group(1)} is not Completed by its deadline", 60, killed_log.read_text)
        assert failed.wait(timeout=60) == 2  # bad input: exit status 2
        failed_name = re.search(r"Flow run '([^']+)' - Finished in state Failed", failed_log.read_text()).group(1)
        failure = _delivered(f"run {failed_name} Failed", 30, failed_log.read_text)
        time.sleep(max(0.0, started + BACKSTOP_S + 20 - time.time()))  # its backstop window too has passed
        about_failed = [t for t in _Hook.got if failed_name in t]
    finally:
        for proc in (run, killed, failed):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
        hook.shutdown()
        with get_client(sync_client=True) as client:  # none of them fires for the other tests' runs
            for automation_id in automations.values():
                client.delete_automation(automation_id)
    assert "Its state in Prefect now: Running." in backstop  # ... still Running there: the backstop is what says so
    assert [t for t in _Hook.got if f"run {name.group(1)} is not Completed" in t] == [backstop]  # once
    assert about_failed == [failure], about_failed  # the failed run: its failure's alert alone
    assert "(no deployment) ended Failed: " in failure and "of  ended" not in failure
    assert f"deadline {due.isoformat()}, projected" in said and "rows left" in said, said
    assert len(found) == 1, found
    event = found[0]
    p = event["payload"]
    assert datetime.fromisoformat(event["occurred"].replace("Z", "+00:00")) < due  # while there was time
    assert p["projected_late_s"] > 0 and p["rows_left"] > 0 and p["rows_per_s"] > 0 and "late" not in p["model"]
    assert event["resource"]["prefect.resource.id"].startswith("captionflow.run.")
    assert "projected" in log.read_text() and EVENT in log.read_text()  # the log line says so too


def test_a_run_whose_deadline_passed_before_its_first_caption_is_warned_then(prefect_api, tmp_path):
    """The projection needs captions; a deadline that passes in preflight, preprocess or while the engines start is
    warned as it passes, not minutes later once captions arrive. Once a run: the captioning's projection does not
    say it again."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    due = datetime.now(UTC) - timedelta(seconds=30)  # already past when the run starts
    args = ["run", "--device", "cpu", "--output", str(tmp_path / "out"), "--deadline", due.isoformat()]
    args += ["--deadline-margin-s", "0", "--warm-engines", "off"]
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary_log = done.stdout + done.stderr
    with get_client(sync_client=True) as client:
        found = _events(client, due.isoformat())
        name = re.search(r"Beginning flow run '([^']+)'", summary_log).group(1)
        run = next(r for r in client.read_flow_runs(limit=200) if r.name == name)
    assert len(found) == 1, found
    event = found[0]
    assert event["payload"]["stage"] == "before its captions" and event["payload"]["rows_left"] is None
    occurred = datetime.fromisoformat(event["occurred"].replace("Z", "+00:00"))
    assert (occurred - run.start_time).total_seconds() < 15, (occurred, run.start_time)  # within a few seconds
    assert "MISSED by" in summary_log
