"""The command line: every command prints its help, bad input is one line and exit status 2, before Ray starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from captionflow.config import RunConfig


def test_every_command_prints_its_help(capsys):
    from flows.cli import main

    helps = {}
    for command in ([], ["run"], ["compare"], ["deploy"], ["watch"], ["build-model"], ["demo-data"]):
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        assert done.value.code == 0, command
        out = helps[" ".join(command)] = capsys.readouterr().out
        assert out.startswith("usage: captionflow"), (command, out[:200])
    missing = [n for n in RunConfig.model_fields if "--" + n.replace("_", "-") not in helps["run"]]
    assert not missing, f"`captionflow run --help` lacks {missing}"


def test_cli_reports_bad_model_and_dataset(prefect_api, tmp_path, capsys):
    import ray

    from flows.cli import main

    ray_was_up = ray.is_initialized()  # an earlier test in this process may have started it
    assert main(["run", "--output", str(tmp_path / "o"), "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["run", "--output", str(tmp_path / "o"), "--dataset", str(tmp_path / "no-such-folder")]) == 2
    err = capsys.readouterr().err
    assert "no-such-folder" in err and "does not exist" in err
    assert ray.is_initialized() == ray_was_up  # rejected before Ray was started
    assert not (tmp_path / "o" / "runs").exists()


def test_a_user_error_is_at_most_three_lines_without_a_traceback_and_starts_nothing(tmp_path):
    """As a user sees it, in a shell: a missing model or dataset printed Prefect's 85-line engine traceback (and
    started a temporary Prefect server) before the one line that matters."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    for bad in (["--model", str(tmp_path / "missing")], ["--dataset", str(tmp_path / "no-such-folder")]):
        r = subprocess.run(
            [sys.executable, "-m", "flows.cli", "run", "--output", str(tmp_path / "o"), *bad],
            capture_output=True,
            text=True,
            cwd=root,
            timeout=300,
        )
        out = (r.stdout + r.stderr).strip().splitlines()
        assert r.returncode == 2 and len(out) <= 3, out
        assert out[-1].startswith("captionflow: ") and "does not exist" in out[-1], out
        assert not any("Traceback" in line or "temporary server" in line for line in out), out


def test_cli_rejects_unknown_config_keys(tmp_path, capsys):
    from flows.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("modle: builtin\n")
    assert main(["run", "--config", str(cfg)]) == 2
    assert "modle" in capsys.readouterr().err


