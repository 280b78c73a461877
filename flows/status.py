"""``captionflow status``: deployments with their last runs and next one, captionflow's automations, the warm engine
service, the leaderboard's head."""

from __future__ import annotations

import argparse


def cmd_status(args: argparse.Namespace) -> int:
    """Deployments with their last runs, captionflow's automations, the warm engine service, the leaderboard's head."""
    from captionflow.config import RunConfig
    from captionflow.data.storage import Store
    from captionflow.report.markdown import leaderboard_rows, leaderboard_table
    from deployments.watcher import api_problem

    out: list[str] = []
    problem = api_problem()
    if problem:
        out.append(f"Prefect API: {problem}: no deployments or runs shown")
    else:
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL

        out.append(f"Prefect API: {PREFECT_API_URL.value()}")
        from prefect.client.schemas.filters import (
            DeploymentFilter,
            DeploymentFilterId,
            FlowFilter,
            FlowFilterName,
            FlowRunFilter,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.objects import StateType
        from prefect.client.schemas.sorting import FlowRunSort

        def state_is(**kw) -> FlowRunFilter:
            return FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(**kw)))

        with get_client(sync_client=True) as client:
            deps = client.read_deployments(flow_filter=FlowFilter(name=FlowFilterName(any_=["captionflow"])))
            out.append(f"deployments ({len(deps)}):")
            for d in deps:
                of_d = DeploymentFilter(id=DeploymentFilterId(any_=[d.id]))
                # the last runs: any state but scheduled (future runs are not "last"), newest first by when they
                # were due - a run that failed or was cancelled before it started has no start time
                runs = client.read_flow_runs(
                    deployment_filter=of_d,
                    flow_run_filter=state_is(not_any_=[StateType.SCHEDULED]),
                    sort=FlowRunSort.EXPECTED_START_TIME_DESC,
                    limit=args.runs,
                )
                upcoming = client.read_flow_runs(
                    deployment_filter=of_d,
                    flow_run_filter=state_is(any_=[StateType.SCHEDULED]),
                    sort=FlowRunSort.EXPECTED_START_TIME_ASC,
                    limit=1,
                )
                sched = ", ".join(s.schedule.cron for s in d.schedules if getattr(s.schedule, "cron", None)) or "-"
                out.append(f"  captionflow/{d.name}  pool {d.work_pool_name}  schedule {sched}  paused {d.paused}")
                if upcoming and upcoming[0].expected_start_time:
                    out.append(f"    next run: {upcoming[0].expected_start_time.isoformat(timespec='seconds')}")
                # a run whose model group leaves its model out gets the deployment's when it starts (parameters.py)
                deployed = (d.parameters.get("model") or {}).get("model") or RunConfig.model_fields["model"].default
                for r in runs:
                    due = r.expected_start_time
                    when = (
                        r.start_time.isoformat(timespec="seconds")
                        if r.start_time
                        else f"not started (due {due.isoformat(timespec='seconds')})"
                        if due
                        else "not started"
                    )
                    model = (r.parameters.get("model") or {}).get("model") or deployed
                    out.append(f"    {r.name:<24} {r.state_name or '-':<10} {when}  model {model}")
            autos = [a for a in client.read_automations() if a.name.startswith("captionflow:")]
            out.append(
                f"automations ({len(autos)}): "
                + (", ".join(f"{a.name!r} {'on' if a.enabled else 'off'}" for a in autos) or "-")
            )
    from captionflow.engines.address import local_service_address

    addr = local_service_address()
    where = f"runs here ({addr}); captionflow serve --status for what it holds" if addr else "none on this machine"
    out.append(f"warm engine service: {where}")
    rows = leaderboard_rows(Store(args.output))[: args.rows]
    out.append(f"leaderboard {args.output}: " + ("empty" if not rows else f"newest {len(rows)}"))
    if rows:
        out.append(leaderboard_table(rows))
    print("\n".join(out))
    return 0
