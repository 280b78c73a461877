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
