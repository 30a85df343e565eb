"""A replica's torch threads: the CPUs it may run on, capped by its container's CPU quota (cgroup v2 and v1),
read from a cgroup tree written here."""

import os

import pytest

from app.engine.host_cpus import cgroup_cpu_quota, usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


def _v2(tmp_path, path: str, limits: dict[str, str]):
    """A v2 hierarchy: this process in ``path``; ``limits``: folder (relative to the root) -> its cpu.max."""
    root = tmp_path / "cgroup"
    (root / path.strip("/")).mkdir(parents=True, exist_ok=True)
    for folder, value in limits.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "cpu.max").write_text(value + "\n")
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text(f"0::{path}\n")
    return root, self_cgroup


@pytest.mark.parametrize("limits, quota", [
    ({}, None),  # the root cgroup has no cpu.max
    ({"": "max 100000"}, None),  # a container without a limit
    ({"": "150000 100000"}, 1.5),  # --cpus 1.5, the container's own namespace
])
def test_a_containers_cpu_max_is_its_quota(tmp_path, limits, quota):
    root, self_cgroup = _v2(tmp_path, "/", limits)
    assert cgroup_cpu_quota(root, self_cgroup) == quota


def test_the_tightest_limit_on_the_way_up_counts(tmp_path):
    root, self_cgroup = _v2(tmp_path, "/kubepods/pod1/container", {"kubepods/pod1": "100000 100000",
                                                                   "kubepods/pod1/container": "300000 100000"})
    assert cgroup_cpu_quota(root, self_cgroup) == 1.0
    assert usable_cpus(root, self_cgroup) == 1


def test_v1_quota_and_minus_one_for_none(tmp_path):
    root = tmp_path / "cgroup"
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(root, tmp_path / "none") is None
    (root / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    assert cgroup_cpu_quota(root, tmp_path / "none") == 0.5
    assert usable_cpus(root, tmp_path / "none") == 1  # at least one thread, however small the quota


def test_v1_on_a_host_the_tightest_quota_on_the_way_up_counts_and_in_a_container_its_own(tmp_path):
    """On a host the v1 mount holds every cgroup: a systemd slice's CPUQuota above this process's service counts. In a
    container the mount's root is the container's cgroup, and the host path /proc/self/cgroup names is not there."""
    root = tmp_path / "cgroup"
    for folder, quota in (("", "-1"), ("user.slice", "150000"), ("user.slice/app.service", "-1")):
        (root / "cpu,cpuacct" / folder).mkdir(parents=True, exist_ok=True)
        (root / "cpu,cpuacct" / folder / "cpu.cfs_period_us").write_text("100000\n")
        (root / "cpu,cpuacct" / folder / "cpu.cfs_quota_us").write_text(quota + "\n")
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text("12:memory:/user.slice/app.service\n4:cpu,cpuacct:/user.slice/app.service\n")
    assert cgroup_cpu_quota(root, self_cgroup) == 1.5
    self_cgroup.write_text("4:cpu,cpuacct:/kubepods/burstable/pod1/abc\n")  # a container's view: only the root is there
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("200000\n")
    assert cgroup_cpu_quota(root, self_cgroup) == 2.0


def test_a_quota_above_the_affinity_leaves_the_affinity(tmp_path):
    root, self_cgroup = _v2(tmp_path, "/", {"": f"{(AFFINITY + 8) * 100000} 100000"})
    assert usable_cpus(root, self_cgroup) == AFFINITY
