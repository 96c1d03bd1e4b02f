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

A server that stops answering trips a circuit breaker (:class:`Breaker`), one per URL shared
by every :class:`HttpReward` of a process and, where a worker loop shares its Redis
(:func:`share_breakers`), by every worker of the cluster: once requests to a URL have failed
for ``down_after_s`` (60 s by default) without one answer, every call fails at once with
:class:`RewardServiceDown` naming the URL, instead of each task on each worker waiting its
own timeouts one after another; one request every ``probe_s`` tests whether the server is back.
A job whose reward server hangs therefore fails within ``down_after_s + timeout_s`` (90 s
with the defaults) plus ``schedule.max_attempts`` immediate failures of a task, not
``timeout_s x retries x max_attempts`` per task in turn.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import threading
import time
from collections.abc import Callable
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

DOWN_AFTER_S = 60.0
"""Seconds of failed requests to a reward server, without one answer, before it is down."""
PROBE_S = 15.0
"""While a server is down, one request every this many seconds tests whether it is back."""


class RewardServiceDown(RewardError):
    """A reward server that has not answered for ``down_after_s``: every call fails at once."""


class Breaker:
    """The state of one reward server URL shared by the :class:`HttpReward` objects of a
    process (see the module docstring). ``clock``: seconds, monotonic (tests pass their own)."""

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic):
        self.url, self.clock = url, clock
        self.failing_since: float | None = None  # when the first failed request of this outage began
        self.down_since: float | None = None
        self.failures = 0
        self.last = ""
        self.next_probe = 0.0
        self.lock = threading.Lock()

    def allow(self) -> bool:
        """May a request go out now? Always while the server is up; while it is down, one
        request (a probe) every ``PROBE_S``."""
        with self.lock:
            if self.down_since is None and not _shared_down(self.url):
                return True
            now = self.clock()
            if now >= self.next_probe:
                self.next_probe = now + PROBE_S
                return True
            return False

    def failed(self, began: float, reason: str, down_after_s: float) -> bool:
        """Record a request that began at ``began`` and failed; True when the server is (now) down."""
        with self.lock:
            now = self.clock()
            if self.failing_since is None:
                self.failing_since = began
            self.failures += 1
            self.last = reason
            if self.down_since is None and now - self.failing_since >= down_after_s:
                self.down_since = now
                self.next_probe = now + PROBE_S
                log.error(
                    "reward server %s has not answered for %.0f s: calls fail at once from now on",
                    self.url,
                    now - self.failing_since,
                )
            down = self.down_since is not None
        if down:
            _share_down(self.url, self.describe())
        return down

    def answered(self) -> None:
        with self.lock:
            was_down = self.down_since is not None
            self.failing_since = self.down_since = None
            self.failures, self.last = 0, ""
        if was_down or _shared_down(self.url):
            log.warning("reward server %s answers again", self.url)
            _share_down(self.url, None)

    def describe(self) -> str:
        """Why the server counts as down (this process's view, else the shared one)."""
        shared = _shared_down(self.url) if self.down_since is None else None
        if shared:
            return shared
        if self.failing_since is not None:
            gone = self.clock() - self.failing_since
            return f"has not answered for {gone:.0f} s ({self.failures} failed requests; last: {self.last})"
        return _shared_down(self.url) or "is down"


_BREAKERS: dict[str, Breaker] = {}
_BREAKERS_LOCK = threading.Lock()
_SHARED: Any = None  # a Redis client (share_breakers), or None


def breaker(url: str) -> Breaker:
    """The process's breaker of ``url``."""
    with _BREAKERS_LOCK:
        if url not in _BREAKERS:
            _BREAKERS[url] = Breaker(url)
        return _BREAKERS[url]


def share_breakers(client: Any) -> None:
    """Share "this reward server is down" through Redis (``client``) with every process of the
    cluster that does the same (worker loops): a server one worker found down fails the others'
    calls at once too. The key (``digen:reward-down:<url>``) expires unless refreshed."""
    global _SHARED
    _SHARED = client


