"""Where a driver's threads spent their time, in order: reads a py-spy speedscope recording (``record --idle -f
speedscope``, as ``CF_BENCH_PYSPY`` makes for verdict runs of gpu_throughput.py).

Without ``--window``: one line per stretch of at least ``--min-ms`` in which the thread's innermost project frame
(captionflow/, tasks/, flows/) stayed the same, with the library frames it was in below that. With ``--window T0 T1``:
the seconds spent between T0 and T1 below each frame named ``--below`` (default: any project frame), by the
``--depth`` frames under it, most first.

    python bench/pyspy_timeline.py REC.json [--thread 'Thread 123'] [--min-ms 50]
    python bench/pyspy_timeline.py REC.json --window 5 7 --below run_task_sync --depth 4
"""

from __future__ import annotations

import argparse
import collections
import json

PROJECT = ("/captionflow/", "/tasks/", "/flows/")


def _name(fr: dict, line: bool = False) -> str:
    file = fr.get("file", "")
    return f"{fr['name']} ({'/'.join(file.rsplit('/', 2)[-2:])}{':' + str(fr.get('line', '')) if line else ''})"


def _project(fr: dict) -> bool:
    file = fr.get("file", "")
    return any(p in file for p in PROJECT) and "site-packages" not in file


def _where(stack: list[int], frames: list[dict]) -> tuple[str, str]:
    """(innermost project frame, the frames inside it: the next and the leaf); stacks run outermost first."""
    inner, below = "", ""
    for i, f in enumerate(stack):
        if _project(frames[f]):
            inner = _name(frames[f], line=True)
            if i + 1 < len(stack):
                below = f"{frames[stack[i + 1]]['name']} ... {_name(frames[stack[-1]])}"
    return inner, below


def timeline(prof: dict, frames: list[dict], min_ms: float) -> None:
    t, start, cur = 0.0, 0.0, None
    for stack, w in zip(prof["samples"], prof["weights"]):
        where = _where(stack, frames)
        if cur is None or where[0] != cur[0]:
            if cur is not None and (t - start) * 1000 >= min_ms:
                print(f"{start:7.2f} {t - start:6.2f}  {cur[0]}  <- {cur[1]}")
            start, cur = t, where
        t += w
    if cur is not None:
        print(f"{start:7.2f} {t - start:6.2f}  {cur[0]}  <- {cur[1]}")


def window(prof: dict, frames: list[dict], t0: float, t1: float, below: str, depth: int, top: int) -> None:
    seconds: collections.Counter = collections.Counter()
    t = 0.0
    for stack, w in zip(prof["samples"], prof["weights"]):
        if t0 <= t < t1:
            at = [i for i, f in enumerate(stack) if (below in frames[f]["name"] if below else _project(frames[f]))]
            if at:
                k = at[-1] if not below else at[0]
                seconds[" > ".join(_name(frames[f]) for f in stack[k : k + 1 + depth])] += w
        t += w
    for chain, s in seconds.most_common(top):
        print(f"{s:6.2f}  {chain}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recording")
    ap.add_argument("--thread", default="", help="part of a thread's name as py-spy gives it (default: the first)")
    ap.add_argument("--min-ms", type=float, default=50.0)
    ap.add_argument("--window", nargs=2, type=float, metavar=("T0", "T1"))
    ap.add_argument("--below", default="", help="with --window: a function name (part of it)")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    with open(a.recording) as fh:
        data = json.load(fh)
    frames = data["shared"]["frames"]
    prof = next((p for p in data["profiles"] if a.thread and a.thread in p.get("name", "")), data["profiles"][0])
    print(f"{prof.get('name')}: {len(prof['samples'])} samples")
    if a.window:
        window(prof, frames, *a.window, a.below, a.depth, a.top)
    else:
        timeline(prof, frames, a.min_ms)


if __name__ == "__main__":
    main()
