"""One real local Ray cluster and Serve instance per session, with two apps on it (each deployed on first use):

- ``serve_app``: the shipped config with the real embedded model, at ``/`` (app "default"): the end-to-end tests;
- ``fake_app``: the same deployments on a fake model (tests/serve/fake_model.py), at ``/fake`` (app "fake"):
  fast tests of the serving layer.
"""

import httpx
import pytest
import yaml

from tests.conftest import TORCH_THREADS

PORT = 8765
BASE = f"http://127.0.0.1:{PORT}"
MODEL = "smollm2-135m-instruct"
GPTQ_MODEL = "smollm2-135m-instruct-gptq"
GPTQ_NGRAM_MODEL = "smollm2-135m-instruct-gptq-ngram"  # the GPTQ model's engine, drafting by prompt lookup
GPTQ_SPEC_MODEL = "smollm2-135m-instruct-spec"  # the GPTQ model's engine, verifying the embedded model's drafts

FAKE_APP = "fake"
FAKE_BASE = f"{BASE}/fake"
FAKE_MODELS = ["fake-a", "fake-b"]
FRAGILE_MODEL = "fake-fragile"  # the one whose replica a test kills
FAKE_TWIN = "fake-a-ngram"  # fake-a's speculative twin: the same model under a second name
FP32_KV_MB = 400  # the embedded model's whole context in fp32 KV (360 MiB), not the shipped 1 GiB (1.9 s of CPU to zero)
TEST_STEP_TOKENS = 256  # real engines' step budget in tests (their warm-up runs one full step)
GPTQ_STEP_TOKENS = 128


def app_args() -> dict:
    """The shipped config, with the bf16 model in fp32: batched == alone must hold exactly, and bf16
    rounding depends on how many rows a matmul has (a near-tie can then flip a greedy token). Steps of
    256 tokens (the GPTQ build's 128): each engine's warm-up runs one step of the whole budget, and the suite
    starts many. The speculative twins draft at every step (``adaptive: false``): on a fast target the policy
    may find the draft model too dear and draft nothing, which would leave their equality tests nothing to
    verify. For the same reason a sequence waits for its draft model's answer however long it takes: on two
    cores the draft replica answers a batch of 16 calls in 1.5-3 s, past the shipped 500 ms wait. Both models
    skip their load-time parity check (~1 s and ~2.3 s of CPU in the app's start on a 2-core AVX2 EPYC), which
    the model tier runs at the same settings: the GPTQ model's in tests/model/test_quantized_models.py, the
    embedded model's at the start of the ``server_fp32`` fixture (tests/model/conftest.py), which fails if it
    does."""
    config = yaml.safe_load(open("configs/smollm2-cpu.yaml"))
    config["models"][0]["model"]["dtype"] = "float32"
    config["models"][0]["engine"]["kv_cache_memory_mb"] = FP32_KV_MB
    for model in config["models"]:
        model.setdefault("engine", {})["max_num_batched_tokens"] = TEST_STEP_TOKENS
        model["engine"]["parity_check"] = False
        model["engine"]["torch_threads"] = TORCH_THREADS
        model["engine"]["batch_invariant"] = True  # batched == alone, bit for bit: one Linear kernel for every row count
        for spec in model["engine"].get("speculative", []):
            # the twins draft at every step, paying or not: their equality tests must exercise verification
            spec["adaptive"] = False
            if spec.get("drafter") == "model":
                spec["max_draft_wait_ms"] = 60_000
    # The GPTQ build warms up through GPTQModel's torch kernel, ~5 s per 512 tokens here; its tests' batches fit 128
    config["models"][1]["engine"]["max_num_batched_tokens"] = GPTQ_STEP_TOKENS
    return config


def fake_app_args() -> dict:
    """Fake models in the replica process (no engine process to spawn), taking no CPU from the real app's replicas."""
    def served(name: str) -> dict:
        return {"model": {"source": name}, "engine": {"separate_process": False}, "replica": {"num_cpus": 0}}

    models = [served(n) for n in FAKE_MODELS + [FRAGILE_MODEL]]
    models[0]["engine"]["speculative"] = {"drafter": "ngram", "served_name": FAKE_TWIN}  # a second name, hosted locally
    return {"server_factory": "tests.serve.fake_model:fake_model_server", "models": models}


@pytest.fixture(scope="session")
def serve_cluster():
    import ray
    from ray import serve

    from deployments.launch import init_local_ray  # make serve's start: a node that times out starting starts again

    init_local_ray(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    yield {"gcs_address": ray.get_runtime_context().gcs_address}
    # The cluster goes whole: serve.shutdown() would first drain every replica left (~15 s on two cores), which
    # the drain tests already test. Each engine process sees its replica's socket close and exits.
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_app(serve_cluster):
    from ray import serve

    from deployments.builder import build_app

    serve.run(build_app(app_args()), name="default", route_prefix="/")
    return serve_cluster


@pytest.fixture(scope="session")
def fake_app(serve_cluster):
    from ray import serve

    from deployments.builder import build_app

    serve.run(build_app(fake_app_args()), name=FAKE_APP, route_prefix="/fake")
    return serve_cluster


@pytest.fixture(scope="session")
def client(serve_app):
    with httpx.Client(base_url=BASE, timeout=120) as http:
        yield http


@pytest.fixture(scope="session")
def fake_client(fake_app):
    with httpx.Client(base_url=FAKE_BASE, timeout=30) as http:
        yield http


def runs_user_code_in_a_thread_of_its_own(replica_actor) -> bool:
    """Run in a replica's process (``__ray_call__``; importable there, unlike a test module): Serve's setting."""
    from ray.serve._private import constants

    return constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD


def with_deployment_options(app, **options):
    """``app`` as build_app made it, with Serve ``options`` (e.g. a shorter grace period or health-check period)
    set on every deployment: the ingress and the model deployments it is bound to."""
    from ray.serve import Application

    ingress = app._bound_deployment
    servers, *rest = ingress.init_args  # build_app binds the model deployments first
    servers = [Application(server._bound_deployment.options(**options)) for server in servers]
    return Application(ingress.options(_init_args=(servers, *rest), **options))
