"""One vLLM engine core fed by several front ends (``AsyncLLM`` clients in other processes).

vLLM's own server does this with ``--api-server-count N``: it starts the engine core with N pairs of ZMQ
addresses and N API-server processes, each an ``AsyncLLM(client_addresses=..., client_count=N,
client_index=i)``. ``launch_core`` is that first half for processes that vLLM did not start (Ray actors):
the engine core is a child of the calling process, the front ends connect to it by the IPC addresses it
returns. What differs between the vLLM versions captionflow runs (0.26 on the GPU host, 0.29 on CPU) is
only what ``launch_core_engines`` takes and yields; both are handled here. Can go when vLLM offers a public
way to attach clients to a running engine core.
"""

from __future__ import annotations

import inspect
import tempfile
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class CoreAddresses:
    """Where the front ends of one engine core bind: client i takes ``inputs[i]`` and ``outputs[i]``."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def client(self, index: int) -> dict[str, str]:
        return {"input_address": self.inputs[index], "output_address": self.outputs[index]}


def ipc_addresses(clients: int, folder: str | None = None) -> CoreAddresses:
    """Fresh IPC socket paths for ``clients`` front ends (short: a Unix socket path has at most 107 bytes)."""
    folder = folder or tempfile.gettempdir()
    token = uuid.uuid4().hex[:12]
    return CoreAddresses(
        inputs=tuple(f"ipc://{folder}/cf-{token}-i{i}" for i in range(clients)),
        outputs=tuple(f"ipc://{folder}/cf-{token}-o{i}" for i in range(clients)),
    )


def preload() -> None:
    """Import what ``launch_core`` needs (vLLM takes ~25 s to import on the GPU host)."""
    import vllm.v1.engine.utils
    import vllm.v1.executor  # noqa: F401


def launch_core(engine_args, addresses: CoreAddresses):
    """Start the engine core that ``engine_args`` describe (a child process of this one) for
    ``len(addresses.inputs)`` front ends, and return vLLM's process manager once the core is ready (model
    loaded, graphs compiled). The core connects to the front ends' addresses itself; a front end may bind them
    before or after this returns. Shut it down with ``manager.shutdown()``."""
    from vllm.v1.engine.utils import EngineZmqAddresses, launch_core_engines
    from vllm.v1.executor import Executor

    # as vLLM's own server does for its API servers: processor caches that assume one front end are off
    engine_args._api_process_count, engine_args._api_process_rank = len(addresses.inputs), -1
    config = engine_args.create_engine_config()
    engine_addresses = EngineZmqAddresses(inputs=list(addresses.inputs), outputs=list(addresses.outputs))
    kwargs = {}
    if "num_api_servers" in inspect.signature(launch_core_engines).parameters:  # vLLM 0.26
        kwargs["num_api_servers"] = len(addresses.inputs)
    log_stats = not engine_args.disable_log_stats
    with launch_core_engines(config, Executor.get_class(config), log_stats, engine_addresses, **kwargs) as launched:
        # 0.26 yields (manager, coordinator, addresses, tensor_queue); 0.29 a CoreEngineLaunch
        manager = launched[0] if isinstance(launched, tuple) else launched.engine_manager
    return manager


def core_pids(manager) -> list[int]:
    """The engine core processes' ids."""
    return [p.pid for p in getattr(manager, "processes", []) if p.pid]
