"""Random streams derived from (seed, iteration, sample, purpose).

Every random draw digen makes comes from a ``torch.Generator`` seeded from a hash of *what*
it is for, never from a global RNG. A sample's noise therefore does not depend on which
worker generates it, in which micro-batch, or after how many other samples: the distributed
modes reproduce the reference trainer because of this, and resuming needs no RNG state.

:func:`permutation` draws what ``torch.randperm`` draws from such a generator, without torch:
the controller, which imports no torch, plans each iteration's prompts with it (the reference
loop with the same function).
"""

from __future__ import annotations

import hashlib
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from the parts (stable across processes, platforms and Python runs)."""
    text = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & (2**63 - 1)


def generator(*parts: int | str) -> torch.Generator:
    """A CPU generator seeded by :func:`derive_seed` of ``parts``."""
    import torch  # the workers' and the reference loop's; the controller draws with permutation()

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


def permutation(n: int, *parts: int | str) -> list[int]:
    """``torch.randperm(n, generator=generator(*parts)).tolist()``, computed without torch.

    torch's CPU generator is MT19937 seeded with the low 32 bits of the seed
    (``at::mt19937``'s ``init_with_uint32``); ``randperm`` on the CPU swaps position ``i``
    with ``i + random() % (n - i)`` for ``i`` in ``0 .. n-2`` (``randperm_cpu``, for ``n``
    below ``2**32 / 20``). Python's :class:`random.Random` is the same MT19937: given that
    state, ``getrandbits(32)`` is torch's ``random()``. tests/trainer/test_seeding.py checks
    the two agree."""
    if not 0 <= n < 2**32 // 20:
        raise ValueError(f"permutation of n={n}: n must be in [0, {2**32 // 20})")
    state = [derive_seed(*parts) & 0xFFFFFFFF]
    for j in range(1, 624):
        prev = state[-1]
        state.append((1812433253 * (prev ^ (prev >> 30)) + j) & 0xFFFFFFFF)
    mt = random.Random()
    mt.setstate((3, (*state, 624), None))
    out = list(range(n))
    for i in range(n - 1):
        z = i + mt.getrandbits(32) % (n - i)
        out[i], out[z] = out[z], out[i]
    return out
