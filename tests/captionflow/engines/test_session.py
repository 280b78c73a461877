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
    from captionflow.engines.session import keep_sigterm

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


UNREACHABLE = textwrap.dedent(
    """
    import socket, sys, time
    from captionflow.config import RunConfig
    from captionflow.errors import ClusterUnreachable
    from captionflow.engines.session import ray_session

    with socket.socket() as s:  # a loopback port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    try:
        ray_session(RunConfig(ray_address=f"127.0.0.1:{port}"))
    except ClusterUnreachable as e:
        print("REFUSED", round(time.monotonic() - t0, 1), str(e).count("\\n"), e)
    import ray
    print("INITIALIZED", ray.is_initialized())
    """
)


def test_an_unreachable_ray_address_fails_at_once_in_one_line_and_is_not_retried():
    """Ray's own connect waited 13.7 min on such an address, then Prefect retried it."""
    from captionflow.errors import ClusterUnreachable
    from tasks.policy import is_permanent

    r = subprocess.run([sys.executable, "-c", UNREACHABLE], capture_output=True, text=True, timeout=120)
    out = r.stdout
    assert "REFUSED" in out, r.stdout + r.stderr[-3000:]
    line = out[out.index("REFUSED") :].splitlines()[0].split(" ", 3)
    assert float(line[1]) < 15 and line[2] == "0"  # at once, one line
    assert "ray_address 127.0.0.1:" in line[3] and "no Ray cluster reachable there" in line[3]
    assert "INITIALIZED False" in out  # Ray was never asked to connect
    assert is_permanent(ClusterUnreachable("x"))


NOT_RAY = textwrap.dedent(
    """
    import http.server, socket, sys, threading, time
    from concurrent import futures
    import grpc
    from captionflow.config import RunConfig
    from captionflow.errors import ClusterUnreachable
    from captionflow.engines.session import ray_session

    quiet = type("Quiet", (http.server.BaseHTTPRequestHandler,), {"log_message": lambda *a: None})
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), quiet)  # a dashboard-like HTTP server
    threading.Thread(target=web.serve_forever, daemon=True).start()
    rpc = grpc.server(futures.ThreadPoolExecutor(1))  # a gRPC server of another service
    rpc_port = rpc.add_insecure_port("127.0.0.1:0")
    rpc.start()
    mute = socket.socket()  # accepts, then says nothing: a head whose GCS hangs, any listening service
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    held = []
    threading.Thread(target=lambda: [held.append(mute.accept()) for _ in range(8)], daemon=True).start()
    for name, port in (("http", web.server_address[1]), ("grpc", rpc_port), ("mute", mute.getsockname()[1])):
        t0 = time.monotonic()
        try:
            ray_session(RunConfig(ray_address=f"127.0.0.1:{port}"))
            print("CONNECTED", name)
        except ClusterUnreachable as e:
            print("REFUSED", name, round(time.monotonic() - t0, 1), str(e).count("\\n"), e)
    import ray
    print("INITIALIZED", ray.is_initialized())
    """
)


def test_an_address_where_something_else_answers_is_refused_in_one_line_within_30_s():
    """Something accepts TCP there, but it is not Ray's GCS: ray.init retried "Failed to connect to GCS" for 10+
    minutes with nothing in the Prefect log. The one line says what answered."""
    r = subprocess.run([sys.executable, "-c", NOT_RAY], capture_output=True, text=True, timeout=180)
    lines = {x.split(" ")[1]: x.split(" ", 4) for x in r.stdout.splitlines() if x.startswith("REFUSED")}
    assert set(lines) == {"http", "grpc", "mute"}, r.stdout + r.stderr[-3000:]
    for _, _, seconds, newlines, message in lines.values():
        assert float(seconds) < 30 and newlines == "0" and message.startswith("ray_address 127.0.0.1:")
        assert "not a Ray cluster there" in message
    assert "an HTTP server answered (the Ray dashboard, on 8265?" in lines["http"][4]
    assert "a gRPC server answered that is not Ray's GCS (a Ray Client server? then write ray://" in lines["grpc"][4]
    assert "gave no Ray answer within 20 s" in lines["mute"][4]
    assert "INITIALIZED False" in r.stdout and "CONNECTED" not in r.stdout


REAL = textwrap.dedent(
    """
    import ray
    from captionflow.engines.session import _ray_answers, check_reachable

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    gcs = ray.get_runtime_context().gcs_address
    check_reachable(gcs)
    print("ANSWERS", _ray_answers(gcs, False, 10))
    ray.shutdown()
    """
)


def test_a_real_gcs_passes_the_check():
    """The check asks the GCS itself (token authentication on, as Ray 2.60 starts a local Ray)."""
    r = subprocess.run([sys.executable, "-c", REAL], capture_output=True, text=True, timeout=180)
    assert "ANSWERS None" in r.stdout, r.stdout + r.stderr[-3000:]
