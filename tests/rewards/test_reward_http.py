"""HttpReward against real servers on localhost: digen's reward server and a scripted one."""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from digen.errors import ConfigError, RewardError
from digen.rewards import HttpReward, Reward, build_reward


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _images(b: int, size: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.rand(b, 3, size, size, generator=torch.Generator().manual_seed(seed))


class _Flaky(Reward):
    """Brightness that raises on its first ``failures`` calls."""

    name = "flaky"

    def __init__(self, failures: int):
        self.failures = failures
        self.calls = 0

    def __call__(self, images, prompts):
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("model not ready")
        return build_reward("brightness")(images, prompts)


class _Scripted(BaseHTTPRequestHandler):
    """Answers every POST with the server's (status, body) and counts the requests."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests += 1
        status, body = self.server.answer
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    """``scripted(status, body)`` -> a server answering that to every POST (``.requests`` counts)."""
    servers = []

    def start(status: int, body: object) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
        server.answer, server.requests = (status, body), 0
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_round_trip_matches_local_brightness_within_png_rounding(serve):
    server = serve(build_reward("brightness"))
    images = _images(5)
    remote = HttpReward(server.url, batch_size=2)  # three requests: 2 + 2 + 1
    try:
        scores = remote(images, [f"p{i}" for i in range(5)])
    finally:
        remote.close()
    local = build_reward("brightness")(images, ["p"] * 5)
    assert scores.dtype == torch.float32 and scores.shape == (5,)
    assert (scores - local).abs().max() <= 0.5 / 255 + 1e-6
    assert not torch.equal(scores, scores[:1].expand(5))  # really per-sample


def test_video_round_trip_keeps_frames_per_sample(serve):
    seen = []

    class _Shape(Reward):
        name = "shape"

        def __call__(self, images, prompts):
            seen.append((tuple(images.shape), list(prompts)))
            return build_reward("brightness")(images, prompts)

    server = serve(_Shape())
    video = torch.rand(2, 3, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    video[1] *= 0.1  # second sample much darker
    scores = HttpReward(server.url)(video, ["a", "b"])
    assert seen == [((2, 3, 3, 8, 8), ["a", "b"])]
    local = build_reward("brightness")(video, ["a", "b"])
    assert (scores - local).abs().max() <= 0.5 / 255 + 1e-6


def test_server_error_is_retried_then_succeeds(serve):
    reward = _Flaky(failures=1)
    server = serve(reward)
    scores = HttpReward(server.url, retries=3, backoff_s=0.01)(_images(2), ["a", "b"])
    assert reward.calls == 2
    assert torch.isfinite(scores).all()


def test_server_error_after_all_retries_names_url_and_error(serve):
    server = serve(_Flaky(failures=10))
    with pytest.raises(RewardError) as err:
        HttpReward(server.url, retries=2, backoff_s=0.01)(_images(2), ["a", "b"])
    msg = str(err.value)
    assert server.url in msg and "after 2 tries" in msg and "RuntimeError: model not ready" in msg


def test_unreachable_server_retries_then_clear_error(caplog, monkeypatch):
    port = _free_port()
    reward = HttpReward(f"http://127.0.0.1:{port}", retries=3, backoff_s=0.01)
    slept: list[float] = []  # the waits between tries, read from the code, not the clock
    monkeypatch.setattr("digen.rewards.http.time", SimpleNamespace(sleep=slept.append))
    with caplog.at_level(logging.WARNING, logger="digen.rewards.http"), pytest.raises(RewardError) as err:
        reward(_images(1), ["a"])
    assert slept == [0.01, 0.02]  # backoff_s before the 2nd try, doubled before the 3rd
    assert str(err.value) == (
        f"reward server http://127.0.0.1:{port} is unreachable after 3 tries (connection refused); "
        f"start it with digen reward-server --reward NAME --port {port}"
    )
    assert caplog.text.count("failed") == 3


def test_wrong_number_of_scores_is_a_reward_error(scripted):
    server = scripted(200, {"scores": [1.0]})
    with pytest.raises(RewardError, match="returned 1 scores for 2 samples"):
        HttpReward(_url(server))(_images(2), ["a", "b"])


def test_missing_scores_key_is_a_reward_error(scripted):
    server = scripted(200, {"result": [1.0, 2.0]})
    with pytest.raises(RewardError, match="no 'scores' list"):
        HttpReward(_url(server))(_images(2), ["a", "b"])


def test_client_error_is_not_retried(scripted):
    server = scripted(400, {"error": "bad images"})
    with pytest.raises(RewardError, match=r"rejected the request \(HTTP 400: bad images\)"):
        HttpReward(_url(server), retries=3, backoff_s=0.01)(_images(1), ["a"])
    assert server.requests == 1


def test_5xx_is_retried_exactly_retries_times(scripted):
    server = scripted(503, {"error": "busy"})
    with pytest.raises(RewardError, match=r"failed after 3 tries \(HTTP 503: busy\)"):
        HttpReward(_url(server), retries=3, backoff_s=0.01)(_images(1), ["a"])
    assert server.requests == 3


def test_null_and_nan_scores_become_nan(scripted, serve):
    server = scripted(200, {"scores": [0.5, None]})
    scores = HttpReward(_url(server))(_images(2), ["a", "b"])
    assert scores[0] == 0.5 and torch.isnan(scores[1])

    class _Nan(Reward):
        name = "nan"

        def __call__(self, images, prompts):
            return torch.tensor([1.0, float("nan"), float("inf")])

    scores = HttpReward(serve(_Nan()).url)(_images(3), ["a", "b", "c"])
    assert scores[0] == 1.0 and not torch.isfinite(scores[1:]).any()


def test_non_finite_pixels_score_nan_locally(serve):
    images = _images(2)
    images[0, 1, 2, 3] = float("inf")
    scores = HttpReward(serve(build_reward("brightness")).url)(images, ["a", "b"])
    assert torch.isnan(scores[0]) and torch.isfinite(scores[1])


def test_health(serve):
    reward = HttpReward(serve(build_reward("color", channel="blue")).url)
    assert reward.health() == {"status": "ok", "reward": "color"}
    with pytest.raises(RewardError, match="health check failed"):
        HttpReward(f"http://127.0.0.1:{_free_port()}").health()


def test_http_is_buildable_by_name_and_validates_args():
    reward = build_reward("http", url="http://127.0.0.1:9999/", retries=1, name="pickscore")
    assert reward.url == "http://127.0.0.1:9999" and reward.name == "pickscore"
    with pytest.raises(ConfigError, match="not an http"):
        HttpReward("127.0.0.1:8765")
    with pytest.raises(ConfigError, match="retries"):
        HttpReward("http://127.0.0.1:8765", retries=0)
