"""The Ray session leaves a Prefect flow run's cancel bridge armed while Ray starts."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A fresh process (its main thread owns the signal handlers; no Ray of the test session's in it): a flow
# engine's SIGTERM bridge is in place, then a real local Ray starts inside keep_sigterm. Ray installs a
# sys.exit handler of its own in ray.init; while that one is in, the flow run cannot acknowledge a cancel
# and a SIGTERM ends it as Crashed.
SCRIPT = textwrap.dedent(
    """
    import signal
    import ray
    from prefect.utilities.engine import can_ack_control_intent, capture_sigterm
    from captionflow.pipeline.session import keep_sigterm

    with capture_sigterm():
        seen = []
        with keep_sigterm():
            ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
            seen.append(can_ack_control_intent())
        seen.append(can_ack_control_intent())
        ray.shutdown()
    print("armed during ray.init:", seen[0], "after:", seen[1])
    raw = signal.getsignal(signal.SIGTERM)
    with keep_sigterm():
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
        inside = signal.getsignal(signal.SIGTERM)
    ray.shutdown()
    print("plain handler kept:", inside is raw)
    """
)


def test_prefects_sigterm_bridge_stays_armed_while_ray_starts():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "armed during ray.init: True after: True" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "plain handler kept: True" in done.stdout, done.stdout
