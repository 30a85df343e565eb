import pytest

from app.config import ModelConfig, ServedModelConfig
from app.server import ModelServer


@pytest.fixture(scope="session")
def server_fp32():
    """The real embedded model in fp32 (exact comparisons), behind the real engine."""
    server = ModelServer(ServedModelConfig(model=ModelConfig(dtype="float32")))
    yield server
    server.shutdown(timeout_s=5)
