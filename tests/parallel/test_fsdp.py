"""FSDP2-sharded full fine-tuning on 2 gloo ranks equals digen's unsharded update."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from digen.algos.sde import sde_step  # noqa: E402
from digen.models import FlowPolicy, make_tiny_model  # noqa: E402
from digen.optim import ParameterStore  # noqa: E402
from digen.parallel import shard_rows  # noqa: E402
from digen.training import build_rows, sum_gradients, task_gradient  # noqa: E402

from . import _fsdp_worker as w  # noqa: E402

torch.set_num_threads(1)
WORLD = 2


def _trajectories(policy: FlowPolicy) -> dict[str, torch.Tensor]:
    """A 4-sample group generated with the policy's SDE: latents ``[4, T+1, C, h, w]``,
    behaviour log-probs ``[4, T]``, sigmas ``[T+1]``, advantages ``[4]``, prompt embeds."""
    gen = torch.Generator().manual_seed(0)
    embeds = policy.encode_prompts(["a red square"], with_uncond=False)
    sigmas = policy.sigmas(w.STEPS)
    x = torch.stack([policy.initial_noise(gen) for _ in range(4)])
    lat, logp = [x], []
    cfg = w.make_cfg()
    with torch.no_grad():
        for j in range(w.STEPS):
            v = policy.velocity(x, sigmas[j].expand(4), embeds.repeat_rows(4), 1.0)
            step = sde_step(
                v,
                x,
                sigmas[j],
                sigmas[j + 1],
                kind="sde",
                noise_level=cfg.rollout.sde.noise_level,
                generator=gen,
                sigma_max=float(sigmas[1]),
            )
            x = step.prev_sample
            lat.append(x)
            logp.append(step.log_prob)
    return {
        "latents": torch.stack(lat, 1).contiguous(),
        "log_probs": torch.stack(logp, 1).contiguous(),
        "sigmas": sigmas.contiguous(),
        "advantages": torch.tensor([1.0, -0.5, 0.8, -1.3]),
        **{f"emb/{k}": v.contiguous() for k, v in embeds.tensors.items()},
    }


def _unsharded(
    policy: FlowPolicy, data: dict[str, torch.Tensor], *, kl: bool
) -> tuple[dict[str, torch.Tensor], list[float], dict[str, torch.Tensor]]:
    """digen's single-process update: ParameterStore.step on the sum of the task gradients;
    the weights, the norms and the store's EMA."""
    cfg = w.make_cfg(kl=kl)
    store = ParameterStore(policy.trainable_state_dict(), cfg.train)
    norms = []
    for _ in range(w.OPT_STEPS):
        parts, rows = [], 0
        for task, embeds, sigma_max in w.task_rows(data):
            grad, stats = task_gradient(policy, task, embeds, cfg, tsp=True, sigma_max=sigma_max)
            parts.append(grad)
            rows += stats.rows
        norms.append(store.step(sum_gradients(parts), rows)["grad_norm"])
        policy.load_trainable_state_dict(store.weights())
    assert store.ema is not None
    return store.weights(), norms, store.ema


