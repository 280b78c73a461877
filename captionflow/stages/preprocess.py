"""Stage 2, preprocess: decode, check and normalise every listed input; write Parquet shards.

A streaming Ray Data pipeline: the listing becomes work items (one per image file, or one per
Parquet row group), ``map_batches`` decodes and normalises them on every core, and the driver
pulls the results in listing order and commits them: accepted rows into shards
(``shards/part-NNNNN.parquet``, bounded in rows and bytes), rejected inputs into
``quarantine.parquet`` with a reason from ``captionflow.workers.images.REASONS``. Memory stays bounded
by Ray Data's backpressure and one open shard, whatever the dataset size. Each input is decoded
exactly once and ends in exactly one place; ``manifest.json`` is written last, so a dataset
folder without it is unfinished and is rebuilt. A block whose worker process dies (a decoder crash)
is retried twice, then its items run one by one, so that only the file that kills its worker is
quarantined (Ray Data alone would retry the block forever). A file that hangs its decoder past
``decode_timeout_s`` ends its worker the same way (a watchdog thread in each worker).
"""

from __future__ import annotations

import itertools
import logging
import time
import warnings
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from captionflow.config import RunConfig
from captionflow.data.layout import MANIFEST, QUARANTINE, SCHEMA_VERSION, SHARDS, dataset_parts, missing_dataset
from captionflow.data.lease import Lease
from captionflow.data.storage import Store, open_fs
from captionflow.engines.session import ray_session
from captionflow.errors import DatasetError
from captionflow.results import Counts, IngestResult, Manifest
from captionflow.runs.watchdog import Watchdog
from captionflow.workers.decode import RESULT_SCHEMA, ItemProcessor, failed_rows, process_alone

log = logging.getLogger(__name__)
# The workers' result columns (RESULT_SCHEMA), split: accepted rows into shards (image: RGB JPEG,
# longest side <= max_image_side), rejected inputs into quarantine.parquet.
SHARD_SCHEMA = pa.schema(
    [
        RESULT_SCHEMA.field(n)
        for n in (
            "image_id",
            "source",
            "image",
            "width",
            "height",
            "orig_format",
            "orig_width",
            "orig_height",
            "references",
            "slice",
        )
    ]
)
QUARANTINE_SCHEMA = pa.schema([RESULT_SCHEMA.field(n) for n in ("source", "reason", "detail", "size_bytes")])
SMALLEST_TASK, LARGEST_TASK = 32, 128  # image files per preprocess task (see task_sizes)
MAX_BLOCK_RETRIES = 2  # a block whose worker died is tried this many more times before its items go alone


ITEM_SCHEMA = pa.schema(
    [
        ("path", pa.binary()),
        ("name", pa.string()),
        ("size", pa.int64()),
        ("problem", pa.string()),
        ("row_group", pa.int64()),
        ("first_row", pa.int64()),
        ("rows", pa.int64()),
        ("item", pa.int64()),
    ]
)


def _item_rows(ing: IngestResult) -> Iterator[dict]:
    def item(f: dict, problem: str, row_group: int, first_row: int, rows: int) -> dict:
        return {
            "path": f["path"].encode("utf-8", "surrogateescape"),
            "name": f["name"],
            "size": f["size"],
            "problem": problem,
            "row_group": row_group,
            "first_row": first_row,
            "rows": rows,
        }

    if ing.kind == "images":
        for f in ing.files:
            yield item(f, f.get("problem", ""), -1, 0, 1)
        return
    fs, _ = open_fs(ing.source)
    import pyarrow.parquet as pq

    for f in ing.files:
        with fs.open(f["path"], "rb") as fh:
            meta = pq.ParquetFile(fh).metadata
        first = 0
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            yield item(f, "", g, first, rows)
            first += rows


def work_items(ing: IngestResult, chunk: int = 8192) -> pa.Table:
    """One row per image file or Parquet row group (``item``: its position), in listing order. ``path``
    travels as bytes (``surrogateescape``): a local file name need not be valid UTF-8, an Arrow string
    must be. Built a chunk at a time: the driver holds ~0.1 KB per input here, not a dict (~0.4 KB)."""
    rows, chunks = _item_rows(ing), []
    while batch := list(itertools.islice(rows, chunk)):
        for k, row in enumerate(batch, len(chunks) * chunk):
            row["item"] = k
        chunks.append(pa.Table.from_pylist(batch, schema=ITEM_SCHEMA))
    return pa.concat_tables(chunks) if chunks else ITEM_SCHEMA.empty_table()


