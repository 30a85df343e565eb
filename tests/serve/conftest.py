"""A real local Ray cluster and Serve app with the real embedded model, shared by the serve tests."""

import httpx
import pytest
import yaml

PORT = 8765
BASE = f"http://127.0.0.1:{PORT}"
MODEL = "smollm2-135m-instruct"
GPTQ_MODEL = "smollm2-135m-instruct-gptq"


def app_args() -> dict:
    """The shipped config, with the bf16 model in fp32: batched == alone must hold exactly, and bf16
    rounding depends on how many rows a matmul has (a near-tie can then flip a greedy token)."""
    config = yaml.safe_load(open("configs/smollm2-cpu.yaml"))
    config["models"][0]["model"]["dtype"] = "float32"
    return config


@pytest.fixture(scope="session")
def serve_app():
    import ray
    from ray import serve

    from deployments.builder import build_app

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(app_args()), name="default", route_prefix="/")
    yield {"gcs_address": ray.get_runtime_context().gcs_address}
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def client(serve_app):
    with httpx.Client(base_url=BASE, timeout=120) as http:
        yield http
