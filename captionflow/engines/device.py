"""What this machine's GPUs are, read once through NVML (no CUDA context in this process: one would
hold GPU memory for the whole run), with torch as the fallback where NVML is not installed."""

from __future__ import annotations

import functools
from typing import Optional


@functools.lru_cache(maxsize=1)
def _local_gpus() -> tuple[int, ...]:
    """Total memory in bytes of each GPU this process can see (empty without one)."""
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return ()
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            sizes = tuple(
                int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total)
                for i in range(pynvml.nvmlDeviceGetCount())
            )
        finally:
            pynvml.nvmlShutdown()
        if visible:
            sizes = tuple(sizes[int(i)] for i in visible.split(",") if i.strip().isdigit() and int(i) < len(sizes))
        return sizes
    except Exception:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return tuple(
                int(torch.cuda.get_device_properties(i).total_memory) for i in range(torch.cuda.device_count())
            )
    except Exception:
        pass
    return ()


def local_gpus() -> int:
    return len(_local_gpus())


def local_gpu_memory_bytes() -> Optional[int]:
    """Memory of this machine's first GPU (None without one)."""
    sizes = _local_gpus()
    return sizes[0] if sizes else None


@functools.lru_cache(maxsize=1)
def local_gpu_name() -> Optional[str]:
    """The name of this machine's first GPU (None without one or without NVML)."""
    if not _local_gpus():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        finally:
            pynvml.nvmlShutdown()
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return None
