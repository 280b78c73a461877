"""Built-in tiny LoRA adapters over the built-in model, made locally for the tests and the examples.

An adapter is what PEFT writes: ``adapter_config.json`` (LoRA, its rank, the modules it adapts, its base) and
``adapter_model.safetensors`` (``lora_A`` / ``lora_B`` of each adapted module of the language model), drawn from a
fixed seed, so that each seed is another fine-tune of the same base and every machine writes the same bytes. Large
enough to change the tiny model's captions; meaningless, like the model's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from captionflow.builtin.model import BUILTIN_NAME

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _shapes(text: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adaptable module of one language-model layer."""
    hidden, inter = text["hidden_size"], text["intermediate_size"]
    head = text.get("head_dim") or hidden // text["num_attention_heads"]
    q, kv = text["num_attention_heads"] * head, text["num_key_value_heads"] * head
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def build_adapter(
    out_dir: str | os.PathLike,
    seed: int = 1,
    base: str = BUILTIN_NAME,
    rank: int = 8,
    targets: tuple[str, ...] = ATTENTION + MLP,
    scale: float = 0.5,
) -> Path:
    """Write a LoRA adapter of ``base`` (a checkpoint folder or 'builtin'; its config.json gives the shapes) into
    ``out_dir`` (created; must not exist): ``rank``, the modules ``targets`` of every language-model layer, weights
    drawn from ``seed`` times ``scale``."""
    import torch
    from safetensors.torch import save_file

    from captionflow.builtin.model import ensure_builtin_model

    base_dir = ensure_builtin_model() if base == BUILTIN_NAME else Path(base)
    config = json.loads((Path(base_dir) / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config") or config
    shapes = _shapes(text)
    out = Path(out_dir)
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for layer in range(text["num_hidden_layers"]):
        for module in targets:
            fan_in, fan_out = shapes[module]
            part = "self_attn" if module in ATTENTION else "mlp"
            name = f"base_model.model.model.language_model.layers.{layer}.{part}.{module}"
            state[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * scale
            state[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": base,
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "target_modules": list(targets),
                "bias": "none",
                "fan_in_fan_out": False,
                "modules_to_save": None,
                "captionflow_seed": seed,
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )
    return out
