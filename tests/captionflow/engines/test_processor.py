"""The Ray Data LLM processor built from EngineSettings (built, not run: no engine starts here)."""

from __future__ import annotations

import functools

from captionflow.config import RunConfig
from captionflow.data.storage import Store
from captionflow.engines.engine import resolve_engine
from captionflow.engines.presets import CPU, GPU
from captionflow.engines.processor import build_vlm_processor, read_pending
from captionflow.engines.request_format import image_prompt
from captionflow.engines.session import WORKER_ENV, ray_session
from captionflow.model_source import resolve_model
from captionflow.workers.llm_rows import caption_request, to_caption


def _caption_processor(engine, model, rows=None):
    """The captioning processor of ``engine`` for ``model`` (built, not run)."""
    return build_vlm_processor(
        engine,
        model.path,
        preprocess=functools.partial(
            caption_request,
            image_prompt=image_prompt(model.path),
            system_prompt="s",
            prompt="p",
            sampling={},
            fail_ids=frozenset(),
        ),
        postprocess=functools.partial(to_caption, max_tokens=4, model_fp="m", attempt=0),
        rows=rows,
    )


def test_processor_stages_carry_the_resolved_settings(builtin_model_dir, tmp_path):
    cfg = RunConfig(
        device="cpu",
        batch_size=4,
        max_concurrent_batches=3,
        engine_kwargs={"seed": 7, "mm_tensor_ipc": "torch_shm"},
        compile_cache_dir=str(tmp_path / "shared"),
    )
    ray_session(cfg)  # building a processor needs Ray (it would start a default one otherwise)
    model = resolve_model("builtin")
    engine = resolve_engine(cfg, model, CPU)
    processor = _caption_processor(engine, model)
    stages = {type(s).__name__: s for s in processor.stages.values()}
    # requests come ready for the engine (rendered prompt, image array): no multimodal-preparation or chat-template
    # actors; CPU preset: tokenising happens in the engine, so no Tokenize/Detokenize actors either
    assert list(stages) == ["vLLMEngineStage"]
    llm = stages["vLLMEngineStage"]
    passed = llm.fn_constructor_kwargs["engine_kwargs"]
    assert {k: passed[k] for k in engine.engine_kwargs} == engine.engine_kwargs  # (Ray adds its executor backend)
    assert llm.fn_constructor_kwargs["engine_kwargs"]["seed"] == 7  # the run's engine_kwargs reach vLLM
    assert llm.fn_constructor_kwargs["should_continue_on_error"] is True  # a bad row fails alone
    assert llm.fn_constructor_kwargs["batch_size"] == 4 and llm.map_batches_kwargs["max_concurrency"] == 3
    assert llm.map_batches_kwargs["num_cpus"] == CPU.engine_cpus
    # the engine processes' environment: vLLM's cache root on the configured volume (its AOT graphs live there),
    # and the start method vLLM uses from a Ray actor anyway, said because torch_shm tensors need it said
    env = llm.map_batches_kwargs["runtime_env"]["env_vars"]
    assert env == {**WORKER_ENV, **engine.env}
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "shared" / "vllm")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "shared" / "triton")  # the kernels its warm-up compiles
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "shared" / "inductor")  # and its sampler's functions
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    plain = resolve_engine(RunConfig(device="cpu"), model, CPU)
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in plain.env and "VLLM_CACHE_ROOT" not in plain.env
    assert "TRITON_CACHE_DIR" not in plain.env and "TORCHINDUCTOR_CACHE_DIR" not in plain.env
    assert passed["disable_log_stats"] is True  # no statistics work on the front end unless metrics are exported


def test_a_pass_gives_each_engine_at_most_its_share_of_the_rows_in_flight(builtin_model_dir):
    """The engines start seconds apart: the first to accept must not take every row of a small pass."""
    ray_session(RunConfig(device="cpu"))
    model = resolve_model("builtin")
    engine = resolve_engine(RunConfig(device="cpu", batch_size=4, max_concurrent_batches=8, concurrency=3), model, CPU)
    assert engine.for_rows(10_000).max_concurrent_batches == 8  # a long pass: the preset's depth
    assert engine.for_rows(30).max_concurrent_batches == 3  # 30 rows over 3 engines: 10 each, 3 batches of 4
    assert engine.for_rows(5).max_concurrent_batches == 1
    assert engine.for_rows(30, engines=1).max_concurrent_batches == 8  # e.g. a warm service of one engine
    llm = next(s for s in _caption_processor(engine, model, rows=30).stages.values())
    assert llm.map_batches_kwargs["max_concurrency"] == 3
    gpu = resolve_engine(RunConfig(device="gpu", gpu_memory_gib=80), model, GPU)
    # one OpenMP thread per engine process: its front end's renderer threads are the parallelism
    assert gpu.env["OMP_NUM_THREADS"] == "1" and "OMP_NUM_THREADS" not in engine.env


