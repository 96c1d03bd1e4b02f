"""geneval: the client of Flow-GRPO's GenEval reward server protocol, against a real HTTP server
in this test that speaks that protocol (pickled request and answer on ``POST /``)."""

from __future__ import annotations

import io
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from digen.errors import ConfigError, RewardError
from digen.rewards import build_reward
from digen.rewards.geneval import loads_plain

RAN = []


class _Exploit:
    """Unpickling this would run code (append to RAN): the client must refuse it."""

    def __reduce__(self):
        return (RAN.append, ("ran",))


class GenevalLikeServer(ThreadingHTTPServer):
    """Answers as app_geneval.py does. Its 'detector': a sample's score is the image's mean
    brightness times the number of ``include`` clauses; ``rewards`` is 1 when the tag is
    single_object; ``strict_rewards`` 0.25."""

    requests: list[dict]
    mode = "ok"  # ok | fail | exploit


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        server: GenevalLikeServer = self.server  # type: ignore[assignment]
        data = loads_plain(self.rfile.read(int(self.headers["Content-Length"])))
        server.requests.append(data)
        if server.mode == "fail":
            body, code = b"Traceback: detector crashed", 500
        elif server.mode == "exploit":
            body, code = pickle.dumps({"scores": _Exploit()}), 200
        else:
            means = [
                np.asarray(Image.open(io.BytesIO(b), formats=["jpeg"])).mean() / 255 for b in data["images"]
            ]
            metas = data["meta_datas"]
            answer = {
                "scores": [float(m) * len(meta["include"]) for m, meta in zip(means, metas, strict=True)],
                "rewards": [1.0 if meta["tag"] == "single_object" else 0.0 for meta in metas],
                "strict_rewards": [0.25] * len(metas),
                "group_rewards": {"single_object": [1.0] * len(metas)},
                "group_strict_rewards": {"single_object": [0.0] * len(metas)},
            }
            body, code = pickle.dumps(answer), 200
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server():
    srv = GenevalLikeServer(("127.0.0.1", 0), Handler)
    srv.requests = []
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def _url(srv) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


META = [
    {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
    {
        "tag": "two_object",
        "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}],
        "prompt": "p2",
    },
    {"tag": "counting", "include": [{"class": "cup", "count": 3}], "exclude": [], "prompt": "p3"},
]


def _flat(levels) -> torch.Tensor:
    """Flat-colour images: JPEG keeps a flat colour exactly, so the brightness is known."""
    return torch.stack([torch.full((3, 16, 16), v) for v in levels])


def test_scores_follow_the_protocol_in_order_and_in_batches(server):
    reward = build_reward("geneval", url=_url(server), batch_size=2)
    images = _flat([64 / 255, 128 / 255, 192 / 255])
    scores = reward(images, [m["prompt"] for m in META], META)
    expected = torch.tensor([64 / 255 * 1, 128 / 255 * 2, 192 / 255 * 1])
    torch.testing.assert_close(scores, expected, rtol=0, atol=2 / 255)
    assert [len(r["images"]) for r in server.requests] == [2, 1]
    assert server.requests[0]["meta_datas"] == META[:2] and server.requests[0]["only_strict"] is False
    assert Image.open(io.BytesIO(server.requests[0]["images"][0])).format == "JPEG"
    rewards = build_reward("geneval", url=_url(server), field="rewards")(images, ["a"] * 3, META)
    assert rewards.tolist() == [1.0, 0.0, 0.0]


def test_video_frames_carry_their_metadata_and_average(server):
    reward = build_reward("geneval", url=_url(server))
    video = torch.stack([_flat([0.2, 0.6]), _flat([1.0, 0.0])])  # [2 samples, 2 frames, 3, H, W]
    scores = reward(video, ["a", "b"], META[:2])
    assert server.requests[0]["meta_datas"] == [META[0], META[0], META[1], META[1]]
    torch.testing.assert_close(scores, torch.tensor([0.4 * 1, 0.5 * 2]), rtol=0, atol=2 / 255)


def test_a_nan_sample_scores_nan(server):
    images = _flat([0.5, 0.5, 0.5])
    images[2, 1, 3, 3] = float("nan")
    scores = build_reward("geneval", url=_url(server))(images, ["a"] * 3, META)
    assert torch.isfinite(scores[:2]).all() and torch.isnan(scores[2])


def test_without_metadata_it_says_how_to_get_it(server):
    with pytest.raises(ConfigError, match="train_metadata.jsonl"):
        build_reward("geneval", url=_url(server))(_flat([0.5]), ["a"])


def test_server_error_is_retried_then_reported(server):
    server.mode = "fail"
    reward = build_reward("geneval", url=_url(server), retries=2, backoff_s=0.0)
    with pytest.raises(RewardError, match="failed after 2 tries"):
        reward(_flat([0.5]), ["a"], META[:1])
    assert len(server.requests) == 2


def test_an_answer_that_would_run_code_is_refused_unrun(server):
    server.mode = "exploit"
    with pytest.raises(RewardError, match="not a plain pickled dict"):
        build_reward("geneval", url=_url(server))(_flat([0.5]), ["a"], META[:1])
    assert RAN == []
    with pytest.raises(pickle.UnpicklingError, match="refused global"):
        loads_plain(pickle.dumps(_Exploit()))
    assert RAN == []
