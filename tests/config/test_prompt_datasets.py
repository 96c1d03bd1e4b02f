"""Prompt datasets (Flow-GRPO's layout): train/test splits, GenEval metadata, prompts.test_file."""

from __future__ import annotations

import json

import pytest
import torch

from digen.config import build_config
from digen.errors import ConfigError, RewardError
from digen.reference import run_reference
from digen.rewards import Reward, register
from tests.conftest import small_config_data


@register("test_metadata_target")
class MetadataTarget(Reward):
    """Scores each sample with its prompt's ``metadata["target"]`` (refuses to score without)."""

    def __call__(self, images, prompts, metadata=None):
        if metadata is None:
            raise RewardError("no metadata reached the reward")
        return torch.tensor([float(m["target"]) for m in metadata])


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def geneval_dir(tmp_path):
    d = tmp_path / "geneval"
    d.mkdir()
    train = [
        {
            "tag": "single_object",
            "include": [{"class": "cat", "count": 1}],
            "prompt": "a photo of a cat",
            "target": 0.25,
        },
        {
            "tag": "counting",
            "include": [{"class": "cup", "count": 2}],
            "prompt": "a photo of two cups",
            "target": 0.25,
        },
    ]
    _jsonl(d / "train_metadata.jsonl", train)
    _jsonl(d / "test_metadata.jsonl", [{"tag": "colors", "prompt": "a red car", "target": 1}])
    (d / "train.txt").write_text("ignored when the metadata file is there\n")
    return d


def _cfg(tiny_sd3, **prompts):
    return build_config(small_config_data(tiny_sd3, prompts=prompts))


def test_text_dataset_splits(tiny_sd3, tmp_path):
    (tmp_path / "train.txt").write_text("a cat\n\n  a dog  \n")
    (tmp_path / "test.txt").write_text("a bird\n")
    cfg = _cfg(tiny_sd3, dataset=str(tmp_path))
    assert cfg.prompt_list() == ["a cat", "a dog"]
    assert cfg.test_prompt_list() == (["a bird"], None)
    assert cfg.prompt_metadata("a cat") is None


def test_metadata_dataset_and_test_file(tiny_sd3, geneval_dir, tmp_path):
    cfg = _cfg(tiny_sd3, dataset=str(geneval_dir))
    assert cfg.prompt_list() == ["a photo of a cat", "a photo of two cups"]
    prompts, metadata = cfg.test_prompt_list()
    assert prompts == ["a red car"] and metadata == [{"tag": "colors", "prompt": "a red car", "target": 1}]
    assert cfg.prompt_metadata("a photo of two cups")["include"] == [{"class": "cup", "count": 2}]
    (tmp_path / "held_out.txt").write_text("a boat\na house\n")
    cfg = _cfg(tiny_sd3, dataset=str(geneval_dir), test_file=str(tmp_path / "held_out.txt"))
    assert cfg.test_prompt_list() == (["a boat", "a house"], None)
    assert _cfg(tiny_sd3, items=["x"]).test_prompt_list() == ([], None)


def test_bad_datasets_are_reported(tiny_sd3, tmp_path):
    with pytest.raises(ConfigError, match=r"prompts.dataset \(.*nowhere\) does not exist"):
        _cfg(tiny_sd3, dataset=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="train_metadata.jsonl nor train.txt"):
        _cfg(tiny_sd3, dataset=str(tmp_path)).prompt_list()
    _jsonl(tmp_path / "train_metadata.jsonl", [{"prompt": "a"}, {"text": "no prompt key"}])
    with pytest.raises(ConfigError, match='line 2 must be a JSON object with a "prompt"'):
        _cfg(tiny_sd3, dataset=str(tmp_path)).prompt_list()
    _jsonl(tmp_path / "train_metadata.jsonl", [{"prompt": "a", "tag": "x"}, {"prompt": "a", "tag": "y"}])
    with pytest.raises(ConfigError, match="appears twice with different metadata"):
        _cfg(tiny_sd3, dataset=str(tmp_path)).prompt_metadata("a")


def test_metadata_reaches_the_reward_in_a_run(tiny_sd3, geneval_dir, tmp_path):
    data = small_config_data(
        tiny_sd3,
        iterations=1,
        prompts={"dataset": str(geneval_dir)},
        reward=[{"name": "test_metadata_target"}],
    )
    run_reference(build_config(data), tmp_path / "run")
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward_mean"] == 0.25
