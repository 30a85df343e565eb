"""This host's CPUs: how many this process may use (the ones it may run on, capped by its container's CPU limit),
and what they are (/proc/cpuinfo: the first processor's fields and flags).

A container limited to 4 CPUs (Docker ``--cpus 4``, a Kubernetes CPU limit without the static CPU manager) still
sees every core of its node in its affinity; one OpenMP thread per core there runs 64 threads on a 4-CPU quota, and
the kernel throttles them all at every period. The limit is the cgroup's CPU quota (v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), as Go's automaxprocs and the JVM read it.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


def usable_cpus(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int:
    """The CPUs in this process's affinity, at most its cgroup's quota (rounded down, at least 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(root, self_cgroup)
    return max(1, min(cpus, math.floor(quota))) if quota is not None else cpus


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> float | None:
    """CPUs' worth of time per period this process's cgroup (or any cgroup above it) allows; None: no limit."""
    quotas = [q for q in (_v2_quota(root, self_cgroup), _v1_quota(root, self_cgroup)) if q is not None]
    return min(quotas) if quotas else None


def _v2_quota(root: Path, self_cgroup: Path) -> float | None:
    """cgroup v2: the tightest ``cpu.max`` from this process's cgroup up to the root of the hierarchy it sees."""
    try:
        entry = next(line for line in self_cgroup.read_text().splitlines() if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    folder, quotas = root / entry[len("0::"):].strip().strip("/"), []
    while True:
        try:
            quotas.append(_ratio((folder / "cpu.max").read_text().split()))
        except OSError:  # no cpu.max here (the root cgroup has none)
            pass
        if folder == root or root not in folder.parents:
            break
        folder = folder.parent
    quotas = [q for q in quotas if q is not None]
    return min(quotas) if quotas else None


def _v1_quota(root: Path, self_cgroup: Path) -> float | None:
    """cgroup v1: the tightest quota over period of the cpu controller, from this process's cgroup up to the mount's
    root. In a container the mount's root is the container's own cgroup, and /proc/self/cgroup names a host path not
    under it: the root alone counts; on a host (a systemd slice with a CPUQuota) each level on the way up counts."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    # "4:cpu,cpuacct:/user.slice/app.service": the hierarchy holding the cpu controller, and this process's path in it
    fields = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    path = next((path for _, controllers, path in fields if "cpu" in controllers.split(",")), "/")
    for controller in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        mount = root / controller
        if not mount.is_dir():
            continue
        folder, quotas = mount / path.strip("/"), []
        while True:
            quotas.append(_v1_ratio(folder))
            if folder == mount or mount not in folder.parents:
                break
            folder = folder.parent
        quotas = [q for q in quotas if q is not None]
        return min(quotas) if quotas else None
    return None


def _v1_ratio(folder: Path) -> float | None:
    try:
        return _ratio([(folder / "cpu.cfs_quota_us").read_text().strip(), (folder / "cpu.cfs_period_us").read_text().strip()])
    except OSError:  # not this far down in the mount (a container's): the levels that are count
        return None


def _ratio(quota_and_period: list[str]) -> float | None:
    """``["400000", "100000"]`` -> 4.0; ``["max", ...]`` (v2) or ``["-1", ...]`` (v1): no limit."""
    try:
        quota, period = int(quota_and_period[0]), int(quota_and_period[1])
    except (ValueError, IndexError):
        return None
    return quota / period if quota > 0 and period > 0 else None


@functools.cache
def cpuinfo_fields() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none: another OS)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    if fields:
                        break
                    continue
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> frozenset[str] | None:
    """The CPU's instruction-set flags (x86's "flags", ARM's "Features"); None where /proc/cpuinfo has none."""
    fields = cpuinfo_fields()
    line = fields.get("flags") or fields.get("Features")
    return frozenset(line.split()) if line is not None else None
