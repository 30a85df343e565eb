"""The queue-depth autoscaling policy on synthetic contexts (no cluster), and the options the builder gives Serve."""

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from app.config import AppConfig, ReplicaConfig
from deployments.autoscaling import POLICY_PATH, QUEUE_DEPTH_METRIC, QueueDepthPolicy, engine_queue_depth
from deployments.builder import ingress_options, replica_options

DEPLOYMENT = DeploymentID(name="LLMServer:m", app_name="default")
REPLICAS = [ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT) for i in range(4)]


def context(depths=None, replicas=1, target=None, ongoing=0.0, queued=0.0, state=None, **config) -> AutoscalingContext:
    """``depths``: each running replica's reported queue depth (None: no replica reports the metric)."""
    running = REPLICAS[:replicas]
    metrics = {} if depths is None else {QUEUE_DEPTH_METRIC: dict(zip(running, depths))}
    autoscaling = AutoscalingConfig(**{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2,
                                       "upscale_delay_s": 0, "downscale_delay_s": 0, **config})
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name, app_name=DEPLOYMENT.app_name,
        current_num_replicas=replicas, target_num_replicas=replicas if target is None else target, running_replicas=running,
        total_num_requests=ongoing, total_queued_requests=queued, aggregated_metrics=metrics, raw_metrics={},
        capacity_adjusted_min_replicas=autoscaling.min_replicas, capacity_adjusted_max_replicas=autoscaling.max_replicas,
        policy_state=dict(state or {}), last_scale_up_time=None, last_scale_down_time=None, current_time=0.0,
        config=autoscaling,
    )


def decide(policy, ctx) -> tuple[int, dict]:
    """What Serve's controller does with a custom policy: its factors and delays around it."""
    return _apply_autoscaling_config(policy)(ctx)


def test_a_replica_reports_its_engines_waiting_and_running_sequences():
    assert engine_queue_depth({"num_running": 5, "num_waiting": 3, "kv_usage": 0.5, "ready": True}) == {QUEUE_DEPTH_METRIC: 8.0}
    assert engine_queue_depth({"num_running": 2}) == {QUEUE_DEPTH_METRIC: 2.0}  # a core without a queue


@pytest.mark.parametrize("depths, queued, expected", [
    ([4.0], 0, 1.0),  # at the target
    ([12.0], 0, 3.0),  # three replicas' worth
    ([6.0, 2.0], 0, 2.0),  # the sum over replicas counts, not each one
    ([3.0], 5.0, 2.0),  # requests queued at callers for want of a replica are load too
    ([0.0, 0.0], 0, 1.0),  # idle: min_replicas
    ([100.0], 0, 4.0),  # never beyond max_replicas
])
def test_the_policy_asks_for_the_replicas_the_queue_depth_needs(depths, queued, expected):
    desired, state = QueueDepthPolicy(target_queue_depth=4)(context(depths, replicas=len(depths), queued=queued))
    assert desired == expected and state["signal"] == QUEUE_DEPTH_METRIC


def test_without_the_metric_serve_s_ongoing_requests_decide():
    policy = QueueDepthPolicy(target_queue_depth=4)
    desired, state = policy(context(None, replicas=2, ongoing=6.0))  # target_ongoing_requests 2
    assert desired == 3.0 and state == {"signal": "ongoing_requests", "load": 6.0}
    # a replica that has not reported yet (just started, already routed to) counts as the others' mean: as nothing,
    # it would read as spare capacity and undo the scale-up that made it
    desired, _ = policy(context([8.0], replicas=2, ongoing=100.0))
    assert desired == 4.0


def test_scaling_up_waits_upscale_delay_s_and_down_downscale_delay_s(monkeypatch):
    import ray.serve.autoscaling_policy as serve_policy

    now = [1000.0]
    monkeypatch.setattr(serve_policy.time, "time", lambda: now[0])
    policy = QueueDepthPolicy(target_queue_depth=2)
    busy = dict(depths=[8.0], replicas=1, upscale_delay_s=1.0, downscale_delay_s=3.0)
    replicas, state = decide(policy, context(**busy))
    assert replicas == 1  # wants 4, but the delay has only begun
    now[0] += 0.5
    replicas, state = decide(policy, context(**busy, state=state))
    assert replicas == 1
    now[0] += 0.6
    replicas, state = decide(policy, context(**busy, state=state))
    assert replicas == 4  # 1.1 s of consistent wish: scaled, to what the load needs
    quiet = dict(depths=[1.0, 0.0, 0.0, 0.0], replicas=4, upscale_delay_s=1.0, downscale_delay_s=3.0)
    for _ in range(3):  # quiet at t, t + 1, t + 2: not yet
        now[0] += 1.0
        replicas, state = decide(policy, context(**quiet, state=state))
        assert replicas == 4
    now[0] += 1.05
    replicas, state = decide(policy, context(**quiet, state=state))
    assert replicas == 1  # 3.05 s of consistent wish


