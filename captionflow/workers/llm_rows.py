"""The row-level functions of the Ray Data LLM passes (captioning and judging), run in Ray workers.

A Ray worker imports the module of each function it runs: this one needs only pyarrow, Pillow and the
standard library, not Prefect (2.7 s of CPU per worker process on 2 cores) - on a GPU host the
postprocess tasks start worker processes while the engines' front ends need the CPU.

Request builders make each request ready for the engine stage - the prompt rendered from the run's
``ImagePrompt`` and the image as an array (``engine_request``; ``engines/request_format.py``) - and *remove*
the preprocessed image bytes from the row: Ray Data LLM carries every input column through every stage
(``wrap_preprocess`` keeps the row it is given), and the bytes are only needed once, to make the array.
"""

from __future__ import annotations

import json
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

from captionflow.workers.fitted_images import fitted_array, read_fitted_shard
from captionflow.workers.image_prompt import ImagePrompt
from captionflow.workers.images import engine_image

CAPTION_SCHEMA = pa.schema(
    [
        ("image_id", pa.string()),
        ("caption", pa.string()),
        ("finish_reason", pa.string()),  # "stop" | "length"
        ("num_input_tokens", pa.int64()),
        ("num_output_tokens", pa.int64()),
        ("model_fingerprint", pa.string()),
        ("error", pa.string()),
        ("attempt", pa.int64()),
    ]
)

JUDGE_REGEX = r'\{"score": [1-5], "reason": "[A-Za-z0-9 ,.;:()-]{0,80}"\}'
JUDGE_MAX_TOKENS = 160  # >= the longest match even at one character per token
JUDGE_SYSTEM = "You are a strict judge of image captions. You answer only in JSON."
JUDGE_SCHEMA = pa.schema(
    [
        ("image_id", pa.string()),
        ("score", pa.int64()),
        ("reason", pa.string()),
        ("raw", pa.string()),
        ("error", pa.string()),
        ("attempt", pa.int64()),
    ]
)


def engine_request(row: dict, prompt: ImagePrompt, system: str, text: str, sampling: dict, grid=None) -> dict:
    """One request as Ray Data LLM's engine stage takes it, for ``row``'s image (taken out of the row): the prompt
    (``prompt`` rendered around ``system`` and ``text``) and the image as an RGB array fitted to the engine's patch
    grid when ``grid`` is given - read fitted (``fitted_images``) or fitted here (``images.engine_image``)."""
    image = fitted_array(row)
    if image is None and "image" not in row:  # a judge after the captioner in one pass: the captioner's array
        image = row.pop(JUDGE_IMAGE)
    elif image is None:
        image = engine_image(row.pop("image"), grid)
    return {
        "image_id": row["image_id"],
        "prompt": prompt.render(system, text),
        "multimodal_data": {"image": image},
        "sampling_params": sampling,
    }


def keep_pending(batch: pa.Table, *, pending: pa.Array) -> pa.Table:
    """The rows of ``batch`` whose image_id is in ``pending``."""
    return batch.filter(pc.is_in(batch["image_id"], value_set=pending))


