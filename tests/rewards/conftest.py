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
