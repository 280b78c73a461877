"""Warm engines: a vLLM engine that outlives runs and swaps checkpoints instead of starting again.

Why: for a golden set, a run's verdict is mostly start-up (importing vLLM, loading and compiling the
engine); the captioning itself takes seconds. The service keeps the engine up between runs.

What it is: one Ray Serve application per engine (``captionflow-0``, ``captionflow-1``, ...: the run's engine
layout, ``EngineSettings.service_engines``, e.g. four per GPU), each with one deployment (``caption-engine``)
whose one replica holds Ray Data LLM's own vLLM engine wrapper (``engine_server.CaptionEngine``) - an
application per engine so that a swap reaches, and a check covers, every engine by name - and a detached
controller actor (``captionflow-service`` in namespace ``captionflow``) that knows what is loaded, hands the
engine to one run at a time (a lease: a run waits, saying for whom), and gives the GPU back after
``idle_timeout_s`` without a run. A run builds its request rows with its Ray Data LLM processor's preprocess,
as a cold run does, and its driver hands them to the engines a block at a time (``warm_feed.py``), where Ray
Data LLM's own engine stage runs them: the rows and the engine code are a cold run's, and so are the captions.

A run whose checkpoint has the loaded architecture and engine settings (``engine_spec``) has its weights
loaded into every running engine at once (vLLM ``reload_weights``), each checked against the checkpoint's
file (``engine_server.weights_problem``); an engine whose swap fails or does not check is replaced, never
used. Another architecture or other settings replace the engines. Each caption row records the checkpoint
that served it.

Lifecycle: ``captionflow serve`` starts it (on a local Ray it stays in the foreground, owning that Ray,
and writes ``<cache>/service.json`` so that runs on this machine find it; on a cluster it detaches);
``captionflow serve --stop`` stops it. Runs use it when it is there (``warm_engines``: auto / off / require).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from captionflow.errors import CaptionflowError, EngineFailed
from captionflow.fingerprint import digest, file_digests
from captionflow.model_source import ResolvedModel
from captionflow.pipeline.engine import EngineSettings
from captionflow.pipeline.service_address import local_service_address, service_file
from captionflow.pipeline.session import WORKER_ENV
from captionflow.processes import alive, process_started

log = logging.getLogger("captionflow.service")

APP = "captionflow"
ENGINE = "caption-engine"
CONTROLLER = "captionflow-service"
NAMESPACE = "captionflow"


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
    ) -> None:
        """``model`` is in every engine of ``apps`` and checked."""
        self.state.update(
            apps=list(apps),
            spec=spec,
            model=model,
            model_path=model_path,
            model_fingerprint=model_fingerprint,
            last_used=time.time(),
        )
        self.state["swaps"] += int(swapped)
        try:  # Ray Serve imported and the handles made now, not at the next run's swap
            for app in apps:
                self._engine(app)
        except Exception:  # made at the swap then, which says what fails
            pass

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
            for app in self.state["apps"]:
                try:
                    serve.delete(app)  # the engine's replica ends: its GPU share and CPUs are free
                except Exception:
                    pass


async def _awaited(response: Any) -> Any:
    """A Serve ``DeploymentResponse``'s result, as a coroutine (for ``asyncio.wait_for``)."""
    return await response


# ---------------------------------------------------------------- deploying the engines
def app_names(n: int) -> list[str]:
    return [f"{APP}-{i}" for i in range(n)]


def _deploy(model: ResolvedModel, engine: EngineSettings, apps: list[str]) -> float:
    """Deploy (or replace) the engines of ``apps`` with ``model`` and ``engine`` (``service_engines``' settings),
    all at once; returns seconds until every one is ready."""
    from ray import serve
    from ray.serve.api import RunTarget

    from captionflow.compat.cuda_mps import ensure_mps
    from captionflow.pipeline.engine_server import CaptionEngine

    t0 = time.perf_counter()
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
    targets = [RunTarget(target=app, name=name, route_prefix=None) for name in apps]
    serve.run_many(targets)
    return round(time.perf_counter() - t0, 2)


