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

