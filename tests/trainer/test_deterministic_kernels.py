"""``model.deterministic``: a process that computes on CUDA turns on deterministic kernels
before its first CUDA computation (no GPU here: the settings are what is checked)."""

from __future__ import annotations

import os

import pytest
import torch

from digen.assembly import CUBLAS_WORKSPACE, deterministic_kernels
from digen.config import build_config
from tests.conftest import required


@pytest.fixture
def torch_flags():
    """Give the process back the flags a test changed."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.utils.deterministic.fill_uninitialized_memory = before[2]
    torch.backends.cudnn.benchmark = before[3]


def _cfg(**model):
    return build_config(required({"model": model}), check_paths=False, algorithms=False)


def test_a_cuda_process_computes_with_deterministic_kernels(monkeypatch, torch_flags):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert _cfg().model.deterministic is True  # the default: the guarantees hold on a GPU too
    assert deterministic_kernels(_cfg(), "cuda:0") is True
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()  # a kernel without one still runs
    assert torch.utils.deterministic.fill_uninitialized_memory is False
    assert torch.backends.cudnn.benchmark is False


def test_cpu_or_the_switch_off_changes_nothing_and_an_operators_workspace_is_kept(monkeypatch, torch_flags):
    torch.use_deterministic_algorithms(False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert deterministic_kernels(_cfg(), "cpu") is False
    assert deterministic_kernels(_cfg(deterministic=False), "cuda:0") is False
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and not torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert deterministic_kernels(_cfg(), "cuda:1")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
