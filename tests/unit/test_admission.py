"""How a served model settles into its replica: its admission window, and the device it runs on."""

import pytest


def test_continuous_admission_waits_for_no_window_and_dynamic_for_its_configured_one():
    from app.config import EngineConfig, ServedModelConfig
    from deployments.admission import admission_wait_s

    assert admission_wait_s(ServedModelConfig(engine=EngineConfig(batching="continuous", batch_wait_timeout_s=0.05))) == 0.0
    assert admission_wait_s(ServedModelConfig(engine=EngineConfig(batching="dynamic", batch_wait_timeout_s=0.05))) == 0.05


@pytest.mark.parametrize("device, ray_gpus, runs_on", [("auto", [], "cpu"), ("auto", [0], "auto"), ("cuda", [], "cuda"),
                                                       ("cpu", [0], "cpu")])
def test_device_auto_takes_a_gpu_only_where_ray_gave_the_replica_one(monkeypatch, device, ray_gpus, runs_on):
    import ray

    from app.config import ModelConfig, ServedModelConfig
    from deployments.admission import on_the_replicas_devices

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: ray_gpus)
    config = ServedModelConfig(model=ModelConfig(device=device))
    assert on_the_replicas_devices(config).model.device == runs_on



def test_only_continuous_admission_lets_a_lone_request_skip_the_window():
    """In dynamic mode a group runs to completion before the next: the first of a burst, alone in the engine when it
    arrives, waits in the window for the others rather than run alone while they wait for its whole generation. In
    continuous mode a lone request goes in at once (later arrivals join the running batch at the next step)."""
    from app.config import EngineConfig, ServedModelConfig
    from deployments.admission import admitted_alone

    dynamic = ServedModelConfig(engine=EngineConfig(batching="dynamic", batch_wait_timeout_s=0.05))
    continuous = ServedModelConfig(engine=EngineConfig(batching="continuous", batch_wait_timeout_s=0.05))
    assert (admitted_alone(dynamic, 1), admitted_alone(dynamic, 2)) == (False, False)
    assert (admitted_alone(continuous, 1), admitted_alone(continuous, 2)) == (True, False)
