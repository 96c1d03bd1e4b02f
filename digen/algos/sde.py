"""One stochastic denoising step of a flow-matching model, with the log-prob of its result.

Three step kinds, exactly as docs/algorithms.md writes them:

- ``"sde"``   Flow-GRPO: ``std_dev_t = a * sqrt(sigma / (1 - sigma_safe))``, Gaussian log density;
- ``"cps"``   coefficients-preserving sampling: ``std = sigma_next * sin(a * pi / 2)``,
              unnormalised log-prob ``-(x_next - mean)**2``;
- ``"dance"`` DanceGRPO: constant ``std_dev_t = eta``, Gaussian log density.

Shapes: ``sample, velocity: [B, ...]`` (any trailing shape); ``sigma, sigma_next``: a python
float, a 0-d tensor or a ``[B]`` tensor (one timestep per row, as time-step parallelism packs
rows at different timesteps). All the math runs in float32 (float64 when ``sample`` is
float64: :mod:`digen.algos.precision`). ``log_prob`` is the MEAN over the
non-batch elements, not the sum (this is why clip ranges are ~1e-4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from digen.algos.precision import at_least_float32, compute_dtype
from digen.errors import AlgorithmError

SdeKind = Literal["sde", "cps", "dance"]
SDE_KINDS: tuple[str, ...] = ("sde", "cps", "dance")

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))

Sigma = float | Tensor


@dataclass(frozen=True)
class SdeStep:
    """The result of one step.

    prev_sample: [B, ...] float32, x_{t+1} (drawn, or the given one when re-scoring).
    log_prob: [B] float32, per-element mean log-prob of ``prev_sample`` (NaN for a
        noiseless "sde"/"dance" step, where the density is undefined).
    mean: [B, ...] float32, the transition mean (carries the gradient of ``velocity``).
    std: [B] float32, the kind's ``std_dev_t`` (the one the KL term divides by).
    transition_std: [B] float32, the std of x_{t+1} given x_t used in the log-prob
        (``std_dev_t * sqrt(-dt)`` for "sde"/"dance", ``std`` itself for "cps").
    """

    prev_sample: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor
    transition_std: Tensor


def _per_sample(
    value: Sigma, batch: int, ndim: int, device: torch.device, name: str, dtype: torch.dtype = torch.float32
) -> Tensor:
    """A scalar or ``[B]`` value as a ``dtype`` column ``[B, 1, ..., 1]`` with ``ndim`` dims (a
    host tensor crosses to ``device`` without the host waiting: :mod:`digen.algos.rows`)."""
    if isinstance(value, Tensor):
        t = value.to(device=device, dtype=dtype, non_blocking=True)
    else:
        t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.numel() == 1:
        t = t.reshape(1).expand(batch)
    elif t.numel() == batch and all(d == 1 for d in t.shape[1:]) and t.shape[0] == batch:
        t = t.reshape(batch)
    else:
        raise AlgorithmError(
            f"{name} has shape {tuple(t.shape)} but the batch has {batch} rows; "
            f"pass a float, a 0-d tensor or a [{batch}] tensor"
        )
    return t.reshape(batch, *([1] * (ndim - 1)))


def _rows_mean(x: Tensor) -> Tensor:
    """[B, ...] -> [B]: mean over every non-batch element."""
    return x.reshape(x.shape[0], -1).mean(dim=1)


def euler_step(velocity: Tensor, sample: Tensor, sigma: Sigma, sigma_next: Sigma) -> Tensor:
    """The deterministic ODE step ``x + v * (sigma_next - sigma)``: [B, ...] float32."""
    x, v = _as_float32_pair(velocity, sample)
    sig = _per_sample(sigma, x.shape[0], x.ndim, x.device, "sigma", x.dtype)
    sig_next = _per_sample(sigma_next, x.shape[0], x.ndim, x.device, "sigma_next", x.dtype)
    return x + v * (sig_next - sig)


def sde_step(
    velocity: Tensor,
    sample: Tensor,
    sigma: Sigma,
    sigma_next: Sigma,
    *,
    kind: SdeKind = "sde",
    noise_level: float = 0.7,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
    sigma_max: float | None = None,
) -> SdeStep:
    """One step x_t -> x_{t+1} of ``kind`` and the log-prob of x_{t+1}.

    velocity, sample: [B, ...]; sigma, sigma_next: float or [B] (sigma_next < sigma).
    noise_level: ``a`` for "sde"/"cps", ``eta`` for "dance"; 0 gives the plain Euler step
        for "sde"/"dance" (log_prob NaN: a zero-width Gaussian has no density).
    prev_sample: [B, ...] x_{t+1} to re-score (training) instead of drawing a new one.
    noise: [B, ...] the standard-normal eps to use; else drawn with ``generator`` (on the
        generator's device, then moved to ``sample.device``).
    sigma_max: the schedule's s[1], used by "sde" in place of sigma == 1 in the denominator.
    """
    if kind not in SDE_KINDS:
        raise AlgorithmError(f"kind={kind!r} is not a step kind; use one of {', '.join(SDE_KINDS)}")
    if not math.isfinite(noise_level) or noise_level < 0:
        raise AlgorithmError(f"noise_level={noise_level} must be a finite number >= 0")
    x, v = _as_float32_pair(velocity, sample)
    batch = x.shape[0]
    sig = _per_sample(sigma, batch, x.ndim, x.device, "sigma", x.dtype)
    sig_next = _per_sample(sigma_next, batch, x.ndim, x.device, "sigma_next", x.dtype)
    dt = sig_next - sig

    if kind != "cps" and noise_level == 0:
        mean = x + v * dt
        zeros = torch.zeros(batch, dtype=x.dtype, device=x.device)
        x_next = mean if prev_sample is None else _match(prev_sample, x, "prev_sample")
        nan = torch.full((batch,), float("nan"), dtype=x.dtype, device=x.device)
        return SdeStep(x_next, nan, mean, zeros, zeros)

    if kind == "cps":
        mean, std_dev_t, s_t = _cps_moments(x, v, sig, sig_next, noise_level)
    else:
        _check_sigmas(kind, sigma, sigma_next, sig, sig_next, sigma_max)
        if kind == "sde":
            std_dev_t = _flow_grpo_std(sig, noise_level, sigma_max)
        else:
            std_dev_t = torch.full_like(sig, noise_level)
        mean = x + v * dt + (std_dev_t**2 / (2 * sig)) * (x + (1 - sig) * v) * dt
        s_t = std_dev_t * torch.sqrt(-dt)

    if prev_sample is not None:
        x_next = _match(prev_sample, x, "prev_sample")
    else:
        eps = _standard_normal(x, noise, generator)
        x_next = mean + s_t * eps

    diff = x_next.detach() - mean
    if kind == "cps":
        log_prob = _rows_mean(-(diff**2))
    else:
        log_prob = _rows_mean(-(diff**2) / (2 * s_t**2) - torch.log(s_t) - _LOG_SQRT_2PI)
    return SdeStep(x_next, log_prob, mean, std_dev_t.reshape(batch), s_t.reshape(batch))


def kl_to_reference(mean: Tensor, ref_mean: Tensor, std_dev_t: Sigma) -> Tensor:
    """KL of the policy's step to the reference policy's step: [B].

    mean, ref_mean: [B, ...] transition means of the policy and of the reference (base
    weights); std_dev_t: float or [B], the ``SdeStep.std`` of the step. Returns the mean over
    non-batch elements of ``(mean - ref_mean)**2 / (2 * std_dev_t**2)`` (inf/NaN when
    std_dev_t is 0, i.e. a noiseless step).
    """
    m, ref = at_least_float32(mean), at_least_float32(ref_mean)
    if m.shape != ref.shape or m.ndim == 0:
        raise AlgorithmError(
            f"mean {tuple(m.shape)} and ref_mean {tuple(ref.shape)} must have the same [B, ...] shape"
        )
    std = _per_sample(std_dev_t, m.shape[0], m.ndim, m.device, "std_dev_t", m.dtype)
    return _rows_mean((m - ref) ** 2 / (2 * std**2))


def _on_host(value: Sigma, like: Tensor) -> Tensor | None:
    """``value`` (a float, or a ``[B]`` tensor) as a 1-D ``like.dtype`` tensor on the host, to
    check without waiting for the device; None for a tensor on another device (a check would
    read it back)."""
    if isinstance(value, Tensor) and value.device.type != "cpu":
        return None
    return torch.as_tensor(value, dtype=like.dtype).reshape(-1)


def _check_sigmas(
    kind: str, sigma: Sigma, sigma_next: Sigma, sig: Tensor, sig_next: Tensor, sigma_max: float | None
) -> None:
    """Refuse what an "sde"/"dance" step cannot take: ``sigma_next >= sigma``, and for "sde" a
    sigma outside (0, 1], or sigma == 1 without a valid ``sigma_max``. Checked on the host
    values when ``sigma`` and ``sigma_next`` are floats or CPU tensors (the rollout's floats, a
    training chunk's rows): no wait for the device; a device tensor costs one read-back for all
    the checks together. The same dtype as the step (``sig``), so the same verdicts."""
    hs, hn = _on_host(sigma, sig), _on_host(sigma_next, sig)
    if hs is not None and hn is not None:
        backwards, outside, at_one = (
            bool((hn - hs >= 0).any()),
            bool(((hs <= 0) | (hs > 1)).any()),
            bool((hs == 1).any()),
        )
    else:
        dt = sig_next - sig
        flags = torch.stack([(dt >= 0).any(), ((sig <= 0) | (sig > 1)).any(), (sig == 1).any()])
        backwards, outside, at_one = (bool(f) for f in flags.tolist())
    if backwards:
        raise AlgorithmError(f"kind={kind!r} needs sigma_next < sigma (denoising goes towards 0)")
    if kind != "sde":
        return
    if outside:
        raise AlgorithmError("kind='sde' needs 0 < sigma <= 1 (a flow-matching sigma)")
    if at_one:
        if sigma_max is None:
            raise AlgorithmError(
                "kind='sde' at sigma == 1 divides by 1 - sigma; pass sigma_max=<the schedule's s[1]> "
                "(Flow-GRPO uses it in the denominator)"
            )
        if not 0 < sigma_max < 1:
            raise AlgorithmError(f"sigma_max={sigma_max} must be in (0, 1): it is the schedule's s[1]")


def _flow_grpo_std(sig: Tensor, a: float, sigma_max: float | None) -> Tensor:
    """Flow-GRPO's ``a * sqrt(sigma / (1 - sigma_safe))``, sigma_safe = sigma_max where sigma
    == 1 (``sig`` checked by :func:`_check_sigmas`)."""
    safe = torch.where(sig == 1, torch.full_like(sig, sigma_max or 0.0), sig)
    return a * torch.sqrt(sig / (1 - safe))


def _cps_moments(
    x: Tensor, v: Tensor, sig: Tensor, sig_next: Tensor, a: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Coefficients-preserving step: (mean [B, ...], std [B, 1..], std [B, 1..])."""
    std = sig_next * math.sin(a * math.pi / 2)
    x0_hat = x - sig * v
    x1_hat = x + (1 - sig) * v
    # sigma_next**2 - std**2 = (sigma_next * cos(a*pi/2))**2 >= 0; clamp only float round-off.
    mean = x0_hat * (1 - sig_next) + x1_hat * torch.sqrt((sig_next**2 - std**2).clamp(min=0))
    return mean, std, std


def _as_float32_pair(velocity: Tensor, sample: Tensor) -> tuple[Tensor, Tensor]:
    """(sample, velocity) as float32 (float64 if ``sample`` is), checked to share one [B, ...] shape."""
    if velocity.shape != sample.shape or sample.ndim == 0:
        raise AlgorithmError(
            f"velocity {tuple(velocity.shape)} and sample {tuple(sample.shape)} must have the same [B, ...] shape"
        )
    dtype = compute_dtype(sample)
    return sample.to(dtype), velocity.to(device=sample.device, dtype=dtype)


def _match(t: Tensor, like: Tensor, name: str) -> Tensor:
    """``t`` in ``like``'s dtype and on its device, checked to have ``like``'s shape."""
    if t.shape != like.shape:
        raise AlgorithmError(f"{name} has shape {tuple(t.shape)}; it must match sample {tuple(like.shape)}")
    return t.to(device=like.device, dtype=like.dtype)


def _standard_normal(like: Tensor, noise: Tensor | None, generator: torch.Generator | None) -> Tensor:
    """eps ~ N(0, I) shaped like ``like``: the given ``noise``, or drawn from ``generator``."""
    if noise is not None:
        return _match(noise, like, "noise")
    device = generator.device if generator is not None else like.device
    eps = torch.randn(like.shape, generator=generator, dtype=torch.float32, device=device)
    return eps.to(device=like.device, dtype=like.dtype)
