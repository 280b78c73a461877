"""Warm engines: a vLLM engine that outlives runs and swaps checkpoints instead of starting again.

Why: for a golden set, a run's verdict is mostly start-up (importing vLLM, loading and compiling the
engine); the captioning itself takes seconds. The service keeps the engine up between runs.

What it is: one Ray Serve application per engine (``captionflow-0``, ``captionflow-1``, ...: the run's engine
layout, ``EngineSettings.service_engines``, e.g. four per GPU), each with one deployment (``caption-engine``)
whose one replica holds Ray Data LLM's own vLLM engine wrapper (``service/replica.CaptionEngine``) - an
application per engine so that a swap reaches, and a check covers, every engine by name - and a detached
controller actor (``captionflow-service`` in namespace ``captionflow``) that knows what is loaded, hands the
engine to one run at a time (a lease: a run waits, saying for whom), and gives the GPU back after
``idle_timeout_s`` without a run. A run builds its request rows with its Ray Data LLM processor's preprocess,
as a cold run does, and its driver hands them to the engines a block at a time (``service/feed.py``), where Ray
Data LLM's own engine stage runs them: the rows and the engine code are a cold run's, and so are the captions.

A run whose checkpoint has the loaded architecture and engine settings (``engine_spec``) has its weights
loaded into every running engine at once (vLLM ``reload_weights``), each checked against the checkpoint's
file (``replica.weights_problem``); an engine whose swap fails or does not check is replaced, never
used. Another architecture or other settings replace the engines. Each caption row records the checkpoint
that served it.

Lifecycle: ``captionflow serve`` starts it (on a local Ray it stays in the foreground, owning that Ray,
and writes ``<cache>/service.json`` so that runs on this machine find it; on a cluster it detaches);
``captionflow serve --stop`` stops it. Runs use it when it is there (``warm_engines``: auto / off / require).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from captionflow.data.fingerprint import digest, file_digests
from captionflow.engines.address import service_file
from captionflow.engines.engine import EngineSettings
from captionflow.engines.session import WORKER_ENV
from captionflow.errors import CaptionflowError
from captionflow.model_source import ResolvedModel
from captionflow.processes import alive, process_started
from captionflow.service.replica import ENGINE

log = logging.getLogger("captionflow.service")

APP = "captionflow"
JUDGE_APP = "captionflow-judge"
CONTROLLER = "captionflow-service"
NAMESPACE = "captionflow"
SWAP_TIMEOUT_S = 1800.0  # a swap, a check or a replacement of the engines


class ServiceError(CaptionflowError, RuntimeError):
    """The warm engine service is not there, or cannot serve this run."""


# The files that decide how a request becomes tokens and pixels: what the warm engines load once.
PROCESSOR_FILES = (
    "tokenizer*",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "*processor_config.json",
    "generation_config.json",
)


def engine_spec(model: ResolvedModel, engine: EngineSettings) -> str:
    """What two runs must share to use the same engine: the architecture (config.json, without names and
    paths), the tokenizer, chat template and image processor (the warm engines load them once), and the
    engine arguments that can change a caption (``EngineSettings.output_params``: not memory, layout or
    where the compile cache lives). Checkpoints that differ only in weights share it."""
    root = Path(model.path)
    conf = json.loads((root / "config.json").read_text(encoding="utf-8"))
    for k in ("_name_or_path", "name_or_path", "transformers_version"):
        conf.pop(k, None)
    return digest(
        {
            "config": conf,
            "files": file_digests(root, PROCESSOR_FILES),
            "output": engine.output_params(),
            "tensor_parallel_size": engine.tensor_parallel_size,
        }
    )


# ---------------------------------------------------------------- the controller (a detached Ray actor)
LEASE_TTL_S = 30.0  # a run renews its hold every third of this; one that stops renewing has lost it after this


class ServiceController:
    """What the service has loaded, who uses it now, and when it was last used."""

    def __init__(self, idle_timeout_s: float):
        self.idle_timeout_s = idle_timeout_s
        self.state: dict[str, Any] = {
            "apps": [],  # the engines' Serve applications
            "spec": "",
            "model_fingerprint": "",
            "model_path": "",
            "model": "",
            "started": time.time(),
            "last_used": time.time(),
            "stopped": False,
            "swaps": 0,
            "lora_rank": 0,  # the largest LoRA adapter rank the engines take (0: none): runs of adapters of the model
            "judge": None,  # the judge's engines, when the service keeps them (``start_service``): what ``loaded`` says
        }
        self.holder: Optional[dict[str, Any]] = None
        self._idle_task = None
        self._handles: dict[str, Any] = {}  # app -> its engine's Serve handle, made once (``_engine``)

    async def start_idle_timer(self) -> None:
        import asyncio

        async def watch() -> None:
            while not self.state["stopped"]:
                await asyncio.sleep(min(10.0, max(self.idle_timeout_s / 4, 0.5)))
                self._lapse()
                idle = time.time() - self.state["last_used"]
                if self.holder is None and self.idle_timeout_s and idle > self.idle_timeout_s:
                    await self.stop(f"idle for {idle:.0f} s")

        self._idle_task = asyncio.get_running_loop().create_task(watch())

    async def describe(self) -> dict[str, Any]:
        self._lapse()
        return {**self.state, "holder": self.holder, "idle_timeout_s": self.idle_timeout_s}

    async def try_acquire(self, owner: str, ttl_s: float = LEASE_TTL_S) -> dict[str, Any]:
        """{"token": ...} when granted, else {"holder": ...}. The hold lapses ``ttl_s`` after its last renewal."""
        if self.state["stopped"]:
            return {"stopped": True}
        self._lapse()
        if self.holder is not None:
            return {"holder": self.holder}
        now = time.time()
        self.holder = {"owner": owner, "token": uuid.uuid4().hex, "since": now, "ttl_s": ttl_s, "expires": now + ttl_s}
        return {"token": self.holder["token"]}

    async def renew(self, token: str) -> bool:
        """Keep the hold of ``token`` for another ``ttl_s``; False when it is not (or no longer) the holder."""
        if self.holder and self.holder["token"] == token:
            self.holder["expires"] = time.time() + self.holder["ttl_s"]
            return True
        return False

    async def release(self, token: str) -> None:
        if self.holder and self.holder["token"] == token:
            self.holder = None
        self.state["last_used"] = time.time()

    def _lapse(self) -> None:
        """A holder that stopped renewing (its run died: SIGKILL, a lost node) holds the engines no longer."""
        if self.holder is not None and self.holder["expires"] < time.time():
            self.state["lapsed"] = self.state.get("lapsed", 0) + 1
            self.state["last_lapsed"] = self.holder["owner"]
            self.holder = None
            self.state["last_used"] = time.time()

    async def loaded(
        self,
        apps: list[str],
        spec: str,
        model: str,
        model_path: str,
        model_fingerprint: str,
        swapped: bool,
        lora_rank: int = 0,
    ) -> None:
        """``model`` is in every engine of ``apps`` and checked; they take LoRA adapters up to ``lora_rank``."""
        self.state.update(
            apps=list(apps),
            spec=spec,
            model=model,
            model_path=model_path,
            model_fingerprint=model_fingerprint,
            lora_rank=lora_rank,
            last_used=time.time(),
        )
        self.state["swaps"] += int(swapped)
        try:  # Ray Serve imported and the handles made now, not at the next run's swap
            for app in apps:
                self._engine(app)
        except Exception:  # made at the swap then, which says what fails
            pass

    async def judge_loaded(self, apps: list[str], spec: str, model: str, model_path: str, model_fingerprint: str):
        """The judge ``model`` is in every engine of ``apps`` (the judge's engines, beside the captioner's)."""
        self.state["judge"] = {
            "apps": list(apps),
            "spec": spec,
            "model": model,
            "model_path": model_path,
            "model_fingerprint": model_fingerprint,
        }

    def _engine(self, app: str) -> Any:
        if app not in self._handles:
            from ray import serve

            self._handles[app] = serve.get_deployment_handle(ENGINE, app, _check_exists=False)
        return self._handles[app]

    async def swap(self, token: str, model_path: str, model_fingerprint: str) -> dict[str, dict[str, Any]]:
        """For the run holding ``token``: load ``model_path`` into every engine at once and check each (all at once
        too). Returns {"swapped": {app: seconds}, "bad": {app: why}} (the engines it did not take on).

        The controller does it, not the run's driver: its handles to the engines are made (and Ray Serve imported)
        once, when the engines are, so the reload reaches them with this call; a driver would first import Ray Serve
        and make handles of its own, on the critical path of every warm verdict."""
        import asyncio

        if not self.holder or self.holder["token"] != token:
            raise ServiceError("this run does not hold the warm engines (its hold lapsed): not swapped")
        apps = list(self.state["apps"])
        started = {app: self._engine(app).reload.remote(model_path, model_fingerprint) for app in apps}
        swapped: dict[str, Any] = {}
        bad: dict[str, Any] = {}
        for app, response in started.items():
            try:
                swapped[app] = await asyncio.wait_for(_awaited(response), SWAP_TIMEOUT_S)
            except Exception as e:
                bad[app] = f"{type(e).__name__}: {str(e)[:200]}"
        checks = {app: self._engine(app).check.remote(model_path) for app in swapped}
        for app, response in checks.items():
            try:
                problem = await asyncio.wait_for(_awaited(response), SWAP_TIMEOUT_S)
            except Exception as e:
                problem = f"the check failed: {type(e).__name__}: {str(e)[:200]}"
            if problem:
                bad[app] = problem
        for app in bad:  # replaced next: a handle of its own then
            self._handles.pop(app, None)
        return {"swapped": {a: v for a, v in swapped.items() if a not in bad}, "bad": bad}

    async def stop(self, why: str = "asked to stop") -> None:
        from ray import serve

        if not self.state["stopped"]:
            self.state["stopped"] = True
            self.state["stopped_why"] = why
            for app in self.state["apps"] + (self.state["judge"] or {}).get("apps", []):
                try:
                    serve.delete(app)  # the engine's replica ends: its GPU share and CPUs are free
                except Exception:
                    pass


async def _awaited(response: Any) -> Any:
    """A Serve ``DeploymentResponse``'s result, as a coroutine (for ``asyncio.wait_for``)."""
    return await response


