"""Random streams derived from (seed, iteration, sample, purpose).

Every random draw digen makes comes from a ``torch.Generator`` seeded from a hash of *what*
it is for, never from a global RNG. A sample's noise therefore does not depend on which
worker generates it, in which micro-batch, or after how many other samples: the distributed
modes reproduce the reference trainer because of this, and resuming needs no RNG state.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from the parts (stable across processes, platforms and Python runs)."""
    text = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & (2**63 - 1)


def generator(*parts: int | str) -> torch.Generator:
    """A CPU generator seeded by :func:`derive_seed` of ``parts``."""
    g = torch.Generator(device="cpu")
    g.manual_seed(derive_seed(*parts))
    return g


def sample_generator(seed: int, iteration: int, sample: int, purpose: str) -> torch.Generator:
    """The stream of one sample of one iteration: ``purpose`` is ``"noise"`` (initial and
    per-step SDE noise) or ``"timesteps"`` (which steps it trains)."""
    return generator(seed, iteration, sample, purpose)


def iteration_generator(seed: int, iteration: int, purpose: str) -> torch.Generator:
    """The stream of one iteration (``"prompts"``: which prompts it draws)."""
    return generator(seed, iteration, purpose)