def read_pending_rows(
    batch: pa.Table,
    *,
    fs,
    columns: list[str],
    pending: pa.Array,
    grid: Optional[tuple[int, int, int]] = None,
    ranked: bool = False,
) -> pa.Table:
    """Read: the ``pending`` rows (``columns``) of the dataset shards named in ``batch["shard"]`` (``fs``: the
    output root's fsspec filesystem). Where ``batch["fitted"]`` names a file, each image comes fitted to ``grid``
    from there (``fitted_images``). ``ranked``: only the rows of ``pending[lo:hi]`` (``batch["lo"]``,
    ``batch["hi"]``: one window of a sequential verdict's order), in that order."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if ranked:
        lo, hi = batch["lo"][0].as_py(), batch["hi"][0].as_py()
        window = pending.slice(lo, hi - lo)
        table = read_pending_rows(batch, fs=fs, columns=columns, pending=window, grid=grid)
        return table.take(pc.sort_indices(pc.index_in(table["image_id"], value_set=window)))

    tables = []
    for path, fitted_path in zip(batch["shard"].to_pylist(), batch["fitted"].to_pylist()):
        if fitted_path:
            tables.append(read_fitted_shard(fs, path, fitted_path, columns, pending, grid))
            continue
        with fs.open(path, "rb") as fh:
            tables.append(keep_pending(pq.read_table(fh, columns=columns), pending=pending))
    return pa.concat_tables(tables) if tables else pa.table({c: [] for c in columns})


# ---------------------------------------------------------------- captioning
def caption_request(
    row: dict,
    *,
    image_prompt: ImagePrompt,
    system_prompt: str,
    prompt: str,
    sampling: dict,
    fail_ids: frozenset,
    grid=None,
    judged: bool = False,
    adapter: str | None = None,
) -> dict:
    """Preprocess: one captioning request. ``fail_ids``: rows sent with invalid sampling parameters
    (temperature -1, which vLLM rejects), for the tests of per-row failures. ``judged``: a judge takes the caption
    on in the same pass, and the image array with it (``JUDGE_IMAGE``: the engine stage takes the request's out
    of the row). ``adapter``: the LoRA adapter's folder the engine applies to this request (Ray Data LLM's
    ``model`` column: a LoRA request where it differs from the engines' checkpoint). A row of a shared pass
    (``stages/shared_pass.py``) names its checkpoint itself: ``model`` and ``model_fingerprint``, carried on."""
    params = dict(sampling)
    if row["image_id"] in fail_ids:
        params["temperature"] = -1.0
    shared = {k: row[k] for k in ("model", "model_fingerprint") if k in row}
    request = engine_request(row, image_prompt, system_prompt, prompt, params, grid)
    if adapter:
        request["model"] = adapter
    request.update(shared)
    return {**request, JUDGE_IMAGE: request["multimodal_data"]["image"]} if judged else request


def for_checkpoints(row: dict, *, models: dict[str, str], some: dict[str, list[str]]) -> list[dict]:
    """A shared pass's fan-out (``stages/shared_pass.py``): the image row once for each checkpoint that lacks its
    caption (``some``: those of the images that only some lack; every other image: each of ``models``), with Ray
    Data LLM's ``model`` column (``models``: fingerprint -> the adapter's folder, or the engines' checkpoint for
    the base) and its ``model_fingerprint``; each image's rows side by side, so that batches mix the adapters."""
    return [{**row, "model": models[fp], "model_fingerprint": fp} for fp in some.get(row["image_id"], models)]


def to_caption(row: dict, *, max_tokens: int, model_fp: str, attempt: int) -> dict:
    """Postprocess: the engine's answer as a caption row."""
    n_out = int(row.get("num_generated_tokens") or 0)
    return {
        "image_id": row["image_id"],
        "caption": row.get("generated_text") or "",
        "finish_reason": "length" if n_out >= max_tokens else "stop",
        "num_input_tokens": int(row.get("num_input_tokens") or 0),
        "num_output_tokens": n_out,
        "model_fingerprint": row.get("model_fingerprint") or model_fp,
        "error": "",
        "attempt": attempt,
    }


def fixed_schema(row: dict, *, schema: pa.Schema, attempt: int, blank: dict) -> dict:
    """Error rows bypass the processor's postprocess: give every row ``schema``'s columns. An error row has
    its image id, the error, the attempt, ``blank``'s values and None for the rest."""
    err = row.get("__inference_error__") or ""
    if err:
        return {
            **dict.fromkeys(schema.names),
            **blank,
            "image_id": row["image_id"],
            "error": str(err)[:2000],
            "attempt": attempt,
        }
    return {k: row[k] for k in schema.names}


def caption_fixed_schema(row: dict, *, model_fp: str, attempt: int) -> dict:
    blank = {"caption": "", "finish_reason": "error", "num_input_tokens": 0, "num_output_tokens": 0}
    fp = row.get("model_fingerprint") or model_fp
    return fixed_schema(row, schema=CAPTION_SCHEMA, attempt=attempt, blank={**blank, "model_fingerprint": fp})


# ---------------------------------------------------------------- captioning and judging in one pass
# A sequential verdict on the judge's score or the pairwise win, cold on CPU: each caption goes on to the judge's
# engines as it is made (``stages/judge.py``, ``SequentialJudging``); a result row is the caption row with its
# judgement under ``judged`` (None where the caption failed: it never reached the judge).
JUDGE_IMAGE = "judge_image"


