"""What ``make serve``'s launcher hands to Ray and to ``serve run`` (tests/deploy/test_launch.py runs it for real)."""

from __future__ import annotations

import os

import pytest
import ray
from ray.serve import scripts

from deployments import launch


@pytest.fixture
def calls(monkeypatch):
    """ray.init and serve run, recorded instead of run; the environment a copy, without the launcher's variables."""
    seen: dict = {"environ": {k: v for k, v in os.environ.items() if k not in [*launch.SERVE_ENV, "RAY_ADDRESS"]}}
    monkeypatch.setattr(os, "environ", seen["environ"])
    monkeypatch.setattr(ray, "init", lambda **options: seen.setdefault("ray.init", options))
    monkeypatch.setattr(scripts.cli, "main", lambda args, prog_name: seen.setdefault("serve", args))
    monkeypatch.setattr(launch.signal, "signal", lambda *args: seen.setdefault("signal", args))  # this process's stay
    return seen


def test_a_local_ray_without_the_dashboard_then_serve_run(calls):
    launch.main(["serve_config.yaml", "--reload"])
    assert calls["ray.init"] == {"address": "local", "namespace": "serve", "include_dashboard": False}  # never a cluster's
    assert calls["serve"] == ["run", "serve_config.yaml", "--reload"]
    assert all(calls["environ"][name] == value for name, value in launch.SERVE_ENV.items())
    assert calls["signal"] == (launch.signal.SIGINT, launch.signal.default_int_handler)  # Ctrl-C stops it


def test_the_dashboard_on_request(calls):
    launch.main(["--dashboard", "serve_config.yaml"])
    assert calls["ray.init"]["include_dashboard"] is True
    assert calls["serve"] == ["run", "serve_config.yaml"]  # the flag is the launcher's, not serve run's


def test_a_variable_already_set_keeps_its_value(calls):
    calls["environ"]["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] = "0.1"
    launch.main(["serve_config.yaml"])
    assert calls["environ"]["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"


@pytest.mark.parametrize("args", [["-a", "ray://head:10001"], ["--address=auto"], ["--runtime-env-json", "{}"],
                                  ["--working-dir", "."]])
def test_serve_run_starts_ray_itself_where_its_options_decide_how(calls, args):
    launch.main(["serve_config.yaml", *args])
    assert "ray.init" not in calls and calls["serve"] == ["run", "serve_config.yaml", *args]


def test_a_cluster_in_the_environment_is_joined_by_serve_run(calls):
    calls["environ"]["RAY_ADDRESS"] = "head:6379"
    launch.main(["serve_config.yaml"])
    assert "ray.init" not in calls and calls["serve"] == ["run", "serve_config.yaml"]


def test_a_node_that_times_out_starting_is_started_again_and_any_other_failure_raises(monkeypatch):
    seen = []
    timed_out = Exception("The current node timed out during startup. This could happen because some of the raylet "
                          "failed to startup or the GCS has become overloaded.")  # Ray 2.60's words

    def init(failures: list[Exception]):
        def call(**options):
            seen.append(options)
            if failures:
                raise failures.pop(0)
        return call

    monkeypatch.setattr(ray, "shutdown", lambda: seen.append("shutdown"))
    monkeypatch.setattr(ray, "init", init([timed_out, timed_out]))
    launch.init_local_ray(namespace="serve")
    assert seen == [{"namespace": "serve"}, "shutdown"] * 2 + [{"namespace": "serve"}]

    seen.clear()
    monkeypatch.setattr(ray, "init", init([timed_out] * launch.RAY_START_ATTEMPTS))
    with pytest.raises(Exception, match="timed out during startup"):
        launch.init_local_ray()
    assert seen.count({}) == launch.RAY_START_ATTEMPTS

    seen.clear()
    monkeypatch.setattr(ray, "init", init([RuntimeError("Address already in use")]))
    with pytest.raises(RuntimeError, match="Address already in use"):
        launch.init_local_ray()
    assert seen == [{}]
