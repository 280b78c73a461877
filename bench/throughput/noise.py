"""The verdict phase's noise floor and a planted difference (``--verdict-phases noise``): what the sequential verdict
says of a checkpoint against itself - captioned again after a second swap into warm engines, and on engines started
for the run (warm against cold) - with the share of images whose two captions agree; and what it says of the same
checkpoint against a baseline better by a known amount (its own captions with the references put in for a few
images), on the verdict's default margin."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from bench.throughput.verdict import _flow_timed, _service, external_captions

PLANTED = 0.02  # the share of images whose baseline caption is a reference caption


def noise(a, images: str, checkpoints: list[str], kwargs: str, env: dict, cc: Path) -> dict:
    """One service on checkpoint A. B's full set (swapped in), A on a few images (swapped back), B's sequential
    verdict against its own full set on a fresh output root (swapped in again), B against the planted baseline;
    then B cold against its full set."""
    ckpt_a, ckpt_b = checkpoints[0], checkpoints[1]
    for root in ("out-noise", "out-noise-warm", "out-noise-cold", "out-noise-a", "out-noise-planted"):
        shutil.rmtree(Path(a.work) / root, ignore_errors=True)
    res: dict = {}
    with _service(a, ckpt_a, kwargs, env, cc, "serve-noise") as started:
        if isinstance(started, dict):
            return {"service": started}
        res["service_start_s"] = started
        full = _flow_timed(a, "noise-full", images, ckpt_b, kwargs, env, "out-noise", ["--verdict", "full"])
        res["full"] = full
        if "error" in full:
            return res
        # A back into the engines (a few images of another folder), so that B's next run swaps it in again
        few = _first_images(a, images, 64)
        res["swap_back"] = _flow_timed(a, "noise-swap-a", few, ckpt_a, kwargs, env, "out-noise-a")
        against = ["--verdict", "sequential", "--verdict-against", full["run_dir"]]
        res["warm"] = _flow_timed(a, "noise-warm", images, ckpt_b, kwargs, env, "out-noise-warm", against)
        planted = _planted_baseline(a, images, full["run_dir"], env)
        if isinstance(planted, dict):
            res["planted"] = planted
        else:
            seq = ["--verdict", "sequential", "--verdict-against", planted]
            res["planted"] = _flow_timed(a, "noise-planted", images, ckpt_b, kwargs, env, "out-noise-planted", seq)
            res["planted"]["planted_share"] = PLANTED
    cold = [*against, "--warm-engines", "off"]
    res["cold"] = _flow_timed(a, "noise-cold", images, ckpt_b, kwargs, env, "out-noise-cold", cold)
    for k in ("warm", "cold"):
        if "error" not in res[k]:
            res[k]["agreement"] = agreement(res[k]["run_dir"], full["run_dir"])
    res["summary"] = {
        k: {**(res[k].get("sequential") or {}), "agreement": (res[k].get("agreement") or {}).get("rate"),
            "leaderboard_row_after_s": res[k].get("leaderboard_row_after_s"), "captioned": res[k].get("captioned")}
        for k in ("warm", "cold", "planted") if isinstance(res.get(k), dict) and "error" not in res[k]
    }  # fmt: skip
    return res


def agreement(run_dir: str, other: str) -> dict:
    """The share of the images captioned in both run folders whose two captions are the same."""
    from captionflow.data.layout import read_captions
    from captionflow.data.storage import Store

    mine, theirs = read_captions(Store(run_dir), ()), read_captions(Store(other), ())
    common = sorted(set(mine) & set(theirs))
    same = sum(mine[i] == theirs[i] for i in common)
    return {"images": len(common), "same_caption": same, "rate": round(same / len(common), 4) if common else None}


def _first_images(a, images: str, n: int) -> str:
    """The first ``n`` images of ``images`` hard-linked into a folder of their own (another dataset)."""
    folder = Path(a.work) / f"images-first-{n}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for f in sorted(p for p in Path(images).iterdir() if p.suffix != ".jsonl")[:n]:
        os.link(f, folder / f.name)
    return str(folder)


def _planted_baseline(a, images: str, run_dir: str, env: dict):
    """B's own captions of the golden set with the first reference put in for PLANTED of the images (every
    50th in file order), imported as external captions: a baseline better than B by a known, small amount."""
    import pyarrow.parquet as pq

    scores = pq.read_table(Path(run_dir) / "scores.parquet", columns=["source", "caption"]).to_pylist()
    by_file = {Path(r["source"]).name: r["caption"] for r in scores}
    refs = [json.loads(x) for x in Path(images, "captions.jsonl").read_text().splitlines()]
    step = round(1 / PLANTED)
    rows = [
        {"file_name": r["file_name"], "caption": r["captions"][0] if k % step == 0 else by_file[r["file_name"]]}
        for k, r in enumerate(refs)
        if r["file_name"] in by_file
    ]
    return external_captions(a, images, rows, "planted", "out-noise-planted", env)
