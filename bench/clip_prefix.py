"""A CLIPScore verdict's scoring in the driver (stages/clip_score.PrefixClipScore): images a second, both sides'
captions scored as a prefix arrives in windows, by CLIP size and device.

Random checkpoints of real shapes are built locally (nothing downloaded; the builtin CLIP's tokenizer): ``builtin``
(2 layers, 64 px), ``b32`` (ViT-B/32, 224 px) and ``l14`` (ViT-L/14, 224 px; CLIP-L's 24 vision layers). The
images are real JPEGs in a real Parquet shard, read as a run reads them.

python bench/clip_prefix.py [--sizes builtin b32 l14] [--devices cpu cuda] [--n 512] [--json PATH]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from captionflow.builtin.clip import ensure_builtin_clip
from captionflow.data.fingerprint import model_fingerprint
from captionflow.data.storage import Store
from captionflow.model_source import ClipModel
from captionflow.stages.clip_score import PrefixClipScore

SHAPES = {  # vision (hidden, layers, heads, patch), text (hidden, layers, heads), projection
    "b32": ((768, 12, 12, 32), (512, 8, 8), 512),
    "l14": ((1024, 24, 16, 14), (768, 12, 12), 768),
}
WINDOW = 64  # the prefix's images scored at once (a batch per engine arrives together)


def checkpoint(size: str, root: Path) -> Path:
    """A random CLIP of ``size``'s shapes, with the builtin's tokenizer."""
    builtin = Path(ensure_builtin_clip())
    if size == "builtin":
        return builtin
    import torch
    from transformers import CLIPConfig, CLIPModel

    (vh, vl, va, patch), (th, tl, ta), proj = SHAPES[size]
    base = json.loads((builtin / "config.json").read_text())["text_config"]
    config = CLIPConfig(
        text_config={**{k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")},
                     "hidden_size": th, "intermediate_size": 4 * th, "num_hidden_layers": tl,
                     "num_attention_heads": ta, "max_position_embeddings": 77},
        vision_config={"hidden_size": vh, "intermediate_size": 4 * vh, "num_hidden_layers": vl,
                       "num_attention_heads": va, "image_size": 224, "patch_size": patch},
        projection_dim=proj,
    )  # fmt: skip
    out = root / size
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin / name, out / name)
    pre = json.loads((builtin / "preprocessor_config.json").read_text())
    pre.update(crop_size={"height": 224, "width": 224}, size={"shortest_edge": 224})
    (out / "preprocessor_config.json").write_text(json.dumps(pre))
    return out


def shard(root: Path, n: int) -> tuple[Store, str, list[str]]:
    import pyarrow as pa
    from PIL import Image

    rng = np.random.default_rng(0)
    ids, data = [], []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (240, 320, 3), dtype=np.uint8)).save(buf, format="JPEG")
        ids.append(f"img_{i:06d}")
        data.append(buf.getvalue())
    store = Store(str(root / "out"))
    path = store.write_table(pa.table({"image_id": ids, "image": data}), "shard-0.parquet")
    return store, path, ids


def measure(path: Path, device: str, store: Store, shard_path: str, ids: list[str]) -> dict:
    rng = np.random.default_rng(1)
    words = ["a", "dog", "on", "the", "grass", "red", "car", "near", "street", "two", "people", "walking"]
    mine = {i: " ".join(rng.choice(words, 9)) for i in ids}
    theirs = {i: " ".join(rng.choice(words, 12)) for i in ids}
    clip = ClipModel(source=str(path), path=str(path), fingerprint=model_fingerprint(path))
    t0 = time.perf_counter()
    scorer = PrefixClipScore(clip, store, [shard_path], ids, gpu=device == "cuda")
    scorer._ready.result()  # the checkpoint and the images loaded (in a thread while a run's requests start)
    loaded = time.perf_counter() - t0
    t1 = time.perf_counter()
    for start in range(0, len(ids), WINDOW):  # as PrefixVerdict scores a prefix: this run's side, then the baseline's
        window = ids[start : start + WINDOW]
        scorer({i: mine[i] for i in window})
        scorer({i: theirs[i] for i in window})
    seconds = time.perf_counter() - t1
    return {"load_s": round(loaded, 2), "seconds": round(seconds, 2), "images_per_s": round(len(ids) / seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["builtin", "b32", "l14"], choices=["builtin", *SHAPES])
    ap.add_argument("--devices", nargs="+", default=["cpu"], choices=["cpu", "cuda"])
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--cpu-n", type=int, default=0, help="images for a non-builtin CLIP on CPU (default --n)")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "clip_prefix-cpu.json"))
    a = ap.parse_args()
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store, shard_path, ids = shard(root, a.n)
        for size in a.sizes:
            path = checkpoint(size, root)
            for device in a.devices:
                n = a.cpu_n if device == "cpu" and size != "builtin" and a.cpu_n else a.n
                rows.append({"size": size, "device": device, "images": n,
                             **measure(path, device, store, shard_path, ids[:n])})  # fmt: skip
                print(rows[-1], flush=True)
    name = torch.cuda.get_device_name(0) if "cuda" in a.devices else f"{os.cpu_count()} CPUs"
    print(f"\n{name}\n{'size':>8} {'device':>6} {'images':>6} {'load s':>7} {'images/s':>9}")
    for r in rows:
        print(f"{r['size']:>8} {r['device']:>6} {r['images']:>6} {r['load_s']:>7} {r['images_per_s']:>9}")
    Path(a.json).write_text(
        json.dumps(
            {"device": name, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "runs": rows}, indent=2
        )
        + "\n"  # fmt: skip
    )
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