def _down_key(url: str) -> str:
    return f"digen:reward-down:{url}"


def _shared_down(url: str) -> str | None:
    if _SHARED is None:
        return None
    try:
        raw = _SHARED.get(_down_key(url))
        return None if raw is None else str(json.loads(raw).get("why", "is down"))
    except Exception:  # noqa: BLE001 - Redis or junk: fall back to this process's view
        return None


def _share_down(url: str, why: str | None) -> None:
    if _SHARED is None:
        return
    try:
        if why is None:
            _SHARED.delete(_down_key(url))
        else:
            _SHARED.set(_down_key(url), json.dumps({"why": why, "t": time.time()}), ex=int(2 * PROBE_S))
    except Exception:  # noqa: BLE001 - sharing is best effort
        pass


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
        down_after_s: seconds of failed requests without an answer after which the server
            counts as down and every call fails at once (:class:`Breaker`).

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
        down_after_s: float = DOWN_AFTER_S,
    ):
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ConfigError(f"reward url {url!r} is not an http(s) URL; use e.g. http://127.0.0.1:8765")
        try:
            port = parsed.port
        except ValueError:
            port = -1
        if port is not None and not 1 <= port <= 65535:
            raw = parsed.netloc.rsplit(":", 1)[-1]
            raise ConfigError(f"reward url {url!r}: port {raw!r} is not a number from 1 to 65535")
        for key, value in (
            ("timeout_s", timeout_s),
            ("backoff_s", backoff_s),
            ("down_after_s", down_after_s),
        ):
            if not math.isfinite(value) or value < 0 or (value == 0 and key != "backoff_s"):
                raise ConfigError(f"reward {key} ({value}) must be a finite number > 0")
        if retries < 1:
            raise ConfigError(f"reward retries ({retries}) must be >= 1")
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"reward batch_size ({batch_size}) must be >= 1 or None")
        self.url = url.rstrip("/")
        self.port = port or (443 if parsed.scheme == "https" else 80)
        self.down_after_s = float(down_after_s)
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
        returns the body decoded by :meth:`_decode`. A server that has not answered for
        ``down_after_s`` fails the call at once (:class:`RewardServiceDown`)."""
        br = breaker(self.url)
        failure = ""
        for attempt in range(self.retries):
            if not br.allow():
                raise self._down(br)
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            began = br.clock()
            try:
                resp = self._session.post(f"{self.url}{path}", timeout=self.timeout_s, **request)
            except requests.Timeout:
                failure = f"did not answer within {self.timeout_s:g} s after {self.retries} tries; raise timeout_s or lower batch_size"
                reason = f"no answer within {self.timeout_s:g} s"
            except requests.ConnectionError as exc:
                failure = f"is unreachable after {self.retries} tries ({_reason(exc)}); {self._fix()}"
                reason = _reason(exc)
            else:
                if resp.status_code < 500:
                    br.answered()
                    return self._decode(resp)
                br.answered()  # it answers: an error of the reward, not a server that is down
                failure = (
                    f"failed after {self.retries} tries (HTTP {resp.status_code}: {_error_text(resp)}); "
                    "check the reward server's log"
                )
                log.warning("reward server %s: try %d/%d failed", self.url, attempt + 1, self.retries)
                continue
            if br.failed(began, reason, self.down_after_s):
                raise self._down(br)
            log.warning("reward server %s: try %d/%d failed", self.url, attempt + 1, self.retries)
        raise RewardError(f"reward server {self.url} {failure}")

    def _down(self, br: Breaker) -> RewardServiceDown:
        return RewardServiceDown(
            f"reward server {self.url} {br.describe()}; every call to it fails at once until it "
            f"answers again: restart it ({self._fix().removeprefix('start it with ')}) and rerun with --resume"
        )

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
