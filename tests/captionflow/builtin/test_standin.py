"""Full-size architecture stand-ins (benchmarks without weights) and the GPU engine sizing."""

import json

import pytest

from captionflow.builtin.standin import QWEN_IDS, QWEN_REGULAR_TOKENS, build_standin
from captionflow.engines.presets import CPU, GPU, engines_per_gpu, model_weight_bytes
from captionflow.model_source import ModelError, resolve_model


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return build_standin("qwen2.5-vl-3b", tmp_path_factory.mktemp("m") / "qwen2.5-vl-3b")


def test_standin_has_the_real_architecture_and_vocabulary(standin):
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor

    cfg = AutoConfig.from_pretrained(standin)
    assert (cfg.text_config.hidden_size, cfg.text_config.num_hidden_layers, cfg.text_config.vocab_size) == (
        2048,
        36,
        151936,
    )
    assert cfg.vision_config.depth == 32 and cfg.image_token_id == QWEN_IDS["<|image_pad|>"] == 151655
    meta = json.loads((standin / "captionflow_model.json").read_text())
    assert 3.7e9 < meta["parameters"] < 3.8e9  # Qwen2.5-VL-3B-Instruct has 3.75 B parameters

    proc = AutoProcessor.from_pretrained(standin)
    assert len(proc.tokenizer) == QWEN_REGULAR_TOKENS + len(QWEN_IDS)
    text = "Describe this image in one sentence."
    assert proc.tokenizer.decode(proc.tokenizer(text)["input_ids"]) == text
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    out = proc(
        text=[prompt],
        images=[Image.new("RGB", (640, 480))],
        return_tensors="pt",
        size={"longest_edge": 448 * 448, "shortest_edge": 3136},
    )
    grid = out["image_grid_thw"][0].tolist()
    n_image_tokens = int((out["input_ids"][0] == cfg.image_token_id).sum())
    assert n_image_tokens == grid[0] * grid[1] * grid[2] // 4 and n_image_tokens <= 448 * 448 // 28**2


def test_weightless_folder_needs_dummy_load_format(standin):
    with pytest.raises(ModelError, match="no weight files"):
        resolve_model(str(standin))
    assert resolve_model(str(standin), dummy_weights=True).architecture == "Qwen2_5_VLForConditionalGeneration"


def test_engines_per_gpu_as_many_as_fit_up_to_the_presets_most(standin):
    gib = 2**30
    weights = model_weight_bytes(str(standin))
    assert weights == json.loads((standin / "captionflow_model.json").read_text())["parameters"] * 2
    assert engines_per_gpu(GPU, weights, 80 * gib) == GPU.max_engines_per_gpu == 4  # 3B: 4 x (7 + 4 + 4) GiB
    assert engines_per_gpu(GPU, 15 * gib, 80 * gib) == 3  # 23 GiB each: three fit in 90% of 80
    assert engines_per_gpu(GPU, 30 * gib, 80 * gib) == 1  # 38 GiB each
    assert engines_per_gpu(GPU, 70 * gib, 80 * gib) == 1
    assert engines_per_gpu(GPU, weights, 80 * gib, tensor_parallel_size=2) == 1
    assert engines_per_gpu(GPU, weights, 80 * gib, override=2) == 2  # several, when asked
    assert engines_per_gpu(CPU, weights, 80 * gib) == 1
    assert engines_per_gpu(GPU, None, 80 * gib) == 1


