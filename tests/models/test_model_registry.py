"""detect_family / load_policy: family detection and the errors a wrong model.path gets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from digen.errors import ModelError
from digen.models import FAMILIES, detect_family, load_policy

from ._helpers import RES


def test_detect_family_reads_model_index(tiny_paths):
    assert detect_family(tiny_paths["sd3"]) == "sd3"
    assert detect_family(tiny_paths["flux"]) == "flux"


def test_load_policy_picks_the_family_adapter(tiny_paths):
    from digen.models.flux import FluxPolicy
    from digen.models.sd3 import Sd3Policy

    assert isinstance(load_policy(tiny_paths["sd3"], height=RES, width=RES), Sd3Policy)
    flux = load_policy(tiny_paths["flux"], height=RES, width=RES)
    assert isinstance(flux, FluxPolicy) and flux.family == "flux"
    frozen = [m for name, m in flux.pipe.components.items() if name.startswith(("text_encoder", "vae"))]
    assert len(frozen) == 3
    assert all(not m.training and not any(p.requires_grad for p in m.parameters()) for m in frozen)
    assert all(p.requires_grad for p in flux.transformer.parameters())


def test_missing_folder_names_path_and_fix(tmp_path):
    path = tmp_path / "nope"
    with pytest.raises(ModelError) as err:
        load_policy(path, height=RES, width=RES)
    assert str(path) in str(err.value) and f"digen make-tiny-model {path}" in str(err.value)


def test_folder_without_model_index(tmp_path):
    with pytest.raises(
        ModelError, match="not a diffusers pipeline folder \\(no model_index.json\\); make one"
    ):
        load_policy(tmp_path, height=RES, width=RES)


def test_unknown_pipeline_class(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(
        ModelError, match="StableDiffusionXLPipeline.*supported pipelines: StableDiffusion3Pipeline"
    ):
        detect_family(tmp_path)


def test_registry_entries_resolve():
    for name, family in FAMILIES.items():
        assert family.adapter_class().family == name


@pytest.mark.slow
def test_import_is_light():
    code = "import sys, digen.models; print('diffusers' in sys.modules or 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