def test_a_short_spike_does_not_scale_up(monkeypatch):
    import ray.serve.autoscaling_policy as serve_policy

    now = [1000.0]
    monkeypatch.setattr(serve_policy.time, "time", lambda: now[0])
    policy = QueueDepthPolicy(target_queue_depth=2)
    replicas, state = decide(policy, context([8.0], upscale_delay_s=2.0))
    now[0] += 1.0
    replicas, state = decide(policy, context([1.0], upscale_delay_s=2.0, state=state))  # the spike is gone
    now[0] += 1.5
    replicas, state = decide(policy, context([8.0], upscale_delay_s=2.0, state=state))  # a new one starts the delay over
    assert replicas == 1


def test_the_target_must_be_positive():
    with pytest.raises(ValueError, match="target_queue_depth"):
        QueueDepthPolicy(target_queue_depth=0)
    with pytest.raises(ValueError, match="replica.target_queue_depth"):
        ReplicaConfig(target_queue_depth=-1)
    with pytest.raises(ValueError, match="replica.max_queued_requests"):
        ReplicaConfig(max_queued_requests=0)


def test_num_replicas_auto_gives_serve_the_queue_depth_policy():
    served = AppConfig.from_dict({"models": [{"replica": {"num_replicas": "auto", "target_queue_depth": 3,
                                                          "autoscaling_config": {"max_replicas": 2, "upscale_delay_s": 1}}}]}).models[0]
    options = replica_options(served)
    assert "num_replicas" not in options
    config = AutoscalingConfig(**options["autoscaling_config"])  # what Serve builds from it
    assert (config.min_replicas, config.max_replicas, config.upscale_delay_s) == (1, 2, 1)
    assert config.policy.policy_function == POLICY_PATH and config.policy.policy_kwargs == {"target_queue_depth": 3}
    assert config.policy.get_policy() is QueueDepthPolicy
    # a config that names its own policy keeps it
    own = {"policy": {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"}}
    served = AppConfig.from_dict({"models": [{"replica": {"num_replicas": "auto", "autoscaling_config": own}}]}).models[0]
    assert AutoscalingConfig(**replica_options(served)["autoscaling_config"]).policy.is_default_policy_function()


def test_the_ingress_hosting_the_first_model_scales_as_that_model():
    config = AppConfig.from_dict({"models": [{"replica": {"num_replicas": "auto"}}, {"model": "other"}]})
    options = ingress_options(config, config.models[0])
    assert options["autoscaling_config"]["policy"]["policy_function"] == POLICY_PATH


def test_the_default_cpu_config_fits_two_replicas_of_each_model_on_two_cores():
    config = AppConfig.from_args({"config": "configs/smollm2-cpu.yaml"})
    assert sum(2 * served.replica.num_cpus for served in config.models) <= 2


@pytest.mark.parametrize("replica, message", [
    ({"autoscaling_config": {"max_replica": 6}}, "unknown key(s) max_replica"),
    ({"autoscaling_config": {"min_replicas": 6}}, "max_replicas (4) must be greater than or equal to min_replicas (6)"),
    ({"autoscaling_config": {"max_replicas": 0}}, "max_replicas: Input should be greater than 0"),  # the key, named
])
def test_an_autoscaling_config_serve_would_refuse_or_pass_over_is_refused_naming_the_model(replica, message):
    config = AppConfig.from_args({"models": [{"model": {"source": "m"}, "replica": replica}]})
    with pytest.raises(ValueError, match=r"model 'm': replica.autoscaling_config") as failure:
        replica_options(config.models[0])
    assert message in str(failure.value)


def test_where_no_replica_reports_serves_request_count_aims_at_the_same_target():
    config = AppConfig.from_args({"models": [{"model": {"source": "m"}, "replica": {"num_replicas": "auto", "target_queue_depth": 40}}]})
    assert replica_options(config.models[0])["autoscaling_config"]["target_ongoing_requests"] == 40


def test_memory_gb_is_rays_memory_resource_for_each_replica_and_the_ingress_hosting_it():
    """Placed by memory too: on KubeRay a replica that fits no pod's memory makes the autoscaler add a pod."""
    from ray.serve.schema import RayActorOptionsSchema

    config = AppConfig.from_dict({"models": [{"replica": {"memory_gb": 3}}, {"model": "other", "replica": {"memory_gb": 1.5}}]})
    hosted, other = ingress_options(config, config.models[0]), replica_options(config.models[1])
    assert hosted["ray_actor_options"]["memory"] == 3 * 2**30 and other["ray_actor_options"]["memory"] == 3 * 2**29
    for options in (hosted, other, ingress_options(config, None)):  # as Serve checks a deployment's actor options
        RayActorOptionsSchema(**options["ray_actor_options"])
    assert "memory" not in replica_options(AppConfig.from_dict({"models": [{}]}).models[0])["ray_actor_options"]
    with pytest.raises(ValueError, match="replica.memory_gb"):
        ReplicaConfig(memory_gb=0)
