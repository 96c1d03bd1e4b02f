"""The training algorithms for flow-matching models and their pure tensor parts: SDE steps
with log-probs, DPM-Solver++(2M), group advantages, the clipped policy loss, trained-timestep
selection; and one module per algorithm (flow_grpo.py, mix_grpo.py, diffusion_nft.py, ...),
found by name in :mod:`digen.algos.registry` (docs/algorithms.md).

Only torch and the standard library: no dask, redis or rq here.
"""

from digen.algos.advantages import Advantages, group_advantages, per_reward_advantages
from digen.algos.loss import LossTerms, ppo_clip_loss
from digen.algos.sde import SDE_KINDS, SdeKind, SdeStep, euler_step, kl_to_reference, sde_step
from digen.algos.timesteps import TIMESTEP_STRATEGIES, TimestepStrategy, sde_step_mask, select_timesteps

__all__ = [
    "SDE_KINDS",
    "TIMESTEP_STRATEGIES",
    "Advantages",
    "LossTerms",
    "SdeKind",
    "SdeStep",
    "TimestepStrategy",
    "euler_step",
    "group_advantages",
    "per_reward_advantages",
    "kl_to_reference",
    "ppo_clip_loss",
    "sde_step",
    "sde_step_mask",
    "select_timesteps",
]
