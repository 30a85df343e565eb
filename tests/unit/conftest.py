import pytest

from app.config import AppConfig
from tests.serve import fake_model


@pytest.fixture
def quick_fake_steps(monkeypatch):
    """The fake model's steps at 2 ms, for tests that read what is streamed, not when (a byte a step)."""
    monkeypatch.setattr(fake_model, "STEP_S", 0.002)


@pytest.fixture
def tools_server(quick_fake_steps):
    """The real serving layer over the fake model that replays recorded answers (Hermes tool calls by default)."""
    served = {"model": {"source": "fake-tools"}, "engine": {"separate_process": False}}
    server = fake_model.fake_model_server(AppConfig.from_dict({"models": [served]}).models[0])
    yield server
    server.shutdown(timeout_s=1)
