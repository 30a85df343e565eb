"""Each Ray internal the app reads (deployments/ray_compat.py) exists in the installed Ray, and each access degrades
safely where it is gone: a Ray upgrade that moves one fails here, not in front of a user."""

import dataclasses
import inspect

import pytest

from deployments import ray_compat


def test_the_request_context_exists_and_names_the_request():
    from ray.serve import context

    assert callable(context._get_serve_request_context)
    assert hasattr(context._get_serve_request_context(), "request_id")
    assert ray_compat.check_ray_internals()["request context"]


def test_without_the_request_context_the_header_names_the_request(monkeypatch):
    from ray.serve import context

    monkeypatch.setattr(context, "_get_serve_request_context", lambda: (_ for _ in ()).throw(AttributeError("moved")))
    assert ray_compat.serve_request_id({"x-request-id": "abc-123"}) == "abc-123"
    made_up = ray_compat.serve_request_id(None)
    assert len(made_up) == 32 and made_up != ray_compat.serve_request_id(None)


def test_the_power_of_two_router_exists_and_is_a_request_router():
    from ray.serve.request_router import RequestRouter

    router = ray_compat.power_of_two_router_class()
    assert router is not None and issubclass(router, RequestRouter)


def test_without_the_power_of_two_router_routing_falls_back_to_the_public_base(monkeypatch, caplog):
    import sys

    monkeypatch.setitem(sys.modules, "ray.serve._private.request_router.pow_2_router", None)  # import fails
    assert ray_compat.power_of_two_router_class() is None
    assert ray_compat.check_ray_internals()["power-of-two router"] is False
    assert "without sequence affinity" in caplog.text


def test_the_replica_stop_flag_is_where_the_drain_reads_it():
    from ray.serve._private import replica

    source = inspect.getsource(replica)
    assert "self._shutting_down = True" in source  # set when Serve begins a graceful shutdown
    assert "self._replica_impl" in source  # the replica actor's replica object
    assert ray_compat.replica_stop_requested() is False  # outside a replica: never stopping


def test_the_replica_context_carries_its_deployment_config():
    from ray.serve._private.config import DeploymentConfig
    from ray.serve.context import ReplicaContext

    assert "_deployment_config" in {f.name for f in dataclasses.fields(ReplicaContext)}
    config = DeploymentConfig()
    assert isinstance(config.graceful_shutdown_timeout_s, (int, float))
    assert isinstance(config.graceful_shutdown_wait_loop_s, (int, float))
    assert ray_compat.replica_drain_settings() is None  # outside a replica: the declared values apply


def test_the_direct_ingress_draining_period_is_serves_own_and_none_without_direct_ingress(monkeypatch):
    from ray.serve._private import constants

    monkeypatch.setattr(constants, "RAY_SERVE_ENABLE_DIRECT_INGRESS", False)
    assert ray_compat.direct_ingress_draining_period_s() == 0.0
    monkeypatch.setattr(constants, "RAY_SERVE_ENABLE_DIRECT_INGRESS", True)
    monkeypatch.setattr(constants, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", 30.0)
    assert ray_compat.direct_ingress_draining_period_s() == 30.0
    monkeypatch.delattr(constants, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S")
    assert ray_compat.direct_ingress_draining_period_s() is None  # moved: the ingress keeps the stale routes' second


def test_the_drain_budget_falls_back_to_the_declared_grace_period():
    from deployments.lifecycle import _MARGIN_S, drain_budget_s

    assert drain_budget_s(30, 2) == pytest.approx(30 - 2 - _MARGIN_S)


def test_every_private_access_lives_in_ray_compat():
    import pathlib
    import re

    pattern = re.compile(r"_private|_shutting_down|_get_serve_request_context|_deployment_config|_replica_impl")
    hits = {path.name for path in pathlib.Path("deployments").glob("*.py") if pattern.search(path.read_text())}
    assert hits == {"ray_compat.py"}
