"""Pure tensor algorithms of GRPO for flow-matching models: SDE steps with log-probs,
group advantages, the clipped policy loss and trained-timestep selection.

Only torch and the standard library: no dask, redis or rq here.
"""

from digen.algos.advantages import Advantages, group_advantages
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
    "kl_to_reference",
    "ppo_clip_loss",
    "sde_step",
    "sde_step_mask",
    "select_timesteps",
]
