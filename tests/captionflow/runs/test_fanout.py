"""How parallel checkpoint evaluations split a cluster."""

from __future__ import annotations

from captionflow.config import RunConfig
from captionflow.runs.fanout import fan_out


def test_each_evaluation_gets_its_share_of_the_gpus_and_the_rest_wait_for_a_slot():
    gpu = RunConfig(device="gpu")
    # 8 GPUs, 4 checkpoints at once, 4 engines per GPU: 2 GPUs (8 engine replicas) each
    plan = fan_out(gpu, checkpoints=4, parallel=4, gpus=8, engines_per_gpu=4)
    assert (plan.slots, plan.concurrency) == (4, 8)
    # more checkpoints than GPUs: one per GPU at a time, the others queue
    plan = fan_out(gpu, checkpoints=6, parallel=6, gpus=2, engines_per_gpu=4)
    assert (plan.slots, plan.concurrency) == (2, 4)
    # fewer checkpoints than asked for: no idle slot
    assert fan_out(gpu, checkpoints=2, parallel=8, gpus=8, engines_per_gpu=1).slots == 2
    # tensor parallel: a slot is a group of GPUs
    tp = RunConfig(device="gpu", tensor_parallel_size=2)
    assert (fan_out(tp, 4, 4, gpus=4, engines_per_gpu=1).slots, fan_out(tp, 4, 4, 4, 1).concurrency) == (2, 1)
    # an explicit concurrency is the run's own
    assert fan_out(RunConfig(device="gpu", concurrency=3), 2, 2, 8, 4).concurrency == 3


def test_on_cpu_every_evaluation_runs_its_own_engine():
    plan = fan_out(RunConfig(device="cpu"), checkpoints=3, parallel=2, gpus=0, engines_per_gpu=1)
    assert (plan.slots, plan.concurrency, plan.gpus) == (2, None, 0)
    assert "2 checkpoint(s) at a time" in plan.describe()
