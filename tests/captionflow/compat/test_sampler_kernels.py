"""The sampler kernels' background prebuild: the vocabulary it compiles for, Triton's cache it fills, done once."""

from __future__ import annotations

import json

from captionflow.compat import sampler_kernels as sk


def test_vocab_size_is_the_text_models(tmp_path, builtin_model_dir):
    from transformers import AutoConfig

    conf = AutoConfig.from_pretrained(builtin_model_dir)
    assert sk.vocab_size(str(builtin_model_dir)) == getattr(conf, "text_config", conf).vocab_size
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 151936}, "vocab_size": 7}))
    assert sk.vocab_size(str(tmp_path)) == 151936
    (tmp_path / "config.json").write_text("{}")
    assert sk.vocab_size(str(tmp_path)) is None
    assert sk.vocab_size(str(tmp_path / "absent")) is None


def test_triton_cache_follows_the_engines_environment(tmp_path):
    assert sk.triton_cache({"TRITON_CACHE_DIR": str(tmp_path / "t")}) == tmp_path / "t"
    assert sk.triton_cache({"TRITON_HOME": str(tmp_path)}) == tmp_path / ".triton" / "cache"


def test_nothing_starts_once_done_or_without_a_vocabulary(tmp_path, builtin_model_dir):
    env = {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    vocab = sk.vocab_size(str(builtin_model_dir))
    marker = sk._marker(env, vocab, 16)
    assert marker.parent.parent == tmp_path / "triton"  # in the engines' Triton cache: it goes where they go
    marker.parent.mkdir(parents=True)
    marker.touch()
    assert sk.prebuild(str(builtin_model_dir), 16, env) is None
    assert sk.prebuild(str(tmp_path), 16, env) is None  # no config.json: no vocabulary to compile for
