"""What each stage gives the next: typed results instead of string-keyed dicts.

Prefect persists them (pickled) under the output root, keyed on content fingerprints; change a
field here and bump the cache-key version in ``tasks/results.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from captionflow.model_source import ClipModel, ResolvedModel

if TYPE_CHECKING:  # the engines' settings travel in the preflight's result; the contracts sit below the engines
    from captionflow.engines.engine import EngineSettings


@dataclass(frozen=True)
class PreflightResult:
    """The checkpoints a run will load (resolved to local folders, fingerprinted, checked) and the engine
    settings each runs with (the device preset and the run's overrides, resolved once)."""

    model: ResolvedModel
    judge: Optional[ResolvedModel]
    engine: EngineSettings
    judge_engine: Optional[EngineSettings] = None
    clip: Optional[ClipModel] = None


@dataclass
class IngestResult:
    """The listing of a dataset: what preprocess needs, and whether its folder is already built."""

    dataset_fingerprint: str
    dataset_dir: str  # URI under the output root
    source: str
    root: str  # the dataset's folder (a single Parquet file's folder): path rows may only name files under it
    kind: str  # "images" | "parquet"
    files: list[dict]  # {"path", "name", "size", "mtime", "etag", "problem"} (+ "rows", "row_groups" for parquet)
    n_inputs: int  # images listed, or Parquet rows
    references: dict[str, list[str]]  # images: file name -> captions (sidecar)
    image_column: Optional[str]
    caption_column: Optional[str]
    preprocess_params: dict
    already_preprocessed: bool
    hidden_skipped: int = 0  # hidden entries (".name"; a local hidden folder counts once) not taken as inputs
    hidden_examples: list[str] = field(default_factory=list)  # the first few of them
    slice_column: Optional[str] = None  # a Parquet column carried into the shards as each row's slice

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Counts:
    listed: int
    accepted: int
    quarantined: int
    duplicates: int


@dataclass
class Manifest:
    """A preprocessed dataset folder (``manifest.json``, written last: a folder without it is unfinished)."""

    dataset_fingerprint: str
    schema_version: int
    source: str
    kind: str
    counts: Counts
    quarantine_reasons: dict[str, int]
    shards: list[str]
    params: dict
    seconds: float
    skipped: bool = False  # this run found it built and reused it (not written to the file)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("skipped")
        return d

    @classmethod
    def from_json(cls, d: dict, skipped: bool = False) -> Manifest:
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__ and k != "skipped"}
        return cls(**{**d, "counts": Counts(**d["counts"])}, skipped=skipped)


@dataclass
class PassResult:
    """One pass of an LLM stage over the rows still to do."""

    attempt: int
    sent: int
    ok: int
    failed: int
    seconds: float
    first_row_s: Optional[float] = None
    stopped: bool = False  # ended early: the sequential verdict was in


@dataclass
class InferenceResult:
    run_dir: str
    run_parts: tuple[str, ...]
    accepted: int
    captioned: int
    failed: int
    resumed_from: int  # rows committed by an earlier run and not sent again
    passes: list[PassResult]
    timings_s: dict[str, float]
    reused: int = 0  # captions of the same images taken from other run folders of this checkpoint and settings
    engines: str = "per-run"  # "per-run", or "warm (loaded|swapped|replaced)": the warm engine service
    verdict: Optional[dict] = None  # the sequential verdict (evaluation/sequential.PrefixVerdict.record)


@dataclass
class JudgeResult:
    judge_model: str
    judge_dir: str
    judge_parts: tuple[str, ...]
    judged: int
    failed: int
    parse_rate: float
    mean_score: Optional[float]
    distribution: dict[str, int]
    passes: list[PassResult]
    seconds: float
    verdict: Optional[dict] = None  # the sequential verdict on the judge's score (evaluation/sequential.PrefixVerdict)

    def headline(self) -> dict:
        """What the metrics and the report show of the judge pass."""
        return {
            k: getattr(self, k) for k in ("judge_model", "judged", "failed", "parse_rate", "mean_score", "distribution")
        }