def test_a_folder_of_only_broken_files_is_not_a_result(prefect_api, tmp_path, capsys):
    from flows.cli import main

    data = tmp_path / "broken"
    data.mkdir()
    (data / "a.jpg").write_bytes(b"")
    (data / "b.jpg").write_bytes(b"<html>not found</html>")
    out = tmp_path / "out"
    assert main(["run", "--dataset", str(data), "--output", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "none of its 2 inputs was accepted (empty_file 1, not_an_image 1" in err and "quarantine.parquet" in err
    assert not (out / "runs").exists() and not (out / "leaderboard.parquet").exists()


def test_a_malformed_config_file_is_one_line(tmp_path, capsys):
    from flows.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: builtin\n  max_tokens: [16\n")
    assert main(["run", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"captionflow: invalid parameters: config file {cfg}:2:") and "\n" not in err


def test_the_watcher_and_deploy_refuse_without_a_prefect_api_and_record_nothing(tmp_path):
    """Without PREFECT_API_URL the events would go to a temporary in-process server and no run would start:
    the watcher must exit non-zero, say why, and not record the checkpoint as announced."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    ckpt = tmp_path / "ckpts" / "step-1000"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")  # no profile that could name a server
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "watch", str(tmp_path / "ckpts")],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "PREFECT_API_URL is not set" in proc.stderr and "announced" not in proc.stdout
    assert not (tmp_path / "ckpts" / ".captionflow-announced.json").exists()
    # deploy, likewise: it deployed into a temporary server that ended with it, and said so with exit 0
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "deploy", "--work-pool", "nowhere"],
        capture_output=True, text=True, cwd=root, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "deploy needs a Prefect server: set PREFECT_API_URL" in proc.stderr
    assert "deployment captionflow/" not in proc.stdout


def test_version_and_json_option_errors_say_what(capsys):
    from flows.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("captionflow ")
    with pytest.raises(SystemExit) as e:
        main(["run", "--engine-kwargs", "[1, 2]"])
    assert e.value.code == 2 and "expected a JSON object" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["run", "--device", "tpu"])
    assert e.value.code == 2 and "choose from 'auto', 'cpu', 'gpu'" in capsys.readouterr().err
    # deploy's options: one line each, exit 2 (they were raw tracebacks)
    for bad, says in (
        (["--cron", "not a cron"], "cron: Value error, Invalid cron string"),
        (["--notify-block", "nope"], "notify_block: expected TYPE/NAME"),
        (["--pool-type", "process", "--image", "x"], "--image is for docker and kubernetes pools"),
    ):
        assert main(["deploy", *bad]) == 2, bad
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"captionflow: {says}") and len(err.splitlines()) == 1, err
    # a seed the engines cannot take: refused before anything starts, one line naming it (it failed every row)
    assert main(["run", "--seed", str(2**64)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("captionflow: invalid parameters") and "seed" in err and len(err.splitlines()) <= 3, err


def test_every_field_is_in_one_group_and_help_is_grouped(capsys):
    from captionflow.config import GROUPS, RunConfig
    from flows.cli import main

    named = [name for names in GROUPS.values() for name in names]
    assert sorted(named) == sorted(RunConfig.model_fields)  # each field once
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    heads = [out.index(f"\n{g.lower()} options:") for g in GROUPS]
    assert heads == sorted(heads)
    assert heads[2] < out.index("  --max-tokens") < heads[3]  # under "generation options"


def _board(tmp_path):
    from captionflow.data.storage import Store
    from captionflow.report.markdown import update_leaderboard

    store = Store(str(tmp_path / "out"))
    metrics = lambda c: {"stats": {"n_captions": 10, "failure_rate": 0.0}, "reference": {"cider": c, "bleu_4": c / 10}}
    update_leaderboard(store, "dsaaaaaaaa", ("runs", "dsaaaaaaaa", "m1", "gen16xxxx"), "step-1000", metrics(0.5))
    update_leaderboard(store, "dsaaaaaaaa", ("runs", "dsaaaaaaaa", "m2", "gen32xxxx"), "step-2000", metrics(0.7))
    update_leaderboard(store, "dsbbbbbbbb", ("runs", "dsbbbbbbbb", "m2", "gen16xxxx"), "step-2000", metrics(0.1))
    return str(tmp_path / "out")


def test_leaderboard_filters_and_prints_a_table_or_json(tmp_path, capsys):
    from flows.cli import main

    out = _board(tmp_path)
    assert main(["leaderboard", "--output", out]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["evaluated_at", "dataset", "generation", "model"] and len(lines) == 4
    assert main(["leaderboard", "--output", out, "--dataset", "dsaa", "--generation", "gen16", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["model"], r["cider"]) for r in rows] == [("step-1000", 0.5)]
    assert main(["leaderboard", "--output", out, "--model", "step-2", "--json"]) == 0
    assert {r["dataset_fingerprint"] for r in json.loads(capsys.readouterr().out)} == {"dsaaaaaaaa", "dsbbbbbbbb"}
    assert main(["leaderboard", "--output", str(tmp_path / "empty")]) == 0
    assert "no leaderboard rows" in capsys.readouterr().out


def test_status_shows_deployments_runs_automations_and_the_board(prefect_api, tmp_path, capsys):
    import uuid

    from captionflow.config import RunConfig
    from deployments.deploy import deploy
    from flows.cli import main

    out = _board(tmp_path)
    pool = f"pool-{uuid.uuid4().hex[:6]}"
    deploy(RunConfig(output=out, dataset="demo"), work_pool=pool)
    assert main(["status", "--output", out]) == 0
    text = capsys.readouterr().out
    assert "Prefect API: http" in text
    assert f"captionflow/golden-nightly  pool {pool}" in text and "captionflow/on-checkpoint" in text
    assert "warm engine service:" in text and "leaderboard" in text and "step-2000" in text


def test_status_lists_the_last_runs_failed_and_cancelled_included_not_the_scheduled_ones(prefect_api, tmp_path, capsys):
    """A real server's scheduler makes the nightly's next runs ahead of time: sorted with them, the "last runs" were
    three future ones, and a Failed and a Cancelled run were not shown."""
    import datetime
    import uuid

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Failed, Scheduled

    from captionflow.config import RunConfig
    from deployments.deploy import deploy
    from flows.cli import main

    out = _board(tmp_path)
    ids = deploy(RunConfig(output=out, dataset="demo"), work_pool=f"pool-{uuid.uuid4().hex[:6]}")
    nightly = uuid.UUID(ids["golden-nightly"])
    now = datetime.datetime.now(datetime.UTC)
    with get_client(sync_client=True) as client:
        for name, state in (("failed-one", Failed(message="x")), ("cancelled-one", Cancelled())):
            run = client.create_flow_run_from_deployment(nightly, name=name)
            client.set_flow_run_state(run.id, state, force=True)
        # a custom run whose model group leaves the model out: it runs the deployment's (it showed "model -")
        run = client.create_flow_run_from_deployment(
            nightly, name="custom-one", parameters={"model": {"max_pixels": 4096}}
        )
        client.set_flow_run_state(run.id, Failed(message="y"), force=True)
        for day in (1, 2, 3):
            when = now + datetime.timedelta(days=day)
            client.create_flow_run_from_deployment(nightly, name=f"future-{day}", state=Scheduled(scheduled_time=when))
    capsys.readouterr()  # what deploy printed
    assert main(["status", "--output", out, "--runs", "4"]) == 0
    text = capsys.readouterr().out
    block = text[text.index("captionflow/golden-nightly") :].split("\n  captionflow/")[0]
    assert "failed-one" in block and "Failed" in block and "cancelled-one" in block and "Cancelled" in block
    assert "model builtin" in block  # the model group's model
    custom = next(line for line in block.splitlines() if "custom-one" in line)
    assert custom.endswith("model builtin")  # the deployment's model, which the run gets when it starts
    assert "future-" not in block.replace("next run", "")  # no scheduled run among the last runs
    assert f"next run: {(now + datetime.timedelta(days=1)).date().isoformat()}" in block


def test_status_without_a_prefect_api_says_so(tmp_path):
    import os
    import subprocess
    import sys

    out = _board(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_API_URL"] = ""
    p = subprocess.run(
        [sys.executable, "-m", "flows.cli", "status", "--output", out],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, (p.stdout, p.stderr[-3000:])
    assert "PREFECT_API_URL is not set" in p.stdout and "no deployments or runs shown" in p.stdout
    assert "step-1000" in p.stdout  # the board still shows


def test_a_killed_runs_temporary_prefect_server_ends_with_it(tmp_path):
    """Without a Prefect API, a run's temporary Prefect server (~200 MB) outlived a driver killed with kill -9. The
    run points at an unreachable Ray (a free port), so that nothing else is started before the kill."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil
    from ports import free_port

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    cmd = [sys.executable, "-m", "flows.cli", "run", "--output", str(tmp_path / "o"), "--device", "cpu"]
    driver = subprocess.Popen(
        [*cmd, "--ray-address", f"127.0.0.1:{free_port()}"],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = guard = None
    try:
        deadline = time.monotonic() + 180
        while guard is None:
            assert driver.poll() is None and time.monotonic() < deadline, "no temporary server with a guard came up"
            for p in psutil.process_iter(["pid", "ppid", "cmdline"]):
                line = " ".join(p.info["cmdline"] or [])
                if p.info["ppid"] == driver.pid and "prefect.server.api.server:create_app" in line:
                    server = p
                elif "captionflow.processes" in line and f" {driver.pid} " in f" {line} ":
                    guard = p
            time.sleep(0.2)
        assert server is not None
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(30)
        gone, alive = psutil.wait_procs([server, guard], timeout=30)
        assert not alive, f"still running 30 s after the driver was killed: {alive}"
    finally:
        for p in [driver, server, guard]:
            try:
                if p is not None:
                    p.kill()
            except (OSError, psutil.Error):
                pass


_STOPPED_IN_A_FINALIZER = """
import os, signal, sys, time
from flows.cli import _stop_on_term

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100_000):  # the stop's handler runs here, in the finalizer, and its exception is dropped
            pass

def body():
    Finalized()
    print("went on", flush=True)
    time.sleep(30)

_stop_on_term()
if sys.argv[1] == "flow":
    from prefect import flow, runtime

    @flow(name="stopped-in-a-finalizer")
    def stopped():
        print("flow run", runtime.flow_run.id, flush=True)
        body()

    stopped()
else:
    body()
"""


@pytest.mark.parametrize("where", ["flow", "command"])
def test_a_stop_whose_exception_a_finalizer_dropped_still_ends_the_run(prefect_api, tmp_path, where):
    """A SIGTERM whose handler ran inside a finalizer (its exception printed and dropped by Python) let the run go
    on to its end. Sent again from outside it, the stop ends the process (143) and, in a flow, the run Crashed."""
    import os
    import re
    import subprocess
    import sys
    import time

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(root)}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _STOPPED_IN_A_FINALIZER, where], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "went on" in out, out[-3000:]  # the first delivery was dropped in the finalizer
    assert proc.returncode == 143, out[-3000:]
    assert time.monotonic() - t0 < 25, out[-3000:]  # not the 30 s the body sleeps
    assert "Traceback" not in out, out[-3000:]
    if where == "flow":
        run_id = re.search(r"flow run (\S+)", out).group(1)
        with get_client(sync_client=True) as client:
            assert client.read_flow_run(run_id).state.type.value == "CRASHED"
