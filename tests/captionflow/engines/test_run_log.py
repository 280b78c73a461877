"""Which worker lines reach the run's log, and how they are forwarded (a real Ray worker's output in the demo
flow test; here the dispatcher's batches as Ray hands them over)."""

from __future__ import annotations

import logging

from captionflow.engines import run_log


class Sink:
    def __init__(self):
        self.records: list[tuple[int, str]] = []

    def log(self, level, msg, *args):
        self.records.append((level, msg % args))


ENGINE_OUTPUT = [
    "(EngineCore_DP0 pid=4242) INFO 11-25 07:00:01 [core.py:369] init engine (profile, create kv cache, "
    "warmup model) took 3.21 s",
    "INFO 11-25 07:00:00 [default_loader.py:291] Loading weights took 0.10 seconds",
    "INFO 11-25 07:00:00 [gpu_model_runner.py:5472] Model loading took 6.2 GiB memory and 4.5 seconds",
    "INFO 11-25 07:00:05 [loggers.py:263] Engine 000: Avg prompt throughput: 812.3 tokens/s, Avg generation "
    "throughput: 410.0 tokens/s",
    "WARNING 11-25 07:00:00 [utils.py:12] some chatty warning about a default",
    "INFO 11-25 07:00:00 [parallel_state.py:1] world_size=1 rank=0",
    "captionflow 07:00:02: AsyncLLM accepting requests 1764054002.123",
    "ERROR 11-25 07:00:09 [core.py:900] EngineCore encountered a fatal error.",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    # a warm service's GCS reaping an earlier run's exited actors: not this run's error
    "[2026-11-25 14:04:45,313 E 25739 25739] (gcs_server) gcs_actor_scheduler.cc:538: Failed to kill actor "
    "db06fbcf842d7d55eefcab2302000000, return status: Invalid: KillActor RPC failed for actor "
    "db06fbcf842d7d55eefcab2302000000: RpcError: RPC error: Socket closed rpc_code: 14",
]


def test_only_the_key_lines_are_forwarded_without_vllm_prefixes():
    sink = Sink()
    with run_log.forward_to(sink):
        run_log._on_worker_lines({"pid": 4242, "actor_name": "MapWorker(vLLMEngineStageUDF)", "lines": ENGINE_OUTPUT})
    texts = [t for _, t in sink.records]
    assert len(texts) == 6, texts  # not the chatty warning, not world_size, not "Loading weights"
    assert texts[0] == (
        "MapWorker(vLLMEngineStageUDF) (pid 4242): init engine (profile, create kv cache, warmup model) took 3.21 s"
    )
    assert any("Avg generation throughput" in t for t in texts)
    assert any("accepting requests" in t for t in texts)
    errors = [t for level, t in sink.records if level == logging.ERROR]
    assert [e.split(": ", 1)[1] for e in errors] == [
        "EngineCore encountered a fatal error.",
        "RuntimeError: CUDA error: an illegal memory access was encountered",
    ]


def test_nothing_is_forwarded_outside_a_run_and_driver_loggers_only_inside():
    sink, lines = Sink(), Sink()
    run_log._on_worker_lines({"pid": 1, "lines": ENGINE_OUTPUT})  # no sink: dropped
    logging.getLogger("ray.data").warning("The job may hang forever unless the cluster scales up.")
    with run_log.forward_to(lines, sink):
        logging.getLogger("ray.data").warning("The job may hang forever unless the cluster scales up.")
        logging.getLogger("ray.data").info("Execution plan: ...")  # below WARNING: not forwarded
        logging.getLogger("captionflow.watchdog").warning("inference: 0 of 40 rows; Ray: 0 of 1 GPU free")
    logging.getLogger("captionflow.watchdog").warning("after the run")
    assert sink.records == [
        (logging.WARNING, "ray.data: The job may hang forever unless the cluster scales up."),
        (logging.WARNING, "captionflow.watchdog: inference: 0 of 40 rows; Ray: 0 of 1 GPU free"),
    ]
    assert run_log._RAY_DATA not in logging.getLogger("ray.data").handlers
    assert lines.records == []  # driver records go to their own sink


SHUTDOWN = [
    "Traceback (most recent call last):",
    '  File "/usr/lib/python3.11/multiprocessing/resource_tracker.py", line 239, in main',
    "KeyError: '/psm_8754b2bb'",
    "KeyError: '/mp-xb564hc2'",
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace for the root cause.",
]


def test_a_completed_stage_leaves_no_error_line_from_its_engines_shutdown():
    """A completed run's log carried ERROR lines from its engines' shutdown after the stage had every result (teams
    that alert on ERROR got false alarms): the resource tracker's KeyError is dropped, and after the stage's wait
    an engine's error line is kept at DEBUG; during the wait it is an ERROR as before."""
    sink = Sink()
    with run_log.forward_to(sink):
        with run_log.engines_at_work():  # the captioning stage: its engine is pid 7
            run_log._on_worker_lines({"pid": 7, "actor_name": "engine", "lines": SHUTDOWN[-1:]})
        with run_log.engines_at_work():  # the next stage (the judge, pid 8) while pid 7 shuts down
            run_log._on_worker_lines({"pid": 7, "actor_name": "engine", "lines": SHUTDOWN})
            run_log._on_worker_lines({"pid": 8, "actor_name": "judge", "lines": SHUTDOWN[-1:]})
    levels = [(level, t.split(" ")[0]) for level, t in sink.records]
    assert levels == [(logging.ERROR, "engine"), (logging.DEBUG, "engine"), (logging.ERROR, "judge")], sink.records
    assert all("EngineDeadError" in t for _, t in sink.records)  # the resource tracker's KeyErrors dropped


def test_an_engines_orderly_shutdown_during_the_wait_leaves_no_error_line_but_a_crash_before_it_does():
    """An engine whose core has only the worker in it shut down faster, and its front end's output handler logged
    EngineDeadError while the driver was still taking the stage's last rows: after vLLM's "[shutdown] MPClient"
    lines a worker's error lines are its shutdown's (DEBUG); before them, errors as ever."""
    sink = Sink()
    orderly = [
        "INFO 11-29 01:09:22 [core_client.py:691] [shutdown] MPClient: stopping engine manager",
        "ERROR 11-29 01:09:23 [async_llm.py:819] AsyncLLM output_handler failed.",
        SHUTDOWN[-1],
    ]
    with run_log.forward_to(sink):
        with run_log.engines_at_work():
            run_log._on_worker_lines({"pid": 9, "actor_name": "engine", "lines": ["RuntimeError: it crashed"]})
            run_log._on_worker_lines({"pid": 9, "actor_name": "engine", "lines": orderly})
            run_log._on_worker_lines({"pid": 10, "actor_name": "other", "lines": SHUTDOWN[-1:]})
    levels = [(level, t.split(": ", 1)[1]) for level, t in sink.records]
    assert levels == [
        (logging.ERROR, "RuntimeError: it crashed"),
        (logging.DEBUG, "AsyncLLM output_handler failed."),
        (logging.DEBUG, SHUTDOWN[-1]),
        (logging.ERROR, SHUTDOWN[-1]),
    ], sink.records
