"""digen's reward server spoken to with plain requests (protocol-level checks)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import requests
import torch
from PIL import Image

from digen.errors import ConfigError
from digen.rewards import Reward, build_reward
from digen.rewards.http import decode_pngs, encode_pngs
from digen.rewards.server import make_server


def _png(value: int, size: int = 4) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.full((size, size, 3), value, dtype=np.uint8)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_png_codec_round_trips_uint8_values():
    images = torch.rand(3, 3, 5, 7, generator=torch.Generator().manual_seed(0))
    decoded = decode_pngs(encode_pngs(images))
    assert decoded.shape == images.shape and decoded.dtype == torch.float32
    torch.testing.assert_close(decoded, (images * 255).round() / 255)


def test_health_and_unknown_routes(serve):
    server = serve(build_reward("brightness"))
    assert requests.get(f"{server.url}/health", timeout=5).json() == {"status": "ok", "reward": "brightness"}
    assert requests.get(f"{server.url}/nope", timeout=5).status_code == 404
    assert requests.post(f"{server.url}/nope", json={}, timeout=5).status_code == 404


def test_score_exact_on_constant_pngs(serve):
    server = serve(build_reward("brightness"))
    resp = requests.post(
        f"{server.url}/score", json={"prompts": ["a", "b"], "images": [_png(0), _png(255)]}, timeout=5
    )
    assert resp.status_code == 200
    assert resp.json() == {"scores": [0.0, 1.0]}


def test_server_splits_requests_into_max_batch_chunks(serve):
    sizes = []

    class _Sizes(Reward):
        name = "sizes"

        def __call__(self, images, prompts):
            sizes.append(images.shape[0])
            return torch.arange(len(prompts), dtype=torch.float32)

    server = serve(_Sizes(), max_batch=2)
    resp = requests.post(
        f"{server.url}/score", json={"prompts": list("abcde"), "images": [_png(9)] * 5}, timeout=5
    )
    assert sizes == [2, 2, 1]
    assert resp.json()["scores"] == [0.0, 1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ([1, 2], "body must be"),
        ({"prompts": "a", "images": []}, "'prompts' must be a list"),
        ({"prompts": ["a"], "images": [_png(1)], "frames": 0}, "'frames' must be an integer"),
        ({"prompts": ["a", "b"], "images": [_png(1)]}, "got 1 images for 2 prompts x 1 frames"),
        ({"prompts": ["a"], "images": ["not-base64!"]}, "images[0] is not a base64-encoded image"),
        ({"prompts": ["a", "b"], "images": [_png(1, 4), _png(1, 8)]}, "same size"),
    ],
)
def test_bad_requests_get_400_with_reason(serve, body, needle):
    server = serve(build_reward("brightness"))
    resp = requests.post(f"{server.url}/score", json=body, timeout=5)
    assert resp.status_code == 400
    assert needle in resp.json()["error"]


def test_non_json_body_gets_400(serve):
    server = serve(build_reward("brightness"))
    resp = requests.post(f"{server.url}/score", data=b"{not json", timeout=5)
    assert resp.status_code == 400 and "not JSON" in resp.json()["error"]


def test_reward_returning_wrong_shape_gets_500_and_server_keeps_serving(serve):
    class _Short(Reward):
        name = "short"

        def __call__(self, images, prompts):
            return torch.zeros(1)

    server = serve(_Short())
    body = {"prompts": ["a", "b"], "images": [_png(1), _png(2)]}
    resp = requests.post(f"{server.url}/score", json=body, timeout=5)
    assert resp.status_code == 500 and "returned shape (1,) for 2 samples" in resp.json()["error"]
    assert requests.get(f"{server.url}/health", timeout=5).status_code == 200


def test_port_in_use_is_a_config_error(serve):
    server = serve(build_reward("brightness"))
    with pytest.raises(ConfigError, match=f"cannot serve reward on 127.0.0.1:{server.server_address[1]}"):
        make_server(build_reward("brightness"), "127.0.0.1", server.server_address[1])


class _MetadataEcho(Reward):
    """Scores each sample with its metadata's ``target`` (NaN without metadata)."""

    name = "metadata_echo"

    def __call__(self, images, prompts, metadata=None):
        if metadata is None:
            return torch.full((len(prompts),), float("nan"))
        return torch.tensor([float(m["target"]) for m in metadata])


def test_metadata_travels_from_the_http_client_to_the_servers_reward(serve):
    server = serve(_MetadataEcho(), max_batch=2)
    client = build_reward("http", url=server.url, batch_size=3)
    images = torch.zeros(4, 3, 8, 8)
    meta = [{"target": t, "tag": "x"} for t in (0.5, 1.5, 2.5, 3.5)]
    assert client(images, ["a"] * 4, meta).tolist() == [0.5, 1.5, 2.5, 3.5]
    assert torch.isnan(client(images, ["a"] * 4)).all()  # none sent, none received
    bad = requests.post(
        f"{server.url}/score", json={"prompts": ["a"], "images": encode_pngs(images[:1]), "metadata": [1]}
    )
    assert bad.status_code == 400 and "metadata" in bad.json()["error"]
