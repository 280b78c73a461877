"""Sources and stage 1, ingest: list the inputs, read reference captions, fingerprint the dataset.

Sources, one code path (any fsspec URI: a local path or ``s3://``):
- a folder of images, recursive; formats are detected from content, never from file names;
  reference captions may come from a sidecar ``captions.jsonl`` (``{"file_name", "captions"}``)
  or ``captions.csv`` (``file_name,caption``, one row per caption);
- Parquet files, or a folder of them, with an image column (Hugging Face ``datasets`` style
  struct ``{bytes, path}`` or plain binary) and an optional reference-caption column (string or
  list of strings).

The listing is cheap (names, sizes, mtimes / ETags, Parquet row counts from the footers) and
decides the dataset fingerprint: when ``datasets/<fingerprint>/manifest.json`` exists the
decode pass is skipped (golden sets); an added, removed or modified file changes the fingerprint.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from dataclasses import dataclass, field

from captionflow.builtin.demo_data import ensure_demo_dataset
from captionflow.config import RunConfig
from captionflow.data.fingerprint import digest
from captionflow.data.layout import MANIFEST, SCHEMA_VERSION, dataset_parts, missing_dataset
from captionflow.data.storage import Store, local_special, open_fs
from captionflow.errors import DatasetError
from captionflow.results import IngestResult

LARGE_ROW_GROUP = 512 * 2**20  # bytes; a preprocess worker holds about twice a row group's image column
log = logging.getLogger(__name__)
SIDECAR_NAMES = ("captions.jsonl", "captions.csv")
IMAGE_COLUMNS = ("image", "img", "image_bytes", "jpg", "png")
CAPTION_COLUMNS = ("captions", "caption", "text", "sentences", "references")


def resolve_dataset(dataset: str) -> str:
    return str(ensure_demo_dataset()) if dataset == "demo" else dataset


def read_utf8(fs, path: str) -> str:
    """A text file's content; one that is not UTF-8 is refused naming the byte."""
    try:  # utf-8-sig: a spreadsheet's CSV export starts with a byte-order mark
        return fs.cat_file(path).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DatasetError(
            f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r}); "
            "save the captions file as UTF-8"
        ) from None


def jsonl_objects(text: str, path: str):
    """(line number, object) for each non-blank line of a JSONL text; a line that is not a JSON object is
    refused naming the file and the line."""
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise DatasetError(f"{path}:{n}: not a JSON object ({e})") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
        yield n, obj


def _read_sidecar(fs, path: str) -> dict[str, list[str]]:
    raw = read_utf8(fs, path)
    refs: dict[str, list[str]] = {}
    if path.endswith(".jsonl"):
        for n, rec in jsonl_objects(raw, path):
            name, caps = rec.get("file_name"), rec.get("captions")
            if isinstance(caps, str):
                caps = [caps]
            if not isinstance(name, str) or not name:
                raise DatasetError(f"{path}:{n}: 'file_name' must be a file name (text), got {name!r}")
            if not isinstance(caps, list) or not all(isinstance(c, str) for c in caps):
                raise DatasetError(f"{path}:{n}: 'captions' must be a caption or a list of captions, got {caps!r}")
            refs[name] = caps
    else:
        for row in csv.DictReader(io.StringIO(raw)):
            if "file_name" not in row or "caption" not in row:
                raise DatasetError(f"{path}: CSV needs the columns file_name, caption")
            refs.setdefault(row["file_name"], []).append(row["caption"])
    return refs


@dataclass
class Listing:
    source: str
    kind: str
    files: list[dict]
    references: dict[str, list[str]] = field(default_factory=dict)
    image_column: str | None = None
    caption_column: str | None = None
    slice_column: str | None = None
    hidden: list[str] = field(default_factory=list)  # skipped entries whose name starts with "."
    root: str = ""  # the folder the dataset is: path rows may only name files under it


