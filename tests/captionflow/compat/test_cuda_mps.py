"""CUDA MPS management for several engines per GPU (captionflow/compat/cuda_mps.py).

There is no GPU or MPS here: the start/reuse/stop protocol is exercised against a stand-in control
program that speaks the same stdin commands (``-d``, ``get_server_list``, ``quit``) and records its
state in the pipe directory. The real daemon ran on the GPU host (README, GPU benchmark).
"""

import os
import stat

import pytest

from captionflow.compat import cuda_mps

FAKE_CONTROL = """#!/bin/sh
state="$CUDA_MPS_PIPE_DIRECTORY/running"
if [ "$1" = "-d" ]; then
  [ -f "$CUDA_MPS_PIPE_DIRECTORY/refuse" ] && { echo "cannot start" >&2; exit 1; }
  touch "$state"; exit 0
fi
read cmd
case "$cmd" in
  get_server_list) [ -f "$state" ] ;;
  quit) rm -f "$state" ;;
  *) exit 1 ;;
esac
"""


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_mps, "_state", {})
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    return tmp_path


def _install_fake(monkeypatch, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    prog = bindir / cuda_mps.CONTROL
    prog.write_text(FAKE_CONTROL)
    prog.chmod(prog.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "pipe"))


def test_without_the_control_program(fresh, monkeypatch):
    monkeypatch.setattr(cuda_mps, "SEARCH_DIRS", ())
    monkeypatch.setenv("PATH", str(fresh))  # nothing there
    assert cuda_mps.ensure_mps("off") == {}
    with pytest.raises(cuda_mps.MpsError, match="cuda_mps=on: nvidia-cuda-mps-control not found"):
        cuda_mps.ensure_mps("on")
    assert cuda_mps.ensure_mps("auto") == {}  # warns and goes on without


def test_starts_reuses_and_stops_the_daemon(fresh, monkeypatch):
    _install_fake(monkeypatch, fresh)
    stops = []
    monkeypatch.setattr(cuda_mps.atexit, "register", lambda fn, *a: stops.append((fn, a)))
    env = cuda_mps.ensure_mps("auto")
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(fresh / "pipe")
    assert (fresh / "pipe" / "running").exists() and len(stops) == 1
    assert cuda_mps.ensure_mps("on") == env  # cached for the process: one daemon
    stops[0][0](*stops[0][1])  # what runs at exit
    assert not (fresh / "pipe" / "running").exists()

    # a daemon that already answers is used and left running (not ours to stop)
    monkeypatch.setattr(cuda_mps, "_state", {})
    (fresh / "pipe" / "running").touch()
    assert cuda_mps.ensure_mps("auto") == env and len(stops) == 1


def test_a_daemon_that_will_not_start(fresh, monkeypatch):
    _install_fake(monkeypatch, fresh)
    (fresh / "pipe").mkdir()
    (fresh / "pipe" / "refuse").touch()
    with pytest.raises(cuda_mps.MpsError, match="-d failed .*cannot start"):
        cuda_mps.ensure_mps("on")
    monkeypatch.setattr(cuda_mps, "_state", {})
    assert cuda_mps.ensure_mps("auto") == {}
