"""The run's last stage: what the Prefect UI shows of it and the regression alert.

Never cached, so a rerun whose every other stage was a cache hit publishes its tables, its report and its
alert too. Table artifacts: ``run-counts``, ``quarantine`` (reasons with examples), ``stage-timings``,
``inference-passes``; markdown: ``caption-report``; link: ``caption-report-html``. The flow's return value
(the summary) is persisted too.
"""

from __future__ import annotations

from typing import Any, Optional

from prefect import task
from prefect.logging import get_run_logger

from captionflow.config import RunConfig
from captionflow.data.storage import Store, open_fs
from captionflow.evaluation.regression import EVENT, regression
from captionflow.evaluation.sequential import bootstrap_line, verdict_line
from captionflow.report.markdown import evaluated_as, md_text
from tasks.policy import TIMEOUT_S, retry_transient

EXAMPLES = 3


def quarantine_table(dataset_dir: str, reasons: dict[str, int]) -> list[dict[str, Any]]:
    """One row per quarantine reason: its count and up to three files with their details."""
    if not reasons:
        return []
    examples: dict[str, list[str]] = {}
    try:
        store = Store(dataset_dir)
        for r in store.read_table(store.path("quarantine.parquet")).select(["reason", "source", "detail"]).to_pylist():
            got = examples.setdefault(r["reason"], [])
            if len(got) < EXAMPLES:
                got.append(f"{r['source']}: {r['detail']}")
    except (OSError, KeyError, ValueError):  # the counts still say what happened
        pass
    return [{"reason": k, "count": n, "examples": " | ".join(examples.get(k, []))} for k, n in sorted(reasons.items())]


REPORT_LINK_S = 7 * 24 * 3600  # how long a report's signed link works (S3's longest for a signed URL)


def report_link(uri: str, output: str = "", served: Optional[str] = None) -> tuple[str, str]:
    """(URL, what it is) for the report's link artifact. A browser refuses file:// links from the Prefect UI ("Not
    allowed to load local resource"). Where the output root is served over http(s) (``served``: ``report_url``,
    e.g. ``captionflow reports``), the link is the report's place there; else a report on an object store gets a
    signed https link that opens from the UI for ``REPORT_LINK_S`` (s3fs/gcsfs ``sign``), and a local one keeps
    its file:// link, which works from a file manager or a terminal on the worker's machine (its text is in the
    caption-report artifact)."""
    from pathlib import Path
    from urllib.parse import quote

    root = output.rstrip("/")
    if served and root and uri.startswith(root + "/"):
        return served.rstrip("/") + "/" + quote(uri[len(root) + 1 :]), f"served from the output root at {served}"
    if "://" not in uri or uri.startswith("file://"):
        return Path(uri.removeprefix("file://")).resolve().as_uri(), "a local file on the worker: open it there"
    fs, path = open_fs(uri)
    try:
        return fs.sign(path, expiration=REPORT_LINK_S), "a signed link, valid for 7 days"
    except (NotImplementedError, AttributeError, ValueError, OSError):
        return uri, "the report's URI on its store"


def publish_artifacts(summary: dict[str, Any], output: str = "", report_url: Optional[str] = None) -> None:
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

    c = summary["counts"]
    create_table_artifact(
        key="run-counts",
        table=[{"what": k, "count": v} for k, v in c.items()]
        + [{"what": "captioned in earlier runs", "count": summary.get("resumed_from", 0)}],
        description=f"images of {summary['dataset_dir']} -> {summary['run_dir']}",
    )
    create_table_artifact(
        key="quarantine",
        table=quarantine_table(summary["dataset_dir"], summary.get("quarantine_reasons") or {})
        or [{"reason": "(none)", "count": 0, "examples": ""}],
        description=f"quarantined images by reason ({summary['dataset_dir']}/quarantine.parquet)",
    )
    cached = set(summary.get("cached_stages") or [])
    create_table_artifact(
        key="stage-timings",
        table=[
            {"stage": k[:-2], "seconds": v, "cached": k[:-2] in cached}
            for k, v in summary["timings_s"].items()
            if k.endswith("_s") and "." not in k
        ],
        description="seconds per stage (cached: a Prefect cache hit, no work done)",
    )
    create_table_artifact(
        key="inference-passes",
        table=summary.get("passes") or [{"attempt": "-", "sent": 0, "captioned": 0, "failed": 0}],
        description="inference passes: rows sent, captioned and failed in each (failed rows are retried alone)",
    )
    due = summary.get("deadline")
    if due:
        create_markdown_artifact(
            markdown=f"**Deadline** {due['deadline']}: {due['line']} (finished {due['finished_at']})",
            key="deadline",
            description="the run's deadline: met or missed",
        )
    seq = (summary.get("metrics") or {}).get("sequential")
    if seq:
        create_markdown_artifact(
            markdown=f"**Sequential verdict**: {md_text(verdict_line(seq))}"
            + (f"\n\n{md_text(line)}" if (line := bootstrap_line(seq)) else ""),
            key="sequential-verdict",
            description="the anytime-valid verdict against the baseline (its interval's trajectory: report.html)",
        )
    fs, path = open_fs(summary["report"])
    create_markdown_artifact(
        markdown=fs.cat_file(path).decode("utf-8"), key="caption-report", description="captionflow evaluation report"
    )
    if summary.get("report_html"):
        link, how = report_link(summary["report_html"], output, report_url)
        create_link_artifact(
            key="caption-report-html",
            link=link,
            link_text="report.html",
            description="the report to look at: thumbnails, captions, side by side with the compared checkpoint, "
            f"the chart across checkpoints (one self-contained file); {how}",
        )


def emit_regression(cfg: RunConfig, summary: dict[str, Any], payload: dict[str, Any]) -> None:
    from prefect.events import emit_event

    emit_event(
        event=EVENT,
        resource={
            "prefect.resource.id": f"captionflow.checkpoint.{summary.get('model_fingerprint') or 'unknown'}",
            "prefect.resource.name": cfg.model,
            "captionflow.dataset": summary["dataset_dir"],
        },
        payload={"model": cfg.model, **payload},
    )


@task(
    name="publish",
    timeout_seconds=TIMEOUT_S["publish"],
    retries=1,
    retry_delay_seconds=[5],
    retry_condition_fn=retry_transient,
)
def publish_task(cfg: RunConfig, summary: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Publish the run's artifacts; emit ``captionflow.checkpoint.regressed`` when the checkpoint regressed
    and this run evaluated it (not a cached rerun). Returns the regression's payload (None: none)."""
    publish_artifacts(summary, Store(cfg.output).url(), cfg.report_url)
    same = evaluated_as(Store(cfg.output), summary["run_dir"], cfg.model)
    if same:
        get_run_logger().warning(
            "%s holds the same weights as %s (content fingerprint %s): its results are that evaluation's, "
            "and the leaderboard keeps one row per content, named %s",
            cfg.model,
            same,
            summary.get("model_fingerprint"),
            same,
        )
    found = regression(summary, cfg.regression_threshold)
    if found:
        again = "evaluate" in summary.get("cached_stages", [])
        get_run_logger().warning(
            "regression: %s %s is %.1f%% below the best comparable run's (%s, %s)%s",
            found["metric"],
            found["value"],
            100 * found["relative_drop"],
            found["best_model"],
            found["best_value"],
            "; evaluation cached: the run that evaluated it emitted the event" if again else "",
        )
        if not again:  # one event per evaluation: a cached rerun does not alert twice
            emit_regression(cfg, summary, found)
    return found