def _handle(app: str):
    from ray import serve

    return serve.get_deployment_handle(ENGINE, app)


# ---------------------------------------------------------------- starting, finding, stopping
def start_service(model: ResolvedModel, engine: EngineSettings, idle_timeout_s: float, address: Optional[str]) -> Any:
    """Deploy the engine and the controller on the connected Ray; returns the controller."""
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
    settings, n = engine.service_engines()
    apps = app_names(n)
    seconds = _deploy(model, settings, apps)
    spec = engine_spec(model, engine)
    ray.get(controller.loaded.remote(apps, spec, model.source, model.path, model.fingerprint, False))
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
    log.info("%d warm engine(s) ready in %.1f s: %s", n, seconds, model.source)
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
    info = ray.get(c.describe.remote(), timeout=60)
    if info["stopped"]:
        return None
    if engines:
        info["engines"] = {}
        for app in info["apps"]:
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
    whose cluster is gone (after ``RAY_gcs_rpc_server_reconnect_timeout_s``, 15 s for runs on a local
    service): this says why first, in the run's log, so the run fails with the reason, never hangs."""

    def __init__(self) -> None:
        info = json.loads(service_file().read_text())
        self.pid, self.started = int(info["pid"]), info.get("pid_started")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="captionflow-service-lifeline", daemon=True)

    def _watch(self) -> None:
        while not self.stop.wait(1.0):
            if not alive(self.pid, self.started):
                log.error(
                    "the warm engine service (pid %d) stopped during the run, and its Ray with it: this run "
                    "ends; the captions it committed are kept; run again to caption the rest (with no "
                    "service running, a run starts engines of its own)",
                    self.pid,
                )
                return

    def __enter__(self) -> _Lifeline:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()


# ---------------------------------------------------------------- a run on the service
SWAP_TIMEOUT_S = 1800.0  # a swap, a check or a replacement of the engines


