"""The sequential verdict end to end: a real Prefect API, Ray Data and vLLM on CPU, real Parquet. A baseline whose
captions are the references (external captions, `captionflow evaluate`) against the built-in random model: clearly
worse, so the run stops captioning long before the set ends; the same run in full-set mode then captions the rest,
every image once; then the same folder with CLIPScore, and with the pairwise judge's win, as the verdict's score;
then a second checkpoint whose pairwise verdict stops the captioning itself (its judge beside the captioner)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from golden import caption_ids, golden_set, judged_rows

pytestmark = pytest.mark.slow
N = 64


def _sla_events(flow_run_id: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    body = {
        "filter": {
            "event": {"name": ["captionflow.run.sla-at-risk"]},
            "resource": {"id": [f"captionflow.run.{flow_run_id}"]},
        }
    }
    with get_client(sync_client=True) as client:
        return client.request("POST", "/events/filter", json={**body, "limit": 5}).json()["events"]


def test_a_sequential_run_stops_once_sure_and_a_full_run_captions_the_rest(prefect_api, tmp_path):
    from flows.cli import main

    data, teacher = golden_set(tmp_path, N)
    common = ["--dataset", str(data), "--output", str(tmp_path / "out")]
    assert (
        main(["evaluate", str(teacher), "--name", "teacher", *common, "--summary-json", str(tmp_path / "t.json")]) == 0
    )
    baseline = json.loads((tmp_path / "t.json").read_text())["run_dir"]

    run = ["run", *common, "--max-tokens", "6", "--verdict-against", baseline, "--summary-json"]
    assert main([*run, str(tmp_path / "seq.json"), "--verdict", "sequential"]) == 0
    seq = json.loads((tmp_path / "seq.json").read_text())
    v = seq["metrics"]["sequential"]
    assert v["decision"] == "worse" and v["upper"] < 0 and v["images_total"] == N
    assert v["against"] == "external:teacher" and v["score"] == "CIDEr-D" and v["alpha"] == 0.05
    assert v["images_used"] < N // 2  # stopped long before the set's end
    captioned = caption_ids(seq["run_dir"])
    assert v["images_used"] <= len(captioned) < N and len(set(captioned)) == len(captioned)
    assert seq["counts"]["failed"] == 0 and seq["passes"][-1]["stopped"] is True
    looks = [t[0] for t in v["trajectory"]]
    assert looks[-1] == v["images_used"] and looks == sorted(set(looks)) and looks[0] >= 1
    html = Path(seq["report_html"]).read_text(encoding="utf-8")
    assert v["decided_by"] == "sequence" and "expected CIDEr-D per image is below the baseline&#x27;s" in html
    assert "id='verdict'" in html and f"worse after {v['images_used']}" in html and "verdict-chart" in html
    # beside it, the fixed-sample paired bootstrap on the images captioned, against the same baseline
    boot = v["bootstrap"]
    assert boot["verdict"] == "worse" and boot["agrees"] and boot["n_images"] == len(captioned)
    assert "id='verdict-bootstrap'" in html and "as the sequential verdict (worse)" in html
    board = {r["run_dir"]: r for r in pq.read_table(tmp_path / "out" / "leaderboard.parquet").to_pylist()}
    row = board[seq["run_dir"]]
    assert row["verdict"].startswith(f"worse after {v['images_used']} of {N} images (CIDEr-D difference -")
    assert row["partial"] is True and "alpha 0.05, margin 0.05" in row["verdict"]  # a prefix: no one's baseline

    # the same command again: the verdict is in from the committed captions, nothing more is captioned
    assert main([*run, str(tmp_path / "again.json"), "--verdict", "sequential"]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["metrics"]["sequential"]["images_used"] == v["images_used"]
    assert sorted(caption_ids(seq["run_dir"])) == sorted(captioned)

    # full-set mode on the same folder: the rest captioned, every image once, the captions made before kept
    assert main([*run, str(tmp_path / "full.json"), "--verdict", "full", "--deadline", "1h"]) == 0
    full = json.loads((tmp_path / "full.json").read_text())
    # a deadline it meets: the summary says by how much, and no sla-at-risk event
    assert full["deadline"]["met"] and full["deadline"]["spare_s"] > 0 and "to spare" in full["deadline"]["line"]
    assert full["deadline"] == full["metrics"]["deadline"]  # one outcome: the summary's is the leaderboard row's
    assert not _sla_events(full["flow_run_id"])
    board = {r["run_dir"]: r for r in pq.read_table(tmp_path / "out" / "leaderboard.parquet").to_pylist()}
    assert (
        board[full["run_dir"]]["deadline"].startswith("met with")
        and full["deadline"]["deadline"][:16] in (board[full["run_dir"]]["deadline"])
    )
    everything = caption_ids(full["run_dir"])
    assert full["run_dir"] == seq["run_dir"] and full["resumed_from"] == len(captioned)
    assert len(everything) == N and len(set(everything)) == N and set(captioned) <= set(everything)
    assert "sequential" not in full["metrics"] and not full["metrics"].get("partial")
    assert board[full["run_dir"]]["partial"] is False  # every image captioned now: a baseline like any other

    # CLIPScore as the verdict's score, on the folder every image of which is captioned: the inference stage is not
    # taken from the cache (its baseline may have moved), nothing is captioned again, the verdict is in from the
    # committed captions, scored in the driver by the CLIP checkpoint that the clip-score stage runs too
    assert main([*run, str(tmp_path / "clip.json"), "--verdict", "sequential", "--verdict-score", "clip",
                 "--clip-model", "builtin"]) == 0  # fmt: skip
    clip = json.loads((tmp_path / "clip.json").read_text())
    c = clip["metrics"]["sequential"]
    assert c["score"] == "CLIPScore" and c["metric"] == "clip_score" and c["images_total"] == N
    assert c["decision"] != "continue" and c["trajectory"][-1][0] == c["images_used"] and c["clip_model"] == "builtin"
    assert clip["metrics"]["clip"]["scored"] == N and sorted(caption_ids(clip["run_dir"])) == sorted(everything)
    # the teacher's imported captions have no CLIPScores: the bootstrap beside the verdict says so
    assert "the baseline has no CLIPScores by builtin" in c["bootstrap"]["error"]

    # the pairwise judge's win as the verdict's score: the captions are all there, the judge (the built-in model)
    # judges the images in the verdict's order, both orders each, and stops once sure
    assert main([*run, str(tmp_path / "pair.json"), "--verdict", "sequential", "--verdict-score", "pairwise",
                 "--pairwise-against", baseline, "--verdict-margin", "0.2"]) == 0  # fmt: skip
    pair = json.loads((tmp_path / "pair.json").read_text())
    p = pair["metrics"]["sequential"]
    # the random judge ties most pairs (its judgements follow positions, mostly): the shares sit at 0.5, so the
    # interval closes around an even split and, inside the declared margin, says so long before the set ends; the
    # judgements it did not need are not made. A wide margin (0.2 on the win rate, docs/evaluation.md suggests
    # 0.03-0.05), so that 64 images are enough to see it
    assert p["score"] == "pairwise win rate" and p["metric"] == "pairwise_score" and p["images_total"] == N
    assert p["decision"] != "continue" and p["images_used"] < N // 2
    if p["decision"] == "equivalent":
        assert -0.2 <= p["lower"] <= p["upper"] <= 0.2
    judged = pair["metrics"]["pairwise"]
    assert p["images_used"] <= judged["judged"] < N and judged["failed"] == 0
    rows = judged_rows(judged["pairwise_dir"])
    assert len(rows) < 2 * N and len({r["image_id"] for r in rows}) == len(rows)
    assert "agrees" in p["bootstrap"] and "images judged" in p["bootstrap"]["line"]
    assert sorted(caption_ids(pair["run_dir"])) == sorted(everything)  # nothing captioned again
    board = {r["run_dir"]: r for r in pq.read_table(tmp_path / "out" / "leaderboard.parquet").to_pylist()}
    line = board[pair["run_dir"]]["verdict"]
    assert line.startswith(f"{p['decision']} after {p['images_used']} of {N} images (pairwise win rate ")
    assert f"win rate {0.5 + p['mean_difference']:.3f}, interval [{0.5 + p['lower']:.3f}, " in line

    # a second checkpoint, the pairwise win as the verdict's score: its judge (the checkpoint itself, on CPU) judges
    # each caption as it comes out of the captioner, in the same Ray Data job, and once the verdict is in the
    # captioning stops too; the pairwise stage after it finds the judgements committed and the verdict in
    from captionflow.builtin.model import build_builtin_model

    ckpt2 = build_builtin_model(tmp_path / "ckpt-2", seed=1)
    second = ["--model", str(ckpt2), "--pairwise-against", baseline, "--verdict-margin", "0.2", "--verdict-score"]
    assert main([*run, str(tmp_path / "pair2.json"), *second, "pairwise", "--verdict", "sequential"]) == 0
    pair2 = json.loads((tmp_path / "pair2.json").read_text())
    q = pair2["metrics"]["sequential"]
    assert pair2["run_dir"] != pair["run_dir"] and q["score"] == "pairwise win rate" and q["images_total"] == N
    assert q["decision"] != "continue" and q["images_used"] < N // 2
    captioned2 = caption_ids(pair2["run_dir"])
    assert q["images_used"] <= len(captioned2) < N and len(set(captioned2)) == len(captioned2)  # stopped, once each
    assert pair2["counts"]["captioned"] == len(captioned2) and pair2["counts"]["failed"] == 0
    assert pair2["passes"][-1]["stopped"] is True
    judged2 = pair2["metrics"]["pairwise"]
    rows = judged_rows(judged2["pairwise_dir"])
    pairs = [r["image_id"] for r in rows]
    assert len(set(pairs)) == len(pairs) and {i.rpartition("#")[0] for i in pairs} <= set(captioned2)
    assert q["images_used"] <= judged2["judged"] <= len(captioned2) and judged2["failed"] == 0
