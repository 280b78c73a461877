"""Resolve and validate the ``model`` parameter before any expensive work starts."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from captionflow.builtin.model import BUILTIN_NAME, ensure_builtin_model
from captionflow.data.cache import build_once, default_cache_dir
from captionflow.data.fingerprint import digest, model_fingerprint
from captionflow.errors import ModelError


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter (``adapter_config.json`` and its weights) the engines apply over its base checkpoint."""

    path: str  # the adapter's local folder (each request names it: vLLM loads it once per engine)
    rank: int
    targets: tuple[str, ...]  # the modules it adapts
    base: str = ""  # its base checkpoint, as the adapter names it
    base_fingerprint: str = ""


@dataclass(frozen=True)
class ResolvedModel:
    source: str  # what the user passed
    path: str  # local folder vLLM loads (an adapter's base)
    fingerprint: str  # the checkpoint's; an adapter's: its base's and its own together
    architecture: str
    adapter: Optional[Adapter] = None  # the checkpoint is a LoRA adapter over the checkpoint at ``path``

    def base(self) -> ResolvedModel:
        """The checkpoint the engines load: an adapter's base, else this one."""
        if self.adapter is None:
            return self
        return ResolvedModel(self.adapter.base, self.path, self.adapter.base_fingerprint, self.architecture)


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _download_s3(uri: str, cache_dir: str | None) -> Path:
    """Copy an s3:// checkpoint prefix into the cache (keyed on its listing: names, sizes, ETags)."""
    from captionflow.data.storage import open_fs

    try:
        fs, root = open_fs(uri)
        listing = fs.find(root, detail=True)
    except Exception as e:  # credentials, endpoint, permissions: say which prefix
        raise ModelError(f"model {uri!r}: cannot list the prefix ({type(e).__name__}: {e})") from None
    if not listing:
        raise ModelError(f"model {uri!r}: the prefix holds no files")
    key = digest(sorted((p[len(root) :], i.get("size"), str(i.get("ETag", ""))) for p, i in listing.items()))
    cache = Path(cache_dir) if cache_dir else default_cache_dir()

    def download(tmp: Path) -> None:
        for path in listing:
            rel = path[len(root) :].lstrip("/")
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(path, str(tmp / rel))

    return build_once(cache / "models" / f"s3-{key}", "config.json", download)


def _download_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=repo_id))
    except Exception as e:
        raise ModelError(
            f"model {repo_id!r} is not a local folder and could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}: {str(e)[:300]}). Offline machines need a local path or s3:// prefix."
        ) from None


def local_model_path(model: str) -> Path | None:
    """The folder a model parameter names on this machine; None for 'builtin', an ``s3://`` prefix and a hub id
    with no such folder here. Raises ModelError for another scheme, a missing path or a file: checks that need
    no download, made before a run starts anything (``preflight.check_inputs``)."""
    if model == BUILTIN_NAME or model.startswith("s3://"):
        return None
    if "://" in model:
        raise ModelError(f"model {model!r}: supported are 'builtin', a local folder, s3:// and hub ids")
    path = Path(os.path.expanduser(model)).resolve()
    if not path.exists():
        if HUB_ID.match(model) and not model.startswith((".", "~")):
            return None
        raise ModelError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelError(f"model path {str(path)!r} is a file; pass the checkpoint folder")
    return path


def resolve_model(model: str, cache_dir: str | None = None, dummy_weights: bool = False) -> ResolvedModel:
    """'builtin', a local folder, an s3:// prefix or a hub id -> a validated local folder and fingerprint.

    Raises ModelError naming the problem and the path: missing folder, no config.json, a config
    that is not JSON, no weights, or a model without a vision tower (captionflow needs a VLM).
    ``dummy_weights`` (vLLM ``load_format="dummy"``): a folder without weights is accepted, e.g. a
    full-size architecture stand-in from ``captionflow build-model --arch``.
    """
    if model == BUILTIN_NAME:
        path = ensure_builtin_model(cache_dir)
    elif model.startswith("s3://"):
        path = _download_s3(model, cache_dir)
    else:
        path = local_model_path(model) or _download_hub(model)
    if (path / ADAPTER_CONFIG).is_file():
        return resolve_adapter(model, path, cache_dir, dummy_weights)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelError(f"model {str(path)!r} has no config.json: not a Hugging Face checkpoint folder")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"model {str(path)!r}: config.json is unreadable ({e})") from None
    archs = cfg.get("architectures") or []
    if "vision_config" not in cfg:
        raise ModelError(
            f"model {str(path)!r} ({', '.join(archs) or cfg.get('model_type', '?')}) has no vision_config: "
            "captionflow needs a vision-language model"
        )
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")]
    if not weights and not dummy_weights:
        raise ModelError(f"model {str(path)!r} has no weight files (*.safetensors / *.bin)")
    if not dummy_weights:
        check_weights(path)
    return ResolvedModel(
        source=model,
        path=str(path),
        fingerprint=model_fingerprint(path),
        architecture=archs[0] if archs else str(cfg.get("model_type", "unknown")),
    )


ADAPTER_CONFIG = "adapter_config.json"
# what adapts the vision tower: vLLM applies LoRA to the language model only (it skips the rest with a warning)
VISION_MODULES = re.compile(r"(^|[._])(visual|vision_tower|vision_model|merger|patch_embed)([._]|$)")