def to_judged_caption(row: dict, **kwargs) -> dict:
    """Postprocess of the captioner: the caption row, and what the judge's request needs of the row (the image as
    the captioner's engine got it: the judge's grid is the same, and the references)."""
    return {**to_caption(row, **kwargs), JUDGE_IMAGE: row[JUDGE_IMAGE], "references": row["references"]}


def judged_request(row: dict, *, request, **kwargs) -> dict:
    """Preprocess of the judge after the captioner: ``request``'s, but a row whose caption failed passes unjudged
    (Ray Data LLM's stages let a row with ``__inference_error__`` through)."""
    return {} if row.get("__inference_error__") else request(row, **kwargs)


def caption_of(row: dict, image_id: str) -> dict:
    return {**{k: row[k] for k in CAPTION_SCHEMA.names}, "image_id": image_id}


def judged_out(row: dict, *, out, attempt: int, pairs: bool) -> dict:
    """Postprocess of the judge after the captioner: the caption row (``pairs``: the rows are judgements of pairs,
    ``<image_id>#ab|#ba``) with the judgement (``out``) under ``judged``."""
    image_id = split_pair_id(row["image_id"])[0] if pairs else row["image_id"]
    return {**caption_of(row, image_id), "judged": out(row, attempt=attempt)}


def judged_fixed_schema(row: dict, *, fixed, model_fp: str, attempt: int, pairs: bool) -> dict:
    """Every row of the pass in ``judged_out``'s shape: a failed caption's error row (``judged`` None), or a caption
    whose judgement failed with the judge's error row (``fixed``)."""
    if row.get("judged") is not None:
        return row
    image_id = split_pair_id(row["image_id"])[0] if pairs else row["image_id"]
    if row.get("caption") is None:  # the caption failed: no caption column, the captioner's error
        failed = caption_fixed_schema({**row, "image_id": image_id}, model_fp=model_fp, attempt=attempt)
        return {**failed, "judged": None}
    return {**caption_of(row, image_id), "judged": fixed(row, attempt=attempt)}


# ---------------------------------------------------------------- judging
def judge_prompt(caption: str, references: list[str]) -> str:
    refs = "".join(f"\n- {r}" for r in references)
    return (
        f"Caption to judge: {caption!r}\n"
        + (f"Reference captions written by people:{refs}\n" if references else "")
        + "Rate how accurately the caption describes the image, from 1 (wrong) to 5 (perfect). "
        'Answer as {"score": <1-5>, "reason": "<short reason>"}.'
    )


def judge_request(row: dict, *, captions: Optional[dict], image_prompt: ImagePrompt, sampling: dict, grid=None) -> dict:
    """Preprocess: one judging request (the image, the caption, the references); ``captions`` None: the row's."""
    caption = row["caption"] if captions is None else captions[row["image_id"]]
    text = judge_prompt(caption, list(row.get("references") or []))
    return engine_request(row, image_prompt, JUDGE_SYSTEM, text, sampling, grid)


def parse_judgement(text: str) -> tuple[int, str]:
    obj = json.loads(text)
    score = int(obj["score"])
    if not 1 <= score <= 5:
        raise ValueError(f"score {score} out of range")
    return score, str(obj.get("reason", ""))


def judge_out(row: dict, *, attempt: int) -> dict:
    """Postprocess: the judge's answer parsed (or the reason it does not parse)."""
    raw = row.get("generated_text") or ""
    try:
        score, reason = parse_judgement(raw)
        err = ""
    except (ValueError, KeyError, TypeError) as e:
        score, reason, err = None, "", f"unparseable judge answer ({e}): {raw[:200]!r}"
    return {"image_id": row["image_id"], "score": score, "reason": reason, "raw": raw, "error": err, "attempt": attempt}


def judge_fixed_schema(row: dict, *, attempt: int) -> dict:
    return fixed_schema(row, schema=JUDGE_SCHEMA, attempt=attempt, blank={"reason": "", "raw": ""})


