"""Fixtures of the unit tests."""

import os
import shutil

import pytest


@pytest.fixture(scope="module")
def cpu_ops():
    """The CPU kernels. Skipped where no C++ toolchain exists (then the fallback tests below still
    run); where one exists, a failed build fails the tests instead of hiding behind the fallback."""
    from depthscale.kernels import attnres_cpu

    if shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None:
        pytest.skip("no C++ compiler or ninja here: the CPU kernels cannot build (fallback tested)")
    if not attnres_cpu.enabled_by_env():
        pytest.skip("DEPTHSCALE_CPU_KERNELS=0")
    ops = attnres_cpu.load()
    assert ops is not None, "a C++ toolchain is present but the AttnRes CPU kernels did not build"
    return ops
