"""The ``captionflow`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import types
import typing
from pathlib import Path

from captionflow.config import RunConfig, grouped_fields, load_config
from captionflow.evaluation.sequential import verdict_line
from deployments.deploy import POOL_TYPES
from flows.parameters import flow_parameters
from flows.status import cmd_status


def _add_config_options(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One option per RunConfig field (--max-tokens, ...), help text from the field's description, in an
    argument group per ``config.GROUPS`` entry."""
    groups: dict[str, typing.Any] = {}
    for group, name, field in grouped_fields():
        if name in skip:
            continue
        if group not in groups:
            groups[group] = p.add_argument_group(f"{group.lower()} options")
        add = groups[group].add_argument
        flag = "--" + name.replace("_", "-")
        help_ = (field.title or name) + (f": {field.description}" if field.description else "")
        help_ = help_.replace("%", "%%")  # argparse formats help with %: "90% of the GPU" broke --help
        ann = field.annotation
        union = typing.get_origin(ann) in (typing.Union, types.UnionType)
        base = next(a for a in typing.get_args(ann) if a is not type(None)) if union else ann  # Optional[X] -> X
        if base is bool:
            add(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typing.get_origin(base) is typing.Literal:
            add(flag, dest=name, choices=typing.get_args(base), default=None, help=help_)
        elif name == "engine_kwargs":
            add(flag, dest=name, type=_json_object, default=None, help=help_ + " (JSON object)")
        else:
            add(
                flag,
                dest=name,
                type=base if base in (int, float) else str,
                default=None,
                help=f"{help_} (default: {field.default!r})" if field.default is not None else help_,
            )


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {text!r}")
    return value


def _summary_text(s: dict, command: str = "run") -> str:
    c, m, t = s["counts"], s["metrics"], s["timings_s"]
    ref = m.get("reference") or {}
    lines = [
        f"captionflow {command} finished",
        f"  dataset   {s['dataset_dir']}" + ("  (preprocessed earlier: reused)" if s.get("preprocess_skipped") else ""),
        f"  run       {s['run_dir']}",
        f"  images    {c['total']} listed: {c['accepted']} accepted, {c['quarantined']} quarantined, "
        f"{c['duplicates']} duplicates",
        *(
            [
                f"  hidden    {h['count']} hidden entr{'y' if h['count'] == 1 else 'ies'} not taken as inputs "
                "(names starting with '.'): "
                + ", ".join(h["examples"])
                + (", ..." if h["count"] > len(h["examples"]) else "")
            ]
            if (h := s.get("hidden_skipped") or {}).get("count")
            else []
        ),
        *(
            [
                "  reasons   "
                + ", ".join(f"{k} {v}" for k, v in sorted(s["quarantine_reasons"].items()))
                + f"  ({s['dataset_dir']}/quarantine.parquet)"
            ]
            if s.get("quarantine_reasons")
            else []
        ),
        f"  captions  {c['captioned']} captioned, {c['failed']} failed"
        + (f" ({s['resumed_from']} from an earlier run)" if s.get("resumed_from") else ""),
        "  metrics   "
        + ", ".join(
            [f"{k} {ref[k]:.4f}" for k in ("bleu_4", "rouge_l", "cider") if k in ref]
            + [f"mean words {m['stats']['words']['mean']:.1f}"]
        ),
        *([f"  verdict   {verdict_line(m['sequential'])}"] if m.get("sequential") else []),
        *([f"  deadline  {d['line']} ({d['deadline']})"] if (d := s.get("deadline")) else []),
        "  time      " + ", ".join(f"{k} {v}s" for k, v in t.items()),
        f"  report    {s['report']}",
        *(
            [
                f"  REGRESSED {r['metric']} {r['value']:.4f} is {100 * r['relative_drop']:.1f}% below the best "
                f"comparable run's {r['best_value']:.4f} ({r['best_model']}): event captionflow.checkpoint.regressed"
            ]
            if (r := s.get("regression"))
            else []
        ),
    ]
    return "\n".join(lines)


class _UserError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


class _RunFailed(Exception):
    """The run failed for a reason captionflow names (rows that failed, a stall, a lease): one line, exit 1."""


def _config(args: argparse.Namespace) -> RunConfig:
    overrides = {k: getattr(args, k, None) for k in RunConfig.model_fields}
    try:
        return load_config(args.config, **overrides)
    except (ValueError, OSError) as e:
        raise _UserError(f"invalid parameters: {e}") from None


_GUARDED: list[int] = []


def _own_temporary_server() -> None:
    """Without a Prefect API (``PREFECT_API_URL``), Prefect starts a temporary server for the flow, and stops it when
    this process exits normally; one killed (``kill -9``, the OOM killer) left it running, ~200 MB each. It is started
    here, before the flow, as Prefect would start it, with a guard process that ends it once this process is gone
    (``processes.end_with_this_process``)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled or _GUARDED:
        return
    from prefect.server.api.server import SubprocessASGIServer

    from captionflow.processes import end_with_this_process

    server = SubprocessASGIServer()  # the instance Prefect's clients use when no API is set
    server.start()
    if server.server_process is not None:
        _GUARDED.append(server.server_process.pid)
        end_with_this_process(server.server_process.pid)


def _flow_call(fn, **kwargs):
    """Run a flow; captionflow's own errors become one line: bad input (a ValueError: dataset, model, options,
    or an output or device that cannot be used) exit status 2, other named failures 1."""
    from captionflow.errors import CaptionflowError, ClusterUnreachable
    from captionflow.preflight import OutputError, PlacementError

    try:
        return fn(**kwargs)
    except (ValueError, OutputError, PlacementError, ClusterUnreachable) as e:
        if isinstance(e, CaptionflowError):
            raise _UserError(str(e)) from None
        raise
    except CaptionflowError as e:
        raise _RunFailed(str(e)) from None


def _check_inputs(cfg: RunConfig, models: list[str] | None = None) -> None:
    """A user error in the inputs as one line, before a flow (and a Prefect server) starts."""
    from captionflow.preflight import check_inputs

    _flow_call(check_inputs, cfg=cfg, models=models)


def _run_flow(fn, **kwargs):
    """A flow, after its inputs were checked (``_check_inputs``): with its temporary Prefect server guarded."""
    _own_temporary_server()
    _one_line_errors()
    return _flow_call(fn, **kwargs)


class _NoOwnTraceback:
    """A filter of Prefect's console handler: a record carrying one of captionflow's own errors (a CaptionflowError:
    a message that says what and where) is left out there - the command prints the message as its one line - and
    kept in the flow run's logs in the UI (their handler is the flow and task run loggers', ahead of this one)."""

    def filter(self, record) -> bool:
        from captionflow.errors import CaptionflowError

        return not (record.exc_info and isinstance(record.exc_info[1], CaptionflowError))


def _one_line_errors() -> None:
    """An error of captionflow's raised in a flow printed Prefect's traceback (94-188 lines) before its one line."""
    import logging

    from prefect.logging.configuration import setup_logging
    from prefect.logging.handlers import PrefectConsoleHandler

    setup_logging()  # once: later setups are incremental and keep the handlers (and this filter)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
            isinstance(f, _NoOwnTraceback) for f in handler.filters
        ):
            handler.addFilter(_NoOwnTraceback())


def cmd_run(args: argparse.Namespace) -> int:
    from flows.caption_flow import caption_flow

    cfg = _config(args)
    _check_inputs(cfg)
    summary = _run_flow(caption_flow, **flow_parameters(cfg))
    print(_summary_text(summary))
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2, sort_keys=True, default=str)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from flows.compare_flow import compare_checkpoints

    cfg = _config(args)
    _check_inputs(cfg, models=list(args.models))
    result = _run_flow(compare_checkpoints, **flow_parameters(cfg), models=tuple(args.models), parallel=args.parallel)
    keys = ("bleu_4", "rouge_l", "cider", "meteor", "judge_mean")
    print(f"{'model':40}" + "".join(f"{k:>12}" for k in keys))
    for row in result["leaderboard"]:
        print(
            f"{row['model'][-40:]:40}"
            + "".join(f"{row[k]:>12.4f}" if row.get(k) is not None else f"{'':>12}" for k in keys)
        )
    for model, run in zip(args.models, result.get("runs") or []):  # each checkpoint's answer, and where to look
        print(f"report  {model}: {run.get('report_html') or run['report']}")
        if said := _compared_line(run.get("metrics") or {}):
            print(f"        {said}")
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2, sort_keys=True, default=str)
    return 0


def _compared_line(metrics: dict) -> str:
    """A checkpoint's answer in a compare: its sequential verdict, else the paired bootstrap of CIDEr-D against the
    previous comparable run; '' for the first."""
    if metrics.get("sequential"):
        return f"verdict {verdict_line(metrics['sequential'])}"
    previous = (metrics.get("comparison") or {}).get("previous") or {}
    sig = (previous.get("significance") or {}).get("cider")
    if not sig:
        return ""
    return (
        f"vs {previous['model']}: CIDEr-D {sig['delta']:+.4f}, 95% [{sig['ci_low']:+.4f}, {sig['ci_high']:+.4f}], "
        f"{sig['verdict']} (paired bootstrap on {sig['n_images']:,} images)"
    )


def cmd_evaluate(args: argparse.Namespace) -> int:
    from flows.evaluate_flow import evaluate_captions

    cfg = _config(args)
    _check_inputs(cfg, models=[])  # the captions were made elsewhere: no model to check
    summary = _run_flow(evaluate_captions, **flow_parameters(cfg), captions=args.captions, name=args.name)
    print(_summary_text(summary, "evaluate"))
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2, sort_keys=True, default=str)
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from captionflow.config import validation_lines
    from deployments.deploy import deploy, prefect_yaml

    cfg = _config(args)
    try:
        if args.prefect_yaml:
            text = prefect_yaml(cfg, args.work_pool, args.cron, pool_type=args.pool_type, image=args.image)
            Path(args.prefect_yaml).write_text(text, encoding="utf-8")
            print(f"wrote {args.prefect_yaml}: prefect deploy --prefect-file {args.prefect_yaml} --all")
            return 0
        ids = deploy(
            cfg,
            work_pool=args.work_pool,
            cron=args.cron,
            pool_type=args.pool_type,
            image=args.image,
            notify_block=args.notify_block,
            pool_concurrency=args.pool_concurrency or None,
        )
    except ValueError as e:  # an option deploy refuses (OptionError), or one Prefect refuses (a cron string)
        raise _UserError(validation_lines(e) if isinstance(e, ValidationError) else str(e)) from None
    for name, dep_id in ids.items():
        print(
            f"automation {name!r}: {dep_id}"
            if name.startswith("captionflow:")
            else f"deployment captionflow/{name}: {dep_id}"
        )
    print(f"start a worker: prefect worker start --pool {args.work_pool}")
    return 0


def cmd_leaderboard(args: argparse.Namespace) -> int:
    from captionflow.data.storage import Store
    from captionflow.report.markdown import leaderboard_rows, leaderboard_table

    rows = leaderboard_rows(Store(args.output), args.dataset, args.generation, args.model)[: args.limit]
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    elif not rows:
        print(
            f"no leaderboard rows under {args.output}"
            + (" matching the filters" if (args.dataset or args.generation or args.model) else "")
        )
    else:
        print(leaderboard_table(rows))
    return 0


MAX_PLAN_GPUS = 1024


def cmd_plan(args: argparse.Namespace) -> int:
    """How many GPUs caption --images by --deadline, from the measured rates (captionflow/runs/plan.py); for
    --model or --arch (and other pixels or tokens) scaled by FLOPs per image."""
    from datetime import UTC, datetime

    from captionflow.deadline import human, parse
    from captionflow.runs import plan as planning

    try:
        now = datetime.now(UTC)
        seconds = (parse(args.deadline, now) - now).total_seconds()
    except ValueError as e:
        raise _UserError(f"plan: {e}") from None
    results = Path(args.results) if args.results else planning.RESULTS
    try:
        scaling = planning.load_scaling(args.gpu, results)
        basis = planning.basis(results, scaling.device)
        config, name = planning.model_config(args.model, args.arch or (None if args.model else basis["arch"]))
        pixels, tokens = args.max_pixels or basis["max_pixels"], args.max_tokens or basis["max_tokens"]
        scaling, said = planning.for_model(scaling, config, name, pixels, tokens, basis)
        unfit = _plan_fit(config, args.model, args.quantization, scaling.device)
        if unfit:
            raise ValueError(f"plan: {name} on one {scaling.device}: {unfit}")
        if seconds <= scaling.start_s:
            raise ValueError(
                f"plan: the deadline is {human(max(seconds, 0))} away, and the engines alone take ~"
                f"{human(scaling.start_s)} to start on {scaling.device}: no number of GPUs makes it"
            )
        p = planning.plan(args.images, seconds, scaling)
    except ValueError as e:
        raise _UserError(str(e)) from None
    p["basis"] = said
    if args.json:
        print(json.dumps(p, indent=2, sort_keys=True))
        return 0
    print(
        f"{p['images']:,} images by {args.deadline} on {p['device']} ({p['rate_per_gpu']:.0f} images/s on one GPU, "
        f"efficiency {p['efficiency']:.2f}, engines start in {p['start_s']:.0f} s; {p['source']})"
    )
    print(f"  basis: {said}")
    if p["gpus"] is None:
        print(f"  not even {MAX_PLAN_GPUS} GPUs: split the set, or give more time")
        return 1
    print(
        f"  {p['gpus']} GPU{'s' if p['gpus'] > 1 else ''}: projected {human(p['projected_s'])}, "
        f"{human(p['spare_s'])} to spare"
    )
    return 0


GPU_MEMORY_GIB = {"h100": 80, "h200": 141}  # the GPUs the rates were measured on


def _plan_fit(config: dict, model: str | None, quantization: str | None, device: str) -> str:
    """Why the model does not fit one GPU of ``device`` in one engine ('' where it does, or it is not known)."""
    import tempfile

    from captionflow.engines.presets import GPU, model_weight_bytes, too_large

    gib = GPU_MEMORY_GIB.get(device)
    if not gib:
        return ""

    def unfit(folder: str) -> str:
        weights = model_weight_bytes(folder, quantization)
        return too_large(GPU, weights, gib * 2**30, 1, quantization, model_weight_bytes(folder, "fp8")) or ""

    if model:
        return unfit(model)
    # an architecture: its config and its parameter count (counted on the meta device), as a stand-in says them
    from captionflow.builtin.standin import count_parameters

    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "config.json").write_text(json.dumps(config))
        Path(folder, "captionflow_model.json").write_text(json.dumps({"parameters": count_parameters(folder)}))
        return unfit(folder)


def cmd_reports(args: argparse.Namespace) -> int:
    """Serve the output root over HTTP, read only, for the report links of runs given ``report_url``; SIGTERM (the
    command's handler, ``_exit_on_term``) or Ctrl-C stops it."""
    from captionflow.report.serve import report_server

    try:
        server = report_server(args.output, args.host, args.port)
    except (ValueError, OSError) as e:
        raise _UserError(str(e)) from None
    host, port = server.server_address[:2]
    print(f"serving {args.output} read only at http://{host}:{port}/ - runs with report_url http://<this host>:{port}/ "
          "link their reports here; stop with Ctrl-C", flush=True)  # fmt: skip
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Start the warm engine service (foreground on a local Ray, detached on a cluster), or stop or show it."""
    import math
    import signal
    import time

    from captionflow.engines.address import local_service_address, service_file
    from captionflow.engines.session import cluster_address, ray_session
    from captionflow.service import controller as service

    cfg = _config(args)
    if args.stop or args.status:
        if cluster_address(cfg) is None:
            print("no warm engine service runs here")
            return 0
        ray_session(cfg)
        info = service.stop_service() if args.stop else service.describe(engines=True)
        if info is None:
            print("no warm engine service runs here")
        else:
            print(("stopped: " if args.stop else "") + json.dumps(info, indent=2, sort_keys=True, default=str))
        return 0
    if cfg.ray_address is None and os.environ.get("RAY_ADDRESS") is None and local_service_address():
        raise _UserError(f"a warm engine service already runs on this machine ({service_file()})")
    from captionflow.engines.presets import PRESETS, local_ray_cpus
    from captionflow.preflight import preflight
    from captionflow.stages.judge import alongside

    checked = _flow_call(preflight, cfg=cfg.model_copy(update={"warm_engines": "off"}), prewarm_imports=False)
    preset = PRESETS[checked.engine.preset.name]
    judge = checked.judge if checked.judge_engine is not None else None  # the runs' judge (judge, pairwise_against)
    if judge is not None and (why := alongside(cfg, checked.engine, judge, checked.judge_engine)):
        raise _UserError(f"serve: the judge {judge.source} cannot keep engines beside the captioner's: {why}")
    # a local Ray with room for the service's engines beside a whole run's pipeline
    _, engines = checked.engine.service_engines(beside_judge=judge is not None)
    judges = checked.judge_engine.service_engines(beside_judge=True)[1] if judge is not None else 0
    cpus = cfg.ray_num_cpus or local_ray_cpus(preset, 1) + math.ceil((engines + judges) * preset.engine_cpus)
    session = ray_session(cfg.model_copy(update={"ray_num_cpus": cpus, "warm_engines": "off"}))
    # LoRA slots: runs of adapters of the loaded checkpoint use the engines as they are (an adapter as --model: its
    # base is loaded, with a slot for it at least)
    model, engine, adapter = checked.model.base(), checked.engine, checked.model.adapter
    slots, rank = max(args.lora_slots, 1 if adapter else 0), max(args.lora_rank, adapter.rank if adapter else 0)
    if slots:
        engine = engine.with_lora(slots, rank)
    service.start_service(model, engine, args.idle_timeout, session.address, judge, checked.judge_engine)
    print(
        f"warm engines ready: {model.source} ({engine.preset.name}, {engines} engine"
        f"{'s' if engines > 1 else ''}"
        + (f", {slots} LoRA slot{'s' if slots > 1 else ''} up to rank {engine.lora_rank}" if slots else "")
        + (f"; the judge {judge.source}, {judges} engine{'s' if judges > 1 else ''}" if judge else "")
        + "); runs use them while this runs; stop with: captionflow serve --stop",
        flush=True,
    )
    if not session.local:
        return 0  # on a cluster the service lives on without this process
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        while not stop and service.describe() is not None:
            time.sleep(2)
    finally:
        try:
            service.stop_service()
        except Exception:
            pass
        service_file().unlink(missing_ok=True)
        import ray

        ray.shutdown()
    print("warm engines stopped")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    import time

    from deployments.watcher import WatchError, watch_once

    while True:
        try:
            announced = watch_once(args.prefix, args.state)
        except Exception as e:
            if not args.every:
                if isinstance(e, WatchError):
                    print(f"captionflow watch: {e}", file=sys.stderr)
                    return 1
                raise
            why = str(e) if isinstance(e, WatchError) else f"{type(e).__name__}: {e}"
            print(f"captionflow watch: {why}; trying again in {args.every:g} s", file=sys.stderr, flush=True)
            announced = []
        for uri in announced:
            print(f"announced {uri}", flush=True)
        if not args.every:
            return 0
        time.sleep(args.every)


def cmd_build_model(args: argparse.Namespace) -> int:
    from captionflow.builtin.model import build_builtin_model, ensure_builtin_model

    if args.adapter:
        from captionflow.builtin.adapter import build_adapter

        if not args.dir:
            print("captionflow: --adapter needs DIR", file=sys.stderr)
            return 2
        print(build_adapter(args.dir, seed=args.seed or 1, base=args.base))
        return 0
    if args.arch:
        from captionflow.builtin.standin import build_standin

        if not args.dir:
            print("captionflow: --arch needs DIR", file=sys.stderr)
            return 2
        print(build_standin(args.arch, args.dir, args.quantization))
        return 0
    if args.seed and not args.dir:
        print("captionflow: --seed needs DIR (the cache holds the seed-0 built-in model)", file=sys.stderr)
        return 2
    print(build_builtin_model(args.dir, seed=args.seed) if args.dir else ensure_builtin_model())
    return 0


def cmd_demo_data(args: argparse.Namespace) -> int:
    from captionflow.builtin.demo_data import build_demo_dataset, ensure_demo_dataset

    print(build_demo_dataset(args.dir) if args.dir else ensure_demo_dataset())
    return 0


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("captionflow")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


class _Stopped(SystemExit):
    """The exit a stop request (SIGTERM) asks for: status 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signal = signum


def _exit_on_term(signum, frame) -> None:
    """SIGTERM (a scheduler's stop, ``timeout``) ends the command as an exit does: Prefect records the flow run
    Crashed, then sends the signal again to the handler it found, this one, and the exit handlers run (the local
    Ray's shutdown, Prefect's events and its temporary server). With the default handler the process died at
    once, leaving the local Ray's agents running."""
    raise _Stopped(signum)


_REDELIVERED: list[int] = []


def _stop_lost_in_a_finalizer(unraisable) -> None:
    """``sys.unraisablehook``: Python runs a signal's handler wherever the main thread is, a finalizer
    (``__del__``, a weakref callback) included, and there the exception it raises to stop the run (Prefect's
    ``TerminationSignal``, this module's ``_Stopped``) is printed and dropped: the run went on to its end as if
    never asked to stop (CI: a SIGTERM during preflight, the run ended 31 s later on its own error). The signal
    is sent again, from outside the finalizer (a few times at most); any other unraisable error is printed as
    Python prints it."""
    signum = getattr(unraisable.exc_value, "signal", None)
    exiting = unraisable.object is threading  # the interpreter's exit, waiting for threads: it ends anyway
    if not isinstance(signum, int) or exiting or len(_REDELIVERED) >= 3:
        sys.__unraisablehook__(unraisable)
        return
    _REDELIVERED.append(signum)
    again = threading.Timer(0.05, os.kill, args=(os.getpid(), signum))
    again.daemon = True
    again.start()


def _stop_on_term() -> None:
    """A stop request (SIGTERM) ends the command (``_exit_on_term``), lost in a finalizer or not."""
    import signal

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_term)
        sys.unraisablehook = _stop_lost_in_a_finalizer