def test_read_pending_gives_the_pending_rows_of_every_shard_in_batches(tmp_path, builtin_model_dir):
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    cfg = RunConfig(device="cpu", batch_size=4)
    ray_session(cfg)
    engine = resolve_engine(cfg, resolve_model("builtin"), CPU)
    shards = []
    for s in range(3):
        ids = [f"img-{s}-{i}" for i in range(7)]
        path = tmp_path / f"part-{s:05d}.parquet"
        pq.write_table(pa.table({"image_id": ids, "image": [b"x" * 10] * 7, "other": list(range(7))}), path)
        shards.append(str(path))
    pending = [f"img-{s}-{i}" for s in range(3) for i in range(0, 7, 2)] + ["img-9-0"]  # 12 of the 21 rows
    ds = read_pending(fsspec.filesystem("file"), shards, ["image_id", "image"], pending, engine)
    batches = list(ds.iter_batches(batch_size=None, batch_format="pyarrow"))
    got = [i for b in batches for i in b["image_id"].to_pylist()]
    assert sorted(got) == sorted(pending[:-1])  # every pending row once, nothing else (img-9-0 is in no shard)
    assert all(b.column_names == ["image_id", "image"] for b in batches)
    assert max(b.num_rows for b in batches) <= engine.batch_size  # re-blocked: the engine sees batches, not shards
    # ordered: pending's order window by window (a sequential verdict's prefix reaches the engines first), each
    # window read from every shard, each read in order
    import random

    import ray

    from captionflow.engines.processor import rank_windows

    assert rank_windows(10, 3) == [(0, 3), (3, 9), (9, 10)] and rank_windows(0, 3) == []
    order = pending[:-1]
    random.Random(3).shuffle(order)
    assert not ray.data.DataContext.get_current().execution_options.preserve_order
    held = Store(str(tmp_path)).shard_ids(shards)
    ds = read_pending(
        fsspec.filesystem("file"), shards, ["image_id", "image"], order, engine, ordered=True, shard_ids=held
    )
    # the dataset's own context (its later stages', the engines' too) keeps the windows' order; the process's not
    assert ds.context.execution_options.preserve_order
    assert not ray.data.DataContext.get_current().execution_options.preserve_order
    batches = list(ds.iter_batches(batch_size=None, batch_format="pyarrow"))
    got = [i for b in batches for i in b["image_id"].to_pylist()]
    assert sorted(got) == sorted(order) and all(b.column_names == ["image_id", "image"] for b in batches)
    windows = rank_windows(len(order), engine.batch_size * engine.concurrency)
    assert windows[0] == (0, 4) and len(windows) == 2  # one engine's batch of 4 first, then the 8 after it
    assert got[0] == order[0]  # the shard holding the order's first image is read first
    position, k = {i: n for n, i in enumerate(order)}, 0
    for lo, hi in windows:
        part, k = got[k : k + hi - lo], k + hi - lo
        assert set(part) == set(order[lo:hi])  # window by window
        for s in range(3):
            mine = [position[i] for i in part if i.startswith(f"img-{s}-")]
            assert mine == sorted(mine)  # each shard's rows of the window in order


def test_an_ordered_read_reads_a_window_only_from_the_shards_holding_its_rows_the_first_rank_first(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from captionflow.engines.processor import ordered_reads

    shards = []
    for s in range(4):
        path = tmp_path / f"part-{s:05d}.parquet"
        pq.write_table(pa.table({"image_id": [f"img-{s}-{i}" for i in range(3)]}), path)
        shards.append({"shard": str(path), "fitted": ""})
    held = Store(str(tmp_path)).shard_ids([s["shard"] for s in shards])
    assert held[shards[2]["shard"]] == ["img-2-0", "img-2-1", "img-2-2"]
    order = ["img-3-0", "img-1-2", "img-3-1", "img-0-0", "img-2-2", "img-1-0", "img-9-9"]  # img-9-9: in no shard
    reads = ordered_reads(shards, order, [(0, 3), (3, 7)], held)
    got = [(r["shard"].rsplit("-", 1)[1][:5], r["lo"], r["hi"]) for r in reads]
    # the first window (ranks 0-2) only from shards 3 and 1, shard 3 first (rank 0); the second from 0, 2, 1
    assert got == [("00003", 0, 3), ("00001", 0, 3), ("00000", 3, 7), ("00002", 3, 7), ("00001", 3, 7)]
    assert all(r["fitted"] == "" for r in reads)
    # nothing pending: one read of no rows
    assert [(r["lo"], r["hi"]) for r in ordered_reads(shards, [], [], held)] == [(0, 0)]
