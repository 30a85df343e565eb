"""The CPU kernels' tests: skipped, with the reason, only where this CPU cannot run the kernels at all.

Where the machine supports them (x86-64 with AVX2/FMA and a C/C++ compiler) the library must build and
load: a build failure fails the tests instead of skipping them. The fallbacks (torch's ops) are tested
on every machine by turning the kernels off (the ``kernels_off`` fixture of tests/conftest.py).
"""

import pytest

from app.cpu import build, ops
from tests.conftest import reset_kernels  # noqa: F401 - re-exported for the kernel tests

UNSUPPORTED = build.unsupported_reason()
needs_kernels = pytest.mark.skipif(UNSUPPORTED is not None, reason=f"the CPU kernels cannot run here: {UNSUPPORTED}")


def loaded_ops():
    """torch.ops.llm_serve, asserting the library built and loaded (call it only where needs_kernels allows)."""
    assert ops.load_ops() is None
    return ops.OPS
