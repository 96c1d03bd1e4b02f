"""The optimizer owner: master copy of the trained tensors, AdamW, EMA, checkpoints.

A :class:`ParameterStore` lives in the reference loop's process, and on every trainer of a
distributed job (replicated: each applies the same step to the same summed gradient,
:mod:`digen.workers.trainer`; with ``train.fsdp`` the trainer group holds it sharded instead). It
receives summed task gradients, steps AdamW and yields the next policy version's weights, which
workers load. The trained tensors live here (the LoRA adapter, or the full transformer for a
full fine-tune), and so does the state an algorithm keeps beside them (DiffusionNFT's ``old``
copy): :attr:`ParameterStore.state`, named ``algo/<role>/<name>`` (:mod:`digen.algos.state`),
part of every version dict :meth:`ParameterStore.weights` returns and of every checkpoint
(``optimizer.safetensors``).

The EMA (``train.ema``) is :attr:`ParameterStore.ema`, moved by :func:`ema_before_step` and
:func:`ema_after_step`; the sharded trainer runs the same functions over each rank's shards
(:class:`digen.parallel.fsdp.ShardedTrainer`).
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from digen.algos.registry import stateful_algorithm
from digen.algos.state import EMA_PREFIX, is_state, load_version, with_ema
from digen.config import Config, EmaConfig, TrainConfig
from digen.errors import CheckpointError
from digen.rundir import DiskFull, RunDir, disk_writes, finalize_checkpoint


# --- the EMA's rule -------------------------------------------------------------------
def ema_decay(cfg: EmaConfig, steps: int) -> float:
    """The decay of an update after ``steps`` optimizer steps: ``min((1 + n) / (10 + n), decay)``
    when ``cfg.warmup`` (flow_grpo/ema.py ``get_current_decay``), else ``cfg.decay``."""
    return min((1 + steps) / (10 + steps), cfg.decay) if cfg.warmup else cfg.decay


@torch.no_grad()
def ema_update(
    cfg: EmaConfig, ema: dict[str, torch.Tensor], params: dict[str, torch.Tensor], steps: int
) -> None:
    """``ema += (1 - d) (w - ema)`` in place after ``steps`` optimizer steps, in flow_grpo/ema.py
    ``EMAModuleWrapper.step``'s order of operations. Elementwise: over one FSDP rank's shards
    (:class:`digen.parallel.fsdp.ShardedTrainer`) it computes the shards of the whole tensors'
    update, bit for bit."""
    one_minus = 1 - ema_decay(cfg, steps)
    for k, v in params.items():
        ema[k].add_(one_minus * (v.detach() - ema[k]))


def ema_before_step(
    cfg: EmaConfig, ema: dict[str, torch.Tensor], params: dict[str, torch.Tensor], version: int
) -> None:
    """The updates of a step's earlier micro-batches (``update: micro_batch``), before the
    optimizer step from ``version``: they see the weights of ``version``."""
    if cfg.update == "micro_batch":
        for _ in range(cfg.micro_batches - 1):
            if (version + 1) % cfg.every == 0:
                ema_update(cfg, ema, params, version)


def ema_after_step(
    cfg: EmaConfig,
    ema: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    version: int,
    last_of_iteration: bool,
) -> None:
    """The update after the optimizer step that made ``version`` (:class:`~digen.config.EmaConfig`'s
    cadence: the step's last micro-batch, every ``every``-th step, or an iteration's last step)."""
    if (
        (cfg.update == "micro_batch" and (version + 1) % cfg.every == 0)
        or (cfg.update == "step" and version % cfg.every == 0)
        or (cfg.update == "iteration" and last_of_iteration)
    ):
        ema_update(cfg, ema, params, version)


class ParameterStore:
    """Master float32 weights + AdamW (+ the algorithm's state). ``version`` counts optimizer
    steps taken."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        train: TrainConfig,
        version: int = 0,
        state: dict[str, torch.Tensor] | None = None,
        device: str = "cpu",
    ):
        # sorted names: the same order whether weights come from a model or a checkpoint
        # (safetensors files sort their keys), so the grad-norm reduction order never changes
        self.names = sorted(weights)
        self.params = {
            k: torch.nn.Parameter(weights[k].detach().float().to(device, copy=True)) for k in self.names
        }
        self.train = train
        self.optimizer = torch.optim.AdamW(
            [self.params[k] for k in self.names],
            lr=train.lr,
            betas=train.betas,
            eps=train.adam_eps,
            weight_decay=train.weight_decay,
            # one kernel over every tensor: 6x the default's (foreach) speed on a CPU core at
            # a FLUX LoRA's size (684 MiB: 0.13 s, not 0.8 s), and torch's fastest on CUDA
            fused=True,
        )
        self.version = version
        self.lock = threading.Lock()
        """Held by :meth:`step` while it rewrites the state, and by :meth:`state_copy`."""
        self.ema: dict[str, torch.Tensor] | None = (
            {k: v.detach().clone() for k, v in self.params.items()} if train.ema.enabled else None
        )
        self.algorithm = stateful_algorithm(train)
        self.state: dict[str, torch.Tensor] = (
            (self.algorithm.initial_state(self.trained(), train) if self.algorithm.keeps_state else {})
            if state is None
            else {k: v.detach().float().to(device, copy=True) for k, v in state.items()}
        )
        """The algorithm's tensors beside the weights, ``algo/<role>/<name>`` (``{}`` for most)."""

    @classmethod
    def fresh(
        cls, weights: dict[str, torch.Tensor], train: TrainConfig, device: str = "cpu"
    ) -> ParameterStore:
        """Version 0 of a job from the policy's trained tensors, on ``device``."""
        return cls(weights, train, device=device)

    def trained(self) -> dict[str, torch.Tensor]:
        """The current trained tensors (detached, contiguous float32 copies on the store's device)."""
        return {k: v.detach().clone().contiguous() for k, v in self.params.items()}

    def weights(self, *, ema: bool = False) -> dict[str, torch.Tensor]:
        """The current version: the trained tensors and the algorithm's state tensors, one
        flat dict (detached, contiguous float32 copies; load it with
        :func:`digen.algos.state.load_version`); with ``ema`` (a version evaluated with
        ``train.ema.eval``: :func:`digen.evaluation.carries_ema`) the EMA too, ``ema/<name>``."""
        version = {**self.trained(), **{k: v.clone().contiguous() for k, v in self.state.items()}}
        if ema and self.ema is not None:
            version = with_ema(version, {k: v.clone().contiguous() for k, v in self.ema.items()})
        return version

    def weights_copy(
        self, copy: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], *, ema: bool = False
    ) -> dict[str, torch.Tensor]:
        """The current version (the names and order of :meth:`weights`, with ``ema`` its EMA
        too) passed through ``copy`` (the data plane's host copy, cast to what it serves) under
        :attr:`lock`: the live tensors go to ``copy`` as they are, so serving a version costs
        its one host copy, not a clone on the store's device first (for a full fine-tune, the
        whole model twice on the GPU). ``copy`` must copy: the next step rewrites what it is
        given."""
        with self.lock:
            live = {k: v.detach() for k, v in self.params.items()}
            version = {**live, **{k: v.detach() for k, v in self.state.items()}}
            if ema and self.ema is not None:
                version = with_ema(version, {k: v.detach() for k, v in self.ema.items()})
            return copy(version)

    def load_into(self, policy: Any, *, ema: bool = False) -> None:
        """Load the current version into ``policy`` (:func:`~digen.algos.state.load_version`,
        with ``ema`` its EMA too), under :attr:`lock`: the trained tensors go to the policy's
        own parameters straight from the live ones (the policy copies them in place), so a
        load costs no clone of them first (for a full fine-tune that clone is the whole model
        a second time on the device); the algorithm's state and the EMA, which the policy
        keeps as they are given, go as copies the next step cannot rewrite."""

        def load(live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            load_version(policy, {k: t if k in self.params else t.clone() for k, t in live.items()})
            return live

        self.weights_copy(load, ema=ema)

    def step(
        self, grad_sum: dict[str, torch.Tensor], rows: int, *, last_of_iteration: bool = True
    ) -> dict[str, float]:
        """:meth:`_step`, holding :attr:`lock` (a :meth:`state_copy` never sees half a step)."""
        with self.lock:
            return self._step(grad_sum, rows, last_of_iteration=last_of_iteration)

    def state_copy(
        self, version: int, copy: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor] | None:
        """The state of ``version`` as a trainer serves it to a newcomer (weights ``w/<name>``,
        optimizer and algorithm tensors ``o/<name>``: :meth:`state_parts`), passed through
        ``copy`` (the data plane's host copy) under :attr:`lock`, so no step rewrites it while
        it is sent or hashed. Taken only when a newcomer asks (one copy of the state, kept until
        the next version's blob replaces it), not at every step: at a FLUX LoRA r64's size the
        state is 2 GiB. None once the store has stepped past ``version`` (the server answers
        that the blob is gone: the newcomer asks another holder, or the next version)."""
        with self.lock:
            if self.version != version:
                return None
            weights, opt, _ = self.state_parts()
            return copy(
                {**{f"w/{k}": t for k, t in weights.items()}, **{f"o/{k}": t for k, t in opt.items()}}
            )

    def _step(
        self, grad_sum: dict[str, torch.Tensor], rows: int, *, last_of_iteration: bool = True
    ) -> dict[str, float]:
        """One AdamW step on the mean gradient ``grad_sum / rows`` (after norm clipping).
        ``grad_sum`` is consumed: its float32 tensors on the store's device are divided in
        place and become the parameters' ``.grad`` (no second copy of a large gradient).
        ``last_of_iteration``: this step ends the iteration's mini-batches, after which the
        algorithm's state moves (:meth:`~digen.algos.registry.Algorithm.next_state`)."""
        if rows <= 0:
            raise ValueError(f"an optimizer step needs trained rows, got {rows}")
        missing = set(self.names) - set(grad_sum)
        if missing:
            raise ValueError(f"gradient lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")
        for k in self.names:
            g = grad_sum[k]
            if g.dtype != torch.float32 or g.device != self.params[k].device:
                g = g.to(self.params[k].device, torch.float32)
            self.params[k].grad = g.div_(rows)
        norm = torch.nn.utils.clip_grad_norm_([self.params[k] for k in self.names], self.train.grad_clip)
        if self.ema is not None:
            ema_before_step(self.train.ema, self.ema, self.params, self.version)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        if self.ema is not None:
            ema_after_step(self.train.ema, self.ema, self.params, self.version, last_of_iteration)
        if last_of_iteration and self.state:
            self.state = self.algorithm.next_state(self.state, self.trained(), self.train, self.version)
        return {"grad_norm": float(norm)}

    # --- checkpoints ---------------------------------------------------------------
    def state_parts(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
        """The whole state as (weights, optimizer tensors, ``state.json`` dict): what a
        checkpoint writes and what a trainer that lost its copy fetches from another (the
        algorithm's state travels with the optimizer tensors, ``algo/<role>/<name>``). The
        tensors are the store's own (no copy): read them before the next step."""
        opt_tensors: dict[str, torch.Tensor] = {}
        steps: dict[str, float] = {}
        for k in self.names:
            st = self.optimizer.state.get(self.params[k], {})
            for field in ("exp_avg", "exp_avg_sq"):
                if field in st:
                    opt_tensors[f"{field}/{k}"] = st[field]
            if "step" in st:
                steps[k] = float(st["step"])
        if self.ema is not None:
            opt_tensors.update({f"{EMA_PREFIX}{k}": v for k, v in self.ema.items()})
        opt_tensors.update(self.state)
        weights = {k: v.detach() for k, v in self.params.items()}
        return weights, opt_tensors, {"version": self.version, "adam_steps": steps}

    @staticmethod
    def restore(
        weights: dict[str, torch.Tensor],
        opt: dict[str, torch.Tensor],
        state: dict,
        train: TrainConfig,
        device: str = "cpu",
    ) -> ParameterStore:
        """The store :meth:`state_parts` described (copies, on ``device``)."""
        algo_state = {k: v for k, v in opt.items() if is_state(k)}
        store = ParameterStore(
            weights, train, version=int(state["version"]), state=algo_state or None, device=device
        )
        # through Optimizer.load_state_dict, which puts every state tensor on its parameter's
        # device, ``step`` included: the fused AdamW keeps ``step`` there (float32), and a CPU
        # ``step`` beside CUDA parameters makes its kernel raise at the first step
        saved = store.optimizer.state_dict()
        saved["state"] = {
            i: {
                "step": torch.tensor(float(state["adam_steps"][k]), dtype=torch.float32),
                "exp_avg": opt[f"exp_avg/{k}"].to(device, torch.float32, copy=True),
                "exp_avg_sq": opt[f"exp_avg_sq/{k}"].to(device, torch.float32, copy=True),
            }
            for i, k in enumerate(store.names)
            if f"exp_avg/{k}" in opt
        }
        store.optimizer.load_state_dict(saved)
        if store.ema is not None and any(k.startswith(EMA_PREFIX) for k in opt):
            store.ema = {k: opt[f"{EMA_PREFIX}{k}"].to(device, copy=True) for k in store.names}
        return store

    def save(self, folder: Path, extra: dict | None = None) -> None:
        """Write ``weights.safetensors``, ``optimizer.safetensors`` and ``state.json``."""
        folder.mkdir(parents=True, exist_ok=True)
        weights, opt, state = self.state_parts()
        save_file({k: v.cpu().contiguous() for k, v in weights.items()}, str(folder / "weights.safetensors"))
        save_file({k: v.cpu().contiguous() for k, v in opt.items()}, str(folder / "optimizer.safetensors"))
        (folder / "state.json").write_text(json.dumps({**state, **(extra or {})}, indent=1))

    @staticmethod
    def load(folder: Path, train: TrainConfig, device: str = "cpu") -> tuple[ParameterStore, dict]:
        """A store restored from :meth:`save`; also the ``state.json`` contents."""
        state, weights, opt = read_checkpoint(folder)
        return ParameterStore.restore(weights, opt, state, train, device), state


def read_checkpoint(
    folder: Path, *, optimizer: bool = True
) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(``state.json``, weights, optimizer tensors or ``{}`` without ``optimizer``) of a
    checkpoint folder written by :meth:`ParameterStore.save`."""
    try:
        state = json.loads((folder / "state.json").read_text())
        weights = load_file(str(folder / "weights.safetensors"))
        opt = load_file(str(folder / "optimizer.safetensors")) if optimizer else {}
    except (OSError, ValueError, KeyError, json.JSONDecodeError, SafetensorError) as exc:
        raise CheckpointError(
            f"checkpoint {folder} cannot be read ({exc.__class__.__name__}: {exc}); delete it to resume "
            f"from the one before, or start without --resume"
        ) from None
    return state, weights, opt


@dataclass
class Resumed:
    store: ParameterStore  # or a ShardedStore (train.fsdp), which quacks like one
    start_iteration: int
    previous_weights: dict[str, torch.Tensor] | None


def open_store(
    cfg: Config,
    run: RunDir,
    initial: Callable[[], dict[str, torch.Tensor]],
    resume: bool,
    store_type: type = ParameterStore,
    device: str = "cpu",
) -> Resumed:
    """A fresh parameter store of the trained tensors ``initial()`` returns (the policy's
    ``trainable_state_dict``; called only when not resuming), or the newest checkpoint's, on
    ``device`` (the reference loop's: its model's, so AdamW runs where the trainers of a
    distributed job run it, and on the same kind of device computes the same bits).
    ``store_type`` (``fresh(weights, train, device)``, ``load(folder, train, device)``) is the
    kind of store."""
    if resume:
        ckpt = run.latest_checkpoint()
        if ckpt is None:
            raise CheckpointError(f"--resume: {run.root} has no checkpoint yet; start without --resume")
        store, state = store_type.load(ckpt, cfg.train, device=device)
        prev = None
        if (ckpt / "previous_weights.safetensors").exists():
            prev = load_file(str(ckpt / "previous_weights.safetensors"))
        # the run directory is left as it is until the weights have loaded (RunDir.resumed)
        return Resumed(store, int(state["iteration"]) + 1, prev)
    return Resumed(store_type.fresh(initial(), cfg.train, device=device), 0, None)


def checkpoint_bytes(store, previous_weights: dict[str, torch.Tensor] | None = None) -> int:
    """About how many bytes a checkpoint of ``store`` takes: its float32 tensors three times
    (weights, AdamW's two moments), four with an EMA, plus the previous version's weights when
    kept."""
    params = getattr(store, "params", None) or {}
    copies = 3 if getattr(store, "ema", None) is None else 4
    n = copies * sum(int(p.numel()) * 4 for p in params.values())
    if previous_weights is not None:
        n += sum(int(v.numel()) * v.element_size() for v in previous_weights.values())
    return n


def save_checkpoint(
    folder: Path,
    store: ParameterStore,
    iteration: int,
    previous: tuple[int, dict[str, torch.Tensor]] | None = None,
    *,
    keep: int,
) -> None:
    """Write the state after ``iteration``'s step into ``folder`` (``checkpoints/iter_NNNN``)
    and keep the newest ``keep`` checkpoints: :func:`stage_checkpoint`, then
    :func:`~digen.rundir.finalize_checkpoint`."""
    stage_checkpoint(folder, store, iteration, previous)
    finalize_checkpoint(folder, keep)


def stage_checkpoint(
    folder: Path,
    store: ParameterStore,
    iteration: int,
    previous: tuple[int, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write the state after ``iteration``'s step into ``folder``'s staging twin
    ``iter_NNNN.tmp`` (the rename that makes it the checkpoint is
    :func:`~digen.rundir.finalize_checkpoint`, so a crash leaves the older ones intact), plus
    ``previous``: (version, weights) of the older version a staleness-1 rollout of the next
    iteration generates with (``previous_weights.safetensors``, its version in ``state.json``
    as ``previous_version``); returns the staging folder."""
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        # the run directory is the checkpoints folder's parent
        prev_weights = previous[1] if previous is not None else None
        with disk_writes(folder.parent.parent, tmp, checkpoint_bytes(store, prev_weights)):
            tmp.mkdir(parents=True)
            extra: dict = {"iteration": iteration}
            if previous is not None:
                save_file(
                    {k: v.cpu().contiguous() for k, v in previous[1].items()},
                    str(tmp / "previous_weights.safetensors"),
                )
                extra["previous_version"] = previous[0]
            store.save(tmp, extra)
    except DiskFull:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint: give its space back
        raise
    return tmp