# ---------------------------------------------------------------- pairwise judging
# Each image is judged twice, the two captions in both orders ("<image_id>#ab": A is this run's caption, B the
# baseline's; "#ba" the other way round), so that a judge's preference for a position cancels out.
ORDERS = ("ab", "ba")
PAIRWISE_REGEX = r'\{"winner": "(A|B|tie)", "reason": "[A-Za-z0-9 ,.;:()-]{0,80}"\}'
PAIRWISE_MAX_TOKENS = 160  # >= the longest match even at one character per token
PAIRWISE_SYSTEM = "You are a strict judge of image captions. You compare two captions and answer only in JSON."
PAIRWISE_SCHEMA = pa.schema(
    [
        ("image_id", pa.string()),  # "<image_id>#ab" | "<image_id>#ba"
        ("winner", pa.string()),  # "A" | "B" | "tie", as the judge saw them
        ("candidate_score", pa.float64()),  # this run's caption: 1 won, 0.5 tie, 0 lost
        ("reason", pa.string()),
        ("raw", pa.string()),
        ("error", pa.string()),
        ("attempt", pa.int64()),
    ]
)


def pair_id(image_id: str, order: str) -> str:
    return f"{image_id}#{order}"


def split_pair_id(pid: str) -> tuple[str, str]:
    image_id, _, order = pid.rpartition("#")
    return image_id, order


def pairwise_prompt(caption_a: str, caption_b: str, references: list[str]) -> str:
    refs = "".join(f"\n- {r}" for r in references)
    return (
        f"Caption A: {caption_a!r}\nCaption B: {caption_b!r}\n"
        + (f"Reference captions written by people:{refs}\n" if references else "")
        + "Which caption describes the image more accurately and completely? Answer A, B or tie, as "
        '{"winner": "<A|B|tie>", "reason": "<short reason>"}.'
    )


def both_orders(row: dict, *, pending: Optional[frozenset] = None) -> list[dict]:
    """One dataset row as its pending judgements: the row once per order still to judge (None: both)."""
    out = []
    for order in ORDERS:
        pid = pair_id(row["image_id"], order)
        if pending is None or pid in pending:
            out.append({**row, "image_id": pid})
    return out


def pairwise_request(
    row: dict, *, candidate: Optional[dict], baseline: dict, image_prompt: ImagePrompt, sampling: dict, grid=None
) -> dict:
    """Preprocess: one pairwise request (the image, both captions in this row's order, the references);
    ``candidate`` None: this run's caption is the row's."""
    image_id, order = split_pair_id(row["image_id"])
    a, b = row["caption"] if candidate is None else candidate[image_id], baseline[image_id]
    if order == "ba":
        a, b = b, a
    text = pairwise_prompt(a, b, list(row.get("references") or []))
    return engine_request(row, image_prompt, PAIRWISE_SYSTEM, text, sampling, grid)


def parse_pairwise(text: str) -> tuple[str, str]:
    obj = json.loads(text)
    winner = str(obj["winner"])
    if winner not in ("A", "B", "tie"):
        raise ValueError(f"winner {winner!r} is not A, B or tie")
    return winner, str(obj.get("reason", ""))


def candidate_score(winner: str, order: str) -> float:
    """This run's caption's share of the judgement: it is A in order "ab" and B in order "ba"."""
    if winner == "tie":
        return 0.5
    return 1.0 if (winner == "A") == (order == "ab") else 0.0


def pairwise_out(row: dict, *, attempt: int) -> dict:
    """Postprocess: the judge's answer parsed (or the reason it does not parse)."""
    raw = row.get("generated_text") or ""
    try:
        winner, reason = parse_pairwise(raw)
        score, err = candidate_score(winner, split_pair_id(row["image_id"])[1]), ""
    except (ValueError, KeyError, TypeError) as e:
        winner, reason, score, err = None, "", None, f"unparseable pairwise answer ({e}): {raw[:200]!r}"
    return {
        "image_id": row["image_id"],
        "winner": winner,
        "candidate_score": score,
        "reason": reason,
        "raw": raw,
        "error": err,
        "attempt": attempt,
    }


def pairwise_fixed_schema(row: dict, *, attempt: int) -> dict:
    return fixed_schema(row, schema=PAIRWISE_SCHEMA, attempt=attempt, blank={"reason": "", "raw": ""})
