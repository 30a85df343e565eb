import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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


def pytest_configure(config):
    config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist runs on one worker, in order")


def pytest_collection_modifyitems(config, items):
    """With two pytest-xdist workers (``make test``), the Ray tests share one worker and its one local cluster, and
    the real-model tests the other (one copy of the session's models); unit tests run on whichever is free. The Ray
    tests mostly wait on Serve's own loops (health checks, drains, autoscaling), so the model tests' CPU work fills
    that time."""
    for item in items:
        tier = item.path.relative_to(ROOT / "tests").parts[0]
        if tier in ("serve", "deploy"):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif tier == "model":
            item.add_marker(pytest.mark.xdist_group("model"))
