"""``geneval``: GenEval object/count/colour/position correctness, scored by a GenEval server.

Speaks the protocol of Flow-GRPO's public GenEval reward server (``yifan123/reward-server``,
``app_geneval.py``; client: ``flow_grpo/rewards.py``, ``geneval_score``):

- ``POST {url}/`` with a pickled ``{"images": [B JPEG bytes], "meta_datas": [B dict],
  "only_strict": bool}``; each metadata dict is a GenEval prompt's line of
  ``*_metadata.jsonl`` (``tag``, ``include``, ``exclude``, ``prompt``).
- answer ``200``: a pickled ``{"scores": [B], "rewards": [B], "strict_rewards": [B],
  "group_rewards": {tag: [B]}, "group_strict_rewards": {tag: [B]}}``; ``500``: a traceback.

Flow-GRPO trains on ``scores`` (the fraction of the prompt's requirements met); ``field``
picks ``rewards`` (GenEval's correctness, 0/1) or ``strict_rewards`` instead.

The request is pickled because that server reads nothing else; digen builds it from plain
values only. The answer is decoded by a restricted unpickler that refuses every global
(:func:`loads_plain`), so a server's answer can only ever build dicts, lists, strings and
numbers: no code in it runs. Retries, timeouts and errors are those of the ``http`` reward
(:class:`~digen.rewards.http.HttpReward`). Needs metadata: use ``prompts.dataset`` with a
``train_metadata.jsonl``. Video: every frame is sent with its sample's metadata, the sample
gets the mean over frames.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Literal

import requests
import torch
from PIL import Image

from digen.errors import ConfigError, RewardError
from digen.rewards.base import Metadata, flatten_frames, mean_over_frames, to_uint8
from digen.rewards.http import HttpReward
from digen.rewards.registry import register

Field = Literal["scores", "rewards", "strict_rewards"]


class _PlainUnpickler(pickle.Unpickler):
    """Builds only pickle's built-in values: every class or function lookup is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused global {module}.{name}: only plain values are accepted")


def loads_plain(data: bytes) -> Any:
    """Unpickle ``data`` holding only dicts, lists, tuples, strings, bytes, numbers, bools, None.

    Raises:
        pickle.UnpicklingError: the data names any class or function (nothing is imported or
            called).
    """
    return _PlainUnpickler(io.BytesIO(data)).load()


def encode_jpegs(images: torch.Tensor) -> list[bytes]:
    """``[N, 3, H, W]`` in ``[0, 1]`` -> N JPEG files (PIL's default quality, as Flow-GRPO sends)."""
    out = []
    for pixels in to_uint8(images):
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG")
        out.append(buf.getvalue())
    return out


@register("geneval")
class GenevalReward(HttpReward):
    """GenEval score of each sample from a GenEval reward server.

    Args:
        url: the server, e.g. ``http://127.0.0.1:18085`` (Flow-GRPO's port).
        field: which answer list is the reward: ``scores`` (Flow-GRPO's), ``rewards``,
            ``strict_rewards``.
        only_strict: sent to the server (it then skips the non-strict check; ``rewards`` is 0).
        timeout_s, retries, backoff_s, batch_size: as for the ``http`` reward (Flow-GRPO
            sends batches of 64).
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:18085",
        *,
        field: Field = "scores",
        only_strict: bool = False,
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int | None = 64,
    ):
        if field not in ("scores", "rewards", "strict_rewards"):
            raise ConfigError(f"geneval field ({field!r}) must be one of scores, rewards, strict_rewards")
        super().__init__(
            url,
            timeout_s=timeout_s,
            retries=retries,
            backoff_s=backoff_s,
            batch_size=batch_size,
            name="geneval",
        )
        self.field, self.only_strict = field, bool(only_strict)

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None = None
    ) -> torch.Tensor:
        if metadata is None:
            raise ConfigError(
                "geneval needs each prompt's GenEval metadata; set prompts.dataset to a folder with "
                "train_metadata.jsonl (one {tag, include, prompt, ...} object a line)"
            )
        return super().__call__(images, prompts, metadata)

    def _score_chunk(
        self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None
    ) -> torch.Tensor:
        assert metadata is not None
        frames, n = flatten_frames(images)
        request = {
            "images": encode_jpegs(frames),
            "meta_datas": [dict(m) for m in metadata for _ in range(n)],
            "only_strict": self.only_strict,
        }
        body = self._post(
            "/", data=pickle.dumps(request), headers={"Content-Type": "application/octet-stream"}
        )
        scores = body.get(self.field) if isinstance(body, dict) else None
        return mean_over_frames(self._scores_from({"scores": scores}, frames.shape[0]), n)

    def _decode(self, resp: requests.Response) -> Any:
        if resp.status_code != 200:
            raise RewardError(
                f"GenEval server {self.url} rejected the request (HTTP {resp.status_code}: {resp.text[:200]!r})"
            )
        try:
            return loads_plain(resp.content)
        except Exception as exc:  # UnpicklingError, EOFError, ValueError, ...
            raise RewardError(
                f"GenEval server {self.url} answered with something that is not a plain pickled dict ({exc})"
            ) from None

    def _fix(self) -> str:
        return "start the GenEval reward server (yifan123/reward-server: gunicorn app_geneval:create_app())"
