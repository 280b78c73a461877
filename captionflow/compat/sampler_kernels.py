"""vLLM's sampler kernels compiled before the engines' warm-up asks for them.

Every engine's start runs its sampler once on dummy logits, with temperature, top-k and top-p on every row, then
again with a per-request generator (``GPUModelRunner._dummy_sampler_run``, vLLM 0.26). With an empty Triton cache
that compiles the kernel applying top-k and top-p: 11.9 s on the H100 host (``bench/sampler_warmup.py``; 0.01 s
with the kernel cached), inside every engine's init on a fresh node - all of them compiling it at once - although a
greedy run (temperature 0, captionflow's default) never uses it.

``prebuild`` makes the same two calls (``warm_up``) in a background process on the local GPU once preflight has
found the model, with the engines' environment (their ``TRITON_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``,
``VLLM_USE_FLASHINFER_SAMPLER``): the engines' warm-up then finds the kernels compiled. Nothing waits for it: it
has imported vLLM, compiled and exited long before the engines load their weights (~15 + 12 s against ~50 s); if
not, or if it fails, the engines compile the kernels themselves, as without this. Nothing happens once a marker in
Triton's cache says this vocabulary and batch were done (every later run on the node).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

MARKERS = "captionflow-sampler"  # a folder in Triton's cache: one empty file per (vocabulary, rows, vLLM) done


def triton_cache(env: Mapping[str, str]) -> Path:
    """Triton's kernel cache under ``env`` (its default: ``$TRITON_HOME/.triton/cache``, else ``~/.triton/cache``)."""
    if env.get("TRITON_CACHE_DIR"):
        return Path(env["TRITON_CACHE_DIR"]).expanduser()
    return Path(env.get("TRITON_HOME") or Path.home()).expanduser() / ".triton" / "cache"


def vocab_size(model_path: str) -> Optional[int]:
    """The model's vocabulary (its text model's), from config.json; None when it does not say."""
    try:
        conf = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    size = (conf.get("text_config") or {}).get("vocab_size") or conf.get("vocab_size")
    return int(size) if isinstance(size, int) and size > 0 else None


def _marker(env: Mapping[str, str], vocab: int, rows: int) -> Path:
    import importlib.metadata

    try:
        vllm = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm = "none"
    return triton_cache(env) / MARKERS / f"vocab{vocab}-rows{rows}-vllm{vllm}"


def prebuild(model_path: str, rows: int, engine_env: Mapping[str, str]) -> Optional[subprocess.Popen]:
    """Compile the sampler warm-up's kernels for ``model_path``'s vocabulary and ``rows`` (the engines'
    ``max_num_seqs``) in a background process with the engines' environment; None when done before, the
    vocabulary is unknown or vLLM is not installed."""
    import importlib.util

    env = {**os.environ, **engine_env}
    vocab = vocab_size(model_path)
    if vocab is None or rows < 1 or importlib.util.find_spec("vllm") is None:
        return None
    marker = _marker(env, vocab, rows)
    if marker.exists():
        return None
    proc = subprocess.Popen(
        [sys.executable, "-m", "captionflow.compat.sampler_kernels", str(vocab), str(rows), str(marker)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    threading.Thread(target=proc.wait, name="captionflow-sampler-reaper", daemon=True).start()  # no zombie
    return proc


def dummy_metadata(rows: int, vocab: int, device: str, generators: dict, greedy: bool = False) -> Any:
    """vLLM's ``SamplingMetadata`` as ``_dummy_sampler_run`` builds it (``greedy``: a batch at temperature 0)."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    def full(v):
        return torch.full((rows,), v, device=device)

    return SamplingMetadata(
        temperature=None if greedy else full(0.5),
        all_greedy=greedy,
        all_random=False,
        top_p=None if greedy else full(0.9),
        top_k=None if greedy else full(vocab - 1),
        generators=generators,
        max_num_logprobs=None,
        logprob_token_ids=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=full(0.1),
        presence_penalties=full(0.1),
        repetition_penalties=full(0.1),
        output_token_ids=[[] for _ in range(rows)],
        spec_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def warm_up(rows: int, vocab: int, device: str = "cuda") -> None:
    """In this process: the sampler calls of an engine's warm-up, on random float32 logits."""
    import torch
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler()
    logits = torch.rand(rows, vocab, device=device, dtype=torch.float32)
    sampler(logits=logits.clone(), sampling_metadata=dummy_metadata(rows, vocab, device, {}))
    seeded = {0: torch.Generator(device=device).manual_seed(0)}
    sampler(logits=logits, sampling_metadata=dummy_metadata(rows, vocab, device, seeded))
    torch.cuda.synchronize()


if __name__ == "__main__":
    vocab_arg, rows_arg, marker_arg = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    warm_up(rows_arg, vocab_arg)
    marker_arg.parent.mkdir(parents=True, exist_ok=True)
    marker_arg.touch()
