"""`train.tf32` (#38 hazard 15): fp32 matmuls on CUDA run in TF32 by default, never on CPU. The
switch is a process-wide flag, so it is read back here without a GPU: setting it for a 'cuda'
device flips cuBLAS's flag (which the MFU peak follows) and leaves CPU matmul precision alone."""

from __future__ import annotations

import pytest
import torch

from depthscale.config import ConfigError, load_config
from depthscale.observe import metrics
from depthscale.train import setup

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture
def restore_matmul_flags():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved[0]
    torch.set_float32_matmul_precision(saved[1])


def _cpu_precision() -> tuple:
    mkldnn = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    return (getattr(mkldnn, "fp32_precision", None),)


@pytest.mark.parametrize(
    "setting, device, want",
    [("auto", CUDA, True), (True, CUDA, True), (False, CUDA, False)]
    + [(s, CPU, False) for s in ("auto", True, False)],
)
def test_tf32_is_wanted_on_cuda_only(setting, device, want):
    assert setup.tf32_wanted(setting, device) is want


def test_cpu_runs_touch_no_matmul_flag(restore_matmul_flags):
    torch.backends.cuda.matmul.allow_tf32 = False
    before = torch.get_float32_matmul_precision(), _cpu_precision()
    for setting in ("auto", True, False):
        assert setup.apply_tf32(setting, CPU) is False
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert (torch.get_float32_matmul_precision(), _cpu_precision()) == before


def test_cuda_runs_set_cublas_tf32_and_the_mfu_peak_follows(restore_matmul_flags):
    cpu_before = _cpu_precision()
    assert setup.apply_tf32("auto", CUDA) is True
    assert torch.backends.cuda.matmul.allow_tf32 and metrics._tf32_enabled()
    assert setup.apply_tf32(False, CUDA) is False
    assert not torch.backends.cuda.matmul.allow_tf32 and not metrics._tf32_enabled()
    assert _cpu_precision() == cpu_before


def test_the_knob_parses_and_names_its_values():
    assert load_config(None, []).train.tf32 == "auto"
    assert load_config(None, ["--train.tf32", "false"]).train.tf32 is False
    assert load_config(None, ["--train.tf32", "on"]).train.tf32 is True
    with pytest.raises(ConfigError, match="train.tf32.*allowed: 'auto', true, false"):
        load_config(None, ["--train.tf32", "fast"])