def task_sizes(n: int, workers: int, smallest: int = SMALLEST_TASK, largest: int = LARGEST_TASK) -> list[int]:
    """How many of ``n`` image files each preprocess task takes, in order: ``smallest`` for each
    worker's first task, doubling up to ``largest``, then halving again so that the workers finish
    together. Small first tasks bring the first results (and the driver's shard writing) in sooner;
    ``largest`` bounds a task's output block (128 files of ~67 KB: ~9 MB); 512 files per task raised
    the peak memory at N=20,000 to 1.32x that at N=2,000."""
    ramp, size = [], smallest
    while size < largest:
        ramp += [size] * workers
        size *= 2
    head, tail, left = [], [], n
    for s in ramp:  # grow from the front and shrink towards the end, while there are files to share
        if left < 2 * s:
            break
        head.append(s)
        tail.insert(0, s)
        left -= 2 * s
    middle = [largest] * (left // largest) if left >= largest else []
    rest = left - sum(middle)
    if rest:
        middle.append(rest)
    return [k for k in head + middle + tail if k > 0] or ([n] if n else [])


class _ShardWriter:
    """Accepted rows (Arrow) -> shards bounded by rows and bytes, each committed atomically."""

    def __init__(self, store: Store, base: tuple[str, ...], max_rows: int, max_bytes: int):
        self.store, self.base, self.max_rows, self.max_bytes = store, base, max_rows, max_bytes
        self.pending: list[pa.Table] = []
        self.rows = 0
        self.nbytes = 0
        self.shards: list[str] = []

    def add(self, table: pa.Table) -> None:
        """Append accepted rows; cut a shard whenever a bound is reached."""
        sizes = pc.binary_length(table["image"]).to_pylist()
        start = 0
        for i, size in enumerate(sizes):
            self.rows += 1
            self.nbytes += size
            if self.rows >= self.max_rows or self.nbytes >= self.max_bytes:
                self.pending.append(table.slice(start, i + 1 - start))
                start = i + 1
                self.flush()
        if start < table.num_rows:
            self.pending.append(table.slice(start))

    def flush(self) -> None:
        if self.pending:
            name = f"part-{len(self.shards):05d}.parquet"
            table = pa.concat_tables(self.pending).select(SHARD_SCHEMA.names).cast(SHARD_SCHEMA)
            self.store.write_table(table, *self.base, SHARDS, name)
            self.shards.append(name)
        self.pending, self.rows, self.nbytes = [], 0, 0


class _Results:
    """The driver's side of the stage: takes result batches in listing order, keeps the first of each
    content hash, routes rejected inputs to the quarantine and accepted rows to the shard writer."""

    def __init__(self, writer: _ShardWriter, items: pa.Table):
        self.writer = writer
        self.quarantine: list[dict] = []
        self.seen: dict[str, str] = {}  # image id -> the source kept
        self.n_rows = 0
        # items whose results arrived (an empty row group has none)
        self.done = bytearray(r == 0 for r in items["rows"].to_pylist())

    def take(self, batch: pa.Table) -> None:
        self.n_rows += batch.num_rows
        for i in pc.unique(batch["item"]).to_pylist():
            self.done[i] = 1
        rejected = pc.not_equal(batch["reason"], "")
        if pc.any(rejected).as_py():
            self.quarantine.extend(batch.filter(rejected).select(QUARANTINE_SCHEMA.names).to_pylist())
            batch = batch.filter(pc.invert(rejected))
        keep = []
        for image_id, source, size in zip(
            batch["image_id"].to_pylist(), batch["source"].to_pylist(), batch["size_bytes"].to_pylist()
        ):
            if image_id in self.seen:
                self.quarantine.append(
                    {
                        "source": source,
                        "reason": "duplicate",
                        "detail": f"same content as {self.seen[image_id]}",
                        "size_bytes": size,
                    }
                )
                keep.append(False)
            else:
                self.seen[image_id] = source
                keep.append(True)
        if any(keep):
            self.writer.add(batch.filter(pa.array(keep)) if not all(keep) else batch)

    def lost(self) -> list[int]:
        """Items whose results never came (their block was dropped after its worker died)."""
        return [i for i, d in enumerate(self.done) if not d]

    def counts(self, listed: int) -> tuple[Counts, dict[str, int]]:
        reasons: dict[str, int] = {}
        for q in self.quarantine:
            reasons[q["reason"]] = reasons.get(q["reason"], 0) + 1
        dups = reasons.get("duplicate", 0)
        counts = Counts(
            listed=listed, accepted=len(self.seen), quarantined=len(self.quarantine) - dups, duplicates=dups
        )
        if self.n_rows != listed or counts.accepted + counts.quarantined + counts.duplicates != listed:
            # every input ends in exactly one place, or the dataset is not committed
            raise AssertionError(f"accounting broken: {self.n_rows} results for {listed} inputs, counts {counts}")
        return counts, reasons


def _decode_stream(ing: IngestResult, items: pa.Table, item_params: dict, workers: int, per_task: float):
    """The Ray dataset of result batches: the work items in blocks, decoded by an actor pool."""
    import ray

    if ing.kind == "images":  # one block, and so one task, per group of files
        sizes = task_sizes(items.num_rows, workers)
    else:  # one per Parquet row group
        sizes = [1] * items.num_rows
    bounds = [0, *itertools.accumulate(sizes)]
    # from_blocks keeps these blocks as they are and reads their metadata here; from_arrow sends one
    # metadata task per block to the workers, which waited ~3 s for Ray to start them (2 cores, N=2,000).
    # Slices share the table's buffers; Ray serialises only each slice's rows.
    blocks = [items.slice(a, b - a) for a, b in zip(bounds, bounds[1:])]
    # Results in listing order, so the first of duplicates is kept: for this dataset only (a Dataset
    # keeps a copy of the process-wide DataContext made when it is created; inference does not want it).
    # A block whose worker process dies (a decoder crash: SIGSEGV, SIGABRT, the OOM killer) is retried
    # MAX_BLOCK_RETRIES times, then dropped instead of failing the dataset (Ray Data's own default
    # retries it forever: a poison-pill image hung the run); its items get a second chance one by one.
    ctx = ray.data.DataContext.get_current()
    saved = ctx.execution_options.preserve_order, ctx.max_errored_blocks
    ctx.execution_options.preserve_order, ctx.max_errored_blocks = True, -1
    try:
        # An actor pool, one actor per core, each sent its next block while it works on the current
        # one: plain tasks left each core idle ~0.17 s between one task and the next (the driver has
        # to see the end of one before it sends the next), ~10% of the stage on 2 cores.
        # Ray 2.60 has no named parameter for an actor's max_restarts / max_task_retries yet: the
        # ray_remote_args deprecation it warns of has no replacement to move to, so it is silenced here only.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            return _item_actors(blocks, item_params, per_task, workers)
    finally:
        ctx.execution_options.preserve_order, ctx.max_errored_blocks = saved


def _item_actors(blocks: list, item_params: dict, per_task: float, workers: int):
    import ray

    return (ray.data.from_blocks(blocks) if blocks else ray.data.from_items([])).map_batches(
        ItemProcessor,
        batch_size=None,
        batch_format="pyarrow",
        zero_copy_batch=True,
        num_cpus=per_task,
        fn_constructor_kwargs=item_params,
        max_restarts=-1,
        max_task_retries=MAX_BLOCK_RETRIES,
        compute=ray.data.ActorPoolStrategy(size=max(1, min(workers, len(blocks))), max_tasks_in_flight_per_actor=2),
    )


def _second_chance(
    results: _Results, items: pa.Table, item_params: dict, per_task: float, decode_timeout_s: int
) -> None:
    """Run each item of a dropped block alone, in order; one that kills (or hangs) its worker again is the
    poison and is quarantined."""
    import ray

    lost = items.take(pa.array(results.lost(), pa.int64())).to_pylist()
    if not lost:
        return
    log.warning("%d work items lost with a crashed worker; running each alone", len(lost))
    alone = ray.remote(process_alone).options(num_cpus=per_task, max_retries=1)
    for item, ref in [(item, alone.remote(item, item_params)) for item in lost]:
        try:
            results.take(ray.get(ref))
        except ray.exceptions.RayError as e:
            why = (
                f"the worker process died processing it, or it decoded for over decode_timeout_s="
                f"{decode_timeout_s} s, twice alone ({type(e).__name__}: {str(e)[:200]})"
            )
            rows = failed_rows(item, "decode_error", why)
            results.take(pa.Table.from_pylist([{**r, "item": item["item"]} for r in rows], schema=RESULT_SCHEMA))


def preprocess(ing: IngestResult, cfg: RunConfig) -> Manifest:
    """Build the dataset folder for ``ing`` (or reuse it) and return its manifest. Raises DatasetError when
    no input was accepted (the folder and its quarantine are kept: they say why)."""
    store = Store(cfg.output)
    base = dataset_parts(ing.dataset_fingerprint)
    if ing.already_preprocessed:
        manifest = Manifest.from_json(store.read_json(*base, MANIFEST), skipped=True)
    else:
        what = f"the dataset folder {store.url(*base)}"
        with Lease(store, "/".join(base), what=what, wait_s=cfg.lease_wait_s):
            if not cfg.force_preprocess and missing_dataset(store, ing.dataset_fingerprint) is None:
                manifest = Manifest.from_json(store.read_json(*base, MANIFEST), skipped=True)  # built meanwhile
            else:
                manifest = _build(ing, cfg, store, base)
    if manifest.counts.accepted == 0:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(manifest.quarantine_reasons.items()))
        raise DatasetError(
            f"dataset {manifest.source!r}: none of its {manifest.counts.listed} inputs was accepted "
            f"({reasons}; see {store.url(*base, QUARANTINE)})"
        )
    return manifest


