"""Flow-GRPO-Fast: Flow-GRPO with SDE noise only inside a short window of steps.

Peer: yifan123/flow_grpo @9745241 scripts/train_sd3_fast.py and
flow_grpo/diffusers_patch/sd3_pipeline_with_logprob_fast.py (``sde_window_size``,
``sde_window_range``; config/grpo.py ``pickscore_sd3_fast``, ``geneval_sd3_fast_nocfg``).

Rollout: a window of ``train.timesteps.window`` consecutive steps, placed uniformly at random
per iteration (one seeded draw shared by every sample, :func:`digen.algos.flow_grpo.window_steps`),
is SDE; every other step is the deterministic Euler step. Training: every sample trains
exactly the window's steps, with Flow-GRPO's loss (:mod:`digen.algos.flow_grpo`).
Trajectory: as Flow-GRPO's (log-probs NaN outside the window).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from digen.algos.flow_grpo import GrpoFamily

if TYPE_CHECKING:
    from digen.config.schema import Config


class FlowGrpoFast(GrpoFamily):
    name = "flow-grpo-fast"
    title = "Flow-GRPO-Fast"
    order = 1
    peer = (
        "yifan123/flow_grpo @9745241: scripts/train_sd3_fast.py, "
        "flow_grpo/diffusers_patch/sd3_pipeline_with_logprob_fast.py (sde_window_size)"
    )
    summary = "Flow-GRPO trained on a random window of SDE steps, Euler (ODE) steps elsewhere"
    rollout_needs = (
        "SDE in one random window of train.timesteps.window steps, ODE elsewhere; log-probs in the window"
    )

    def check(self, cfg: Config) -> list[str]:
        if cfg.train.algorithm == self.name and cfg.train.timesteps.strategy != "window":
            return [
                f"train.algorithm (flow-grpo-fast) trains a window of SDE steps; set "
                f"train.timesteps.strategy=window (got {cfg.train.timesteps.strategy})"
            ]
        return []


ALGORITHM = FlowGrpoFast()