def test_random_weights_have_the_checkpoint_layout_and_depend_on_the_seed(tmp_path):
    """The same tensor names as a real checkpoint of the architecture (here the built-in model's, saved from
    transformers), sharded with an index; another seed, other bytes; the folder resolves with its weights."""
    from safetensors import safe_open

    from captionflow.builtin.model import ensure_builtin_model
    from captionflow.builtin.standin import write_random_weights

    builtin = ensure_builtin_model()
    with safe_open(str(builtin / "model.safetensors"), "pt") as f:
        real = set(f.keys())
    a = write_random_weights(builtin, tmp_path / "a", seed=0)
    b = write_random_weights(builtin, tmp_path / "b", seed=1)
    index = json.loads((a / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == real - {"lm_head.weight"} or set(index["weight_map"]) == real
    name = sorted(k for k in index["weight_map"] if k.endswith("embed_tokens.weight"))[0]
    with (
        safe_open(str(a / index["weight_map"][name]), "pt") as fa,
        safe_open(str(b / index["weight_map"][name]), "pt") as fb,
    ):
        ta, tb = fa.get_tensor(name), fb.get_tensor(name)
    assert str(ta.dtype) == "torch.bfloat16" and ta.shape == tb.shape and not (ta == tb).all()
    assert resolve_model(str(a)).fingerprint != resolve_model(str(b)).fingerprint


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    """The 7B, 32B and 72B stand-ins: their published configs, no weights."""
    root = tmp_path_factory.mktemp("large")
    return {size: build_standin(f"qwen2.5-vl-{size}", root / size) for size in ("7b", "32b", "72b")}


def test_the_larger_standins_have_the_published_parameter_counts(large):
    published = {"7b": 8.29e9, "32b": 33.45e9, "72b": 73.41e9}  # the *-Instruct checkpoints' model cards
    for size, folder in large.items():
        params = json.loads((folder / "captionflow_model.json").read_text())["parameters"]
        assert abs(params / published[size] - 1) < 0.005, (size, params)
        assert json.loads((folder / "config.json").read_text())["text_config"]["vocab_size"] == 152064


def test_fp8_weights_take_about_half_but_the_embeddings_and_one_engine_per_gpu_for_32b_and_72b(large):
    gib = 2**30
    for size, folder in large.items():
        bf16, fp8 = model_weight_bytes(str(folder)), model_weight_bytes(str(folder), "fp8")
        assert 0.5 < fp8 / bf16 < 0.58, size  # the embeddings and the untied LM head (7B: 13%) stay in 16 bits
    assert engines_per_gpu(GPU, model_weight_bytes(str(large["7b"])), 80 * gib) == 3  # 15.4 + 8 GiB each
    for size in ("32b", "72b"):
        for q in (None, "fp8"):
            assert engines_per_gpu(GPU, model_weight_bytes(str(large[size]), q), 141 * gib) == 1, (size, q)


def test_a_model_too_large_for_the_gpu_says_what_would_fit_it(large):
    from captionflow.engines.presets import too_large

    gib = 2**30
    w72, w72_fp8 = model_weight_bytes(str(large["72b"])), model_weight_bytes(str(large["72b"]), "fp8")
    h200 = too_large(GPU, w72, 141 * gib, 1, None, w72_fp8)
    assert h200.startswith("its weights take ~137 GiB, with 8 GiB of KV cache and activations more than the 127 GiB")
    assert "quantization fp8 (~71 GiB of weights)" in h200 and "tensor_parallel_size 2 on a host with 2 GPUs" in h200
    assert too_large(GPU, w72_fp8, 141 * gib, 1, "fp8", w72_fp8) is None  # 72B in FP8 on one H200
    h100 = too_large(GPU, w72, 80 * gib, 1, None, w72_fp8)
    assert "quantization" not in h100 and "tensor_parallel_size 4" in h100  # FP8 does not fit 80 GB either
    assert too_large(GPU, w72, 80 * gib, 4, None, w72_fp8) is None  # over 4 GPUs it does
    assert too_large(CPU, w72, 80 * gib) is None and too_large(GPU, None, 80 * gib) is None


def test_a_standin_stored_in_fp8_declares_it_and_takes_the_online_fp8_bytes_as_it_is(large, tmp_path):
    """A checkpoint stored in FP8 (as the published FP8 checkpoints are) sizes as online FP8 of its 16-bit twin would,
    and asking for fp8 again changes nothing: vLLM allocates its weights in FP8 from the start."""
    stored = build_standin("qwen2.5-vl-72b", tmp_path / "72b-fp8", quantization="fp8")
    config = json.loads((stored / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic"}
    online = model_weight_bytes(str(large["72b"]), "fp8")
    assert model_weight_bytes(str(stored)) == model_weight_bytes(str(stored), "fp8") == online
    with pytest.raises(ValueError, match="unknown quantization"):
        build_standin("qwen2.5-vl-7b", tmp_path / "7b-int4", quantization="int4")