# ---------------------------------------------------------------- deploying the engines
def app_names(n: int, judge: bool = False) -> list[str]:
    """The engines' Serve applications: the captioner's, or the judge's (``judge``)."""
    return [f"{JUDGE_APP if judge else APP}-{i}" for i in range(n)]


def _deploy(model: ResolvedModel, engine: EngineSettings, apps: list[str], *also: tuple) -> float:
    """Deploy (or replace) the engines of ``apps`` with ``model`` and ``engine`` (``service_engines``' settings),
    and those of each ``(model, engine, apps)`` of ``also`` (the judge's), all at once; returns seconds until every
    one is ready."""
    from ray import serve

    t0 = time.perf_counter()
    serve.run_many([t for group in ((model, engine, apps), *also) for t in _targets(*group)])
    return round(time.perf_counter() - t0, 2)


def _targets(model: ResolvedModel, engine: EngineSettings, apps: list[str]) -> list:
    from ray import serve
    from ray.serve.api import RunTarget

    from captionflow.compat.cuda_mps import ensure_mps
    from captionflow.service.replica import CaptionEngine

    preset = engine.preset
    actor_options: dict[str, Any] = {
        "num_cpus": preset.engine_cpus,
        "runtime_env": {
            "env_vars": {**WORKER_ENV, **engine.env, **ensure_mps(engine.mps), "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
        },
    }
    if preset.engine_gpus:
        actor_options["num_gpus"] = engine.gpu_share * engine.tensor_parallel_size
    if engine.accelerator_type:
        actor_options["accelerator_type"] = engine.accelerator_type
    deployment = serve.deployment(CaptionEngine).options(
        name=ENGINE,
        num_replicas=1,
        ray_actor_options=actor_options,
        max_ongoing_requests=100_000,
        health_check_period_s=30,
        health_check_timeout_s=300,
        graceful_shutdown_timeout_s=5,
    )
    app = deployment.bind(model.path, model.fingerprint, engine)
    return [RunTarget(target=app, name=name, route_prefix=None) for name in apps]


def _handle(app: str):
    from ray import serve

    return serve.get_deployment_handle(ENGINE, app)


# ---------------------------------------------------------------- starting, finding, stopping
def start_service(
    model: ResolvedModel,
    engine: EngineSettings,
    idle_timeout_s: float,
    address: Optional[str],
    judge: Optional[ResolvedModel] = None,
    judge_engine: Optional[EngineSettings] = None,
) -> Any:
    """Deploy the engines and the controller on the connected Ray; returns the controller. ``judge``,
    ``judge_engine``: the judge's engines too (on GPUs each model on half of each GPU's engines:
    ``service_engines``), which judge a run's captions as its captioner's engines make them (``feed.WarmRows.then``)."""
    import ray
    from ray import serve

    serve.start(http_options={"location": "NoServer"})
    old = _controller()
    if old is not None:
        raise ServiceError("a warm engine service is already running on this Ray cluster (captionflow serve --stop)")
    controller = (
        ray.remote(ServiceController)
        .options(
            name=CONTROLLER,
            namespace=NAMESPACE,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=64,
        )
        .remote(idle_timeout_s)
    )
    ray.get(controller.start_idle_timer.remote())
    judged = judge is not None and judge_engine is not None
    settings, n = engine.service_engines(beside_judge=judged)
    apps, also, judge_apps = app_names(n), [], []
    if judged:
        judge_settings, n_judge = judge_engine.service_engines(beside_judge=True)
        judge_apps = app_names(n_judge, judge=True)
        also.append((judge, judge_settings, judge_apps))
    seconds = _deploy(model, settings, apps, *also)
    if judged:
        spec = engine_spec(judge, judge_engine)
        ray.get(controller.judge_loaded.remote(judge_apps, spec, judge.source, judge.path, judge.fingerprint))
    spec = engine_spec(model, engine)
    lora = settings.lora_rank
    ray.get(controller.loaded.remote(apps, spec, model.source, model.path, model.fingerprint, False, lora))
    if address is None:  # a local Ray: tell the runs on this machine where it is
        path = service_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "address": ray.get_runtime_context().gcs_address,
                    "pid": os.getpid(),
                    "pid_started": process_started(os.getpid()),
                    "model": model.source,
                    "started": time.time(),
                    # Ray 2.60 turns token authentication on for a local Ray when a token exists: the runs
                    # that join it must say so too
                    "auth_mode": os.environ.get("RAY_AUTH_MODE", ""),
                }
            )
        )
    log.info(
        "%d warm engine(s) ready in %.1f s: %s%s", n, seconds, model.source,
        f", and {len(judge_apps)} of the judge {judge.source}" if judged else "",
    )  # fmt: skip
    return controller


