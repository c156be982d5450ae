"""CPU used by processes during a measured window, from /proc: who spent the machine's cores (Linux only)."""

from __future__ import annotations

import os
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")

Snapshot = tuple[float, dict[int, float], float, float]  # wall time, CPU by session, this process, machine


def _stat_fields(stat: bytes) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses)."""
    return stat[stat.rfind(b")") + 2:].split()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = _stat_fields(f.read())
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def session_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of every process, summed by session id (each Child runs in its own)."""
    out: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = _stat_fields(f.read())
        except OSError:
            continue
        out[int(fields[3])] = out.get(int(fields[3]), 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return (sum(parts[:8]) - idle) / CLK_TCK


class CpuMeter:
    """Cores used over a window by each named group of processes, by this process (the load generator), and
    by everything else on the machine."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups  # label -> session ids

    def snapshot(self) -> Snapshot:
        return time.perf_counter(), session_cpu(), time.process_time(), machine_busy()

    def cores(self, a: Snapshot, b: Snapshot) -> dict[str, float]:
        wall = b[0] - a[0]
        out = {label: sum(b[1].get(s, 0.0) - a[1].get(s, 0.0) for s in sids) / wall
               for label, sids in self.groups.items()}
        out["load generator"] = (b[2] - a[2]) / wall
        out["machine"] = (b[3] - a[3]) / wall
        out["other processes"] = max(0.0, out["machine"] - sum(v for k, v in out.items() if k != "machine"))
        return {k: round(v, 3) for k, v in out.items()}
