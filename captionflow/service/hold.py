"""A run on the warm engine service: its lease, the checkpoint loaded (swapped, or the engines replaced) while the
run's dataset starts, and the engines handed to the run (``controller.py`` says what the service is).

A run takes the service's lease for its checkpoint as early as preflight (``start_early``), so that the swap is under
way while the run lists and preprocesses; ``use`` / ``for_run`` give the run a ``WarmEngine`` once the checkpoint is
in every engine and checked, or say why not. One run holds the engines at a time; a hold lapses when its run is gone.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Optional

from captionflow.engines.address import local_service_address
from captionflow.engines.engine import EngineSettings
from captionflow.errors import CaptionflowError, EngineFailed
from captionflow.model_source import ResolvedModel
from captionflow.service.controller import (
    LEASE_TTL_S,
    SWAP_TIMEOUT_S,
    ServiceError,
    _controller,
    _deploy,
    _handle,
    _Lifeline,
    app_names,
    describe,
    engine_spec,
    log,
)


class WarmEngine:
    """What a run uses: once ``wait`` returns, the engines' applications holding its checkpoint, checked, and how it
    got into them: "loaded" (already), "swapped" (hot swap), "replaced" (new engines), in ``seconds``; the run's lease
    token.

    The checkpoint is loaded in the background while the run's dataset starts (its reads, its requests); the run
    sends no request before ``wait`` has returned (``service/feed.py``)."""

    def __init__(self, apps: list[str], model_fingerprint: str, token: str, judge: Optional[dict] = None):
        self.apps, self.model_fingerprint, self.token = apps, model_fingerprint, token
        self.judge = judge  # the service's judge engines (the controller's "judge"), if it keeps any
        self.how, self.seconds = "", 0.0
        self.error: Optional[BaseException] = None
        self.done = threading.Event()

    def handles(self) -> list:
        """A Serve handle to each engine of ``apps``, in order."""
        return [_handle(app) for app in self.apps]

    def judge_engines(self) -> WarmEngine:
        """The service's judge engines, as a run's warm engines (they hold the judge since the service started)."""
        judges = WarmEngine(list(self.judge["apps"]), self.judge["model_fingerprint"], self.token)
        judges.how = "loaded"
        judges.done.set()
        return judges

    def judges(self, judge: ResolvedModel, engine: EngineSettings) -> Optional[str]:
        """None where the service's judge engines hold ``judge`` with ``engine``'s settings (they can judge this
        run's captions as they are made: ``feed.WarmRows.then``), else why not."""
        return _not_judging(self.judge, judge, engine)

    def processor(self, config, engine: EngineSettings, preprocess, postprocess, map_kwargs: dict, ordered: bool):
        """The Ray Data LLM processor of ``config`` whose engine stage runs in these engines
        (``engines.processor.build_vlm_processor`` asks for it): the run's tasks build the requests, the driver feeds
        them to the engines (``feed.WarmRows``)."""
        from captionflow.service.feed import warm_processor

        return warm_processor(config, self, engine, preprocess, postprocess, map_kwargs, ordered)

    def wait(self) -> WarmEngine:
        """Once the checkpoint is in (or its load failed: raises why)."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self


def _not_judging(kept: Optional[dict], judge: ResolvedModel, engine: EngineSettings) -> Optional[str]:
    """Why the judge engines ``kept`` (the controller's "judge") cannot judge for ``judge`` with ``engine``'s
    settings; None where they can."""
    if not kept:
        return "the warm engine service keeps no judge engines (captionflow serve with the run's judge)"
    if kept["model_fingerprint"] != judge.fingerprint or kept["spec"] != engine_spec(judge, engine):
        return f"the warm engine service's judge engines hold {kept['model']}, not {judge.source}"
    return None


class _Hold:
    """A run's hold on the service: its lease token, renewed in the background until ``release``, and its checkpoint's
    load, started at once (``warm``)."""

    def __init__(
        self, c, token: str, model: Optional[ResolvedModel], engine: EngineSettings, spec: str, owner: str = ""
    ):
        import ray

        self.c, self.token, self.owner = c, token, owner
        self.stop = threading.Event()
        self.renewer = threading.Thread(target=self._renew, name="captionflow-warm-lease", daemon=True)
        self.renewer.start()
        self.loading: Optional[threading.Thread] = None
        try:
            info = ray.get(c.describe.remote(), timeout=60)
            if model is None:  # a judge's pass: the engines as they are (``for_judge``)
                self.warm = WarmEngine(list(info["apps"]), info["model_fingerprint"], token, info.get("judge"))
                self.warm.done.set()
                return
            same = info["spec"] == spec and info["apps"]  # else _load replaces them with the run's layout
            n = engine.service_engines(beside_judge=bool(info.get("judge")))[1]
            self.warm = WarmEngine(
                list(info["apps"]) if same else app_names(n), model.fingerprint, token, info.get("judge")
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
    from captionflow.data.lease import _default_owner

    if cfg.warm_engines == "off" or engine.tensor_parallel_size > 1 or model.adapter is not None:
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
def use(model: Optional[ResolvedModel], engine: EngineSettings, owner: str, wait_s: float) -> Iterator[WarmEngine]:
    """Hold the service for one run: wait for it, get ``model`` loaded (swap, check, replace) while the run goes
    on, and give it back once the run and the load are over. A hold taken at preflight (``start_early``) is
    taken over. ``model`` None: the engines as they are (a judge's pass on the service's judge engines)."""
    c = _controller()
    if c is None:
        raise ServiceError("no warm engine service on this Ray cluster")
    spec = engine_spec(model, engine) if model is not None else ""
    with _EARLY_LOCK:
        hold = _EARLY.pop((model.fingerprint, spec), None) if model is not None else None
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

    settings, n = engine.service_engines(beside_judge=bool(info.get("judge")))  # the judge's keep their share
    t0 = time.perf_counter()
    apps, how, lora_rank = list(info["apps"]), "loaded", info.get("lora_rank", 0)
    try:
        try:
            if info["spec"] != spec or not apps:
                log.warning(
                    "warm engines: %s needs another architecture or other engine settings: replacing the engines",
                    model.source,
                )
                apps = _replace_all(model, settings, apps, app_names(n))
                how, lora_rank = "replaced", settings.lora_rank
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
                    lora_rank = min(lora_rank, settings.lora_rank)
                how = "replaced" if len(bad) == len(apps) else "swapped"
        except CaptionflowError:
            raise
        except Exception as e:
            raise EngineFailed(
                f"warm engines: loading {model.source} failed: {type(e).__name__}: {str(e)[:300]}"
            ) from e
        ray.get(
            c.loaded.remote(apps, spec, model.source, model.path, model.fingerprint, how == "swapped", lora_rank),
            timeout=60,
        )
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
    info = describe()
    if info is None:
        if cfg.warm_engines == "require":
            raise ServiceError(
                "warm_engines is 'require' but no warm engine service runs (start one: captionflow serve)"
            )
        yield None
        return
    if model.adapter is not None and (why := _not_adapting(info, model)):
        if cfg.warm_engines == "require":
            raise ServiceError(f"warm_engines is 'require' but {why}")
        log.info("warm engines: %s: the adapter runs on engines of its own", why)
        yield None
        return
    from captionflow.data.lease import _default_owner

    # an adapter: the engines hold its base (swapped in where they hold another checkpoint), each request names
    # the adapter, which vLLM loads into a LoRA slot at its first request (no weights reloaded)
    with use(model.base(), engine, _default_owner(), cfg.lease_wait_s) as warm:
        yield warm


def _not_adapting(info: dict, model: ResolvedModel) -> Optional[str]:
    """Why the service's engines (``info``: the controller's state) cannot serve LoRA adapter ``model``; None
    where they can (LoRA slots of a rank that holds it; its base is swapped in where another checkpoint is)."""
    rank = int(info.get("lora_rank") or 0)
    if not rank:
        return "the warm engine service has no LoRA slots (captionflow serve --lora-slots K)"
    if rank < model.adapter.rank:
        return f"the warm engine service's LoRA rank {rank} is below the adapter's {model.adapter.rank}"
    return None


@contextlib.contextmanager
def for_judge(cfg, judge: ResolvedModel, engine: EngineSettings) -> Iterator[Optional[WarmEngine]]:
    """The warm engine service's judge engines for one judge pass, held for it (one run at a time, as ``for_run``),
    where they hold ``judge`` with ``engine``'s settings (``WarmEngine.judges``), else None: the pass starts
    engines of its own (said in the log where a service runs)."""
    if cfg.warm_engines == "off" or engine.tensor_parallel_size > 1:
        yield None
        return
    info = describe()
    why = _not_judging(info.get("judge"), judge, engine) if info is not None else "no service"
    if why:
        if info is not None:
            log.info("warm engines: %s: the judge starts engines of its own", why)
        yield None
        return
    from captionflow.data.lease import _default_owner

    with use(None, engine, _default_owner(), cfg.lease_wait_s) as warm:
        why = warm.judges(judge, engine)  # the service may have changed while this run waited for it
        if why is None:
            log.info("warm engines: the service's judge engines judge (%s)", judge.source)
            yield warm.judge_engines()
            return
    log.info("warm engines: %s: the judge starts engines of its own", why)  # the service given back first
    yield None
