"""A stop request (SIGTERM, as from a scheduler or ``timeout``) ends a CLI run within seconds: the flow run recorded
Crashed once, exit status 143, and nothing of it left running (its local Ray's agents were, before). Twice: while
preflight asks a ``ray_address`` where something that is not Ray listens (the run stayed alive 56 s, printing event
errors against its own temporary server), and while its engine starts. A real Prefect server, real Ray and vLLM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
from processes import marked_processes

pytestmark = pytest.mark.slow
MARK = "CAPTIONFLOW_TEST_RUN"


def _flow_runs(log: str) -> list:
    """The flow runs the log names (its lines "Flow run 'NAME' - ...")."""
    import re

    from prefect.client.orchestration import get_client

    names = set(re.findall(r"Flow run '([^']+)'", log))
    with get_client(sync_client=True) as client:
        return [r for r in client.read_flow_runs(limit=200) if r.name in names]


def _run_then_term(tmp_path, args: list[str], ready: str, log_name: str, env: dict) -> tuple[int, float, str, str]:
    """``captionflow run`` with ``args`` until its log shows ``ready``, then SIGTERM: (exit status, seconds to exit
    after the signal, the log, the marker its processes carry)."""
    marker = uuid.uuid4().hex
    env = {**env, MARK: marker}
    log = tmp_path / log_name
    out = str(tmp_path / f"out-{marker}")
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--output", out, *args], env=env,
                                stdout=fh, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while ready not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        rc = proc.wait(timeout=60)
        return rc, time.monotonic() - t0, log.read_text(errors="replace"), marker
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_ends_a_cli_run_within_seconds_and_leaves_nothing_running(env, tmp_path):
    mute = socket.socket()  # accepts connections and says nothing
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    held = []
    threading.Thread(target=lambda: [held.append(mute.accept()) for _ in range(8)], daemon=True).start()
    own_server = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}  # Prefect's temporary server, as a CLI run
    cases = {
        "preflight": (["--ray-address", f"127.0.0.1:{mute.getsockname()[1]}"], "Beginning flow run", own_server),
        "engine start": (["--device", "cpu"], "MapBatches(vLLMEngineStageUDF)", env),
    }
    for name, (args, ready, run_env) in cases.items():
        rc, seconds, text, marker = _run_then_term(tmp_path, args, ready, f"{name.replace(' ', '-')}.log", run_env)
        assert rc == 143 and seconds < 10, f"{name}: exit status {rc}, {seconds:.1f} s after SIGTERM; its log:\n{text}"
        assert text.count("Finished in state Crashed('Execution was aborted by a termination signal.')") >= 1
        assert "Traceback" not in text and "Failed to send" not in text and "EventsWorker" not in text, text[-3000:]
        deadline = time.monotonic() + 15
        while left := marked_processes(MARK, marker):  # Ray's processes exit as its session shuts down
            assert time.monotonic() < deadline, (name, left)
            time.sleep(0.5)
        if run_env is env:  # the server outlives the run: its state there, recorded once
            runs = _flow_runs(text)
            assert [r.state.type.value for r in runs] == ["CRASHED"], (name, runs)
        else:  # its own temporary server stopped, after the events were sent
            assert "Stopping temporary server" in text.splitlines()[-1], text[-2000:]
