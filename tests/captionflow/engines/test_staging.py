"""A checkpoint staged at a stable slot path: links to its files, one run per slot at a time."""

from pathlib import Path

from captionflow.engines.staging import staged


def _checkpoint(root: Path, name: str, weights: bytes) -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "x"}')
    (d / "model.safetensors").write_bytes(weights)
    return d


def test_a_checkpoint_is_staged_at_a_stable_path_and_a_concurrent_run_gets_its_own(tmp_path):
    a = _checkpoint(tmp_path, "ckpt-a", b"A" * 8)
    b = _checkpoint(tmp_path, "ckpt-b", b"B" * 8)
    (b / "extra.json").write_text("{}")
    compile_dir = str(tmp_path / "cache" / "arch" / "key1")
    with staged(str(a), compile_dir, local=True) as pa:
        assert Path(pa, "model.safetensors").read_bytes() == b"A" * 8
        with staged(str(b), compile_dir, local=True) as pb:  # slot 0 is held: the next one
            assert pb != pa
            assert Path(pb, "model.safetensors").read_bytes() == b"B" * 8
    with staged(str(b), compile_dir, local=True) as again:  # both free: the first slot, re-pointed
        assert again == pa
        assert Path(again, "model.safetensors").read_bytes() == b"B" * 8
        assert sorted(p.name for p in Path(again).iterdir()) == ["config.json", "extra.json", "model.safetensors"]
    with staged(str(a), compile_dir, local=True) as back:  # a file b had and a lacks is gone
        assert back == pa
        assert sorted(p.name for p in Path(back).iterdir()) == ["config.json", "model.safetensors"]
        assert Path(back, "model.safetensors").read_bytes() == b"A" * 8


def test_engines_elsewhere_or_without_a_compile_cache_load_the_checkpoint_itself(tmp_path):
    a = _checkpoint(tmp_path, "ckpt-a", b"A")
    with staged(str(a), str(tmp_path / "c" / "arch" / "k"), local=False) as p:
        assert p == str(a)
    with staged(str(a), "", local=True) as p:
        assert p == str(a)
    with staged("org/hub-name", str(tmp_path / "c" / "arch" / "k"), local=True) as p:
        assert p == "org/hub-name"
