"""CPS: Flow-GRPO with coefficients-preserving sampling.

Peer: yifan123/flow_grpo @9745241 flow_grpo/diffusers_patch/sd3_sde_with_logprob.py
``sde_step_with_logprob`` with ``sde_type='cps'`` (config/grpo.py ``*_fast_nocfg`` recipes).

Rollout: each step is ``x_{t+1} = x0_hat (1 - s') + x1_hat sqrt(s'^2 - std^2) + std eps`` with
``std = s' sin(a pi / 2)`` (``s'`` the next sigma, ``a = rollout.sde.noise_level``); its
"log-prob" is the unnormalised ``-mean((x_{t+1} - mean)^2)`` (:func:`digen.algos.sde.sde_step`,
``kind: cps``). Training: Flow-GRPO's loss on those log-probs (:mod:`digen.algos.flow_grpo`),
on every step or (``train.timesteps.strategy: window``) the Fast window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from digen.algos.flow_grpo import GrpoFamily

if TYPE_CHECKING:
    from digen.config.schema import Config


class Cps(GrpoFamily):
    name = "cps"
    title = "CPS (coefficients-preserving sampling)"
    order = 2
    peer = "yifan123/flow_grpo @9745241: flow_grpo/diffusers_patch/sd3_sde_with_logprob.py sde_step_with_logprob (sde_type 'cps')"
    summary = "Flow-GRPO with the coefficients-preserving SDE step and its unnormalised log-prob"
    rollout_needs = "CPS steps on all T steps (or the Fast window), log-probs of those steps"

    def check(self, cfg: Config) -> list[str]:
        return self._kind_check(cfg, "cps")


ALGORITHM = Cps()
