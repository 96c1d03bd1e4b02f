"""A reward scored by a remote server, and the JSON protocol it speaks.

Heavy rewards (PickScore, HPSv2, VLM judges) run in their own process or machine, often in
their own Python environment, behind ``digen reward-server`` (:mod:`digen.rewards.server`).

Protocol (JSON both ways, no pickle):

- ``POST {url}/score`` with ``{"prompts": [B str], "images": [B*F base64 PNG], "frames": F,
  "metadata": [B object] (optional: the prompts' metadata, passed to the server's reward)}``;
  ``frames`` (default 1) is the number of video frames per sample, sample b owning images
  ``b*F .. b*F+F-1`` in order. The server rebuilds ``[B, 3, H, W]`` (F = 1) or
  ``[B, F, 3, H, W]`` and calls its reward, so frames are handled as that reward documents.
- answer ``200 {"scores": [B float|null]}``; ``null`` (or NaN) marks a sample that failed.
- errors: ``400 {"error": msg}`` for a bad request (not retried), ``500 {"error": msg}`` when
  the reward raised (retried, like a refused connection).
- ``GET {url}/health`` -> ``{"status": "ok", "reward": NAME}``.

Images travel as PNGs of the uint8-quantised pixels, so a remote score equals the local one
computed on ``round(x * 255) / 255``.
"""

from __future__ import annotations

import base64
import io
import logging
import math
import time
from typing import Any
from urllib.parse import urlparse

import numpy as np
import requests
import torch
from PIL import Image

from digen.errors import ConfigError, RewardError
from digen.rewards.base import Metadata, Reward, check_batch, finite_rows, flatten_frames, to_uint8
from digen.rewards.registry import register

log = logging.getLogger(__name__)


def encode_pngs(images: torch.Tensor) -> list[str]:
    """``[N, 3, H, W]`` float in ``[0, 1]`` -> N base64 strings of uint8 PNGs."""
    out = []
    for pixels in to_uint8(images):
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
        out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return out


def decode_pngs(encoded: list[str]) -> torch.Tensor:
    """N base64 PNG strings -> float32 ``[N, 3, H, W]`` in ``[0, 1]``.

    Raises:
        ValueError: a string that is not a base64 image, or images of different sizes.
    """
    arrays = []
    for i, s in enumerate(encoded):
        try:
            with Image.open(io.BytesIO(base64.b64decode(s, validate=True))) as img:
                arrays.append(np.asarray(img.convert("RGB")))
        except Exception as exc:  # binascii.Error, PIL.UnidentifiedImageError, ...
            raise ValueError(f"images[{i}] is not a base64-encoded image ({exc})") from None
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise ValueError(f"images must all have the same size, got {sorted(shapes)}")
    batch = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)
    return batch.float().div_(255)


def scores_to_json(scores: torch.Tensor) -> list[float | None]:
    """``[B]`` scores -> JSON-safe list, non-finite values as ``None``."""
    return [v if math.isfinite(v) else None for v in scores.double().tolist()]


