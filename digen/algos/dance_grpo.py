"""DanceGRPO: GRPO on DanceGRPO's SDE step, a random subset of the steps per sample.

Peer: XueZeyue/DanceGRPO @15cc71d fastvideo/train_grpo_flux.py ``train_one_step``,
``grpo_one_step`` and ``flux_step`` (``sde_solver=True``).

Rollout: every step is ``x + (s' - s) v + (-eta^2 / 2) score (s' - s) + eta sqrt(s - s')
eps`` with ``score = -(x - x0_hat (1 - s)) / s^2`` (:func:`digen.algos.sde.sde_step`,
``kind: dance``); usually with ``rollout.shared_noise`` (one initial noise per group).
Training: each sample trains ``int((T - 1) * fraction)`` random steps, the last never
(``train.timesteps.strategy: random``), with the clipped loss and no KL; advantages use the
unbiased std and eps 1e-8 (``train.unbiased_std``). The loss is Flow-GRPO's
(:mod:`digen.algos.flow_grpo`): DanceGRPO divides each row by
``gradient_accumulation_steps * train_timesteps``, the mean over its step's rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from digen.algos.flow_grpo import GrpoFamily

if TYPE_CHECKING:
    from digen.config.schema import Config


class DanceGrpo(GrpoFamily):
    name = "dance-grpo"
    title = "DanceGRPO"
    order = 3
    peer = (
        "XueZeyue/DanceGRPO @15cc71d: fastvideo/train_grpo_flux.py train_one_step + grpo_one_step + flux_step"
    )
    summary = "GRPO on DanceGRPO's SDE step, a random subset of each sample's steps, unbiased-std advantages"
    rollout_needs = "dance SDE on all T steps, log-probs of all steps"

    def check(self, cfg: Config) -> list[str]:
        return self._kind_check(cfg, "dance")


ALGORITHM = DanceGrpo()
