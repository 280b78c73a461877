"""The Ray session: one object owns captionflow's use of Ray in a process.

It connects to a cluster (``ray_address``, else ``RAY_ADDRESS``) or starts a local Ray sized for
the pipeline, knows which it did (a cluster's settings and GPUs are the cluster's business; a local
Ray's are ours), and answers the questions the stages ask of it: the device preset, how many CPU
workers fit, what share of a CPU one CPU-bound task declares.

Local sizing. Ray schedules by *logical* CPUs. Ray Data LLM runs one actor per stage plus the engine
actor, and plain tasks for read, filter and the pre/post maps; at Ray's defaults (1 CPU each) the
actors take every CPU of a 2-core machine and the map tasks wait forever ("Active & requested
resources: 3/2 CPU"). So every stage declares its share (``presets.py``) and a local Ray gets
``max(physical cores, ceil(sum of shares) + 1)`` logical CPUs (``presets.local_ray_cpus``).

The device is detected once: a local Ray is given the GPUs this machine has (``device.local_gpus``,
through NVML, no CUDA context in this process), so Ray's resources and captionflow's view agree; a
cluster's come from Ray.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

from captionflow.compat import vllm_warmup
from captionflow.config import RunConfig
from captionflow.engines import run_log
from captionflow.engines.device import local_gpus
from captionflow.engines.presets import PRESETS, Preset, local_ray_cpus

WORKER_ENV = {  # every Ray worker: offline, no usage statistics
    "RAY_USAGE_STATS_ENABLED": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# Only for a Ray this process starts without metrics_port (a cluster's settings are its own): no one reads
# its metrics then, and collecting them cost every Ray process CPU (the preprocess stage ran ~7% faster on
# 2 cores without).
LOCAL_RAY_ENV = {"RAY_enable_metrics_collection": "0"}


def cluster_address(cfg: RunConfig) -> Optional[str]:
    """The Ray cluster to use: ``ray_address``, else ``RAY_ADDRESS``, else the Ray of a warm engine service
    running on this machine (unless ``warm_engines`` is off); None: a local Ray of the run's own."""
    explicit = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    if explicit:
        return explicit
    if cfg.warm_engines != "off":
        from captionflow.engines.address import local_service_address

        return local_service_address()
    return None


@dataclass
class RaySession:
    address: Optional[str]  # the cluster connected to; None for a local Ray
    started_here: bool  # this process started the (local) Ray it uses

    @property
    def local(self) -> bool:
        return self.address is None

    def resources(self) -> dict[str, float]:
        import ray

        return ray.cluster_resources()

    def gpus(self) -> int:
        return int(self.resources().get("GPU", 0))

    def preset(self, device: str) -> Preset:
        """The preset for ``device`` ("auto": gpu where the cluster has a GPU)."""
        if device != "auto":
            return PRESETS[device]
        return PRESETS["gpu" if self.gpus() > 0 else "cpu"]

    def cpu_task_share(self) -> float:
        """Logical CPUs that one CPU-bound task or actor declares, so that at most one runs per physical
        core: a local Ray declares more logical CPUs than cores; on a cluster one."""
        if not self.local:
            return 1.0
        physical = os.cpu_count() or 1
        return max(1.0, self.resources().get("CPU", physical) / physical)

    def cpu_workers(self) -> int:
        """How many CPU-bound workers (one per physical core, or per cluster CPU) fit at once, in what the
        cluster has free now (a warm engine service holds CPUs of its own)."""
        import ray

        free = min(self.resources().get("CPU", 1), ray.available_resources().get("CPU", 1))
        return max(1, int(free / self.cpu_task_share()))


_SESSION: list[RaySession] = []  # the process's session, once there is one


@contextlib.contextmanager
def keep_sigterm() -> Iterator[None]:
    """Keep this process's SIGTERM handler through a block that calls ``ray.init`` (ours, and Ray Data LLM's
    own when it builds a processor). Ray installs ``sys.exit`` as the handler there; while it is installed,
    Prefect's cancel bridge is not armed, so a cancel arriving then (the runner asks the flow process to
    acknowledge, then sends SIGTERM) ended the flow run as Crashed instead of Cancelled. Ray is kept from
    installing it during the block, and whatever handler is in place afterwards is restored."""
    import signal
    import threading

    import ray._private.utils as ray_utils

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    ray_sets = getattr(ray_utils, "set_sigterm_handler", None)
    if ray_sets is not None:
        ray_utils.set_sigterm_handler = _leave_sigterm
    try:
        yield
    finally:
        if ray_sets is not None:
            ray_utils.set_sigterm_handler = ray_sets
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _leave_sigterm(handler) -> None:
    """Stands in for Ray's ``set_sigterm_handler`` inside :func:`keep_sigterm`: the handler stays as it is."""


