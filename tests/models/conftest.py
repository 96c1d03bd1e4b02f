"""Tiny SD3 / FLUX pipeline folders shared by the model tests (built once per session)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from digen.models import FlowPolicy, load_policy  # noqa: E402

from ._helpers import RES  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_paths(tiny_models) -> dict[str, Path]:
    return {arch: tiny_models(arch, RES) for arch in ("sd3", "flux")}


@pytest.fixture
def sd3_policy(tiny_paths: dict[str, Path]) -> FlowPolicy:
    return load_policy(tiny_paths["sd3"], height=RES, width=RES)


@pytest.fixture
def flux_policy(tiny_paths: dict[str, Path]) -> FlowPolicy:
    return load_policy(tiny_paths["flux"], height=RES, width=RES)


@pytest.fixture(params=["sd3", "flux"])
def policy(request: pytest.FixtureRequest, tiny_paths: dict[str, Path]) -> FlowPolicy:
    return load_policy(tiny_paths[request.param], height=RES, width=RES)
