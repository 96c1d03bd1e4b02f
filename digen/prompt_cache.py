"""The prompt-embedding cache: text-encoder outputs computed once per distinct prompt.

Prompts recur every epoch, and at every train task of their group, yet the text encoders are
frozen: their outputs for one prompt never change during a job. Each worker keeps one
:class:`EmbedCache` beside its policy, and generation, training and evaluation all read it,
so a prompt is encoded once per worker while it stays in the cache.

- **Key.** ``(prompt, with_uncond)`` under the encoder's identity (:func:`encoder_identity`:
  the family, each text encoder's class, checkpoint name, dtype and device, and
  ``max_sequence_length``). A cache belongs to one policy; the identity is part of every
  key so that an entry can never serve a policy that encodes differently.
- **Bits.** An entry is the very :meth:`~digen.models.base.FlowPolicy.encode_prompts` output
  of that prompt alone, so a hit returns what a fresh encoding returns, bit for bit
  (tests/models/test_prompt_cache.py).
- **Memory.** The entries' bytes are capped (``model.embed_cache_mib``); past the cap the
  least recently used entries go. The unconditional (empty-prompt) embeddings CFG adds are
  the same for every prompt: entries share one copy of them, counted once.
- **Counts.** Hits and misses since the worker started (:attr:`EmbedCache.hits`,
  :attr:`EmbedCache.misses`); a worker reports them on its task events and the iteration's
  metrics row sums them (``embed_cache_hits``, ``embed_cache_misses``,
  ``embed_cache_hit_rate``: :func:`digen.iteration.cache_metrics`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from digen.models.base import FlowPolicy, PromptEmbeds

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
"""The pipeline components that encode prompts (diffusers' names)."""


def encoder_identity(policy: FlowPolicy) -> tuple[Any, ...]:
    """What makes two policies encode a prompt alike: the family, each text encoder's class,
    checkpoint name (``config._name_or_path``), dtype and device, and ``max_sequence_length``."""
    pipe = getattr(policy, "pipe", None)
    parts: list[Any] = [policy.family, type(policy).__name__, getattr(policy, "max_sequence_length", None)]
    for name in TEXT_ENCODERS:
        enc = getattr(pipe, name, None)
        if enc is None:
            continue
        first = next(iter(enc.parameters()), None)
        dtype = str(first.dtype) if first is not None else None
        device = str(first.device) if first is not None else None
        path = getattr(getattr(enc, "config", None), "_name_or_path", None)
        parts.append((name, type(enc).__name__, path, dtype, device))
    return tuple(parts)


def embeds_bytes(embeds: PromptEmbeds, shared: PromptEmbeds | None = None) -> int:
    """Bytes of ``embeds``' tensors, leaving out those it shares with ``shared`` (the one
    copy of the unconditional embeddings)."""
    seen = {id(t) for t in shared.uncond.values()} if shared is not None else set()
    tensors = [*embeds.tensors.values(), *embeds.uncond.values()]
    return sum(t.numel() * t.element_size() for t in tensors if id(t) not in seen)


class EmbedCache:
    """Prompt embeddings of one policy's frozen text encoders, least recently used first out
    past ``max_bytes`` (None: unbounded; 0: nothing kept). ``cache(prompt)`` is the
    :class:`PromptEmbeds` of ``[prompt]`` (with CFG's unconditional rows when ``with_uncond``)."""

    def __init__(self, policy: FlowPolicy, with_uncond: bool, max_bytes: int | None = None):
        self.policy, self.with_uncond, self.max_bytes = policy, with_uncond, max_bytes
        self.identity = encoder_identity(policy)
        self._entries: OrderedDict[tuple[Any, ...], tuple[PromptEmbeds, int]] = OrderedDict()
        self._uncond: PromptEmbeds | None = None
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._reported = (0, 0)

    @classmethod
    def for_config(cls, policy: FlowPolicy, cfg) -> EmbedCache:
        """The cache a worker of ``cfg`` keeps: CFG's unconditional rows when
        ``rollout.guidance_scale > 1``, capped at ``model.embed_cache_mib``."""
        cap = int(cfg.model.embed_cache_mib * 2**20)
        return cls(policy, cfg.rollout.guidance_scale > 1.0, max_bytes=cap)

    def key(self, prompt: str) -> tuple[Any, ...]:
        return (prompt, self.with_uncond, self.identity)

    def __call__(self, prompt: str) -> PromptEmbeds:
        key = self.key(prompt)
        found = self._entries.get(key)
        if found is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            return found[0]
        self.misses += 1
        embeds = self._share_uncond(self.policy.encode_prompts([prompt], with_uncond=self.with_uncond))
        size = embeds_bytes(embeds, self._uncond)
        if self.max_bytes is None or size <= self.max_bytes:
            self._entries[key] = (embeds, size)
            self.bytes += size
            self._evict()
        return embeds

    def many(self, prompts: list[str]) -> list[PromptEmbeds]:
        """Each prompt's embeddings, in order (a batched generation or train task's groups,
        an evaluation chunk)."""
        return [self(p) for p in prompts]

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "entries": len(self._entries), "bytes": self.bytes}

    def report(self) -> dict[str, int]:
        """``{"embed_hits", "embed_misses"}`` since the last report (what a task's last
        timeline event carries); empty when there were none."""
        hits, misses = self.hits - self._reported[0], self.misses - self._reported[1]
        self._reported = (self.hits, self.misses)
        return {"embed_hits": hits, "embed_misses": misses} if hits or misses else {}

    def _share_uncond(self, embeds: PromptEmbeds) -> PromptEmbeds:
        """``embeds`` with its unconditional rows replaced by the one shared copy when they are
        equal to it (they are: the empty prompt encodes alike every time), so an entry's
        bytes are its own prompt's."""
        if not embeds.uncond:
            return embeds
        if self._uncond is None:
            if self.max_bytes != 0:  # the one copy, kept (and counted) from now on
                self._uncond = embeds
                self.bytes += embeds_bytes(PromptEmbeds({}, embeds.uncond))
            return embeds
        shared = self._uncond.uncond
        same = shared.keys() == embeds.uncond.keys() and all(
            shared[k].shape == v.shape and shared[k].dtype == v.dtype and torch.equal(shared[k], v)
            for k, v in embeds.uncond.items()
        )
        return PromptEmbeds(embeds.tensors, dict(shared)) if same else embeds

    def _evict(self) -> None:
        while self.max_bytes is not None and self.bytes > self.max_bytes and self._entries:
            _, (_, size) = self._entries.popitem(last=False)
            self.bytes -= size
