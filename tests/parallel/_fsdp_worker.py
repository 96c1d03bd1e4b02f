"""The FSDP test's problem (shared by the unsharded reference and the spawned ranks) and the
rank entry point. Lives outside the test module so spawned processes import only this."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from digen.config import Config, TrainConfig
from digen.models.base import FlowPolicy, PromptEmbeds
from digen.training import TrainRows, build_rows

RES = 32
STEPS = 4  # denoising steps of the stored trajectories
# Two train tasks of one 4-sample group: (samples, trained steps per sample). Split over 2
# ranks with rows_per_forward 2 they need 2 and 3 forwards (task 0: 4 + 5 rows), so padding
# forwards run; task 1 gives each rank one row.
TASKS: list[tuple[list[int], list[list[int]]]] = [([0, 1, 2], [[0, 1, 2]] * 3), ([3], [[0, 1]])]
OPT_STEPS = 2
# name -> (activation checkpointing, LoRA + KL to the base weights)
PHASES: dict[str, tuple[bool, bool]] = {
    "full": (False, False),
    "full_ckpt": (True, False),
    "lora_kl": (False, True),
}


def make_cfg(kl: bool = False) -> Config:
    """A clip range wide enough that no row sits at the PPO clip boundary, a grad clip low
    enough that clipping is active (the norm is a cross-rank reduction)."""
    return Config(
        model={"path": "tiny (loaded by make_policy)"},
        prompts={"items": ["a red square"]},
        reward=[{"name": "brightness"}],
        train=TrainConfig(
            clip_range=0.5,
            grad_clip=0.002 if kl else 0.05,
            rows_per_forward=2,
            lr=1e-3,
            kl_beta=0.1 if kl else 0.0,
            # an EMA that moves twice a step (one update before it, one after): 4 in OPT_STEPS
            ema={"enabled": True, "every": 1, "micro_batches": 2},
        ),
    )


def make_policy(model: str, lora: bool) -> FlowPolicy:
    from digen.models import load_policy

    policy = load_policy(model, height=RES, width=RES)
    if lora:
        policy.enable_lora(rank=4, alpha=8)
    return policy


def task_rows(data: dict[str, torch.Tensor]) -> list[tuple[TrainRows, PromptEmbeds, float]]:
    """Per task: its rows, its embeddings (one row per sample) and sigma_max."""
    embeds = PromptEmbeds({k[4:]: v for k, v in data.items() if k.startswith("emb/")})
    out = []
    for samples, steps in TASKS:
        keep = torch.tensor(samples)
        rows = build_rows(
            data["latents"][keep], data["log_probs"][keep], data["sigmas"], data["advantages"][keep], steps
        )
        out.append((rows, embeds.repeat_rows(len(samples)), float(data["sigmas"][1])))
    return out


def run_rank(rank: int, world: int, rendezvous: str, model: str, data_file: str, out_dir: str) -> None:
    """One trainer rank: for each of PHASES, shard a fresh policy, train OPT_STEPS steps on
    this rank's share of every task, gather the trained weights on rank 0."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from digen.parallel import ShardedTrainer, shard_rows

    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",  # a file store: no port to race for
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        tasks = task_rows(load_file(data_file))
        for name, (ckpt, lora) in PHASES.items():
            cfg = make_cfg(kl=lora)
            policy = make_policy(model, lora)
            trainer = ShardedTrainer(policy, cfg.train, activation_checkpointing=ckpt)
            norms = []
            for _ in range(OPT_STEPS):
                for rows, embeds, sigma_max in tasks:
                    trainer.accumulate(
                        shard_rows(rows, rank, world), embeds, cfg, tsp=True, sigma_max=sigma_max
                    )
                norms.append(trainer.step()["grad_norm"])
            state = trainer.full_state_dict()
            ema = trainer.ema_state()  # gathered from the ranks' shards
            # a checkpoint's EMA scattered back (here: twice it), gathered again
            trainer.load_ema({k: 2 * v for k, v in ema.items()} if rank == 0 else None)
            again = trainer.ema_state()
            if rank == 0:
                save_file(state, str(Path(out_dir) / f"weights_{name}.safetensors"))
                save_file(ema, str(Path(out_dir) / f"ema_{name}.safetensors"))
                save_file(again, str(Path(out_dir) / f"ema_reloaded_{name}.safetensors"))
                (Path(out_dir) / f"norms_{name}.json").write_text(json.dumps(norms))
            else:
                assert state == {} and ema == {} and again == {}
    finally:
        dist.destroy_process_group()
