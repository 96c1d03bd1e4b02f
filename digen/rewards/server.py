"""Serve any :class:`Reward` over HTTP (the protocol is in :mod:`digen.rewards.http`).

One thread per connection parses and decodes requests; the reward itself runs under a lock,
one call at a time (models on a GPU are not thread-safe), in chunks of at most ``max_batch``
samples. ``digen reward-server`` calls :func:`serve_reward`; tests use :func:`make_server` and
run ``serve_forever`` in a thread.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from digen.errors import ConfigError
from digen.rewards.base import Metadata, Reward, call_reward
from digen.rewards.http import decode_pngs, scores_to_json

log = logging.getLogger(__name__)


class RewardServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that owns one reward. ``server_address[1]`` is the bound port."""

    daemon_threads = True

    def __init__(self, reward: Reward, host: str, port: int, max_batch: int):
        self.reward = reward
        self.max_batch = max_batch
        self.lock = threading.Lock()
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        if isinstance(host, bytes):
            host = host.decode()
        return f"http://{host}:{port}"

    def score(
        self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None = None
    ) -> list[float | None]:
        """Run the reward on ``images`` ``[B, (F,) 3, H, W]`` in chunks of ``max_batch``
        (``metadata``, when the request carries it, goes to the reward with its samples)."""
        out: list[float | None] = []
        for i in range(0, len(prompts), self.max_batch):
            chunk = prompts[i : i + self.max_batch]
            meta = None if metadata is None else metadata[i : i + self.max_batch]
            with self.lock:
                s = call_reward(self.reward, images[i : i + self.max_batch], chunk, meta)
            if tuple(s.shape) != (len(chunk),):
                raise RuntimeError(
                    f"reward '{self.reward.name}' returned shape {tuple(s.shape)} for {len(chunk)} samples"
                )
            out += scores_to_json(s.detach().float().cpu())
        return out


class _BadRequest(Exception):
    """A request that does not follow the protocol (answered 400)."""


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    protocol_version = "HTTP/1.1"
    timeout = 120  # drop idle keep-alive connections

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/health":
            self._reply(200, {"status": "ok", "reward": self.server.reward.name})
        else:
            self._reply(404, {"error": f"no route GET {self.path}; use GET /health or POST /score"})

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/score":
            self._drain()
            self._reply(404, {"error": f"no route POST {self.path}; use POST /score"})
            return
        try:
            images, prompts, metadata = _parse_score_request(self._read_json())
        except _BadRequest as exc:
            self._reply(400, {"error": str(exc)})
            return
        try:
            scores = self.server.score(images, prompts, metadata)
        except Exception as exc:  # the reward failed: tell the client, keep serving
            log.exception("reward '%s' failed on a batch of %d", self.server.reward.name, len(prompts))
            self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self._reply(200, {"scores": scores})

    def _read_json(self) -> Any:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise _BadRequest("missing Content-Length header") from None
        try:
            return json.loads(self.rfile.read(length))
        except ValueError as exc:
            raise _BadRequest(f"body is not JSON ({exc})") from None

    def _drain(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        log.debug("%s - " + format, self.address_string(), *args)


def _parse_score_request(body: Any) -> tuple[torch.Tensor, list[str], Metadata | None]:
    """Protocol body -> (images ``[B, 3, H, W]`` or ``[B, F, 3, H, W]``, B prompts, B metadata
    dicts or None)."""
    if not isinstance(body, dict):
        raise _BadRequest('body must be {"prompts": [...], "images": [...], "frames": F}')
    prompts, encoded, frames = body.get("prompts"), body.get("images"), body.get("frames", 1)
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise _BadRequest("'prompts' must be a list of strings")
    if not isinstance(encoded, list) or not all(isinstance(s, str) for s in encoded):
        raise _BadRequest("'images' must be a list of base64 PNG strings")
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise _BadRequest(f"'frames' must be an integer >= 1, got {frames!r}")
    if not prompts or len(encoded) != len(prompts) * frames:
        raise _BadRequest(
            f"got {len(encoded)} images for {len(prompts)} prompts x {frames} frames; expected one image per "
            "prompt per frame, at least one prompt"
        )
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, list)
        or len(metadata) != len(prompts)
        or not all(isinstance(m, dict) for m in metadata)
    ):
        raise _BadRequest("'metadata' must be a list of one JSON object per prompt")
    try:
        images = decode_pngs(encoded)
    except ValueError as exc:
        raise _BadRequest(str(exc)) from None
    if frames > 1:
        images = images.reshape(len(prompts), frames, *images.shape[1:])
    return images, prompts, metadata


def make_server(
    reward: Reward, host: str = "127.0.0.1", port: int = 8765, *, max_batch: int = 64
) -> RewardServer:
    """Bind a reward server (port 0 picks a free port); call ``serve_forever`` to run it.

    Raises:
        ConfigError: bad ``max_batch`` or the address cannot be bound (port in use).
    """
    if max_batch < 1:
        raise ConfigError(f"reward server max_batch ({max_batch}) must be >= 1")
    try:
        return RewardServer(reward, host, port, max_batch)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve reward on {host}:{port} ({exc.strerror or exc}); choose another port with --port"
        ) from None


def serve_reward(reward: Reward, host: str = "127.0.0.1", port: int = 8765, *, max_batch: int = 64) -> None:
    """Serve ``reward`` until interrupted (Ctrl-C), then close the socket and the reward."""
    server = make_server(reward, host, port, max_batch=max_batch)
    log.info("serving reward '%s' on %s (POST /score, GET /health)", reward.name, server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        log.info("reward server on %s stopping", server.url)
    finally:
        server.server_close()
        reward.close()
