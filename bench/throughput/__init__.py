"""The GPU benchmark's phases (bench/gpu_throughput.py runs them): measure.py, raw.py, stage.py, flow.py, verdict.py."""
