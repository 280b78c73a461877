"""The GPU benchmark samples the GPUs its runs may use, not every GPU of the host (NVML ignores
CUDA_VISIBLE_DEVICES). NVML is replaced by a stand-in here: this machine has no GPU."""

from __future__ import annotations

from bench.throughput.measure import visible_gpus


class _NVML:
    """Four GPUs, as NVML would list them."""

    def nvmlDeviceGetCount(self):
        return 4

    def nvmlDeviceGetHandleByIndex(self, i):
        return f"handle-{i}"

    def nvmlDeviceGetUUID(self, handle):
        return f"GPU-{handle[-1]}aaa-uuid"


def test_only_the_visible_gpus_are_sampled(monkeypatch):
    nvml = _NVML()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [i for i, _ in visible_gpus(nvml)] == [0, 1, 2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert visible_gpus(nvml) == [(0, "handle-0")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    assert [i for i, _ in visible_gpus(nvml)] == [2, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-3aaa")  # a UUID prefix, as CUDA takes it
    assert visible_gpus(nvml) == [(3, "handle-3")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,7,2")  # CUDA stops at the first invalid entry
    assert [i for i, _ in visible_gpus(nvml)] == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus(nvml) == []


def test_cpu_by_process_counts_cores_per_kind_of_process():
    from bench.throughput.measure import cpu_by_process, process_label

    before = (100.0, {1: ("ray::IDLE", 5.0), 2: ("VLLM::EngineCore", 10.0), 3: ("raylet", 1.0)})
    after = (110.0, {1: ("ray::MapWorker(Fit)", 25.0), 2: ("VLLM::EngineCore", 30.0), 4: ("VLLM::EngineCore", 8.0)})
    rows = cpu_by_process(before, after)
    # pid 1 changed its title (took an actor): its delta counts under the new one; pid 4 started in between
    assert rows == [
        {"process": "VLLM::EngineCore", "count": 2, "cores": 2.8},
        {"process": "ray::MapWorker(Fit)", "count": 1, "cores": 2.0},
    ]
    assert process_label("python3.12", ["python3", "-u", "bench/gpu_scaling.py", "--n", "8"]) == "python gpu_scaling.py"
    assert process_label("python3", ["ray::RayletMonitor", "x"]) == "ray::RayletMonitor"
