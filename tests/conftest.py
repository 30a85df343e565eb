import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The device the model tier's engines run on. The suite states the CPU path's guarantees (our kernels' fixed-order
# bits, the dtypes ``auto`` picks on a CPU), and CI has no GPU: on a machine with one, `make test` hides it (set
# here, before anything initializes CUDA; Ray's workers inherit it). LLM_SERVE_TEST_DEVICE=cuda runs the model tier
# on the GPU instead, where the tests marked ``cpu_only`` skip, saying why.
TEST_DEVICE = os.environ.get("LLM_SERVE_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"LLM_SERVE_TEST_DEVICE is {TEST_DEVICE!r}: cpu (the default) or cuda")
if TEST_DEVICE == "cpu":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
ON_GPU = "the model tier runs on the GPU (LLM_SERVE_TEST_DEVICE=cuda), where our CPU kernels do not run"


def pytest_collection_modifyitems(config, items):
    if TEST_DEVICE == "cuda":
        for item in items:
            if item.get_closest_marker("cpu_only"):
                item.add_marker(pytest.mark.skip(reason=f"a CPU-only guarantee: {ON_GPU}"))


def reset_kernels() -> None:
    """Forget what was decided about the CPU kernels (a loaded library stays loaded: ``available()`` decides use)."""
    from app.cpu import ops, rotary

    ops.load_ops.cache_clear()
    rotary.rotary_for.cache_clear()


@pytest.fixture
def kernels_off():
    """The CPU kernels as on a CPU where they cannot run: every caller takes torch's ops."""
    from app.cpu import build, ops

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(build.DISABLE_VARIABLE, "0")
        reset_kernels()
        assert not ops.available()
        yield
    reset_kernels()  # as the environment was before


# Threads of torch in this process and of the engines the tests start (engine.torch_threads; 0: every core).
# `make test` runs the tiers side by side on a 2-core machine, each on one thread: two 2-thread OpenMP pools on
# 2 cores stall each other at every parallel region. torch reads OMP_NUM_THREADS when it starts (set here, before
# any test module imports it; the Ray tier's process never does).
TORCH_THREADS = int(os.environ.get("LLM_SERVE_TEST_THREADS", "0"))
if TORCH_THREADS:
    os.environ["OMP_NUM_THREADS"] = str(TORCH_THREADS)
