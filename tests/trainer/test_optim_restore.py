"""A restored :class:`digen.optim.ParameterStore`: its AdamW state on the parameters' device and
the same next step as the store it was saved from.

The fused AdamW the store builds keeps ``step`` on the parameter's device; a ``step`` left on the
CPU beside CUDA parameters makes the fused kernel raise at the first step after ``--resume`` or a
trainer's copy of a peer's state. No CUDA here: the ``meta`` device stands in for it (a restore
onto ``meta`` must leave no state tensor on the CPU), and the step equality runs on the CPU.
"""

from __future__ import annotations

import json

import pytest
import torch

from digen.config import TrainConfig
from digen.optim import ParameterStore


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"b.lora_A": torch.randn(4, 8, generator=g), "a.lora_B": torch.randn(8, 4, generator=g)}


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in _weights().items()}


def _stepped(train: TrainConfig) -> ParameterStore:
    store = ParameterStore(_weights(), train)
    store.step(_grads(1), rows=3)
    return store


def test_restore_puts_every_state_tensor_on_its_parameters_device():
    train = TrainConfig()
    weights, opt, state = _stepped(train).state_parts()
    restored = ParameterStore.restore(weights, opt, state, train, device="meta")
    assert restored.optimizer.defaults["fused"] is True
    assert len(restored.optimizer.state) == len(restored.names)
    for k in restored.names:
        p = restored.params[k]
        st = restored.optimizer.state[p]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
        assert {name: t.device.type for name, t in st.items()} == dict.fromkeys(st, "meta"), k
        assert st["step"].dtype == torch.float32  # what the fused kernel keeps


def test_a_step_after_a_restore_equals_one_without_the_round_trip(tmp_path):
    train = TrainConfig()
    kept = _stepped(train)
    saved = _stepped(train)
    saved.save(tmp_path / "ckpt")
    loaded, _ = ParameterStore.load(tmp_path / "ckpt", train)
    copied = ParameterStore.restore(*saved.state_parts(), train)  # a peer's state, as a newcomer copies it
    for store in (kept, loaded, copied):
        store.step(_grads(2), rows=5)
    for store in (loaded, copied):
        assert store.version == kept.version == 2
        for k in kept.names:
            assert torch.equal(store.params[k].detach(), kept.params[k].detach()), k
            for field in ("exp_avg", "exp_avg_sq", "step"):
                mine, theirs = store.optimizer.state[store.params[k]], kept.optimizer.state[kept.params[k]]
                assert torch.equal(mine[field], theirs[field]), (k, field)


def test_a_restored_state_is_a_copy():
    """A newcomer restores from the tensors a peer serves (``state_parts`` returns the store's
    own): its steps must not write into them."""
    train = TrainConfig()
    source = _stepped(train)
    weights, opt, state = source.state_parts()
    before = {k: v.clone() for k, v in opt.items()}
    copied = ParameterStore.restore(weights, opt, state, train)
    copied.step(_grads(2), rows=5)
    for k, v in before.items():
        assert torch.equal(opt[k], v), k


def test_a_job_opens_its_store_on_the_device_it_names(tmp_path):
    """The reference loop's AdamW runs on its model's device (as a distributed job's trainers
    run theirs), fresh or resumed: ``open_store(..., device=...)``; ``meta`` stands in for CUDA."""
    from digen.config import build_config
    from digen.optim import open_store, save_checkpoint
    from digen.rundir import RunDir
    from tests.conftest import required

    cfg = build_config(required({}), check_paths=False, algorithms=False)
    run = RunDir(tmp_path / "run", cfg, resume=False)
    fresh = open_store(cfg, run, _weights, resume=False, device="meta").store
    assert {p.device.type for p in fresh.params.values()} == {"meta"}
    save_checkpoint(run.checkpoint_dir(0), _stepped(cfg.train), 0, keep=1)
    resumed = open_store(
        cfg, RunDir(tmp_path / "run", cfg, resume=True), _weights, resume=True, device="meta"
    )
    assert resumed.start_iteration == 1 and resumed.store.version == 1
    tensors = [*resumed.store.params.values()]
    tensors += [t for st in resumed.store.optimizer.state.values() for t in st.values()]
    assert len(tensors) == 4 * len(resumed.store.names) and {t.device.type for t in tensors} == {"meta"}


def test_a_served_state_is_its_version_after_the_store_steps():
    """What a trainer serves as version v's state stays version v's state once the store steps
    to v + 1: a snapshot taken before the step is unchanged and matches its digest; one first
    asked after the step is refused (the newcomer asks another holder), never v + 1 as v."""
    from digen.dataplane.auth import keyring, new_key
    from digen.dataplane.blobs import BlobLost, BlobServer, BlobStore, fetch
    from digen.workers.trainer import serve_state

    train = TrainConfig()
    store = _stepped(train)
    weights, opt, _ = store.state_parts()
    before = {f"w/{k}": t.clone() for k, t in weights.items()} | {f"o/{k}": t.clone() for k, t in opt.items()}
    blobs = BlobStore()
    serve_state(blobs, "statejob:state:1", store)  # fetched before the step
    serve_state(blobs, "statejob:state:1b", store)  # first asked after it
    keyring().add("statejob", new_key())
    server = BlobServer(blobs)
    try:
        fetch(server.address, "statejob:state:1")
        store.step(_grads(2), rows=5)
        assert store.version == 2
        moved = [k for k in store.names if not torch.equal(store.params[k].detach(), before[f"w/{k}"])]
        assert moved == store.names, "the step should move every weight; the check would be vacuous"
        got, meta = fetch(server.address, "statejob:state:1")  # checked against its digest
        assert json.loads(meta["state"])["version"] == 1
        assert got.keys() == before.keys()
        assert [k for k in got if not torch.equal(got[k], before[k])] == []
        with pytest.raises(BlobLost, match="gone"):
            fetch(server.address, "statejob:state:1b")
    finally:
        server.close()
        keyring().drop("statejob")