@dataclass
class PairwiseResult:
    """The pairwise judge's verdict of this run's captions against a baseline run's, on the images both have."""

    against: str  # what the run asked for (``pairwise_against``)
    judge_model: str
    baseline_model: str  # "" when there was no baseline to compare with (``note`` says why)
    baseline_run_dir: str
    pairwise_dir: str
    judged: int  # images judged in both orders
    failed: int  # judgements that failed every pass
    parse_rate: float
    wins: int  # images whose both judgements went to this run
    losses: int
    ties: int  # split or tied
    consistency: float  # share of images whose two orders agreed (low: the judge follows positions)
    stats: Optional[dict[str, Any]]  # win rate, interval, p-value, verdict (significance.win_rate)
    passes: list[PassResult]
    seconds: float
    note: str = ""
    verdict: Optional[dict] = None  # the sequential verdict on the judge (evaluation/sequential.PrefixVerdict.record)

    def headline(self) -> dict:
        d = asdict(self)
        d.pop("passes")
        d.pop("verdict")  # the metrics' "sequential"
        return d


@dataclass
class ClipResult:
    """The reference-free CLIPScore pass of one run (captionflow/stages/clip_score.py)."""

    clip_model: str
    clip_dir: str
    scored: int
    failed: int
    mean: Optional[float]
    seconds: float

    def headline(self) -> dict:
        return {"clip_model": self.clip_model, "scored": self.scored, "failed": self.failed, "mean": self.mean}


@dataclass
class EvalResult:
    metrics: dict[str, Any]
    report: str  # URI of report.md
    seconds: float
    report_html: str = ""  # URI of report.html


@dataclass
class StageRecord:
    """How one stage of this flow run ended: ``state`` is Prefect's ("Completed", "Cached")."""

    name: str
    state: str
    seconds: float


@dataclass
class RunSummary:
    """What ``captionflow run`` prints and ``--summary-json`` writes: one checkpoint on one dataset."""

    dataset_dir: str
    run_dir: str
    counts: dict[str, int]
    quarantine_reasons: dict[str, int]
    hidden_skipped: dict[str, Any]
    metrics: dict[str, Any]
    timings_s: dict[str, float]
    cached_stages: list[str]
    preprocess_skipped: bool
    resumed_from: int
    passes: list[dict]
    report: str
    report_html: str = ""
    reused: int = 0
    engines: str = "per-run"
    model_fingerprint: str = ""
    flow_run_id: str = ""
    regression: Optional[dict[str, Any]] = None  # the alert's payload when the checkpoint regressed
    deadline: Optional[dict[str, Any]] = None  # met or missed (deadline.Deadline.outcome); None: no deadline

    @classmethod
    def build(
        cls,
        ing: IngestResult,
        manifest: Manifest,
        inference: InferenceResult,
        evaluation: EvalResult,
        stages: list[StageRecord],
        total_s: float,
        flow_run_id: str = "",
    ) -> RunSummary:
        cached = [s.name for s in stages if s.state == "Cached"]
        timings = {f"{s.name}_s": round(s.seconds, 2) for s in stages if s.name != "preflight"}
        if "inference" not in cached:
            timings.update({f"inference.{k}": v for k, v in inference.timings_s.items()})
        timings["total_s"] = round(total_s, 2)
        c = manifest.counts
        return cls(
            dataset_dir=ing.dataset_dir,
            run_dir=inference.run_dir,
            counts={
                "total": c.listed,
                "accepted": c.accepted,
                "quarantined": c.quarantined,
                "duplicates": c.duplicates,
                "captioned": inference.captioned,
                "failed": inference.failed,
            },
            quarantine_reasons=dict(manifest.quarantine_reasons),
            hidden_skipped={"count": ing.hidden_skipped, "examples": ing.hidden_examples},
            metrics=evaluation.metrics,
            timings_s=timings,
            cached_stages=cached,
            preprocess_skipped=manifest.skipped or "preprocess" in cached,
            resumed_from=inference.resumed_from,
            passes=[
                {
                    "attempt": p.attempt,
                    "sent": p.sent,
                    "captioned": p.ok,
                    "failed": p.failed,
                    "seconds": p.seconds,
                    "first_row_s": p.first_row_s,
                    "stopped": p.stopped,
                }
                for p in inference.passes
            ],
            report=evaluation.report,
            report_html=evaluation.report_html,
            reused=inference.reused,
            engines=inference.engines,
            model_fingerprint=inference.run_parts[2] if len(inference.run_parts) > 2 else "",
            flow_run_id=str(flow_run_id or ""),
        )

    def to_dict(self) -> dict:
        return asdict(self)
