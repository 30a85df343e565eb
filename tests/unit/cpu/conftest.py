"""The CPU kernels' tests: skipped, with the reason, only where this CPU cannot run the kernels at all.

Where the machine supports them (x86-64 with AVX2/FMA and a C/C++ compiler) the library must build and
load: a build failure fails the tests instead of skipping them. The fallbacks (torch's ops) are tested
on every machine by turning the kernels off (``kernels_off``).
"""

import pytest

from app.cpu import build, ops, rotary

UNSUPPORTED = build.unsupported_reason()
needs_kernels = pytest.mark.skipif(UNSUPPORTED is not None, reason=f"the CPU kernels cannot run here: {UNSUPPORTED}")


def loaded_ops():
    """torch.ops.llm_serve, asserting the library built and loaded (call it only where needs_kernels allows)."""
    assert ops.load_ops() is None
    return ops.OPS


def reset_kernels() -> None:
    """Forget what was decided about the kernels (a loaded library stays loaded: ``available()`` decides use)."""
    ops.load_ops.cache_clear()
    rotary.rotary_for.cache_clear()


@pytest.fixture
def kernels_off():
    """The kernels as on a CPU where they cannot run: every caller takes torch's ops."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(build.DISABLE_VARIABLE, "0")
        reset_kernels()
        assert not ops.available()
        yield
    reset_kernels()  # as the environment was before
