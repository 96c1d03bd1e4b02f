"""How often generation waits for the device: a copy between host and device that blocks, or a
device value read as a Python number, makes the host wait until the device has run
everything queued before it, so the host cannot queue step i + 1 while the device runs step i.

No GPU here: the ``meta`` device stands in for it (it holds no values). :class:`HostReads`
answers each read of a meta tensor by the host with zeros and counts it, blocking or queued
(``non_blocking``: on CUDA, a copy to or from pinned memory the host does not wait for).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from digen.algos.registry import algorithm_for
from digen.assembly import build_policy
from digen.config import build_config
from digen.models.base import PromptEmbeds
from digen.rollout import generate_groups
from digen.task_records import GroupTask, TrainSpec
from digen.training import forward_chunks, task_gradient
from tests.conftest import small_config_data

aten = torch.ops.aten


class HostReads(TorchDispatchMode):
    """Counts the copies between the host and the ``meta`` device and the device values read
    as numbers: ``blocking[where]`` and ``queued``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocking: Counter[str] = Counter()
        self.queued = 0

    def _count(self, what: str, non_blocking: bool) -> None:
        if non_blocking:
            self.queued += 1
        else:
            self.blocking[what] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            if dst.device.type == "cpu" and src.device.type == "meta":
                self._count("to the host", non_blocking)
                return dst.zero_()
            if dst.device.type == "meta" and src.device.type == "cpu":
                self._count("to the device", non_blocking)
        if func is aten._to_copy.default:
            src, to = args[0], str(kwargs.get("device", args[0].device))
            if src.device.type == "meta" and to == "cpu":
                self.blocking["to the host"] += 1
                return torch.zeros(src.shape, dtype=kwargs.get("dtype") or src.dtype)
            if src.device.type == "cpu" and to == "meta":
                self._count("to the device", bool(kwargs.get("non_blocking", False)))
        if func is aten._local_scalar_dense.default and args[0].device.type == "meta":
            self.blocking["a number"] += 1
            return 0
        return func(*args, **kwargs)


def _on_meta(policy, embeds: list[PromptEmbeds]) -> list[PromptEmbeds]:
    policy.pipe.to("meta")
    policy.device = torch.device("meta")
    return [
        PromptEmbeds(
            {k: v.to("meta") for k, v in e.tensors.items()}, {k: v.to("meta") for k, v in e.uncond.items()}
        )
        for e in embeds
    ]


@pytest.mark.parametrize("algorithm", ["flow-grpo", "grpo-guard"])
def test_generation_waits_for_the_device_once_per_group_to_decode(tiny_sd3, algorithm):
    """Two groups of one batch, 4 denoising steps: the starting noise, every step's noise and
    every stored latent, log-prob (and, for GRPO-Guard, mean) cross between host and device
    without the host waiting; the only waits left are each group's decode, whose images the
    reward reads (the reward here is a host function)."""
    cfg = build_config(small_config_data(tiny_sd3, train={"algorithm": algorithm}))
    policy = build_policy(cfg, device="cpu")
    prompts = ["a red square", "a blue circle"]
    embeds = [policy.encode_prompts([p], with_uncond=cfg.rollout.guidance_scale > 1.0) for p in prompts]
    embeds = _on_meta(policy, embeds)
    tasks = [GroupTask(0, g, p, tuple(range(4 * g, 4 * g + 4)), 0) for g, p in enumerate(prompts)]
    reads = HostReads()
    with reads:
        out = generate_groups(
            policy, tasks, cfg, lambda images, *_: torch.zeros(images.shape[0]), embeds=embeds
        )
    steps = cfg.rollout.num_steps
    means = 1 if algorithm == "grpo-guard" else 0
    assert [t.latents.shape[1] for t in out] == [steps + 1] * 2
    assert dict(reads.blocking) == {"to the host": len(tasks)}  # each group's decoded images
    # one copy of each group's starting noise, one of each step's noise, and per stored step
    # its latent, its log-prob (and its mean), the starting latent too
    assert reads.queued == len(tasks) + steps + (steps + 1) + steps + means * steps


@pytest.mark.parametrize("algorithm", ["flow-grpo", "grpo-guard"])
def test_a_train_task_waits_for_the_device_once(tiny_sd3, algorithm):
    """A train task of 4 samples x 4 timesteps in one forward per step (no TSP): its rows cross
    to the device without the host waiting, the noiseless-row checks read host values, and the
    task's loss statistics come back in one read after the last backward, not one per forward
    (each of which would keep the host from queuing the next forward behind the backward)."""
    cfg = build_config(small_config_data(tiny_sd3, train={"algorithm": algorithm}))
    policy = build_policy(cfg, device="cpu")
    prompt = "a red square"
    embeds = policy.encode_prompts([prompt], with_uncond=cfg.rollout.guidance_scale > 1.0)
    task = GroupTask(0, 0, prompt, (0, 1, 2, 3), 0)
    (traj,) = generate_groups(
        policy, [task], cfg, lambda images, *_: torch.zeros(images.shape[0]), embeds=[embeds]
    )
    steps = list(range(cfg.rollout.num_steps))
    spec = TrainSpec(0, 0, 0, [0, 1, 2, 3], [0, 1, 2, 3], [1.0, -1.0, 0.5, -0.5], [steps] * 4)
    rows = algorithm_for(cfg).rows(spec, traj.tensors(), cfg)
    (embeds,) = _on_meta(policy, [embeds.repeat_rows(4)])
    reads = HostReads()
    with reads:
        _, stats = task_gradient(policy, rows, embeds, cfg, tsp=False, sigma_max=float(traj.sigmas[1]))
    assert stats.forwards == len(forward_chunks(rows, False, cfg.train.rows_per_forward)) > 1
    assert sum(reads.blocking.values()) == 1, dict(reads.blocking)
