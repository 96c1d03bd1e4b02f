"""Fixtures for the reward tests: real reward servers on free localhost ports."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from digen.rewards.base import Reward
from digen.rewards.server import RewardServer, make_server

torch.set_num_threads(1)


@pytest.fixture
def serve() -> Iterator[Callable[..., RewardServer]]:
    """``serve(reward, **make_server_kwargs)`` -> a running server on 127.0.0.1:<free port>."""
    running: list[tuple[RewardServer, threading.Thread]] = []

    def start(reward: Reward, **kwargs: Any) -> RewardServer:
        server = make_server(reward, "127.0.0.1", 0, **kwargs)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        running.append((server, thread))
        return server

    yield start
    for server, thread in running:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def save_tiny_clip(folder, *, seed: int = 0, projection_dim: int = 16, hidden_act: str = "quick_gelu"):
    """A random-weight CLIP in the ``save_pretrained`` layout of openai/clip-vit-large-patch14
    and PickScore_v1 (``config.json``, ``model.safetensors``, tokenizer and
    ``preprocessor_config.json``), small enough for the CPU. Returns the folder."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from digen.models.text import tiny_clip_tokenizer

    tokenizer = tiny_clip_tokenizer()
    small = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "hidden_act": hidden_act,
    }
    config = CLIPConfig(
        text_config={
            **small,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 77,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={**small, "image_size": 32, "patch_size": 8},
        projection_dim=projection_dim,
    )
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(folder)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    return folder
