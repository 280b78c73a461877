"""vLLM's tokenizer pools filled in the background (captionflow/compat/tokenizer_pool.py), with real vLLM (CPU build)
and the built-in model's tokenizer, in a fresh interpreter where the engine-process hook is installed before vLLM is
imported (as in a Ray worker)."""

import textwrap

import pytest

from tests.support.fresh_python import run_script

SCRIPT = textwrap.dedent("""
    import copy, json, pickle, threading
    from concurrent.futures import ThreadPoolExecutor
    from captionflow.compat import tokenizer_pool, vllm_warmup
    vllm_warmup.install()                       # before any vLLM import, as in a Ray worker
    from captionflow.builtin.model import ensure_builtin_model
    from transformers import AutoTokenizer
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers import renderer_from_config
    import vllm.tokenizers.hf as hf

    # the background copies wait until released: what the front end has when vLLM's call returns
    release, fill = threading.Event(), tokenizer_pool._fill
    def gated(*args):
        release.wait(60)
        fill(*args)
    tokenizer_pool._fill = gated
    pools, submit = [], tokenizer_pool._submit
    def counted(source, pool, copies):
        pools.append(pool)
        submit(source, pool, copies)
    tokenizer_pool._submit = counted

    cfg = EngineArgs(model=str(ensure_builtin_model()), max_model_len=1024,
                     renderer_num_workers=3).create_engine_config()
    renderer = renderer_from_config(cfg)
    tok = renderer.tokenizer
    source, pool = tokenizer_pool.pool_of(tok)
    at_return = pool.qsize()
    release.set()
    tokenizer_pool.filled()                     # what the front end waits for before it accepts requests
    filled = pool.qsize()

    plain = AutoTokenizer.from_pretrained(str(ensure_builtin_model()))
    texts = [f"caption number {i}: a red square on a blue field" for i in range(24)]
    expect = [plain.encode(t) for t in texts]
    with ThreadPoolExecutor(8) as ex:           # more threads than copies: the pool grows as vLLM's does
        got = list(ex.map(tok.encode, texts))
    decoded = tok.decode(expect[0])

    renderer.mm_processor.info.get_hf_processor()  # its build deep-copies the tokenizer in its kwargs, twice
    pools_after_processor = len(pools)
    dup = copy.deepcopy(tok)
    back = pickle.loads(pickle.dumps(tok))
    tokenizer_pool.filled()
    mine = tokenizer_pool._copy(source)
    copiers = [t for t in threading.enumerate() if t.name == tokenizer_pool.FILL_THREAD]
    print("RESULT " + json.dumps({
        "patched": bool(getattr(hf.maybe_make_thread_pool, "_captionflow_patched", False)),
        "copies": cfg.model_config.renderer_num_workers + 1,
        "at_return": at_return, "filled": filled,
        "same_tokens": got == expect, "decoded": decoded == plain.decode(expect[0]),
        "dup_pool": tokenizer_pool.pool_of(dup)[1].qsize(), "dup_same": dup.encode(texts[3]) == expect[3],
        "pickled_pool": tokenizer_pool.pool_of(back)[1].qsize(), "pickled_same": back.encode(texts[5]) == expect[5],
        "dup_shares_pool": tokenizer_pool.pool_of(dup)[1] is pool, "copiers": len(copiers),
        "pools_after_processor": pools_after_processor, "pools": len(pools),
        "pickled_own_pool": tokenizer_pool.pool_of(back)[1] is not pool,
        "copy_shares_init_data": mine._vocab is source._vocab and mine._tokenizer is not source._tokenizer,
        "copy_same": mine.encode(texts[7]) == expect[7] and mine.decode(expect[7]) == plain.decode(expect[7]),
    }))
""")


@pytest.mark.slow
def test_the_front_ends_tokenizer_copies_are_made_after_it_returns_and_tokenize_as_vllms_own(tmp_path):
    proc, r = run_script(SCRIPT, tmp_path)
    assert r["patched"] and r["copies"] == 4
    # vLLM's own pool holds its copies when the call returns; this one none, and all of them once filled
    assert r["at_return"] == 0 and r["filled"] == 4
    assert r["same_tokens"] and r["decoded"]
    # building the HF processor makes no pool of its own (it deep-copied the tokenizer in its kwargs: vLLM's own
    # pools made a whole new pool for each), and a copy shares the pool; an unpickled tokenizer gets its own, filled
    assert r["pools_after_processor"] == 1 and r["dup_shares_pool"] and r["dup_pool"] >= 4
    assert r["pickled_own_pool"] and r["pickled_pool"] >= 4 and r["pools"] == 2
    assert r["dup_same"] and r["pickled_same"]
    # the pool's copies share the tokenizer's construction data, not its Rust tokenizer, and tokenize alike
    assert r["copy_shares_init_data"] and r["copy_same"]
    assert r["copiers"] == 1  # one thread makes every pool's copies, one pool after another
    assert "thread copies made in the background" in proc.stderr
