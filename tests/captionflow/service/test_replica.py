"""A warm engine's swap check: the embedding an engine holds against the checkpoint file's, both read in the
engine's process (service/replica.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from captionflow.service.replica import _embedding_digest, checkpoint_digest, weights_problem


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from captionflow.builtin.model import build_builtin_model

    root = tmp_path_factory.mktemp("ckpts")
    return [str(build_builtin_model(root / f"seed{s}", seed=s)) for s in (0, 1)]


def _engine_worker(checkpoint: str, dtype):
    """What ``collective_rpc`` hands ``_embedding_digest`` in a vLLM worker: a model whose parameters are named
    as vLLM names them, here loaded from ``checkpoint`` in the engine's dtype."""
    import torch
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    (key,) = [k for k in weights if k.endswith("embed_tokens.weight")]
    model = torch.nn.Module()
    model.language_model = torch.nn.Module()
    model.language_model.embed_tokens = torch.nn.Embedding(*weights[key].shape, dtype=dtype)
    with torch.no_grad():
        model.language_model.embed_tokens.weight.copy_(weights[key].to(dtype))
    return SimpleNamespace(model_runner=SimpleNamespace(model=model))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_holding_a_checkpoint_passes_the_check_and_one_holding_another_does_not(checkpoints, dtype):
    import torch

    a, b = checkpoints
    loaded_a = _embedding_digest(_engine_worker(a, getattr(torch, dtype)))
    assert loaded_a[0] == dtype  # the file is cast to the engine's dtype before it is compared
    assert weights_problem(a, loaded_a) is None
    problem = weights_problem(b, loaded_a)
    assert problem and "is not" in problem and b in problem
    assert checkpoint_digest(a, dtype) != checkpoint_digest(b, dtype)


def test_an_unreadable_embedding_or_a_checkpoint_without_one_fails_the_check(checkpoints, tmp_path):
    assert "could not be read" in weights_problem(checkpoints[0], ("", ""))
    assert "no embedding" in weights_problem(str(tmp_path), ("float32", "ab" * 32))


def test_a_weight_the_reload_does_not_write_is_found(checkpoints):
    """Every floating-point weight is marked (NaN) before a swap's reload; one the reload leaves unwritten is found
    after it, by name, not only a wrong embedding."""
    import torch

    from captionflow.service.replica import _mark_weights, _unwritten

    worker = _engine_worker(checkpoints[0], torch.bfloat16)
    worker.model_runner.model.proj = torch.nn.Linear(4, 4, dtype=torch.float32)
    worker.model_runner.model.ids = torch.nn.Parameter(torch.arange(4), requires_grad=False)  # not a float: kept
    before = _embedding_digest(worker)
    assert _mark_weights(worker) == 3  # the embedding, the projection's weight and bias
    assert _unwritten(worker) == (3, ["language_model.embed_tokens.weight", "proj.weight", "proj.bias"])
    reloaded = _engine_worker(checkpoints[0], torch.bfloat16).model_runner.model.language_model
    with torch.no_grad():  # the reload writes the embedding only
        worker.model_runner.model.language_model.embed_tokens.weight.copy_(reloaded.embed_tokens.weight)
    assert _embedding_digest(worker) == before  # what the embedding check alone would pass
    assert _unwritten(worker) == (2, ["proj.weight", "proj.bias"])
    assert worker.model_runner.model.ids.tolist() == [0, 1, 2, 3]
