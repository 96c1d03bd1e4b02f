"""Loading a trainer's version into its policy, and the older version it keeps serving, cost no
copy of the model on its device (:meth:`digen.optim.ParameterStore.load_into`,
``Member._keep``).

A trainer loads its store's version into its policy after every step. Loading a clone of the
trained tensors (as ``load_version(policy, store.weights())`` did) holds the model a second
time on the device for the load: for a full fine-tune of a 12B model, 48 GiB of float32. The
policy copies the values into its own parameters in place, so the live tensors are enough;
only what the policy keeps as given (the algorithm's state, the EMA) must be a copy. The
version a staleness-1 rollout may still fetch is kept in host memory, owned, where it is
served and checkpointed from (on the CPU that copy is a copy before and after: the test of it
guards that it is owned and float32; that it leaves the device is what ``_keep`` reads as).
The tests count the ``aten`` clones and copies the load makes
(torch's dispatch mode sees every one), and check that nothing loaded or kept changes when the
store steps on.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from digen.algos.state import loaded_ema
from digen.config import Config, TrainConfig
from digen.models import lora
from digen.optim import ParameterStore
from digen.workers.trainer import Member

COPIES = {torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


class _Policy:
    """A policy's trainable side as the model adapters have it: parameters of its own, loaded
    in place (:func:`digen.models.lora.load_full_state_dict`)."""

    def __init__(self) -> None:
        self.module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: p.detach().clone() for k, p in self.module.named_parameters()}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        lora.load_full_state_dict(self.module, state)


class _Copies(TorchDispatchMode):
    """Every copying op dispatched, with the number of elements it wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func in COPIES:
            self.seen.append((str(func), args[0].numel()))
        return out


def _grads(store: ParameterStore, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(p.shape, generator=g) for k, p in store.params.items()}


def _store(train: TrainConfig) -> tuple[_Policy, ParameterStore]:
    policy = _Policy()
    store = ParameterStore(policy.trainable_state_dict(), train)
    store.step(_grads(store, 1), rows=2)
    return policy, store


def test_a_load_copies_each_trained_tensor_once_into_the_policy_and_clones_none():
    policy, store = _store(TrainConfig())
    with _Copies() as seen:
        store.load_into(policy)
    assert [op for op, _ in seen.seen] == ["aten.copy_.default"] * len(store.params)
    loaded = dict(policy.module.named_parameters())
    assert all(torch.equal(loaded[k], store.params[k]) for k in store.params)
    want = {k: p.detach().clone() for k, p in loaded.items()}
    store.step(_grads(store, 2), rows=2)  # the policy holds its own copy: the step leaves it
    assert all(torch.equal(loaded[k], want[k]) for k in want)
    assert not all(torch.equal(loaded[k], store.params[k]) for k in store.params)


def test_the_ema_a_load_carries_is_a_copy_the_next_step_cannot_rewrite():
    policy, store = _store(TrainConfig(ema={"enabled": True, "warmup": False, "update": "step", "every": 1}))
    store.load_into(policy, ema=True)
    ema = {k: t.clone() for k, t in loaded_ema(policy).items()}
    assert set(ema) == set(store.params) and store.ema is not None
    store.step(_grads(store, 2), rows=2)
    assert not all(torch.equal(store.ema[k], ema[k]) for k in ema)  # the store's EMA moved ...
    assert all(torch.equal(loaded_ema(policy)[k], ema[k]) for k in ema)  # ... the loaded one did not


def test_the_kept_version_is_an_owned_host_copy_the_next_step_cannot_rewrite():
    _, store = _store(TrainConfig())
    cfg = Config(model={"path": "unused"}, prompts={"items": ["a"]}, reward=[{"name": "brightness"}])
    member = Member(ctx=SimpleNamespace(cfg=cfg), store=store)  # type: ignore[arg-type]
    version, kept = member._keep(store.version) or (None, {})
    assert version == store.version and set(kept) == set(store.params)
    for k, t in kept.items():
        assert t.device.type == "cpu" and t.dtype == torch.float32
        assert t.untyped_storage().data_ptr() != store.params[k].untyped_storage().data_ptr()
    want = {k: t.clone() for k, t in kept.items()}
    store.step(_grads(store, 2), rows=2)
    assert all(torch.equal(kept[k], want[k]) for k in want)