def _controller():
    import ray

    try:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        return None


def describe(engines: bool = False) -> Optional[dict[str, Any]]:
    """The service's state, or None when there is none on the connected Ray; ``engines``: with what each engine
    holds and how many rows it captioned."""
    import ray

    c = _controller()
    if c is None:
        return None
    try:
        info = ray.get(c.describe.remote(), timeout=60)
    except ray.exceptions.RayActorError:  # stopped (and killed) between the lookup and the call
        return None
    if info["stopped"]:
        return None
    if engines:
        info["engines"] = {}
        for app in info["apps"] + (info.get("judge") or {}).get("apps", []):
            try:
                info["engines"][app] = _handle(app).loaded.remote().result(timeout_s=60)
            except Exception as e:
                info["engines"][app] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return info


def stop_service() -> Optional[dict[str, Any]]:
    import ray

    c = _controller()
    if c is None:
        return None
    info = ray.get(c.describe.remote(), timeout=60)
    ray.get(c.stop.remote("stopped by captionflow serve --stop"), timeout=300)
    ray.kill(c)
    return info


class _Lifeline:
    """Watches a local service's process while a run uses it. Its Ray goes with it, and Ray ends a driver
    whose cluster is gone (after ``RAY_gcs_rpc_server_reconnect_timeout_s``, 30 s for runs on a local
    service): this says why first, in the run's log, so the run fails with the reason, never hangs."""

    def __init__(self) -> None:
        from prefect.context import FlowRunContext

        info = json.loads(service_file().read_text())
        self.pid, self.started = int(info["pid"]), info.get("pid_started")
        ctx = FlowRunContext.get()
        self.flow_run_id = ctx.flow_run.id if ctx is not None and ctx.flow_run is not None else None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="captionflow-service-lifeline", daemon=True)

    def _watch(self) -> None:
        while not self.stop.wait(1.0):
            if not alive(self.pid, self.started):
                reason = (
                    f"the warm engine service (pid {self.pid}) stopped during the run, and its Ray with it: this run "
                    "ends; the captions it committed are kept; run again to caption the rest (with no service "
                    "running, a run starts engines of its own)"
                )
                log.error(reason)
                self._end_run(reason)
                return

    def _end_run(self, reason: str) -> None:
        """Ray ends this process without any Python cleanup (its core worker's quick exit) once the service's GCS
        has been gone for the reconnect timeout: the flow run would stay Running forever and the run's temporary
        Prefect server would be orphaned. So it ends first, in order: the flow run Failed with the reason, the
        temporary server (the CLI's, when no PREFECT_API_URL is set) stopped, one line, exit status 1."""
        import sys

        if self.flow_run_id is not None:
            try:
                from prefect.client.orchestration import get_client
                from prefect.states import Failed

                with get_client(sync_client=True) as client:
                    client.set_flow_run_state(self.flow_run_id, Failed(message=reason), force=True)
            except Exception as e:  # the exit below still happens: Ray would end the process anyway
                log.warning("could not mark the flow run Failed: %s: %s", type(e).__name__, str(e)[:200])
        try:
            from prefect.server.api.server import SubprocessASGIServer

            for server in list(SubprocessASGIServer._instances.values()):
                server.stop()
        except Exception as e:
            log.warning("could not stop the temporary Prefect server: %s: %s", type(e).__name__, str(e)[:200])
        print(f"captionflow: run failed: {reason}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(1)

    def __enter__(self) -> _Lifeline:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
