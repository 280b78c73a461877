"""vLLM's model-class inspection cached ahead (captionflow/compat/vllm_modelinfo.py), with real vLLM (CPU build)."""

import textwrap

import pytest

from captionflow.compat import vllm_modelinfo
from captionflow.model_source import resolve_model
from tests.support.fresh_python import run_script

# vLLM asks for the inspection as an engine's configuration is built; its own new interpreter is refused here, so
# the answer can only come from the cache the prefetch wrote
ASK = textwrap.dedent("""
    import json
    from vllm.model_executor.models import registry
    def refused(fn):
        raise AssertionError("vLLM inspected the class itself")
    registry._run_in_subprocess = refused
    info = registry.ModelRegistry.models["{arch}"].inspect_model_cls()
    print("RESULT " + json.dumps({{"multimodal": bool(info.supports_multimodal)}}))
""")


@pytest.mark.slow
def test_the_prefetch_caches_vllms_inspection_where_the_engines_look(tmp_path, monkeypatch):
    arch = resolve_model("builtin").architecture
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    assert not vllm_modelinfo.cached(arch, env)
    proc = vllm_modelinfo.prefetch(arch, env)
    assert proc is not None and proc.wait(300) == 0
    assert vllm_modelinfo.cached(arch, env)
    assert vllm_modelinfo.prefetch(arch, env) is None  # cached: nothing started
    monkeypatch.setenv("VLLM_CACHE_ROOT", env["VLLM_CACHE_ROOT"])
    _, r = run_script(ASK.format(arch=arch), tmp_path)
    assert r["multimodal"]  # the built-in VLM, as vLLM's own inspection says


def test_an_architecture_vllm_does_not_know_ends_the_background_process_with_nothing_cached(tmp_path):
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    proc = vllm_modelinfo.prefetch("NoSuchModelForCaptioning", env)
    assert proc is not None and proc.wait(300) == 1
    assert not vllm_modelinfo.cached("NoSuchModelForCaptioning", env)


def test_the_cache_root_is_vllms():
    assert vllm_modelinfo.cache_root({"VLLM_CACHE_ROOT": "/x/y"}).as_posix() == "/x/y"
    assert vllm_modelinfo.cache_root({"XDG_CACHE_HOME": "/c"}).as_posix() == "/c/vllm"
