"""CPU seconds spent by each part of a running server while a workload runs (machine-wide snapshot).

On a 2-core machine the serving path (replica, ingress, proxy, Ray) shares the CPU with the engine's
OpenMP threads, and the engine slows by more than the serving processes' own CPU. Snapshot before
and after a run: ``cpu_seconds_by_part(before, after)`` says where the CPU went, so the README's
"served against engine alone" comes from a command, not a one-off script. Processes are grouped by
their Ray Serve role, read from the command line Ray gives each actor.
"""

from __future__ import annotations

import os

import psutil

# Ray names a Serve actor's process after it: "ray::ServeReplica:<app>:<deployment>", "ray::ProxyActor"...
_ROLES = (("LLMServer", "replica"), ("OpenAIIngress", "ingress"), ("ProxyActor", "proxy"), ("ServeController", "controller"))


def process_cpu_snapshot() -> dict[int, tuple[str, float]]:
    """Every process's role and CPU seconds (user + system) so far; this process is left out."""
    processes = {
        p.pid: p.info for p in psutil.process_iter(["ppid", "cmdline", "name", "cpu_times"]) if p.pid != os.getpid()
    }
    commands = {pid: " ".join(info["cmdline"] or [info["name"] or ""]) for pid, info in processes.items()}
    return {
        pid: (role_of(commands[pid], commands.get(info["ppid"], "")), info["cpu_times"].user + info["cpu_times"].system)
        for pid, info in processes.items()
        if info["cpu_times"] is not None  # None: the process went away or is not ours to read
    }


def role_of(command: str, parent_command: str) -> str:
    """A process's part in the server; the engine core is the child process of the replica hosting its model."""
    for marker, role in _ROLES:
        if marker in command:
            return role
    if "LLMServer" in parent_command or "OpenAIIngress" in parent_command:
        return "engine core"
    return "other (Ray, system)"


def cpu_seconds_by_part(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role spent between two snapshots (processes started in between count whole)."""
    spent: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        spent[role] = spent.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return {role: round(seconds, 1) for role, seconds in sorted(spent.items(), key=lambda item: -item[1])}