def _build(ing: IngestResult, cfg: RunConfig, store: Store, base: tuple[str, ...]) -> Manifest:
    t0 = time.perf_counter()
    store.remove(*base)  # an unfinished or forced rebuild starts clean
    session = ray_session(cfg)
    fs, _ = open_fs(ing.source)
    params = ing.preprocess_params
    items = work_items(ing)
    per_task = session.cpu_task_share()  # one actor per physical core
    item_params = {
        "fs": fs,
        "kind": ing.kind,
        "image_column": ing.image_column,
        "caption_column": ing.caption_column,
        "references": ing.references,
        "slice_column": ing.slice_column,
        "max_side": params["max_image_side"],
        "max_pixels": params["max_input_pixels"],
        "max_bytes": params["max_input_mb"] * 2**20,
        "decode_timeout_s": cfg.decode_timeout_s,
        "root": ing.root,
        "allow_external_paths": cfg.allow_external_paths,
    }
    ds = _decode_stream(ing, items, item_params, session.cpu_workers(), per_task)
    results = _Results(_ShardWriter(store, base, params["shard_rows"], params["shard_mb"] * 2**20), items)
    status = lambda: f"{results.n_rows} of {ing.n_inputs} inputs processed"
    # Batches stay Arrow tables: the driver only looks at ids and reasons, never copies pixels row by row.
    with Watchdog("preprocess", cfg.stall_timeout_s, status) as watchdog:
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            watchdog.tick()
            results.take(batch)
    _second_chance(results, items, item_params, per_task, cfg.decode_timeout_s)
    results.writer.flush()
    store.write_table(pa.Table.from_pylist(results.quarantine, schema=QUARANTINE_SCHEMA), *base, QUARANTINE)
    counts, reasons = results.counts(ing.n_inputs)
    manifest = Manifest(
        dataset_fingerprint=ing.dataset_fingerprint,
        schema_version=SCHEMA_VERSION,
        source=ing.source,
        kind=ing.kind,
        counts=counts,
        quarantine_reasons=reasons,
        shards=results.writer.shards,
        params=params,
        seconds=round(time.perf_counter() - t0, 3),
    )
    store.write_json(manifest.to_json(), *base, MANIFEST)
    return manifest