def _spawn_ranks(model: Path, data_file: Path, out: Path, timeout_s: float = 150.0) -> None:
    ctx = mp.start_processes(
        w.run_rank,
        args=(WORLD, str(out / "rendezvous"), str(model), str(data_file), str(out)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"sharded ranks still running after {timeout_s:.0f} s (deadlock?)")


def test_shard_rows_splits_every_row_once() -> None:
    latents = torch.arange(5 * 3 * 2, dtype=torch.float32).reshape(5, 3, 2)
    rows = build_rows(
        latents,
        torch.zeros(5, 2),
        torch.tensor([1.0, 0.5, 0.0]),
        torch.zeros(5),
        [[0, 1], [0], [], [1], [0, 1]],
    )
    parts = [shard_rows(rows, r, 3) for r in range(3)]
    assert [len(p) for p in parts] == [2, 2, 2]
    assert torch.equal(torch.cat([p.x for p in parts]), rows.x)
    assert len(shard_rows(rows.take(torch.tensor([0])), 1, 2)) == 1
    assert len(shard_rows(rows.take(torch.tensor([0])), 0, 2)) == 0


@pytest.mark.slow
@pytest.mark.slow
def test_sharded_update_equals_unsharded(tmp_path: Path) -> None:
    """Full fine-tune (activation checkpointing off and on) and LoRA with the KL term: rank 0's
    gathered weights after 2 steps equal ParameterStore's, and so do the clipped norms and the
    EMA the ranks keep of their shards (``train.ema``, 4 updates); the EMA scattered back from
    whole tensors (a checkpoint's) gathers to them again."""
    model = make_tiny_model(tmp_path / "sd3", "sd3", seed=0, resolution=w.RES)
    data = _trajectories(w.make_policy(str(model), lora=False))
    save_file(data, str(tmp_path / "data.safetensors"))
    out = tmp_path / "out"
    out.mkdir()
    _spawn_ranks(model, tmp_path / "data.safetensors", out)

    for name, (_, lora) in w.PHASES.items():
        policy = w.make_policy(str(model), lora)
        initial = {k: v.clone() for k, v in policy.trainable_state_dict().items()}  # CPU fp32 aliases params
        expected, expected_norms, expected_ema = _unsharded(policy, data, kl=lora)
        moved = max(float((expected[k] - initial[k]).abs().max()) for k in expected)
        assert moved > 1e-4, f"{name}: the update did not change the weights; the comparison would be vacuous"
        assert expected_norms[0] > w.make_cfg(kl=lora).train.grad_clip, (
            f"{name}: grad clipping should be active"
        )

        got = load_file(str(out / f"weights_{name}.safetensors"))
        assert set(got) == set(expected)
        diff = max(float((got[k] - expected[k]).abs().max()) for k in expected)
        assert diff < 1e-5, f"{name}: max |sharded - unsharded| = {diff}"
        norms = json.loads((out / f"norms_{name}.json").read_text())
        assert norms == pytest.approx(expected_norms, rel=1e-5), name
        ema = load_file(str(out / f"ema_{name}.safetensors"))
        assert set(ema) == set(expected_ema)
        for other in (initial, expected):  # the EMA is neither the start nor the end
            assert max(float((expected_ema[k] - other[k]).abs().max()) for k in other) > 1e-5, name
        diff = max(float((ema[k] - expected_ema[k]).abs().max()) for k in expected_ema)
        assert diff < 1e-5, f"{name}: max |sharded EMA - replicated EMA| = {diff}"
        reloaded = load_file(str(out / f"ema_reloaded_{name}.safetensors"))
        assert set(reloaded) == set(ema) and all(torch.equal(reloaded[k], 2 * ema[k]) for k in ema), name


@pytest.mark.slow
def test_served_shards_do_not_change_when_the_group_steps(tmp_path: Path) -> None:
    """What a rank serves as version v stays version v after the step to v + 1 (a staleness-1
    rollout still fetches it): one gloo rank, full fine-tune, one AdamW step."""
    import torch.distributed as dist

    from digen.parallel import ShardedTrainer
    from digen.parallel.fsdp import local_trainable_shards
    from digen.workers.fsdp_loop import shard_snapshot

    model = make_tiny_model(tmp_path / "sd3", "sd3", seed=0, resolution=w.RES)
    policy = w.make_policy(str(model), lora=False)
    data = _trajectories(policy)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = w.make_cfg()
        trainer = ShardedTrainer(policy, cfg.train)
        served = shard_snapshot(policy, torch.float32)
        before = {k: v.clone() for k, v in served.items()}
        for rows, embeds, sigma_max in w.task_rows(data):
            trainer.accumulate(rows, embeds, cfg, tsp=True, sigma_max=sigma_max)
        trainer.step()
        now = local_trainable_shards(policy)
    finally:
        dist.destroy_process_group()
    assert served.keys() == now.keys() and len(served) > 0
    changed = [k for k in now if not torch.equal(now[k], before[k])]
    assert len(changed) > len(now) // 2, "the step should move most weights; the check would be vacuous"
    assert [k for k in served if not torch.equal(served[k], before[k])] == []
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in served.values())
