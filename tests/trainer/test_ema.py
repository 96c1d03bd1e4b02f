"""The EMA of the trained tensors against the peers' own code, restated here.

Flow-GRPO (yifan123/flow_grpo 9745241): flow_grpo/ema.py ``EMAModuleWrapper`` (decay warm-up
``min((1 + n) / (10 + n), decay)``, an update when ``(n + 1) % update_step_interval == 0``),
stepped once per micro-batch by scripts/train_sd3.py l.959-960 with ``global_step`` (the
optimizer steps so far, counted at a step's last micro-batch), decay 0.9, interval 8.
DanceGRPO (XueZeyue/DanceGRPO 15cc71d): fastvideo/train_grpo_flux.py ``FSDP_EMA.update``,
``ema = decay * ema + (1 - decay) * w`` once per rollout batch (l.866-867), decay 0.995.
The weights each peer averages are digen's own trajectory (recorded step by step), so the
comparison is of the averaging alone, tensor by tensor.
"""

from __future__ import annotations

import pytest
import torch

from digen.config import TrainConfig
from digen.optim import ParameterStore


class FlowGrpoEma:
    """flow_grpo/ema.py, restated (the parts train_sd3.py uses)."""

    def __init__(self, parameters, decay=0.9, update_step_interval=8):
        self.ema_parameters = [p.clone().detach() for p in parameters]
        self.decay, self.update_step_interval = decay, update_step_interval

    def get_current_decay(self, optimization_step):
        return min((1 + optimization_step) / (10 + optimization_step), self.decay)

    def step(self, parameters, optimization_step):
        one_minus_decay = 1 - self.get_current_decay(optimization_step)
        if (optimization_step + 1) % self.update_step_interval == 0:
            for ema_parameter, parameter in zip(self.ema_parameters, parameters, strict=True):
                ema_parameter.add_(one_minus_decay * (parameter - ema_parameter))


def _run(train: TrainConfig, steps: int, steps_per_iteration: int):
    """digen's store over ``steps`` optimizer steps; the weights after each, and its EMA."""
    gen = torch.Generator().manual_seed(0)
    weights = {"a": torch.randn(3, 4, generator=gen), "b": torch.randn(5, generator=gen)}
    store = ParameterStore(weights, train)
    trajectory = [store.trained()]
    for s in range(steps):
        grad = {k: torch.randn(v.shape, generator=gen) for k, v in weights.items()}
        store.step(grad, rows=1, last_of_iteration=(s + 1) % steps_per_iteration == 0)
        trajectory.append(store.trained())
    return trajectory, store.ema


@pytest.mark.parametrize("micro_batches", [1, 2, 6])
def test_ema_equals_flow_grpo_s(micro_batches):
    train = TrainConfig(lr=0.05, ema={"enabled": True, "micro_batches": micro_batches})  # decay 0.9, every 8
    trajectory, ours = _run(train, steps=80, steps_per_iteration=2)
    names = sorted(trajectory[0])
    peer = FlowGrpoEma([trajectory[0][k] for k in names], decay=0.9, update_step_interval=8)
    global_step = 0
    for _ in range(80):  # train_sd3.py: the micro-batches of each optimizer step
        for j in range(micro_batches):
            if j == micro_batches - 1:  # accelerator.sync_gradients: the step, global_step += 1
                global_step += 1
            params = trajectory[global_step]
            peer.step([params[k] for k in names], global_step)
    for k, theirs in zip(names, peer.ema_parameters, strict=True):
        torch.testing.assert_close(ours[k], theirs, rtol=0, atol=1e-6)


def test_flow_grpo_s_warm_up_forgets_the_start():
    """After 80 optimizer steps (2 micro-batches each) Flow-GRPO's EMA keeps 0.5% of the initial
    weights; the fixed 0.9 every 8 steps that digen used to run kept 0.9 ** 10 = 35%."""
    start = torch.ones(1)
    peer = FlowGrpoEma([start])
    global_step = 0
    for _ in range(80):
        for j in range(2):
            global_step += j == 1
            peer.step([torch.zeros(1)], global_step)
    kept = float(peer.ema_parameters[0])
    assert 0.004 < kept < 0.006 and abs(0.9**10 - 0.349) < 1e-3
    train = TrainConfig(ema={"enabled": True, "micro_batches": 2})
    store = ParameterStore({"w": start}, train)
    for _ in range(80):  # weights held at 0 after the first step: the EMA's share of the start
        store.params["w"].data.zero_()
        store.step({"w": torch.zeros(1)}, rows=1)
    assert abs(float(store.ema["w"]) - kept) < 1e-7


def test_ema_equals_dance_grpo_s():
    train = TrainConfig(
        lr=0.05, ema={"enabled": True, "decay": 0.995, "warmup": False, "update": "iteration"}
    )
    trajectory, ours = _run(train, steps=30, steps_per_iteration=3)
    theirs = {k: v.clone() for k, v in trajectory[0].items()}
    for it in range(10):  # FSDP_EMA.update after train_one_step's optimizer steps
        model_state_dict = trajectory[3 * (it + 1)]
        for key in theirs:
            theirs[key].copy_(0.995 * theirs[key] + (1 - 0.995) * model_state_dict[key])
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("world", [2, 3])
def test_the_ema_of_shards_is_the_shards_of_the_ema(world):
    """What each FSDP rank computes (digen.parallel.fsdp.ShardedTrainer: the rule over its
    dim-0 shards, torch.chunk's split) put together is the replicated store's EMA, bit for bit,
    for the same weights: the update is elementwise."""
    from digen.optim import ema_after_step, ema_before_step

    train = TrainConfig(lr=0.05, ema={"enabled": True, "every": 1, "micro_batches": 2})
    trajectory, whole = _run(train, steps=6, steps_per_iteration=2)
    shards = [{k: torch.chunk(v, world)[r].clone() for k, v in trajectory[0].items()} for r in range(world)]
    for n in range(6):  # the store's step from version n: before it (weights n), after (n + 1)
        for r in range(world):
            ema_before_step(
                train.ema, shards[r], {k: torch.chunk(v, world)[r] for k, v in trajectory[n].items()}, n
            )
            after = {k: torch.chunk(v, world)[r] for k, v in trajectory[n + 1].items()}
            ema_after_step(train.ema, shards[r], after, n + 1, (n + 1) % 2 == 0)
    for k, v in whole.items():
        assert torch.equal(torch.cat([shards[r][k] for r in range(world)]), v), k
    assert not torch.equal(whole["a"], trajectory[0]["a"]) and not torch.equal(
        whole["a"], trajectory[-1]["a"]
    )
