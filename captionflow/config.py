"""The run parameters: one typed model shared by the CLI, a YAML config file and the Prefect UI form."""

from __future__ import annotations

import os
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_OUTPUT = "./captionflow-out"
DEFAULT_PROMPT = "Describe this image in one sentence."
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant that writes short, factual image captions."


# a duration (8h, 90m, 1h30m, 45s, 2d) or an ISO 8601 time: what deadline.parse takes
_DURATION = r"\s*(\d+(\.\d+)?\s*[dD])?\s*(\d+(\.\d+)?\s*[hH])?\s*(\d+(\.\d+)?\s*[mM])?\s*(\d+(\.\d+)?\s*[sS])?\s*"
_TIME = r"\s*\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?)?\s*(Z|[+-]\d{2}(:?\d{2})?)?\s*"
DEADLINE_PATTERN = f"^({_DURATION}|{_TIME})$"


class RunConfig(BaseModel):
    """Everything one captionflow run needs. Unset engine fields are filled by the device preset."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    dataset: str = Field(
        "demo",
        title="Dataset",
        description="'demo' (the built-in golden set) or a folder of images (local path or fsspec URI).",
    )
    output: str = Field(
        DEFAULT_OUTPUT,
        title="Output root",
        description="Storage root for datasets/, runs/ and the leaderboard: a local path or any fsspec URI.",
    )
    report_url: Optional[str] = Field(
        None,
        pattern=r"^https?://\S+$",
        title="URL the output root is served at",
        description="Where a web server serves the output root (captionflow reports --output ROOT, or any static "
        "server of that folder), e.g. http://reports.internal:8080/: each run's report link in the Prefect UI "
        "opens there. Empty: a report on an object store gets a signed link (7 days), a local one its file path "
        "(a browser will not open file:// links from the UI).",
    )
    model: str = Field(
        "builtin",
        title="Model",
        description="'builtin' (tiny random Qwen2-VL built locally; captions are meaningless), a local "
        "checkpoint folder, an s3:// prefix (downloaded to the local cache) or a Hugging Face hub id.",
    )
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto", title="Device", description="Which preset sizes the engine: 'auto' picks 'gpu' when Ray sees a GPU."
    )
    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, title="System prompt")
    prompt: str = Field(DEFAULT_PROMPT, title="User prompt", description="Text sent with each image.")
    max_tokens: int = Field(32, ge=1, title="Max new tokens per caption")
    temperature: float = Field(0.0, ge=0.0, title="Sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, title="Top-p")
    seed: int = Field(
        0,
        ge=0,
        le=2**63 - 1,
        title="Sampling seed",
        description="The engines' random seed (a 64-bit one: larger values failed every row with an empty error).",
    )
    ignore_eos: bool = Field(
        False,
        title="Ignore end-of-sequence",
        description="Always generate max_tokens (benchmarks: a fixed amount of work per image).",
    )
    max_image_side: int = Field(
        448,
        ge=28,
        title="Longest image side (px)",
        description="Preprocess bounds every image's longest side to this (the vision-token budget).",
    )
    max_input_pixels: int = Field(
        64_000_000,
        ge=1,
        title="Pixel budget per input image",
        description="Inputs with more pixels are quarantined from their header, before decoding (decompression bombs).",
    )
    max_input_mb: int = Field(
        512,
        ge=1,
        title="Byte budget per input (MB)",
        description="Larger inputs are quarantined (too_large) from the listing's size, without being read: "
        "a video or an archive among the images must not fill a worker's memory.",
    )
    decode_timeout_s: int = Field(
        60,
        ge=1,
        title="Seconds one image may take to decode",
        description="An image still decoding after this long ends its worker process (a hung decoder cannot be "
        "interrupted): its block is retried twice, then its files run alone, and a file that hangs "
        "again is quarantined (decode_error). Not part of the dataset fingerprint.",
    )
    image_column: Optional[str] = Field(
        None, title="Parquet image column", description="Default: the first of image, img, image_bytes, jpg, png."
    )
    caption_column: Optional[str] = Field(
        None,
        title="Parquet reference-caption column",
        description="Default: the first of captions, caption, text, sentences, references (if any).",
    )
    slice_column: Optional[str] = Field(
        None,
        title="Parquet slice column",
        description="A column whose value names each row's slice (e.g. a source or a category): the report gives "
        "the metrics per slice with counts. A folder of images is sliced by its sub-folders without this.",
    )
    max_pixels: Optional[int] = Field(
        None,
        title="Max pixels seen by the model",
        description="Passed to the model's image processor (mm_processor_kwargs). Default: the preset's.",
    )
    batch_size: Optional[int] = Field(None, ge=1, title="Rows per Ray Data batch")
    concurrency: Optional[int] = Field(
        None,
        ge=1,
        title="Engine replicas",
        description="Engine-stage actors. Default: on GPU, every GPU of the Ray cluster (divided by "
        "tensor_parallel_size) times engines_per_gpu; on CPU, 1.",
    )
    engines_per_gpu: Optional[int] = Field(
        None,
        ge=1,
        le=16,
        title="Engine replicas per GPU",
        description="Default: as many as fit in 90% of the GPU's memory (weights + fixed KV cache + overhead), "
        "at most the GPU preset's 4. More engines spread image processing over more processes.",
    )
    gpu_memory_gib: Optional[float] = Field(
        None,
        gt=0,
        title="GPU memory (GiB) for sizing engines_per_gpu",
        description="Default: read from this machine's GPU, else 80.",
    )
    cuda_mps: Literal["auto", "on", "off"] = Field(
        "auto",
        title="CUDA MPS for several engines per GPU",
        description="auto: when captionflow starts Ray locally and several engines share a GPU, it starts the CUDA "
        "MPS control daemon (if found) so their kernels run side by side; on: the same, failing if it "
        "cannot; off: never.",
    )
    max_concurrent_batches: Optional[int] = Field(None, ge=1, title="Batches in flight per engine replica")
    max_num_seqs: Optional[int] = Field(None, ge=1, title="vLLM max_num_seqs")
    max_model_len: Optional[int] = Field(None, ge=64, title="vLLM max_model_len")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        title="Tensor parallel size",
        description="GPUs of one host each engine spans (a model too large for one GPU: the run says how many).",
    )
    quantization: Optional[Literal["fp8"]] = Field(
        None,
        title="Quantization",
        description="'fp8': vLLM quantizes a 16-bit checkpoint's weights to FP8 as it loads them (about half the "
        "memory; on GPUs with FP8, such as H100 and H200). Captions made with it are apart from the 16-bit ones "
        "(the generation fingerprint). A pre-quantized FP8 checkpoint needs nothing here.",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        title="KV cache dtype",
        description="'fp8': the engines keep their KV cache in FP8 (twice the sequences in the same memory); "
        "'auto': the model's dtype. In the generation fingerprint.",
    )
    accelerator_type: Optional[str] = Field(None, title="Ray accelerator type (e.g. H100)")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        title="Extra vLLM engine kwargs",
        description="Passed through to vLLM; wins over the preset.",
    )
    ray_address: Optional[str] = Field(
        None, title="Ray address", description="An existing Ray cluster (else RAY_ADDRESS, else a local Ray)."
    )
    metrics_port: Optional[int] = Field(
        None,
        ge=1024,
        le=65535,
        title="Prometheus port of a local Ray",
        description="A local Ray this run starts exports its metrics (Ray Data operators, vLLM engines) on this "
        "port for Prometheus (infra/prometheus). A cluster's Ray (ray_address) exports its own; there vLLM engine "
        "metrics are always on.",
    )
    ray_num_cpus: Optional[int] = Field(
        None,
        ge=1,
        title="Logical CPUs for a local Ray",
        description="Default: enough for every pipeline stage to be placed at once (docs/sizing.md).",
    )
    force_preprocess: bool = Field(False, title="Rebuild the preprocessed dataset even if it exists")
    shard_rows: int = Field(256, ge=1, title="Rows per Parquet shard (at most)")
    shard_mb: int = Field(256, ge=1, title="Megabytes of image data per Parquet shard (at most)")
    engine_image_cache_max_images: int = Field(
        20_000,
        ge=0,
        title="Keep the images fitted to the engine's grid for datasets up to this size",
        description="A dataset of at most this many accepted images (a golden set) gets its images decoded and "
        "fitted to the engine's patch grid once per grid and kept beside its shards (raw RGB: ~150 KB an image at "
        "224 px, ~600 KB at 448 px); later runs and judges read them instead of decoding again. Captions are the "
        "same either way. 0: never.",
    )
    row_retries: int = Field(2, ge=0, title="Extra passes over rows whose inference failed")
    judge: bool = Field(
        False,
        title="LLM-as-judge pass",
        description="Score each caption 1-5 against its image (and references) with a VLM.",
    )
    judge_model: Optional[str] = Field(
        None,
        title="Judge model",
        description="Any VLM checkpoint the model parameter accepts. Default: the model itself.",
    )
    pairwise_against: Optional[str] = Field(
        None,
        title="Pairwise judge against",
        description="Judge this run's captions against another run's, image by image, in both orders (A / B / "
        "tie): 'previous' or 'best' (the comparable runs: same dataset, same generation settings), a checkpoint "
        "evaluated on this dataset (its model source or fingerprint prefix) or a run folder. Gives a win rate "
        "with its 95% interval. The judge is judge_model (default: the model itself).",
    )
    verdict: Literal["full", "sequential"] = Field(
        "full",
        title="Verdict: the full set, or stop as soon as it is sure",
        description="'sequential': caption the dataset in a seeded random order and compare each image's "
        "verdict_score with verdict_against's; captioning stops as soon as the checkpoint is surely better, worse "
        "or equivalent (within verdict_margin) - about the checkpoint on images like these, not only this set's "
        "mean - and once every image is seen a paired test decides the rest ('no detectable difference' where "
        "neither). The same run with 'full' later captions the rest. docs/evaluation.md says what each verdict "
        "promises.",
    )
    verdict_against: str = Field(
        "previous",
        title="Sequential verdict against",
        description="The baseline of the sequential verdict: 'previous' or 'best' among the comparable runs that "
        "captioned the whole set (same dataset, same generation settings; a run the verdict stopped early is "
        "never a baseline), a checkpoint evaluated on this dataset or a run folder (external captions imported "
        "with captionflow evaluate too). Without one yet, the run captions the full set. A pairwise verdict's "
        "baseline is pairwise_against's.",
    )
    verdict_score: Literal["auto", "cider", "clip", "judge", "pairwise"] = Field(
        "auto",
        title="Sequential verdict: score",
        description="The per-image score the sequential verdict compares: 'cider' (CIDEr-D, the IDF from all the "
        "references; needs references), 'clip' (CLIPScore against the image by clip_model; no references "
        "needed), 'judge' (the judge's 1-5 score, against a baseline judged by the same judge), 'pairwise' (the "
        "pairwise judge's win against pairwise_against); with 'judge' and 'pairwise' the judge judges each "
        "caption as it is made and the captioning stops once sure (with warm engines, the service's judge engines "
        "where it keeps this judge - captionflow serve with the run's judge options - else the set is captioned in "
        "full and the judging stops once sure). 'auto': CIDEr-D where the dataset has references, else CLIPScore "
        "where clip_model is set.",
    )
    verdict_alpha: float = Field(
        0.05,
        gt=0.0,
        lt=0.5,
        title="Sequential verdict: error rate",
        description="The chance that the sequential verdict calls two equally good checkpoints better or worse, "
        "however early it stops (each wrong direction at most half of it; a wrong 'equivalent' at most half of it).",
    )
    verdict_margin: Optional[float] = Field(
        None,
        ge=0.0,
        lt=5.0,
        title="Sequential verdict: equivalence margin",
        description="Differences of the expected per-image verdict_score smaller than this do not matter: the "
        "verdict says 'equivalent' once they are surely within +/- this, and its stakes are tuned to detect "
        "differences this large. Default (empty): CIDEr-D 0.05, CLIPScore 0.01, judge score 0.1, pairwise win rate "
        "0.03 (docs/evaluation.md); 0: no equivalence verdict. At least 0 and below half the score's range.",
    )
    clip_model: Optional[str] = Field(
        None,
        title="Reference-free score: CLIP checkpoint",
        description="'builtin' (a tiny random CLIP built locally: meaningless scores) or a local CLIP-family "
        "checkpoint folder: every caption gets its CLIPScore against its image (2.5 x max(cosine, 0); captions "
        "truncated to 77 tokens), computed through Ray Data; the score a dataset without references gets.",
    )
    coco_java: bool = Field(
        False,
        title="Java COCO metrics",
        description="Tokenise with pycocoevalcap's PTB tokenizer and add METEOR (both need Java on the PATH).",
    )
    commit_rows: int = Field(
        64,
        ge=1,
        title="Rows per committed caption shard",
        description="Inference commits captions in shards of at most this many rows: a killed run loses at most these.",
    )
    max_failure_rate: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        title="Failed rows a run may have and still count",
        description="A run whose share of rows that failed every pass is above this fails and is not put on the "
        "leaderboard (the captions it did commit are kept; the next run retries the rest).",
    )
    allow_external_paths: bool = Field(
        False,
        title="Let Parquet path rows name files outside the dataset",
        description="A Parquet row that gives an image path, not bytes, may only name a file under the dataset's own "
        "folder on the same store; with this, any path or URL the row names is read.",
    )
    bootstrap_resamples: int = Field(
        1000,
        ge=0,
        title="Bootstrap resamples for comparisons",
        description="Each comparison with an earlier checkpoint (the previous and the best comparable run) gets a "
        "paired bootstrap over images with this many resamples (fixed seed): per metric the delta, its 95% interval "
        "and a verdict (better / worse / no detectable difference, Holm-corrected over the metrics); 0: none.",
    )
    report_images: int = Field(
        200,
        ge=0,
        title="Images listed in the HTML report",
        description="report.html shows this many images (the first by image id) with thumbnail, caption, references "
        "and scores, besides the side-by-side wins and losses against the compared checkpoint.",
    )
    regression_threshold: float = Field(
        0.05,
        ge=0.0,
        title="Relative drop of the primary metric that counts as a regression",
        description="When the run's CIDEr is below the best comparable run's (same dataset, same generation "
        "settings) by more than this fraction of it, the run emits the Prefect event captionflow.checkpoint.regressed "
        "with the deltas (captionflow deploy --notify-block turns it into a notification).",
    )
    lease_wait_s: int = Field(
        3600,
        ge=0,
        title="Seconds to wait for another run writing the same outputs",
        description="Runs on the same dataset folder or run folder take turns (a lease on the output root); a run "
        "that waited this long for the other one fails, naming it.",
    )
    deadline: Optional[str] = Field(
        None,
        # in the form's schema too, so that the server refuses a deadline that is neither before the run starts
        pattern=DEADLINE_PATTERN,
        title="Deadline",
        description="When the run is due: a duration from its start (8h, 90m, 1h30m, 45s, 2d) or a time "
        "(2026-11-29T06:00:00+00:00; no zone: UTC). The progress artifact and the log compare the projected "
        "completion with it; the first projection later than it by more than deadline_margin_s emits the Prefect "
        "event captionflow.run.sla-at-risk once; the summary says whether the run met it.",
    )
    deadline_margin_s: int = Field(
        60,
        ge=0,
        title="Seconds late a projection may be before the run is at risk",
        description="The sla-at-risk event is emitted the first time the projected completion is later than the "
        "deadline by more than this.",
    )
    stall_timeout_s: int = Field(
        1800,
        ge=60,
        title="Seconds a stage may go without a result",
        description="Preprocess and inference log what they wait on every minute; one that went this long "
        "without a single result fails with what it was waiting for.",
    )
    warm_engines: Literal["auto", "off", "require"] = Field(
        "auto",
        title="Use the warm engine service",
        description="auto: when a warm engine service runs (captionflow serve, on this machine or on the Ray "
        "cluster), caption through it - the checkpoint is swapped into the running engine instead of starting one; "
        "off: always start the run's own engines; require: fail when no service runs.",
    )
    compile_cache_dir: Optional[str] = Field(
        None,
        title="vLLM compile cache folder",
        description="The engines' vLLM cache root and Triton and Inductor caches: what vLLM keeps between engine "
        "starts, the kernels an engine's warm-up compiles, and the compiled graphs when engine_kwargs ask for "
        "torch.compile (the GPU preset runs CUDA graphs without it), keyed on the architecture and engine settings "
        "(not the checkpoint's path): every checkpoint of an architecture reuses them. Default: "
        "<captionflow cache>/vllm-compile; a shared volume lets a fresh node start warm.",
    )
    placement_wait_s: int = Field(
        300,
        ge=0,
        title="Seconds to wait for a Ray cluster to offer the engines' resources",
        description="Before any work starts, the engines' GPUs and CPUs are checked against the cluster; a cluster "
        "that cannot place them (after this long, for an autoscaling one) fails the run naming what is missing.",
    )

    def dummy_weights(self) -> bool:
        """vLLM draws random weights (``engine_kwargs.load_format == "dummy"``): no weight files needed."""
        return self.engine_kwargs.get("load_format") == "dummy"

    @field_validator("deadline", mode="before")  # before the pattern: this says what is accepted
    @classmethod
    def _deadline_parses(cls, v: Optional[str]) -> Optional[str]:
        if v and isinstance(v, str):
            from datetime import UTC, datetime

            from captionflow.deadline import parse

            parse(v, datetime.now(UTC))  # ValueError: what is accepted
        return v

    def generation_params(self) -> dict[str, Any]:
        """What decides the generated text besides dataset and model (the generation fingerprint)."""
        return {
            "system_prompt": self.system_prompt,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            **({"ignore_eos": True} if self.ignore_eos else {}),
        }


# The fields by what they are about, in the order the Prefect form, ``--help`` and docs/parameters.md show them.
GROUPS: dict[str, tuple[str, ...]] = {
    "Data": (
        "dataset",
        "output",
        "report_url",
        "image_column",
        "caption_column",
        "slice_column",
        "allow_external_paths",
        "max_input_pixels",
        "max_input_mb",
        "decode_timeout_s",
        "max_image_side",
        "force_preprocess",
        "shard_rows",
        "shard_mb",
        "engine_image_cache_max_images",
    ),
    "Model": ("model", "max_pixels"),
    "Generation": ("system_prompt", "prompt", "max_tokens", "temperature", "top_p", "seed", "ignore_eos"),
    "Evaluation": (
        "judge",
        "judge_model",
        "pairwise_against",
        "verdict",
        "verdict_against",
        "verdict_score",
        "verdict_alpha",
        "verdict_margin",
        "clip_model",
        "coco_java",
        "bootstrap_resamples",
        "report_images",
        "regression_threshold",
    ),
    "Engine": (
        "device",
        "batch_size",
        "concurrency",
        "engines_per_gpu",
        "gpu_memory_gib",
        "cuda_mps",
        "max_concurrent_batches",
        "max_num_seqs",
        "max_model_len",
        "tensor_parallel_size",
        "quantization",
        "kv_cache_dtype",
        "accelerator_type",
        "engine_kwargs",
        "warm_engines",
        "compile_cache_dir",
    ),
    "Cluster": ("ray_address", "metrics_port", "ray_num_cpus", "placement_wait_s"),
    "Reliability": (
        "row_retries",
        "commit_rows",
        "max_failure_rate",
        "lease_wait_s",
        "stall_timeout_s",
        "deadline",
        "deadline_margin_s",
    ),
}


def grouped_fields() -> list[tuple[str, str, Any]]:
    """(group, field name, pydantic FieldInfo) of every RunConfig field, group by group."""
    return [(g, name, RunConfig.model_fields[name]) for g, names in GROUPS.items() for name in names]


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> RunConfig:
    """Build a RunConfig from an optional YAML file, then explicit overrides (None values ignored)."""
    data: dict[str, Any] = {}
    if path:
        import yaml

        with open(path, encoding="utf-8") as fh:
            try:
                loaded = yaml.safe_load(fh) or {}
            except yaml.YAMLError as e:  # one line naming the file and the place, not a parser traceback
                mark = getattr(e, "problem_mark", None)
                where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
                raise ValueError(f"config file {where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path}: expected a mapping of parameters, got {type(loaded).__name__}")
        data.update(loaded)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return RunConfig(**data)
    except ValidationError as e:  # one line per bad parameter, not pydantic's dump
        raise ValueError(validation_lines(e)) from None


def validation_lines(e: ValidationError) -> str:
    """A pydantic validation error as "name: what is wrong (got value)", one per bad field, joined by "; "."""
    parts = []
    for err in e.errors():
        name = ".".join(str(x) for x in err.get("loc", ())) or "parameters"
        got = err.get("input")
        shown = repr(got) if not isinstance(got, dict) or len(repr(got)) < 80 else "{...}"
        parts.append(f"{name}: {err.get('msg', 'invalid')} (got {shown})")
    return "; ".join(parts)