@register("http")
class HttpReward(Reward):
    """Scores samples by POSTing them to a reward server (see the module docstring).

    Args:
        url: server base URL, e.g. ``http://127.0.0.1:8765``.
        timeout_s: per-request timeout.
        retries: tries per request (>= 1) on connection errors, timeouts and HTTP 5xx.
        backoff_s: sleep before the 2nd try; doubled before each later one.
        batch_size: samples per request (None: the whole batch in one request).
        name: name for logs and metrics.

    Video ``[B, F, 3, H, W]`` is sent frame by frame with ``frames = F``; the server's reward
    decides how frames combine. Samples with non-finite pixels score NaN.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int | None = None,
        name: str = "http",
    ):
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ConfigError(f"reward url {url!r} is not an http(s) URL; use e.g. http://127.0.0.1:8765")
        if retries < 1:
            raise ConfigError(f"reward retries ({retries}) must be >= 1")
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"reward batch_size ({batch_size}) must be >= 1 or None")
        self.url = url.rstrip("/")
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.batch_size = batch_size
        self.name = name
        self._session = requests.Session()

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None = None
    ) -> torch.Tensor:
        check_batch(images, prompts, metadata)
        b = images.shape[0]
        step = self.batch_size or b
        scores = torch.cat(
            [
                self._score_chunk(
                    images[i : i + step],
                    prompts[i : i + step],
                    None if metadata is None else metadata[i : i + step],
                )
                for i in range(0, b, step)
            ]
        )
        frames, n_frames = flatten_frames(images)
        scores[~finite_rows(frames).reshape(b, n_frames).all(dim=1)] = float("nan")
        return scores

    def health(self) -> dict[str, Any]:
        """``GET /health`` once (no retries); raises :class:`RewardError` when it fails."""
        try:
            resp = self._session.get(f"{self.url}/health", timeout=self.timeout_s)
            resp.raise_for_status()
            return dict(resp.json())
        except (requests.RequestException, ValueError) as exc:
            raise RewardError(
                f"reward server {self.url} health check failed ({_reason(exc)}); {self._fix()}"
            ) from None

    def close(self) -> None:
        self._session.close()

    def _score_chunk(
        self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None
    ) -> torch.Tensor:
        """One request: ``[b, (F,) 3, H, W]`` -> ``[b]`` scores."""
        frames, n_frames = flatten_frames(images)
        payload: dict[str, Any] = {
            "prompts": list(prompts),
            "images": encode_pngs(frames),
            "frames": n_frames,
        }
        if metadata is not None:
            payload["metadata"] = list(metadata)
        return self._scores_from(self._post("/score", json=payload), len(prompts))

    def _scores_from(self, body: Any, n: int) -> torch.Tensor:
        """``{"scores": [n float|null]}`` -> float32 ``[n]`` (null -> NaN)."""
        scores = body.get("scores") if isinstance(body, dict) else None
        if not isinstance(scores, list) or len(scores) != n:
            got = (
                f"{len(scores)} scores"
                if isinstance(scores, list)
                else f"no 'scores' list ({str(body)[:80]})"
            )
            raise RewardError(
                f"reward server {self.url} returned {got} for {n} samples; "
                'the server must answer {"scores": [one float per sample]}'
            )
        try:
            return torch.tensor([math.nan if v is None else float(v) for v in scores], dtype=torch.float32)
        except (TypeError, ValueError):
            raise RewardError(f"reward server {self.url} returned non-numeric scores {scores[:5]}") from None

    def _post(self, path: str, **request: Any) -> Any:
        """POST ``{url}{path}`` with retries (``request``: the body, as ``requests`` takes it);
        returns the body decoded by :meth:`_decode`."""
        failure = ""
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = self._session.post(f"{self.url}{path}", timeout=self.timeout_s, **request)
            except requests.Timeout:
                failure = f"did not answer within {self.timeout_s:g} s after {self.retries} tries; raise timeout_s or lower batch_size"
            except requests.ConnectionError as exc:
                failure = f"is unreachable after {self.retries} tries ({_reason(exc)}); {self._fix()}"
            else:
                if resp.status_code < 500:
                    return self._decode(resp)
                failure = (
                    f"failed after {self.retries} tries (HTTP {resp.status_code}: {_error_text(resp)}); "
                    "check the reward server's log"
                )
            log.warning("reward server %s: try %d/%d failed", self.url, attempt + 1, self.retries)
        raise RewardError(f"reward server {self.url} {failure}")

    def _decode(self, resp: requests.Response) -> Any:
        """A non-5xx answer -> its JSON body; raises :class:`RewardError` on 4xx or bad JSON."""
        if resp.status_code != 200:
            raise RewardError(
                f"reward server {self.url} rejected the request (HTTP {resp.status_code}: {_error_text(resp)}); "
                "check that url points at a digen reward server"
            )
        try:
            return resp.json()
        except ValueError:
            raise RewardError(
                f"reward server {self.url} answered with invalid JSON: {resp.text[:80]!r}"
            ) from None

    def _fix(self) -> str:
        return f"start it with digen reward-server --reward NAME --port {self.port}"


def _reason(exc: BaseException) -> str:
    text = str(exc)
    for needle, reason in (
        ("Connection refused", "connection refused"),
        ("Name or service not known", "unknown host"),
        ("nodename nor servname", "unknown host"),
        ("Connection reset", "connection reset"),
        ("Connection aborted", "connection aborted"),
    ):
        if needle in text:
            return reason
    return type(exc).__name__


def _error_text(resp: requests.Response) -> str:
    try:
        body = resp.json()
        if isinstance(body, dict) and "error" in body:
            return str(body["error"])[:200]
    except ValueError:
        pass
    return resp.text[:200] or resp.reason