def _init(**kwargs) -> None:
    import ray

    with keep_sigterm():
        ray.init(**kwargs)


def local_num_cpus(cfg: RunConfig, preset: Preset, gpus: int) -> int:
    """Logical CPUs of a local Ray for one pipeline of ``preset`` on this machine's ``gpus`` GPUs: the engines of
    every GPU (a tensor-parallel engine spans ``tensor_parallel_size`` of them) and the plain tasks that feed them.
    Sized for one GPU's engines, the engines of 2 GPUs (a 32-core host) or 4 (64 cores) held every CPU, Ray Data's
    reads never got one, and the run hung with every engine loaded. On CPU, a sequential verdict on the judge's
    score or the pairwise win runs the judge's engines beside the captioner's (``judge.SequentialJudging``)."""
    groups = max(1, gpus // cfg.tensor_parallel_size) if preset.engine_gpus else 1
    per_gpu = cfg.engines_per_gpu or preset.max_engines_per_gpu
    engines = cfg.concurrency or preset.concurrency * per_gpu * groups
    if not preset.engine_gpus and cfg.verdict == "sequential" and cfg.verdict_score in ("judge", "pairwise"):
        engines *= 2
    return local_ray_cpus(preset, engines, gpus=groups)


REACH_TIMEOUT_S = 10.0  # for a TCP connection
HANDSHAKE_TIMEOUT_S = 20.0  # for Ray's own answer once connected: the whole check stays within 30 s


def check_reachable(
    address: str, from_env: bool = False, timeout_s: float = REACH_TIMEOUT_S, handshake_s: float = HANDSHAKE_TIMEOUT_S
) -> None:
    """Raise ``ClusterUnreachable`` unless a Ray cluster answers at ``address``, before ``ray.init``: that waits
    10+ minutes on an address where nothing answers, or where something that is not Ray does (the dashboard's
    port, a Ray Client port without ``ray://``, any other service, a head whose GCS hangs), and says nothing
    meanwhile. First a TCP connection within ``timeout_s``; then, within ``handshake_s``, Ray's own answer: the
    GCS's cluster id over gRPC (a ``ray://`` address: a gRPC server at all, the Ray Client's). The error says in
    one line what did answer there. ``auto`` and ``local`` name no address to check."""
    import socket

    from captionflow.errors import ClusterUnreachable

    client = address.startswith("ray://")
    target = address.removeprefix("ray://")
    if target in ("auto", "local") or ":" not in target:
        return
    host, _, port = target.rpartition(":")
    where = f"ray_address {address}" + (" (from RAY_ADDRESS)" if from_env else "")
    try:
        port_n = int(port)
    except ValueError:
        raise ClusterUnreachable(f"{where}: the port {port!r} is not a number") from None
    try:
        with socket.create_connection((host.strip("[]"), port_n), timeout=timeout_s):
            pass
    except OSError as e:
        why = f"nothing answered within {timeout_s:g} s" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise ClusterUnreachable(
            f"{where}: no Ray cluster reachable there ({why.lower()}); check the address, or that the head node is up"
        ) from None
    answered = _ray_answers(target, client, handshake_s)
    if answered:
        raise ClusterUnreachable(f"{where}: not a Ray cluster there: {answered}")


# The GCS's cheapest call: its cluster id (an empty request). A Ray GCS answers it (or refuses an unauthenticated
# caller: still Ray's); a gRPC server of another service says the method is unknown.
GCS_PROBE = "/ray.rpc.NodeInfoGcsService/GetClusterId"
RAY_CLIENT_PROBE = "/ray.rpc.RayletDriver/ClusterInfo"


def _ray_answers(target: str, client: bool, timeout_s: float) -> Optional[str]:
    """None where Ray answers at ``target`` (host:port) within ``timeout_s``; else what did, in a few words."""
    import grpc

    channel = grpc.insecure_channel(target)
    call = channel.unary_unary(
        RAY_CLIENT_PROBE if client else GCS_PROBE, request_serializer=bytes, response_deserializer=bytes
    )
    try:
        call(b"", timeout=timeout_s)
        return None
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
    finally:
        channel.close()
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return None  # Ray's, with token authentication: ray.init brings the token
    if client and code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return None  # a gRPC server that answered: the Ray Client server says what it wants in ray.init
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (
            "a gRPC server answered that is not Ray's GCS (a Ray Client server? then write ray://"
            f"{target}; the GCS listens on the head's port 6379 by default)"
        )
    if "HTTP/2" in details or "http1" in details.lower():
        return "an HTTP server answered (the Ray dashboard, on 8265? the GCS is on the head's port 6379 by default)"
    # a listener that says nothing: our deadline, or gRPC's own connect timeout first on a busy machine ("connection
    # attempt timed out before receiving SETTINGS frame")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED or "timed out" in details.lower():
        return f"something accepted the connection but gave no Ray answer within {timeout_s:g} s (a hung head?)"
    return f"something accepted the connection but did not speak Ray's protocol ({details.splitlines()[0][:120]})"


def ray_session(cfg: RunConfig, pipelines: int = 1) -> RaySession:
    """The process's Ray session: connect to the cluster, else start a local Ray sized for ``cfg`` (for
    ``pipelines`` runs at once: parallel evaluations of checkpoints).

    A Ray already initialised in this process (by a caller, a test, a benchmark) is adopted as it is.
    """
    import ray

    if _SESSION and ray.is_initialized():
        return _SESSION[0]
    _SESSION.clear()
    address = cluster_address(cfg)
    if ray.is_initialized():
        run_log.take_worker_output(replace_printing=False)
        _SESSION.append(RaySession(address=address, started_here=False))
        return _SESSION[0]
    for k, v in WORKER_ENV.items():
        os.environ.setdefault(k, v)
    # The vLLM processor pre-build hook (import-triggered, otherwise a no-op) is set for the whole job:
    # Ray does not run a setup hook given to a single actor's runtime_env.
    hook = {"worker_process_setup_hook": vllm_warmup.SETUP_HOOK}
    if address:
        check_reachable(address, os.environ.get("RAY_ADDRESS") == address and not cfg.ray_address)
        # worker output streams to this process for run_log (it forwards the key lines, prints none of it)
        client = address.startswith("ray://")
        _init(address=address, runtime_env={"env_vars": WORKER_ENV, **hook}, log_to_driver=not client)
        if not client:
            run_log.take_worker_output(replace_printing=True)
        _SESSION.append(RaySession(address=address, started_here=False))
        return _SESSION[0]
    if cfg.metrics_port is None:
        for k, v in LOCAL_RAY_ENV.items():
            os.environ.setdefault(k, v)
    else:
        os.environ["RAY_enable_metrics_collection"] = "1"  # noqa: SIM112 - Ray's own spelling
    gpus = local_gpus()
    hint = PRESETS[cfg.device] if cfg.device != "auto" else PRESETS["gpu" if gpus else "cpu"]
    # A local Ray's workers inherit this process's environment (WORKER_ENV is set above). A job
    # runtime_env, even env_vars alone, makes Ray start new workers instead of the ones it prestarted
    # (2 fresh worker processes, ~2 s of CPU each, before the first task on 2 cores), so the job gets
    # one only where the vLLM hook is needed: the GPU preset (vLLM 0.26 on the GPU host; the CPU build,
    # vLLM 0.29 and later, pre-builds its processor itself).
    # address="local": a new Ray of our own, even where a `ray start` left its address file behind (a live
    # or crashed cluster; without it, ray.init would try to join that one with our sizing and refuse)
    _init(
        address="local",
        num_cpus=cfg.ray_num_cpus or local_num_cpus(cfg, hint, gpus) * pipelines,
        num_gpus=gpus,
        include_dashboard=False,
        _metrics_export_port=cfg.metrics_port,
        runtime_env=hook if hint.engine_gpus else None,
        log_to_driver=True,
    )
    run_log.take_worker_output(replace_printing=True)
    atexit.register(_shutdown_local_ray)
    _SESSION.append(RaySession(address=None, started_here=True))
    return _SESSION[0]


def _shutdown_local_ray() -> None:
    """At this process's exit, the local Ray it started goes with it: Ray's own exit handler left its
    dashboard and runtime-env agents running, orphaned, after a run ended by SIGTERM (a scheduler's stop,
    ``timeout``) or an error (Ray 2.60, as ``sys.exit`` after ``ray.init`` does)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
