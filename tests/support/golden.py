"""A small golden set with reference captions, and a teacher's captions of it (the references' first)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq

from captionflow.builtin.synthetic import make_images

COLORS = ["red", "blue", "green", "yellow", "black", "white", "brown", "grey", "orange", "pink"]
THINGS = ["dog", "cat", "horse", "bird", "car", "bus", "bicycle", "boat", "kite", "train"]
VERBS = ["stands", "sits", "runs", "waits", "rests", "lies", "plays", "parks"]
PLACES = ["grass", "road", "beach", "field", "street", "park", "snow", "lake"]


def references(i: int) -> list[str]:
    r = random.Random(i)
    c, t, v, p = r.choice(COLORS), r.choice(THINGS), r.choice(VERBS), r.choice(PLACES)
    return [f"a {c} {t} {v} on the {p}", f"the {c} {t} {v} near the {p}", f"a {t} that {v} by the {p}"]


def golden_set(root: Path, n: int) -> tuple[Path, Path]:
    """(the dataset folder: ``n`` images and their references, the teacher's captions as a JSONL file)."""
    data = make_images(root / "golden", n, size=(64, 48))
    refs = {f"img_{i:06d}.jpg": references(i) for i in range(n)}
    (data / "captions.jsonl").write_text(
        "".join(json.dumps({"file_name": k, "captions": v}) + "\n" for k, v in refs.items())
    )
    teacher = root / "teacher.jsonl"
    teacher.write_text("".join(json.dumps({"file_name": k, "caption": v[0]}) + "\n" for k, v in refs.items()))
    return data, teacher


def caption_ids(run_dir: str) -> list[str]:
    """The image ids of every caption row committed in ``run_dir``, in file order."""
    return [
        i for p in sorted(Path(run_dir, "captions").glob("*.parquet")) for i in pq.read_table(p)["image_id"].to_pylist()
    ]


def judged_rows(folder: str) -> list[dict]:
    """Every judgement row committed in a judge or pairwise folder."""
    return [r for f in sorted(Path(folder, "scores").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
