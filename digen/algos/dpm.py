"""A deterministic multistep solver for flow-matching rollouts: DPM-Solver++(2M).

In a flow-matching model ``x = (1 - sigma) x0 + sigma x1``; with ``alpha = 1 - sigma`` and
``lambda = log(alpha / sigma)`` the data-prediction DPM-Solver++ second-order multistep update
from ``sigma`` (``s0``) to ``sigma_next`` (``t``), with the previous step's ``sigma_prev``
(``s1``), is

    h = lambda_t - lambda_s0,   h0 = lambda_s0 - lambda_s1,   r0 = h0 / h
    D0 = x0_hat(s0),            D1 = (x0_hat(s0) - x0_hat(s1)) / r0
    x_t = (sigma_t / sigma_s0) x - alpha_t (exp(-h) - 1) D0 - 0.5 alpha_t (exp(-h) - 1) D1

where ``x0_hat(s) = x_s - s v(x_s, s)``. Its first-order form equals the Euler step exactly
for flow matching (``x + (sigma_t - sigma_s0) v``), so the first step (no history) and the
last one (to ``sigma = 0``) are Euler steps, as both peers do:

- NVlabs/DiffusionNFT flow_grpo/diffusers_patch/solver.py ``dpm_step`` and
  ``multistep_dpm_solver_second_order_update`` (@24af555, its ``solver="dpm2"`` rollouts):
  first step and last step first order (DDIM with eta 0, which is Euler here), second order
  in between.
- Tencent-Hunyuan/MixGRPO fastvideo/utils/sampling_utils.py ``dpm_step`` and
  ``multistep_dpm_solver_second_order_update`` with ``dpm_algorithm_type dpmsolver++``,
  ``dpm_solver_type midpoint`` and no noise (@e5cdd6a, the "Flash" variant's steps after the
  SDE window): the history holds the x0 prediction of every earlier step, window steps
  included, so the first step after the window is already second order.

``sigma_prev == 1`` gives ``lambda_s1 = -inf``, ``r0 = inf`` and ``D1 = 0`` (first order),
as the peers' float64 arithmetic does. Coefficients are computed in Python floats (float64),
the update in the sample's precision (:mod:`digen.algos.precision`).
"""

from __future__ import annotations

import math

from torch import Tensor

from digen.algos.precision import compute_dtype
from digen.algos.sde import euler_step
from digen.errors import AlgorithmError


def log_snr(sigma: float) -> float:
    """``lambda = log((1 - sigma) / sigma)``: ``-inf`` at sigma 1, ``inf`` at sigma 0."""
    if not 0.0 <= sigma <= 1.0:
        raise AlgorithmError(f"sigma={sigma} must lie in [0, 1] (a flow-matching sigma)")
    if sigma == 1.0:
        return -math.inf
    if sigma == 0.0:
        return math.inf
    return math.log(1.0 - sigma) - math.log(sigma)


def dpm2_step(
    velocity: Tensor,
    sample: Tensor,
    sigma: float,
    sigma_next: float,
    *,
    prev_x0: Tensor | None = None,
    sigma_prev: float | None = None,
) -> tuple[Tensor, Tensor]:
    """One DPM-Solver++(2M) step ``x_sigma -> x_sigma_next``; also this step's ``x0_hat``
    (the next step's ``prev_x0``).

    velocity, sample: [B, ...]; sigma, sigma_next, sigma_prev: floats (sigma_next < sigma <
    sigma_prev). prev_x0: [B, ...] the previous step's ``x0_hat`` (None: no history, the Euler
    step). A step to ``sigma_next == 0`` is the Euler step (the peers' ``lower_order_final``).
    Returns ``(x_next [B, ...], x0_hat [B, ...])`` in the sample's precision.
    """
    if not sigma_next < sigma:
        raise AlgorithmError(f"dpm2_step needs sigma_next ({sigma_next}) < sigma ({sigma})")
    dtype = compute_dtype(sample)
    x, v = sample.to(dtype), velocity.to(device=sample.device, dtype=dtype)
    x0 = x - sigma * v
    if prev_x0 is None or sigma_prev is None or sigma_next == 0.0:
        return euler_step(v, x, sigma, sigma_next), x0
    if not sigma < sigma_prev:
        raise AlgorithmError(f"dpm2_step needs sigma ({sigma}) < sigma_prev ({sigma_prev})")
    lam_t, lam_s0, lam_s1 = log_snr(sigma_next), log_snr(sigma), log_snr(sigma_prev)
    h, h0 = lam_t - lam_s0, lam_s0 - lam_s1
    inv_r0 = h / h0  # 0 when sigma_prev == 1 (h0 = inf): the first-order update
    c = (1.0 - sigma_next) * (math.exp(-h) - 1.0)
    d1 = inv_r0 * (x0 - prev_x0.to(device=x.device, dtype=dtype))
    x_next = (sigma_next / sigma) * x - c * x0 - 0.5 * c * d1
    return x_next, x0
