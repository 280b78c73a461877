"""Full-size architecture stand-ins: a real VLM's config, tokenizer and processor, without weights.

For benchmarks on machines that cannot download checkpoints. The folder holds everything vLLM
needs except the weights; run it with ``engine_kwargs={"load_format": "dummy"}`` (random
weights) and a fixed output length (``ignore_eos``), and every image costs what it costs with
the real model: same layers and widths, same vocabulary size (so the same LM head), same image
processor (same vision tokens per image), same chat template and special-token ids.

The tokenizer is a byte-level BPE with the real model's 151,643 regular tokens and its special
tokens at the real ids (151,643-151,664): the merges learned from captionflow's bundled text
come first, then every byte pair, then byte-pair+byte triples until the size is reached. Its
prompts tokenise into a few more tokens than the real tokenizer's (a handful per prompt, next to
hundreds of image tokens).

    captionflow build-model --arch qwen2.5-vl-3b DIR
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from captionflow.builtin.model import (
    CHAT_TEMPLATE,
    _training_text,
    _write_json,
    qwen_image_processor_config,
    qwen_tokenizer_config,
)

QWEN_REGULAR_TOKENS = 151_643
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
QWEN_IDS = {t: QWEN_REGULAR_TOKENS + i for i, t in enumerate(QWEN_SPECIAL_TOKENS)}


def _larger_qwen25_vl(hidden: int, intermediate: int, layers: int, heads: int) -> dict:
    """Qwen2.5-VL-7B/32B/72B-Instruct: the 3B's vision tower (its merger into ``hidden``), a text model of these
    widths with 4 (7B) or 8 key-value heads, a vocabulary of 152,064 and untied embeddings."""
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "processor_class": "Qwen2_5_VLProcessor",
        "text": {
            "model_type": "qwen2_5_vl_text",
            "vocab_size": 152064,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": 4 if hidden == 3584 else 8,
            "max_position_embeddings": 128000,
            "max_window_layers": layers,
            "sliding_window": 32768,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        },
        "vision": {**_QWEN25_VISION, "out_hidden_size": hidden},
        "tie_word_embeddings": False,
    }


_QWEN25_VISION = {
    "model_type": "qwen2_5_vl",
    "depth": 32,
    "hidden_act": "silu",
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_chans": 3,
    "out_hidden_size": 2048,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "spatial_patch_size": 14,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "tokens_per_second": 2,
    "temporal_patch_size": 2,
}

# Published architecture hyper-parameters (config.json of each *-Instruct checkpoint).
ARCHES: dict[str, dict] = {
    "qwen2.5-vl-3b": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "processor_class": "Qwen2_5_VLProcessor",
        "text": {
            "model_type": "qwen2_5_vl_text",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128000,
            "max_window_layers": 70,
            "sliding_window": 32768,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        },
        "vision": _QWEN25_VISION,
        "tie_word_embeddings": True,
    },
    **{
        f"qwen2.5-vl-{size}": _larger_qwen25_vl(hidden, intermediate, layers, heads)
        for size, hidden, intermediate, layers, heads in (
            ("7b", 3584, 18944, 28, 28),
            ("32b", 5120, 27648, 64, 40),
            ("72b", 8192, 29568, 80, 64),
        )
    },
    "qwen2-vl-2b": {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "processor_class": "Qwen2VLProcessor",
        "text": {
            "model_type": "qwen2_vl_text",
            "vocab_size": 151936,
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "max_window_layers": 28,
            "sliding_window": 32768,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        },
        "vision": {
            "model_type": "qwen2_vl",
            "depth": 32,
            "embed_dim": 1280,
            "hidden_size": 1536,
            "hidden_act": "quick_gelu",
            "mlp_ratio": 4,
            "num_heads": 16,
            "in_chans": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "tie_word_embeddings": True,
    },
}


def _bytes_to_unicode() -> list[str]:
    """GPT-2 / Qwen byte-level alphabet, in token-id order (ids 0..255)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    order = sorted(range(256), key=lambda i: bs[i])
    return [chr(cs[i]) for i in order]