def main(argv: list[str] | None = None) -> int:
    _stop_on_term()
    # No network at run time: the temporary Prefect server's telemetry would try (and log an ERROR).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The temporary server Prefect starts without PREFECT_API_URL has 20 s to come up by default: not
    # always enough on a busy 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    parser = argparse.ArgumentParser(
        prog="captionflow", description="Batch image captioning and VLM checkpoint evaluation."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the flow: ingest, preprocess, inference, evaluate")
    run.add_argument("--config", help="YAML file of parameters (command-line options win)")
    run.add_argument("--summary-json", help="also write the run summary as JSON here")
    _add_config_options(run)
    run.set_defaults(func=cmd_run)
    cmp_ = sub.add_parser("compare", help="evaluate several checkpoints on one dataset and print the leaderboard")
    cmp_.add_argument("models", nargs="+", help="checkpoints, in training order (each as the model parameter)")
    cmp_.add_argument("--config", help="YAML file of parameters (command-line options win)")
    cmp_.add_argument("--summary-json", help="also write the per-checkpoint summaries as JSON here")
    cmp_.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="K",
        help="evaluate K checkpoints at once through prefect-ray's RayTaskRunner, the Ray cluster's GPUs split "
        "between them (default 1: one after another)",
    )
    _add_config_options(cmp_, skip=("model",))
    cmp_.set_defaults(func=cmd_compare)
    ev = sub.add_parser(
        "evaluate",
        help="evaluate captions produced elsewhere (JSONL/Parquet) on a dataset: metrics, report, leaderboard",
    )
    ev.add_argument("captions", help="JSONL or Parquet with 'caption' and 'image_id' or 'file_name' per row")
    ev.add_argument("--name", help="the leaderboard's name for them (default: the file's name), shown as external:NAME")
    ev.add_argument("--config", help="YAML file of parameters (command-line options win)")
    ev.add_argument("--summary-json", help="also write the run summary as JSON here")
    _add_config_options(ev, skip=("model", "judge", "judge_model", "pairwise_against", "clip_model"))
    ev.set_defaults(func=cmd_evaluate)
    dep = sub.add_parser("deploy", help="create the Prefect deployments (nightly golden run, checkpoint trigger)")
    dep.add_argument("--config", help="YAML file of parameters: the deployments' default run config")
    dep.add_argument("--work-pool", default="captionflow", help="work pool (created if missing)")
    dep.add_argument("--pool-type", default="process", choices=POOL_TYPES)
    dep.add_argument(
        "--pool-concurrency",
        type=int,
        default=1,
        help="flow runs at once on the pool, across both deployments (0: no limit); each run sizes its engines "
        "for the whole machine or GPU",
    )
    dep.add_argument("--cron", default="0 2 * * *", help="schedule of the golden-nightly deployment (UTC)")
    dep.add_argument("--image", help="container image with captionflow installed (kubernetes/docker pools)")
    dep.add_argument(
        "--prefect-yaml",
        metavar="FILE",
        help="write these deployments as a prefect.yaml (for prefect deploy --all) instead of creating them",
    )
    dep.add_argument(
        "--notify-block",
        metavar="TYPE/NAME",
        help="a saved Prefect notification block: automations send to it when a checkpoint regressed "
        "(captionflow.checkpoint.regressed), when a captionflow flow run failed, crashed or timed out, and when a "
        "captionflow automation's action failed",
    )
    _add_config_options(dep)
    dep.set_defaults(func=cmd_deploy)
    srv = sub.add_parser(
        "serve",
        help="keep warm vLLM engines between runs (the run's engine layout): runs swap their checkpoint into them "
        "instead of starting their own; with --judge or --pairwise-against, the judge's engines too (half of each "
        "GPU's engines each), which judge a sequential verdict's captions as they are made",
    )
    srv.add_argument("--config", help="YAML file of parameters: the model and engine settings to start with")
    srv.add_argument(
        "--idle-timeout", type=float, default=1800, help="seconds without a run before it stops (0: never)"
    )
    srv.add_argument(
        "--lora-slots",
        type=int,
        default=0,
        metavar="K",
        help="LoRA adapters the engines hold at once: runs of adapters of the model use the engines as they are, "
        "each adapter loaded at its first request (default 0: no LoRA, which costs GPU engines ~0.8x)",
    )
    srv.add_argument(
        "--lora-rank", type=int, default=64, metavar="R", help="with --lora-slots: the largest adapter rank (64)"
    )
    srv.add_argument("--stop", action="store_true", help="stop the running service")
    srv.add_argument("--status", action="store_true", help="show what the running service has loaded and who uses it")
    _add_config_options(srv)
    srv.set_defaults(func=cmd_serve)
    rp = sub.add_parser("reports", help="serve an output root's reports over HTTP (read only): report_url's server")
    rp.add_argument("--output", default=RunConfig.model_fields["output"].default, help="the output root (a folder)")
    rp.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    rp.add_argument("--port", type=int, default=8080)
    rp.set_defaults(func=cmd_reports)
    lb = sub.add_parser("leaderboard", help="the leaderboard of an output root, newest first (table or JSON)")
    lb.add_argument("--output", default=RunConfig.model_fields["output"].default, help="the output root")
    lb.add_argument("--dataset", help="only this dataset (a prefix of its fingerprint)")
    lb.add_argument("--generation", help="only these generation settings (a prefix of their fingerprint)")
    lb.add_argument("--model", help="only models whose name contains this")
    lb.add_argument("--limit", type=int, default=50, help="at most this many rows")
    lb.add_argument("--json", action="store_true", help="the rows as JSON, every field")
    lb.set_defaults(func=cmd_leaderboard)
    pl = sub.add_parser("plan", help="how many GPUs caption N images by a deadline, from the measured rates")
    pl.add_argument("--images", type=int, required=True, help="images to caption")
    pl.add_argument("--deadline", required=True, help="the time there is (8h, 90m, 1h30m, 2d) or a time (ISO 8601)")
    which = pl.add_mutually_exclusive_group()
    which.add_argument("--model", help="a checkpoint folder (its config.json): the rate scaled by its FLOPs per image")
    which.add_argument("--arch", help="an architecture instead (captionflow build-model --arch's names)")
    pl.add_argument("--max-pixels", type=int, help="pixels an image is fitted to (default: the measurement's)")
    pl.add_argument("--max-tokens", type=int, help="tokens of a caption (default: the measurement's)")
    pl.add_argument("--quantization", choices=["fp8"], help="the weights in FP8: whether the model fits one GPU")
    pl.add_argument("--gpu", help="the GPU kind measured (bench/results/gpu_scaling-<gpu>.json), e.g. h200")
    pl.add_argument("--results", help="where the measurements are (default: the checkout's bench/results)")
    pl.add_argument("--json", action="store_true", help="the answer as JSON")
    pl.set_defaults(func=cmd_plan)
    st = sub.add_parser("status", help="deployments and their last runs, automations, warm engines, leaderboard head")
    st.add_argument("--output", default=RunConfig.model_fields["output"].default, help="the output root")
    st.add_argument("--runs", type=int, default=3, help="last runs shown per deployment")
    st.add_argument("--rows", type=int, default=5, help="leaderboard rows shown")
    st.set_defaults(func=cmd_status)  # flows/status.py
    w = sub.add_parser("watch", help="announce new checkpoints under a storage prefix as Prefect events")
    w.add_argument("prefix", help="local folder or s3:// prefix holding checkpoint folders")
    w.add_argument(
        "--state", help="where to remember announced checkpoints (default: PREFIX/.captionflow-announced.json)"
    )
    w.add_argument("--every", type=float, default=0, help="poll every N seconds (default: once)")
    w.set_defaults(func=cmd_watch)
    bm = sub.add_parser(
        "build-model",
        help="build the built-in tiny model (into the cache, or DIR), or a "
        "full-size architecture stand-in without weights (--arch)",
    )
    bm.add_argument("dir", nargs="?", help="where to write it (default: the built-in model in the cache)")
    bm.add_argument("--seed", type=int, default=0, help="other random weights: a stand-in for another checkpoint")
    from captionflow.builtin.standin import ARCHES

    bm.add_argument(
        "--arch",
        choices=sorted(ARCHES),
        help="write a full-size config/tokenizer/processor of this architecture, no weights "
        '(run it with --engine-kwargs \'{"load_format": "dummy"}\')',
    )
    bm.add_argument(
        "--quantization", choices=["fp8"], help="with --arch: a checkpoint whose weights are stored in FP8, as the "
        "published FP8 checkpoints are (vLLM allocates them in FP8; online fp8 first builds them in 16 bits)"
    )  # fmt: skip
    bm.add_argument(
        "--adapter", action="store_true", help="a tiny LoRA adapter (adapter_config.json + weights) over --base "
        "instead: another fine-tune per --seed (default 1)"
    )  # fmt: skip
    bm.add_argument("--base", default="builtin", help="with --adapter: its base checkpoint (default: builtin)")
    bm.set_defaults(func=cmd_build_model)
    dd = sub.add_parser("demo-data", help="assemble the demo dataset (into the cache, or DIR)")
    dd.add_argument("dir", nargs="?", help="where to write it (default: the cache)")
    dd.set_defaults(func=cmd_demo_data)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except _UserError as e:
        print(f"captionflow: {e}", file=sys.stderr)
        return 2
    except _RunFailed as e:
        print(f"captionflow: run failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