def display_name(name: str) -> str:
    """A file name as valid UTF-8 text: bytes that are not UTF-8 (a Latin-1 name on a local disk,
    which Python reads as surrogate escapes) are shown as backslash escapes, e.g. ``caf\\xe9.jpg``.
    The file is still read by its real path."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _file_info(path: str, name: str, info: dict, problem: str = "") -> dict:
    """One listed input. ``problem`` (set for what is listed but must not be opened: a FIFO, a broken
    link) makes preprocess quarantine it as ``unreadable`` without reading it."""
    mtime = info.get("mtime") or info.get("LastModified") or info.get("created") or ""
    return {
        "path": path,
        "name": display_name(name),
        "size": int(info.get("size") or 0),
        "mtime": str(mtime),
        "etag": str(info.get("ETag") or ""),
        "problem": problem,
    }


_INFO_KEYS = ("type", "size", "mtime", "islink", "destination")


def _local_find(fs, root: str, unlisted: list[OSError]) -> dict[str, dict]:
    """``fs.find(root, detail=True)`` for a local folder (the same entries and infos, links not
    followed), except that a folder which cannot be listed goes into ``unlisted`` (fsspec's walk
    drops it without a word below the top level) and a hidden folder is one entry ``path/``, not walked."""
    found, folders = {}, [root]
    while folders:
        folder = folders.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError as e:
            unlisted.append(e)
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name.startswith("."):  # hidden: not inputs, counted as one entry, not walked
                        found[entry.path + "/"] = {"name": entry.path, "type": "directory", "size": 0}
                    else:
                        folders.append(entry.path)
                else:  # only what the listing uses: a full info dict is ~1 KB, held for every file
                    info = fs.info(entry)
                    found[entry.path] = {k: info[k] for k in _INFO_KEYS if k in info}
            except FileNotFoundError:  # gone since the folder was read
                pass
    return found


def _walk_folder(fs, uri: str, root: str, local: bool) -> tuple[list[dict], dict[str, list[str]], list[str]]:
    """Every entry under a folder: (files, reference captions from a sidecar, hidden entries)."""
    files, refs, hidden = [], {}, []
    unlisted: list[OSError] = []  # local folders that cannot be listed (permissions)
    found = _local_find(fs, root, unlisted) if local else fs.find(root, detail=True)
    for e in unlisted:
        where = fs._strip_protocol(str(e.filename or root)).rstrip("/")
        if where == root.rstrip("/"):
            raise DatasetError(f"dataset {uri!r}: cannot list it ({type(e).__name__}: {e.strerror})")
        found[where + "/"] = {"type": "unlisted", "error": e}
    for path, info in sorted(found.items()):
        rel = path[len(root) :].strip("/")
        if not rel:
            continue
        if any(part.startswith(".") for part in rel.split("/")):  # not an input; counted, not silent
            hidden.append(rel + ("/" if path.endswith("/") else ""))
            continue
        if path.endswith("/") and info.get("type") != "unlisted":  # an object store's folder marker
            continue
        if info.get("type") == "unlisted":  # every file in it is unknown: the folder is the input
            e = info["error"]
            files.append(
                _file_info(
                    path,
                    rel + "/",
                    {},
                    f"a folder that cannot be listed: {type(e).__name__}: "
                    f"{e.strerror or e}; its files are not inputs until it can be",
                )
            )
            continue
        if rel in SIDECAR_NAMES:
            refs.update(_read_sidecar(fs, path))
            continue
        problem = ""
        if info.get("type") not in ("file", None) and local:
            info, problem = local_special(path, info)
        files.append(_file_info(path, rel, info, problem))
    return files, refs, hidden


def list_source(
    uri: str, image_column: str | None = None, caption_column: str | None = None, slice_column: str | None = None
) -> Listing:
    """List a folder of images or Parquet files (local or fsspec URI)."""
    try:
        fs, root = open_fs(uri)
        exists = fs.exists(root)
    except Exception as e:  # bad credentials, unknown bucket, unreachable endpoint
        raise DatasetError(f"dataset {uri!r}: cannot access it ({type(e).__name__}: {e})") from None
    if not exists:
        raise DatasetError(f"dataset {uri!r} does not exist")
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    local = protocol in ("file", "local")
    source = root if local else f"{protocol}://{root}"
    hidden: list[str] = []  # names starting with "." (or inside such a folder): not inputs
    if fs.isfile(root):
        if not root.endswith(".parquet"):
            raise DatasetError(f"dataset {uri!r} is a file: pass a folder of images or a .parquet file")
        files = [_file_info(root, root.rsplit("/", 1)[-1], fs.info(root))]
        folder = source.rsplit("/", 1)[0]
    else:
        folder = source
        files, refs, hidden = _walk_folder(fs, uri, root, local)
        if not files:
            raise DatasetError(f"dataset {uri!r} contains no files")
        plain = [f for f in files if not f["problem"]]
        if not plain or not all(f["name"].endswith(".parquet") for f in plain):
            if slice_column:
                raise DatasetError(
                    f"dataset {uri!r} is a folder of images: slice_column names a Parquet column (the slices of "
                    "a folder of images are its sub-folders, without a parameter)"
                )
            return Listing(source=source, kind="images", files=files, references=refs, hidden=hidden, root=source)
        for f in files:  # a Parquet dataset with a part that cannot be read is not taken half
            if f["problem"]:
                raise DatasetError(f"dataset {uri!r}: {f['name']}: {f['problem']}")
    listing = _parquet_listing(fs, source, files, image_column, caption_column, slice_column)
    listing.hidden = hidden
    listing.root = folder
    return listing


def _parquet_listing(
    fs, source: str, files: list[dict], image_column: str | None, caption_column: str | None, slice_column: str | None
) -> Listing:
    import pyarrow.parquet as pq

    schemas = []
    for f in files:
        try:
            with fs.open(f["path"], "rb") as fh:
                meta = pq.ParquetFile(fh)
                f["rows"] = meta.metadata.num_rows
                f["row_groups"] = meta.metadata.num_row_groups
                largest = max((meta.metadata.row_group(g).total_byte_size for g in range(f["row_groups"])), default=0)
                if largest > LARGE_ROW_GROUP:
                    log.warning(
                        "%s: a row group of %d MB; each preprocess worker holds about twice one row group "
                        "in memory: rewrite with smaller row groups (docs/data.md, Sources)",
                        f["path"],
                        largest >> 20,
                    )
                schemas.append(meta.schema_arrow)
        except Exception as e:
            raise DatasetError(f"{f['path']}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    if not sum(f["rows"] for f in files):
        raise DatasetError(f"dataset {source!r}: {len(files)} Parquet file(s), 0 rows")
    first = schemas[0]
    names = first.names
    # Named columns are checked; of the usual names, the first with a fitting type is taken (a
    # numeric "text" column is not taken for captions, and the log says so).
    img = image_column or next(
        (c for c in IMAGE_COLUMNS if c in names and _image_type(first.field(c).type)),
        next((c for c in IMAGE_COLUMNS if c in names), None),
    )
    cap = caption_column or next(
        (c for c in CAPTION_COLUMNS if c in names and _caption_type(first.field(c).type)), None
    )
    if not caption_column:
        for c in CAPTION_COLUMNS[: CAPTION_COLUMNS.index(cap) if cap else None]:
            if c in names:
                log.warning(
                    "%s: column %r is %s, not text: not taken as reference captions (caption_column names one)",
                    source,
                    c,
                    first.field(c).type,
                )
    for f, schema in zip(files, schemas):  # every file, not just the first: a worker must not meet a surprise
        where = source if len(files) == 1 else f"{source}: {f['name']}"
        if img is None or img not in schema.names:
            raise DatasetError(
                f"{where}: no image column (looked for {image_column or IMAGE_COLUMNS}; has {schema.names})"
            )
        if not _image_type(t := schema.field(img).type):
            raise DatasetError(f"{where}: column {img!r} is {t}; expected binary or a struct {{bytes, path}}")
        if cap and cap not in schema.names:
            raise DatasetError(f"{where}: no caption column {cap!r} (has {schema.names})")
        if cap and not _caption_type(t := schema.field(cap).type):
            raise DatasetError(f"{where}: caption column {cap!r} is {t}; expected a string or a list of strings")
        if slice_column and slice_column not in schema.names:
            raise DatasetError(f"{where}: no slice column {slice_column!r} (has {schema.names})")
    return Listing(
        source=source, kind="parquet", files=files, image_column=img, caption_column=cap, slice_column=slice_column
    )


def _text_type(t) -> bool:
    import pyarrow as pa

    return (
        pa.types.is_string(t) or pa.types.is_large_string(t) or (pa.types.is_dictionary(t) and _text_type(t.value_type))
    )


def _image_type(t) -> bool:
    """Binary, or a Hugging Face ``{bytes, path}`` struct."""
    import pyarrow as pa

    return (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or (pa.types.is_struct(t) and t.get_field_index("bytes") >= 0)
    )


def _caption_type(t) -> bool:
    """A string, a list of strings, or all null (no captions)."""
    import pyarrow as pa

    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    return _text_type(t) or pa.types.is_null(t)


def ingest(cfg: RunConfig) -> IngestResult:
    """List the dataset and decide whether its preprocessed form already exists."""
    listing = list_source(resolve_dataset(cfg.dataset), cfg.image_column, cfg.caption_column, cfg.slice_column)
    params = {
        "max_image_side": cfg.max_image_side,
        "shard_rows": cfg.shard_rows,
        "shard_mb": cfg.shard_mb,
        "max_input_pixels": cfg.max_input_pixels,
        "max_input_mb": cfg.max_input_mb,
        "schema_version": SCHEMA_VERSION,
        "image_column": listing.image_column,
        "caption_column": listing.caption_column,
        **({"slice_column": listing.slice_column} if listing.slice_column else {}),  # absent: fingerprints as before
    }
    # where the data is (its URI) and what is there: names, sizes, mtimes, ETags (content hashes on S3);
    # two folders with the same file names, sizes and times are two datasets
    fp = digest(
        {
            "source": listing.source,
            "files": [(f["name"], f["size"], f["mtime"], f["etag"]) for f in listing.files],
            "references": listing.references,
            "params": params,
        }
    )
    store = Store(cfg.output)
    manifest_ok = False
    if not cfg.force_preprocess and missing_dataset(store, fp) is None:  # built, and its shards all there
        manifest = store.read_json(*dataset_parts(fp), MANIFEST)
        manifest_ok = manifest.get("dataset_fingerprint") == fp and manifest.get("schema_version") == SCHEMA_VERSION
    n_inputs = sum(f.get("rows", 1) for f in listing.files)
    if listing.hidden:
        log.info(
            "%d hidden entries are not inputs (names starting with '.'): %s",
            len(listing.hidden),
            ", ".join(listing.hidden[:5]) + (", ..." if len(listing.hidden) > 5 else ""),
        )
    return IngestResult(
        dataset_fingerprint=fp,
        dataset_dir=store.url(*dataset_parts(fp)),
        source=listing.source,
        root=listing.root or listing.source,
        kind=listing.kind,
        files=listing.files,
        n_inputs=n_inputs,
        references=listing.references,
        image_column=listing.image_column,
        caption_column=listing.caption_column,
        slice_column=listing.slice_column,
        preprocess_params=params,
        already_preprocessed=manifest_ok,
        hidden_skipped=len(listing.hidden),
        hidden_examples=listing.hidden[:5],
    )