def resolve_adapter(model: str, path: Path, cache_dir: str | None, dummy_weights: bool) -> ResolvedModel:
    """A LoRA adapter folder (PEFT's ``adapter_config.json`` and ``adapter_model.safetensors``) over its base
    (``base_model_name_or_path``: a folder, relative to the adapter's or absolute, 'builtin', an s3:// prefix or a
    hub id), both checked before any engine starts: the base resolved as any checkpoint, the adapter a LoRA of the
    language model (not of the vision tower, which vLLM does not adapt, nor with extra trained modules) with
    complete weights. ModelError in one line naming the adapter and what is wrong."""
    where = f"adapter {str(path)!r}"
    try:
        conf = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{where}: {ADAPTER_CONFIG} is unreadable ({e})") from None
    if str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise ModelError(f"{where}: peft_type {conf.get('peft_type')!r}; captionflow runs LoRA adapters")
    if conf.get("modules_to_save"):
        raise ModelError(
            f"{where}: it also trains whole modules (modules_to_save {conf['modules_to_save']}), which vLLM's LoRA "
            "does not load: merge the adapter into its base and evaluate the merged checkpoint"
        )
    base_name = conf.get("base_model_name_or_path")
    if not base_name:
        raise ModelError(f"{where}: {ADAPTER_CONFIG} names no base_model_name_or_path")
    if not (base_name == "builtin" or "://" in base_name or Path(base_name).is_absolute()):
        relative = (path / base_name).resolve()
        base_name = str(relative) if relative.exists() else base_name
    weights = sorted(path.glob("adapter_model.*"))
    if not weights:
        raise ModelError(f"{where} has no adapter weights (adapter_model.safetensors)")
    check_weights(path)
    rank = int(conf.get("r") or 0)
    targets = conf.get("target_modules") or []
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    vision = [t for t in targets if VISION_MODULES.search(t)] + [
        k for k in _safetensors_keys(weights[0]) if VISION_MODULES.search(k)
    ]
    if vision:
        raise ModelError(
            f"{where}: it adapts the vision tower ({vision[0]}); vLLM applies LoRA to the language model only, "
            "so its captions would not be the adapter's: merge it into its base and evaluate the merged checkpoint"
        )
    if not 1 <= rank <= MAX_LORA_RANK:
        raise ModelError(f"{where}: rank r={rank}; vLLM serves LoRA ranks 1 to {MAX_LORA_RANK}")
    try:
        base = resolve_model(base_name, cache_dir, dummy_weights)
    except ModelError as e:
        raise ModelError(f"{where}: its base {base_name!r}: {e}") from None
    if base.adapter is not None:
        raise ModelError(f"{where}: its base {base_name!r} is itself an adapter")
    return ResolvedModel(
        source=model,
        path=base.path,
        fingerprint=digest({"base": base.fingerprint, "adapter": model_fingerprint(path)}),
        architecture=base.architecture,
        adapter=Adapter(str(path), rank, targets, base=base.source, base_fingerprint=base.fingerprint),
    )


MAX_LORA_RANK = 512  # vLLM's largest max_lora_rank


def _safetensors_keys(path: Path) -> list[str]:
    if path.suffix != ".safetensors":
        return []
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return [k for k in json.loads(fh.read(n)) if k != "__metadata__"]


SAFETENSORS_MAX_HEADER = 100 * 2**20


def check_weights(path: Path) -> None:
    """A checkpoint's weight files are complete: every shard an index names exists, and every safetensors
    file holds a readable header whose tensors end exactly where the file does (a truncated copy or an
    interrupted upload fails here, not inside an engine after Ray started)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError) as e:
            raise ModelError(f"model {str(path)!r}: {index.name} is unreadable ({e})") from None
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelError(
                f"model {str(path)!r}: {index.name} names {len(missing)} missing shard(s): {', '.join(missing[:3])}"
            )
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or n > SAFETENSORS_MAX_HEADER or 8 + n > size:
                raise ModelError(
                    f"model weights {str(f)!r}: not a complete safetensors file (header length {n}, "
                    f"file size {size} bytes): truncated or not safetensors"
                )
            try:
                header = json.loads(fh.read(n))
            except ValueError as e:
                raise ModelError(f"model weights {str(f)!r}: the safetensors header is not JSON ({e})") from None
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end != size:
            raise ModelError(
                f"model weights {str(f)!r}: the header describes {8 + n + end} bytes, the file has "
                f"{size}: truncated or damaged"
            )


@dataclass(frozen=True)
class ClipModel:
    """The checkpoint of the reference-free score (``clip_model``), resolved to a local folder."""

    source: str
    path: str
    fingerprint: str


def resolve_clip(source: str) -> ClipModel:
    """The checkpoint ``clip_model`` names, checked before any work: a CLIP config and its weights."""
    if source == "builtin":
        from captionflow.builtin.clip import ensure_builtin_clip

        path = ensure_builtin_clip()
    else:
        path = Path(source).expanduser()
        config = path / "config.json"
        if not config.is_file():
            raise ModelError(f"clip_model {source!r}: no config.json there (a local CLIP-family checkpoint folder)")
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        if model_type != "clip":
            raise ModelError(f"clip_model {source!r}: model_type is {model_type!r}, not 'clip'")
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise ModelError(f"clip_model {source!r}: no weights (*.safetensors or *.bin) in {path}")
    return ClipModel(source=source, path=str(path), fingerprint=model_fingerprint(path))