class WarmEngine:
    """What a run uses: once ``wait`` returns, the engines' applications holding its checkpoint, checked, and how it
    got into them: "loaded" (already), "swapped" (hot swap), "replaced" (new engines), in ``seconds``; the run's lease
    token.

    The checkpoint is loaded in the background while the run's dataset starts (its reads, its requests); the run
    sends no request before ``wait`` has returned (``warm_feed.py``)."""

    def __init__(self, apps: list[str], model_fingerprint: str, token: str):
        self.apps, self.model_fingerprint, self.token = apps, model_fingerprint, token
        self.how, self.seconds = "", 0.0
        self.error: Optional[BaseException] = None
        self.done = threading.Event()

    def handles(self) -> list:
        """A Serve handle to each engine of ``apps``, in order."""
        return [_handle(app) for app in self.apps]

    def wait(self) -> WarmEngine:
        """Once the checkpoint is in (or its load failed: raises why)."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self


class _Hold:
    """A run's hold on the service: its lease token, renewed in the background until ``release``, and its checkpoint's
    load, started at once (``warm``)."""

    def __init__(self, c, token: str, model: ResolvedModel, engine: EngineSettings, spec: str, owner: str = ""):
        import ray

        self.c, self.token, self.owner = c, token, owner
        self.stop = threading.Event()
        self.renewer = threading.Thread(target=self._renew, name="captionflow-warm-lease", daemon=True)
        self.renewer.start()
        self.loading: Optional[threading.Thread] = None
        try:
            info = ray.get(c.describe.remote(), timeout=60)
            same = info["spec"] == spec and info["apps"]  # else _load replaces them with the run's layout
            self.warm = WarmEngine(
                list(info["apps"]) if same else app_names(engine.service_engines()[1]), model.fingerprint, token
            )
            self.loading = threading.Thread(
                target=_load, args=(c, model, engine, info, spec, self.warm), name="captionflow-warm-load", daemon=True
            )
            self.loading.start()
        except BaseException:
            self.release()
            raise

    def _renew(self) -> None:
        import ray

        while not self.stop.wait(LEASE_TTL_S / 3):
            try:
                ray.get(self.c.renew.remote(self.token), timeout=LEASE_TTL_S / 3)
            except Exception:  # the service is gone: the run finds that out where it uses the engines
                pass

    def release(self) -> None:
        """Give the engines back, once no swap runs on them."""
        import ray

        if self.loading is not None:
            self.loading.join()
        self.stop.set()
        try:
            ray.get(self.c.release.remote(self.token), timeout=60)
        except Exception:  # the service went away: nothing to give back
            pass


def _acquire(c, owner: str, wait_s: Optional[float]) -> Optional[str]:
    """The service's lease token, waiting up to ``wait_s`` while another run holds it (saying for whom); with
    ``wait_s`` None, not waiting: None when it is held."""
    import ray

    t0, said = time.monotonic(), 0.0
    while True:
        got = ray.get(c.try_acquire.remote(owner), timeout=60)
        if got.get("stopped"):
            raise ServiceError("the warm engine service has stopped")
        if "token" in got:
            return got["token"]
        if wait_s is None:
            return None
        waited = time.monotonic() - t0
        if waited > wait_s:
            raise ServiceError(f"the warm engines stayed in use by {got['holder']['owner']} for {waited:.0f} s")
        if waited - said >= 60 or said == 0.0:
            log.warning("waiting for the warm engines: in use by %s", got["holder"]["owner"])
            said = max(waited, 1e-9)
        time.sleep(1.0)


# Holds taken at preflight (``start_early``) for the run's inference stage, by checkpoint and engine spec; one that
# no inference stage takes within EARLY_HOLD_S (the run failed before, or its dataset is being preprocessed) is
# released, and the inference stage takes the service then (finding its checkpoint loaded, unless another run came).
EARLY_HOLD_S = 60.0
_EARLY: dict[tuple[str, str], _Hold] = {}


_EARLY_LOCK = threading.Lock()


def start_early(cfg, model: ResolvedModel, engine: EngineSettings) -> bool:
    """At preflight, on a cluster with a warm engine service that no run holds: take it and start loading ``model``,
    while the run lists and checks its dataset (for a golden set, ~2-3 s before its inference stage would have).
    True when it did."""
    from captionflow.lease import _default_owner

    if cfg.warm_engines == "off" or engine.tensor_parallel_size > 1:
        return False
    c = _controller()
    if c is None:
        return False
    key = (model.fingerprint, engine_spec(model, engine))
    try:
        with _EARLY_LOCK:
            if key in _EARLY:
                return True
            owner = _default_owner()
            token = _acquire(c, owner, wait_s=None)
            if token is None:
                return False
            hold = _EARLY[key] = _Hold(c, token, model, engine, key[1], owner)
    except Exception as e:  # the inference stage tries again, and says what fails there
        log.warning("warm engines: could not take the service at preflight: %s: %s", type(e).__name__, str(e)[:300])
        return False
    timer = threading.Timer(EARLY_HOLD_S, _end_early, args=(key, hold))
    timer.daemon = True
    timer.start()
    return True


def end_early(owner: str) -> None:
    """Give back the holds ``owner`` took at preflight that no inference stage took (its result was cached)."""
    with _EARLY_LOCK:
        mine = [(k, h) for k, h in _EARLY.items() if h.owner == owner]
    for key, hold in mine:
        _end_early(key, hold)


def _end_early(key: tuple[str, str], hold: _Hold) -> None:
    with _EARLY_LOCK:
        if _EARLY.get(key) is not hold:
            return  # taken by its inference stage
        del _EARLY[key]
    hold.release()


@contextlib.contextmanager
def use(model: ResolvedModel, engine: EngineSettings, owner: str, wait_s: float) -> Iterator[WarmEngine]:
    """Hold the service for one run: wait for it, get ``model`` loaded (swap, check, replace) while the run goes
    on, and give it back once the run and the load are over. A hold taken at preflight (``start_early``) is
    taken over."""
    c = _controller()
    if c is None:
        raise ServiceError("no warm engine service on this Ray cluster")
    spec = engine_spec(model, engine)
    with _EARLY_LOCK:
        hold = _EARLY.pop((model.fingerprint, spec), None)
    if hold is None:
        hold = _Hold(c, _acquire(c, owner, wait_s), model, engine, spec, owner)
    warm = hold.warm
    try:
        with _Lifeline() if local_service_address() else contextlib.nullcontext():
            try:
                yield warm
            except BaseException:
                warm.done.wait()
                if warm.error is not None:  # the run failed because its checkpoint did not get in: say why
                    raise warm.error from None
                raise
    finally:
        hold.release()


def _load(c, model: ResolvedModel, engine: EngineSettings, info: dict, spec: str, warm: WarmEngine) -> None:
    """Get ``model`` into the service's engines (``info``: the controller's state when the run took it) and tell
    the controller, for ``warm``'s run; runs in the background (``use``): the outcome goes to ``warm``."""
    import ray

    settings, n = engine.service_engines()
    t0 = time.perf_counter()
    apps, how = list(info["apps"]), "loaded"
    try:
        try:
            if info["spec"] != spec or not apps:
                log.warning(
                    "warm engines: %s needs another architecture or other engine settings: replacing the engines",
                    model.source,
                )
                apps = _replace_all(model, settings, apps, app_names(n))
                how = "replaced"
            elif info["model_fingerprint"] != model.fingerprint:
                got = ray.get(c.swap.remote(warm.token, model.path, model.fingerprint), timeout=SWAP_TIMEOUT_S)
                for app, seconds in got["swapped"].items():
                    log.info("warm engines: %s loaded into %s in %.2f s and checked", model.source, app, seconds)
                bad = got["bad"]
                if bad:
                    log.warning(
                        "warm engines: the swap to %s did not take on %s: replacing %s",
                        model.source,
                        "; ".join(f"{app} ({why})" for app, why in bad.items()),
                        "it" if len(bad) == 1 else "them",
                    )
                    _deploy(model, settings, list(bad))
                how = "replaced" if len(bad) == len(apps) else "swapped"
        except CaptionflowError:
            raise
        except Exception as e:
            raise EngineFailed(
                f"warm engines: loading {model.source} failed: {type(e).__name__}: {str(e)[:300]}"
            ) from e
        ray.get(c.loaded.remote(apps, spec, model.source, model.path, model.fingerprint, how == "swapped"), timeout=60)
        warm.apps, warm.how, warm.seconds = apps, how, round(time.perf_counter() - t0, 2)
    except BaseException as e:
        warm.error = e
    finally:
        warm.done.set()


def _replace_all(model: ResolvedModel, settings: EngineSettings, old: list[str], new: list[str]) -> list[str]:
    from ray import serve

    gone = set(old) - set(new)  # fewer engines now: the others go
    for app in sorted(gone):
        try:
            serve.delete(app)
        except Exception:  # not there
            pass
    _deploy(model, settings, new)
    return new


@contextlib.contextmanager
def for_run(cfg, model: ResolvedModel, engine: EngineSettings) -> Iterator[Optional[WarmEngine]]:
    """The warm engine for one run when a service runs on the connected Ray (per ``warm_engines``), else None."""
    if cfg.warm_engines == "off" or engine.tensor_parallel_size > 1:
        yield None
        return
    if describe() is None:
        if cfg.warm_engines == "require":
            raise ServiceError(
                "warm_engines is 'require' but no warm engine service runs (start one: captionflow serve)"
            )
        yield None
        return
    from captionflow.lease import _default_owner

    with use(model, engine, _default_owner(), cfg.lease_wait_s) as warm:
        yield warm
