"""make_tiny_model: complete offline pipeline folders that diffusers itself can run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from digen.errors import ConfigError
from digen.models import make_tiny_model

from ._helpers import RES


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.rglob("*.safetensors")):
        out.update({f"{f.parent.name}/{k}": v for k, v in load_file(f).items()})
    return out


@pytest.mark.parametrize(
    ("arch", "pipeline_name"), [("sd3", "StableDiffusion3Pipeline"), ("flux", "FluxPipeline")]
)
def test_tiny_folder_runs_in_its_diffusers_pipeline(tiny_paths, arch, pipeline_name):
    import diffusers

    pipe = getattr(diffusers, pipeline_name).from_pretrained(tiny_paths[arch], local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        "a photo of a cat",
        num_inference_steps=2,
        height=RES,
        width=RES,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).images
    assert images.shape == (1, 3, RES, RES)
    assert torch.isfinite(images).all() and images.std() > 0


@pytest.mark.parametrize("arch", ["sd3", "flux"])
def test_tiny_folder_is_small(tiny_paths, arch):
    size = sum(f.stat().st_size for f in tiny_paths[arch].rglob("*") if f.is_file())
    assert size < 4 * 2**20


def test_same_seed_same_weights_other_seed_other_weights(tiny_paths, tmp_path):
    again = _weights(make_tiny_model(tmp_path / "a", "flux", seed=0, resolution=RES))
    first = _weights(tiny_paths["flux"])
    assert again.keys() == first.keys()
    assert all(torch.equal(again[k], first[k]) for k in first)
    other = _weights(make_tiny_model(tmp_path / "b", "flux", seed=1, resolution=RES))
    assert not torch.equal(other["transformer/proj_out.weight"], first["transformer/proj_out.weight"])


def test_tokenizers_load_from_their_files(tiny_paths):
    from transformers import CLIPTokenizer, T5TokenizerFast

    clip = CLIPTokenizer.from_pretrained(tiny_paths["sd3"] / "tokenizer")
    t5 = T5TokenizerFast.from_pretrained(tiny_paths["sd3"] / "tokenizer_3")
    assert (tiny_paths["sd3"] / "tokenizer" / "merges.txt").is_file()
    ids = clip("a photo of a cat 42").input_ids
    assert ids[0] == clip.bos_token_id and ids[-1] == clip.eos_token_id
    assert clip.unk_token_id not in ids[1:-1]
    pieces = t5.convert_ids_to_tokens(t5("a photo of a cat").input_ids)
    assert pieces == ["▁a", "▁photo", "▁of", "▁a", "▁cat", "</s>"]


def test_unknown_arch_and_bad_resolution_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="arch"):
        make_tiny_model(tmp_path, "sdxl")
    with pytest.raises(ConfigError, match="resolution"):
        make_tiny_model(tmp_path, "sd3", resolution=40)