def _learned_merges() -> list[tuple[str, str]]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def build_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer of exactly Qwen's size and special-token ids (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    vocab: dict[str, int] = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []

    def add(a: str, b: str) -> bool:
        if a + b in vocab or a not in vocab or b not in vocab:
            return False
        vocab[a + b] = len(vocab)
        merges.append((a, b))
        return len(vocab) >= QWEN_REGULAR_TOKENS

    full = False
    for a, b in _learned_merges():
        if full := add(a, b):
            break
    pairs = [a + b for a in alphabet for b in alphabet]
    for p in pairs:
        if full or (full := add(p[0], p[1])):
            break
    for p in pairs:
        if full:
            break
        for c in alphabet:
            if full := add(p, c):
                break
    assert len(vocab) == QWEN_REGULAR_TOKENS, len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(QWEN_SPECIAL_TOKENS)
    assert all(tok.token_to_id(t) == i for t, i in QWEN_IDS.items())
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", qwen_tokenizer_config(QWEN_IDS, 131072))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def arch_config(arch: str) -> dict:
    a = ARCHES[arch]
    text = {
        **a["text"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "bos_token_id": QWEN_IDS["<|endoftext|>"],
        "eos_token_id": QWEN_IDS["<|im_end|>"],
        "dtype": "bfloat16",
    }
    return {
        "architectures": a["architectures"],
        "model_type": a["model_type"],
        "text_config": text,
        "vision_config": dict(a["vision"]),
        "image_token_id": QWEN_IDS["<|image_pad|>"],
        "video_token_id": QWEN_IDS["<|video_pad|>"],
        "vision_start_token_id": QWEN_IDS["<|vision_start|>"],
        "vision_end_token_id": QWEN_IDS["<|vision_end|>"],
        "bos_token_id": QWEN_IDS["<|endoftext|>"],
        "eos_token_id": QWEN_IDS["<|im_end|>"],
        "tie_word_embeddings": a["tie_word_embeddings"],
        "dtype": "bfloat16",
    }


def count_parameters(model_dir: str | os.PathLike) -> int:
    """Parameters of the architecture in ``model_dir`` (built on the meta device: no memory used)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return sum(p.numel() for p in model.parameters())


# A checkpoint that declares its weights stored in FP8 (vLLM's own format: one scale per tensor, activations scaled
# dynamically), as the published FP8 checkpoints do: vLLM allocates its weights in FP8 from the start (with
# load_format dummy: random FP8 weights), where online FP8 of a 16-bit checkpoint first builds every weight in 16 bits
# (145 GB for a 72B: more than one H200 holds).
FP8_CHECKPOINT = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def build_standin(arch: str, out_dir: str | os.PathLike, quantization: str | None = None) -> Path:
    """Write the stand-in for ``arch`` (one of ARCHES) into ``out_dir`` (created; must not exist); ``quantization``
    fp8: a checkpoint whose weights are stored in FP8 (``FP8_CHECKPOINT``)."""
    if arch not in ARCHES:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(sorted(ARCHES))}")
    if quantization not in (None, "fp8"):
        raise ValueError(f"unknown quantization {quantization!r}; known: fp8")
    out = Path(out_dir)
    out.mkdir(parents=True)
    build_tokenizer(out)
    config = arch_config(arch)
    if quantization == "fp8":
        config["quantization_config"] = dict(FP8_CHECKPOINT)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": QWEN_IDS["<|endoftext|>"],
            "pad_token_id": QWEN_IDS["<|endoftext|>"],
            "eos_token_id": [QWEN_IDS["<|im_end|>"], QWEN_IDS["<|endoftext|>"]],
        },
    )
    _write_json(
        out / "preprocessor_config.json",
        qwen_image_processor_config(ARCHES[arch]["processor_class"], 3136, 12845056),
    )
    _write_json(
        out / "captionflow_model.json",
        {
            "name": f"standin-{arch}" + (f"-{quantization}" if quantization else ""),
            "architecture": arch,
            "quantization": quantization,
            "parameters": count_parameters(out),
            "weights": None,
            "note": "no weights: run with engine_kwargs load_format=dummy (random weights, meaningless captions)",
        },
    )
    return out


def write_random_weights(
    standin_dir: str | os.PathLike, out_dir: str | os.PathLike, seed: int, device: str = "cpu"
) -> Path:
    """A checkpoint folder ``out_dir`` (created): the stand-in's files plus random bf16 weights in
    safetensors shards (<= 4 GiB each, with an index), so that checkpoints of a full-size architecture can be
    loaded, hot-swapped and told apart without any download. Tensors are drawn in sorted order from one
    generator seeded with ``seed`` on ``device`` (a GPU draws 3B parameters in about a second)."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    src, out = Path(standin_dir), Path(out_dir)
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(f, out / f.name)
    config = AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False) or getattr(
        getattr(config, "text_config", None), "tie_word_embeddings", False
    ):
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator(device=device).manual_seed(int(seed))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, limit = 0, 4 * 2**30
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("weight") and ("norm" in name or "ln_q" in name):
            t = torch.ones(shape, dtype=torch.bfloat16)
        elif name.endswith(".bias"):
            t = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        nbytes = t.numel() * 2
        if size + nbytes > limit and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t.cpu().contiguous()
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for k, v in shard.items():
            weight_map[k] = fname
            total += v.numel() * 2
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    meta = json.loads((out / "captionflow_model.json").read_text()) if (out / "captionflow_model.json").exists() else {}
    meta.update({"weights": f"random bf16, seed {seed}", "note": "random weights: meaningless captions"})
    _write_json(out / "captionflow_model.json", meta)
    return out
