"""GPU placement: which GPU each worker process gets, proven on a machine without GPUs through
the discovery seam (``DIGEN_FAKE_GPUS``): the rules (one GPU per worker, trainers and
sequence-parallel replicas on adjacent ids of one type, two GPU types, too many workers),
a real local cluster whose worker processes each see only their own GPU, ``digen plan`` and
``digen worker --gpus``'s node placement."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from typer.testing import CliRunner

from digen.cli.main import app
from digen.cluster.placement import (
    FAKE_ENV,
    Gpu,
    _visible,
    discover,
    gpu_type,
    parse_nvidia_smi,
    parse_roles,
    parse_spec,
    place,
    plan_local,
)
from digen.config import build_config
from digen.errors import ConfigError
from digen.runtime.sp_group import Candidate, plan_replicas
from tests.conftest import DIGEN, required, small_config_data


def cfg_of(rollout: int, trainer: int, *, reward: int = 0, sp: int = 1, train: dict | None = None, **local):
    data = {
        "train": train or {},
        "model": {"device": "cuda:0"},
        "rollout": {"sequence_parallel": sp},
        "schedule": {"mode": "disaggregated"},
        "cluster": {
            "local": {
                "rollout_workers": rollout,
                "trainer_workers": trainer,
                "reward_workers": reward,
                **local,
            }
        },
    }
    return build_config(required(data), check_paths=False, algorithms=False)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("Tesla V100-SXM2-16GB", "v100"),
        ("NVIDIA A10G", "a10g"),
    ],
)
def test_gpu_types_are_read_from_device_names(name: str, kind: str):
    assert gpu_type(name) == kind


def test_a_spec_lists_gpus_in_order_and_a_bad_one_is_refused():
    gpus = parse_spec("2xh100,1xl40s")
    assert [(g.index, g.type) for g in gpus] == [(0, "h100"), (1, "h100"), (2, "l40s")]
    assert gpus[0].memory_mib > gpus[2].memory_mib
    with pytest.raises(ConfigError, match="8xh100"):
        parse_spec("eight h100")


def test_every_worker_gets_a_gpu_of_its_own_trainers_first_on_adjacent_ids():
    p = plan_local(cfg_of(4, 4, train={"fsdp": True}), parse_spec("8xh100"))
    by = {s.worker: s.gpus for s in p.slots}
    assert sorted(g for s in p.slots for g in s.gpus) == list(range(8))
    # trainers in rank order (sorted names) on 0..3: FSDP ranks and the all-reduce stay adjacent
    assert [by[f"trainer-{i}"] for i in range(4)] == [(0,), (1,), (2,), (3,)]
    assert all(s.gpu_type == "h100" for s in p.slots) and not p.idle


def test_sequence_parallel_replicas_sit_on_adjacent_gpus_as_the_controller_cuts_them():
    """12 rollout workers, d=2: the controller pairs sorted names (rollout-1 with rollout-10);
    each pair it forms is on two adjacent GPUs of one type."""
    gpus = parse_spec("8xh100,6xl40s")
    p = plan_local(cfg_of(12, 1, sp=2), gpus)
    slot = {s.worker: s for s in p.slots}
    rollouts = [Candidate(s.worker, s.gpu_type) for s in p.slots if s.role == "rollout"]
    replicas = plan_replicas(rollouts, 2)
    assert len(replicas) == 6  # every rollout worker is in a replica: none split across types
    for a, b in replicas:
        assert slot[a].gpu_type == slot[b].gpu_type
        assert abs(slot[a].gpus[0] - slot[b].gpus[0]) == 1, (a, b, slot[a].gpus, slot[b].gpus)
    assert slot["trainer-0"].gpus == (0,)


def test_two_gpu_types_form_a_heterogeneous_cluster_trainers_on_the_larger():
    p = plan_local(cfg_of(4, 2), parse_spec("4xl40s,4xh100"))  # the l40s are listed first
    types = {s.worker: s.gpu_type for s in p.slots}
    assert types["trainer-0"] == types["trainer-1"] == "h100"
    assert {s.gpu_type for s in p.slots} == {"h100", "l40s"}
    # the h100 (4-7) fill first: trainers on 4, 5, rollouts on 6, 7, then the l40s 0, 1
    assert [types[f"trainer-{i}"] for i in range(2)] == ["h100", "h100"]
    assert {s.worker: s.gpus[0] for s in p.slots} == {
        "trainer-0": 4,
        "trainer-1": 5,
        "rollout-0": 6,
        "rollout-1": 7,
        "rollout-2": 0,
        "rollout-3": 1,
    }
    assert [g.index for g in p.idle] == [2, 3]


def test_too_many_workers_is_one_line_unless_the_config_shares_gpus():
    with pytest.raises(ConfigError) as exc:
        plan_local(cfg_of(4, 1), parse_spec("2xh100"))
    (line,) = exc.value.problems
    assert "\n" not in line and "5 workers" in line and "2 GPUs" in line and "workers_per_gpu: 3" in line
    shared = plan_local(cfg_of(4, 1, workers_per_gpu=3), parse_spec("2xh100"))
    per_gpu: dict[int, int] = {}
    for s in shared.slots:
        per_gpu[s.gpus[0]] = per_gpu.get(s.gpus[0], 0) + 1
    assert max(per_gpu.values()) <= 3 and sum(per_gpu.values()) == 5


def _on_device(cfg, device: str):
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"device": device})})


def test_no_gpu_or_a_cpu_device_or_an_empty_list_runs_on_cpu():
    """Each worker is pinned to the CPU (no GPU visible to it, ``DIGEN_DEVICE=cpu``), so a
    process that torch would give a GPU does not take GPU 0 while tagged ``cpu``; only a
    config that names a CUDA device itself, on a machine whose GPUs discovery cannot list,
    leaves the worker's environment alone."""
    cfg = cfg_of(1, 1)  # model.device: cuda:0
    pinned = {"CUDA_VISIBLE_DEVICES": "", "DIGEN_DEVICE": "cpu"}
    for chosen, why, env in (
        (plan_local(_on_device(cfg, "auto"), []), "no GPU visible", pinned),
        (plan_local(_on_device(cfg, "cpu"), parse_spec("2xh100")), "model.device is cpu", pinned),
        (plan_local(cfg_of(1, 1, gpus=[]), parse_spec("2xh100")), "cluster.local.gpus is []", pinned),
        (
            plan_local(_on_device(cfg_of(1, 1, gpus=[]), "auto"), parse_spec("2xh100")),
            "cluster.local.gpus is []",
            pinned,
        ),
        (plan_local(cfg, []), "no GPU visible", {}),
    ):
        assert chosen.cpu_reason == why
        assert all(s.gpus == () and s.gpu_type == "cpu" and s.env() == env for s in chosen.slots), why


def test_listed_gpu_ids_and_gpu_types_narrow_the_choice():
    p = plan_local(cfg_of(1, 1, gpus=[6, 7]), parse_spec("8xh100"))
    assert sorted(s.gpus[0] for s in p.slots) == [6, 7]
    with pytest.raises(ConfigError, match="lists GPU 9"):
        plan_local(cfg_of(1, 1, gpus=[9]), parse_spec("8xh100"))
    with pytest.raises(ConfigError, match=r"cluster.local.gpus \('fast'\).*auto or a list of GPU ids"):
        cfg_of(1, 1, gpus="fast")
    only = build_config(
        required(
            {
                "model": {"device": "cuda"},
                "cluster": {"gpu_types": ["l40s"], "local": {"rollout_workers": 1, "trainer_workers": 1}},
            }
        ),
        check_paths=False,
        algorithms=False,
    )
    assert {s.gpu_type for s in plan_local(only, parse_spec("4xh100,2xl40s")).slots} == {"l40s"}


def _gpus_of(p) -> dict[str, int]:
    return {s.worker: s.gpus[0] for s in p.slots}


def test_shared_gpus_spread_ranks_over_distinct_gpus_first():
    """``workers_per_gpu`` allows sharing; it does not ask for it: 2 trainers and 2 rollout
    workers on 8 GPUs take 4 GPUs of their own (it used to put both trainers on GPU 0 and
    both rollout workers on GPU 1, six GPUs idle)."""
    p = plan_local(cfg_of(2, 2, workers_per_gpu=2), parse_spec("8xh100"))
    assert _gpus_of(p) == {"trainer-0": 0, "trainer-1": 1, "rollout-0": 2, "rollout-1": 3}
    assert [g.index for g in p.idle] == [4, 5, 6, 7] and p.notes == []
    # more workers than GPUs: every GPU takes one before any takes two
    p = plan_local(cfg_of(3, 2, workers_per_gpu=2, train={"reduce": "exact"}), parse_spec("3xh100"))
    per_gpu = sorted(list(_gpus_of(p).values()).count(i) for i in range(3))
    assert per_gpu == [1, 2, 2] and _gpus_of(p)["trainer-0"] != _gpus_of(p)["trainer-1"]


@pytest.mark.slow
def test_the_plan_of_the_shared_quickstart_puts_each_worker_on_its_own_gpu():
    res = CliRunner().invoke(
        app,
        [
            "plan",
            "configs/quickstart.yaml",
            "--gpus",
            "8xh100",
            "--json",
            "--set",
            "cluster.local.workers_per_gpu=2",
            "--set",
            "cluster.local.trainer_workers=2",
            "--set",
            "cluster.local.rollout_workers=2",
        ],
    )
    assert res.exit_code == 0, res.output
    got = {r["worker"]: r["gpus"] for r in json.loads(res.stdout)}
    assert got == {"trainer-0": [0], "trainer-1": [1], "rollout-0": [2], "rollout-1": [3]}


def test_a_group_that_needs_nccl_with_two_ranks_on_one_gpu_is_refused_in_one_line(tmp_path):
    """NCCL refuses two ranks of one group on one device ("Duplicate GPU detected"): FSDP
    ranks and a sequence-parallel replica that would share a GPU exit 2 before anything
    starts, naming the key to change."""
    with pytest.raises(ConfigError) as exc:
        plan_local(cfg_of(1, 2, workers_per_gpu=3, train={"fsdp": True}), parse_spec("1xh100"))
    (line,) = exc.value.problems
    assert "trainer-0 and trainer-1 of the FSDP trainer group would share GPU 0" in line
    assert "set cluster.local.trainer_workers to at most 1" in line and "\n" not in line
    with pytest.raises(ConfigError) as exc:
        plan_local(cfg_of(2, 1, sp=2, workers_per_gpu=3), parse_spec("1xh100"))
    (line,) = exc.value.problems
    assert "rollout-0 and rollout-1 of a sequence-parallel replica would share GPU 0" in line
    assert "set rollout.sequence_parallel to at most 1" in line
    # two GPUs: each replica's ranks on two GPUs, sharing them with the other replica and the trainer
    ok = plan_local(cfg_of(4, 1, sp=2, workers_per_gpu=3), parse_spec("2xh100"))
    pairs = plan_replicas([Candidate(s.worker, s.gpu_type) for s in ok.slots if s.role == "rollout"], 2)
    assert len(pairs) == 2 and all(_gpus_of(ok)[a] != _gpus_of(ok)[b] for a, b in pairs)
    path = write_config(
        tmp_path,
        train={"fsdp": True},
        cluster={"local": {"rollout_workers": 1, "trainer_workers": 2, "workers_per_gpu": 3}},
    )
    res = CliRunner().invoke(app, ["plan", path, "--gpus", "1xh100"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert "cluster.local.trainer_workers" in res.output


@pytest.mark.parametrize(("mode", "members"), [("disaggregated", 2), ("colocated", 3)])
def test_a_replicated_trainer_group_sharing_a_gpu_all_reduces_on_gloo_and_says_so(mode, members):
    """The replicated group's all-reduce runs on gloo where its members share a GPU (in
    colocated mode every worker is a member); ``digen plan`` says so; an ``exact`` reduction,
    which runs no collective, needs neither."""
    cfg = cfg_of(1, 2, workers_per_gpu=3)
    cfg = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"mode": mode})})
    p = plan_local(cfg, parse_spec("1xh100"))
    gloo = {s.worker for s in p.slots if s.env().get("DIGEN_TRAINER_BACKEND") == "gloo"}
    assert len(gloo) == members and {"trainer-0", "trainer-1"} <= gloo
    (note,) = p.notes
    assert f"trainer group ({members} ranks) all-reduces on gloo" in note
    assert p.lines()[-1] == f"note: {note}"
    exact = cfg.model_copy(update={"train": cfg.train.model_copy(update={"reduce": "exact"})})
    assert plan_local(exact, parse_spec("1xh100")).notes == []
    spread = plan_local(cfg, parse_spec("4xh100"))
    assert spread.notes == [] and all("DIGEN_TRAINER_BACKEND" not in s.env() for s in spread.slots)


def test_a_placed_worker_sees_only_its_gpu_as_cuda_0():
    p = place([("rollout-0", "rollout")], [Gpu(3, "NVIDIA H100 80GB HBM3", 81559)])
    assert p.slots[0].env() == {
        "CUDA_VISIBLE_DEVICES": "3",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "DIGEN_DEVICE": "cuda:0",
    }


def test_discovery_reads_nvidia_smi_and_keeps_to_the_visible_devices(monkeypatch):
    listed = parse_nvidia_smi(
        "0, NVIDIA H100 80GB HBM3, 81559, GPU-aaa\n1, NVIDIA H100 80GB HBM3, 81559, GPU-bbb\n"
        "2, NVIDIA L40S, 46068, GPU-ccc\n"
    )
    assert [g.type for g, _ in listed] == ["h100", "h100", "l40s"]
    assert [g.index for g in _visible(listed, None)] == [0, 1, 2]
    assert [g.index for g in _visible(listed, "2,0")] == [2, 0]
    assert _visible(listed, "") == [] and _visible(listed, "-1") == []
    (by_uuid,) = _visible(listed, "GPU-bbb")
    assert by_uuid.index == 1 and by_uuid.cuda_id == "GPU-bbb"
    monkeypatch.setenv(FAKE_ENV, "1xh200")
    assert [g.type for g in discover()] == ["h200"]


@pytest.mark.slow
def test_each_worker_process_of_a_local_cluster_sees_only_its_own_gpu(monkeypatch):
    """A real local cluster (three worker processes) placed on a fake inventory of two kinds
    of GPU: each process reads back its own CUDA_VISIBLE_DEVICES, and its Dask resource
    carries its GPU's type."""
    from digen.cluster.cluster import close_local_cluster, list_workers, start_local_cluster

    monkeypatch.setenv(FAKE_ENV, "1xh100,2xl40s")
    placement = plan_local(cfg_of(2, 1))
    cluster, client = start_local_cluster(2, 1, "cpu", 1, start_method="spawn", placement=placement)
    try:
        seen = client.run(lambda: (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("DIGEN_DEVICE")))
        workers = list_workers(client)
        name_of = {w.address: w.name for w in workers}
        got = {name_of[addr]: env for addr, env in seen.items()}
    finally:
        client.close()
        close_local_cluster(cluster)
    assert got == {
        "trainer-0": ("0", "cuda:0"),
        "rollout-0": ("1", "cuda:0"),
        "rollout-1": ("2", "cuda:0"),
    }
    assert {w.name: w.gpu_type for w in workers} == {
        "trainer-0": "h100",
        "rollout-0": "l40s",
        "rollout-1": "l40s",
    }


# ---------------------------------------------------------------------------------------------
# the commands


def write_config(tmp_path, **sections) -> str:
    data = {
        "model": {"path": "models/none", "device": "cuda:0"},
        "schedule": {"mode": "disaggregated"},
        "cluster": {"local": {"rollout_workers": 4, "trainer_workers": 1}},
        **sections,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(required(data)))
    return str(path)


def test_plan_json_gives_every_worker_its_own_gpus(tmp_path):
    res = CliRunner().invoke(app, ["plan", write_config(tmp_path), "--gpus", "8xh100", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert all(set(r) == {"worker", "role", "gpus", "gpu_type"} for r in rows)
    assert len(rows) == 5 and all(r["gpu_type"] == "h100" and len(r["gpus"]) == 1 for r in rows)
    assert len({r["gpus"][0] for r in rows}) == 5


def test_plan_exits_2_in_one_line_when_the_workers_do_not_fit(tmp_path):
    res = CliRunner().invoke(app, ["plan", write_config(tmp_path), "--gpus", "2xh100"])
    assert res.exit_code == 2
    assert len(res.output.strip().splitlines()) == 1 and "do not fit 2 GPUs" in res.output


def test_train_refuses_workers_that_do_not_fit_before_anything_starts(tmp_path, tiny_sd3, monkeypatch):
    monkeypatch.setenv(FAKE_ENV, "1xh100")
    data = small_config_data(tiny_sd3, schedule__mode="disaggregated")
    data["model"]["device"] = "cuda:0"
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", str(path), "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert "do not fit 1 GPUs" in res.output and not out.exists()


def test_a_node_starts_one_worker_per_gpu_trainers_first(monkeypatch):
    from digen.cluster.node import node_placement

    monkeypatch.setenv(FAKE_ENV, "2xl40s,2xh100")
    p = node_placement("trainer=1,rollout", "auto")
    roles = {s.gpus[0]: (s.role, s.gpu_type) for s in p.slots}
    assert roles == {
        0: ("rollout", "l40s"),
        1: ("rollout", "l40s"),
        2: ("trainer", "h100"),
        3: ("rollout", "h100"),
    }
    # named by role, type and GPU id: within a role and type, sorted names follow the ids
    assert all(
        s.worker.startswith(f"{s.role}-{s.gpu_type}-") and s.worker.endswith(f"-g{s.gpus[0]:02d}")
        for s in p.slots
    )
    assert {s.env()["CUDA_VISIBLE_DEVICES"] for s in p.slots} == {"0", "1", "2", "3"}
    assert [s.gpus[0] for s in node_placement("rollout", "1,3").slots] == [1, 3]
    with pytest.raises(ConfigError, match="no GPU 7"):
        node_placement("rollout", "7")
    monkeypatch.setenv(FAKE_ENV, "")
    with pytest.raises(ConfigError, match="no GPU visible"):
        node_placement("rollout", "auto")


def test_worker_roles_split_by_counts():
    assert parse_roles("rollout", 3) == ["rollout"] * 3
    assert parse_roles("trainer=2,rollout", 4) == ["trainer", "trainer", "rollout", "rollout"]
    for bad in ("trainer=5,rollout", "trainer=1", "rollout,trainer", "judge"):
        with pytest.raises(ConfigError):
            parse_roles(bad, 4)


def test_worker_with_gpus_refuses_device(monkeypatch):
    monkeypatch.setenv(FAKE_ENV, "2xh100")
    res = CliRunner().invoke(
        app,
        [
            "worker",
            "--scheduler",
            "tcp://127.0.0.1:1",
            "--role",
            "rollout",
            "--gpus",
            "auto",
            "--device",
            "cuda:0",
        ],
    )
    assert res.exit_code == 2 and "drop --device" in res.output
    res = CliRunner().invoke(app, ["worker", "--scheduler", "tcp://127.0.0.1:1", "--role", "rollout"])
    assert res.exit_code == 2 and "--gpu-type is required" in res.output


def test_doctor_json_exits_0_without_gpus_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv(FAKE_ENV, "")
    res = CliRunner().invoke(app, ["doctor", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["gpus"] == [] and "no GPU" in report["summary"]
    assert report["torch"]["version"] and report["dask"] and report["redis"]["server_binary"]
    assert report["disk"]["free_gib"] > 0
    assert report["placement"]["cpu_reason"] and len(report["placement"]["workers"]) == 2  # the quickstart's
    table = CliRunner().invoke(app, ["doctor"])
    assert table.exit_code == 0 and "none visible" in table.stdout


def test_doctor_shows_the_placement_of_a_given_config_on_fake_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv(FAKE_ENV, "8xh100")
    res = CliRunner().invoke(app, ["doctor", write_config(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert len(report["gpus"]) == 8 and report["placement"]["cpu_reason"] is None
    assert sorted(w["gpus"][0] for w in report["placement"]["workers"]) == [0, 1, 2, 3, 4]


def test_gpu_bench_on_cpu_says_what_it_skips_and_writes_its_tables(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the bench would run")
    res = CliRunner().invoke(app, ["doctor", "--gpu-bench", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    result = json.loads((tmp_path / "gpu-bench.json").read_text())
    assert set(result["skipped"]) == {"allreduce", "weight_fetch", "rollout_train"} and not result["parts"]
    assert (
        "skipped" in res.output and "| rollout_train | skipped |" in (tmp_path / "gpu-bench.md").read_text()
    )


def test_topology_block_of_nvidia_smi_is_parsed():
    from digen.bench.doctor import parse_topology

    text = (
        "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV18\t0-47\t0\n"
        "GPU1\tNV18\t X \t0-47\t0\n\nLegend:\n"
    )
    assert parse_topology(text, 2) == [["X", "NV18"], ["NV18", "X"]]
    assert parse_topology("", 2) == []


@pytest.mark.slow
def test_gpu_bench_parts_run_their_code_on_cpu_at_a_small_size(tmp_path, tiny_sd3):
    """The weight fetch (two processes, the blob server, the bucketed fetch) and the bf16
    rollout-and-train part run on CPU with a small adapter and a 2-block transformer: what
    runs on GPUs is this code with cuda devices and SD3.5-Medium's size (about 20 s here)."""
    from digen.bench.gpu import _fetch_part, _rollout_train_part, bench_config

    cfg = bench_config(str(tmp_path / "model"))
    assert (cfg.model.dtype, cfg.model.device, cfg.model.resolution) == ("bfloat16", "cuda:0", 512)
    assert cfg.schedule.mode == "reference" and cfg.schedule.resolved().max_staleness == 0
    fetched = _fetch_part("cpu", "cpu", 8)
    assert fetched["size_mib"] == 8 and fetched["fetch_s"] > 0, fetched
    small = {"layers": 2, "heads": 2, "head_dim": 16}
    part = _rollout_train_part(str(tiny_sd3), str(tmp_path / "run"), "cpu", 32, small)  # built already
    assert part["iterations"] == 2 and part["gen_images_per_s"] > 0 and part["train_images_per_s"] > 0
    assert part["ratio_max_dev_bf16"] is not None and part["clipfrac_bf16"] is not None
    # a second bench into the same folder runs again (its first run's directory is its own)
    again = _rollout_train_part(str(tiny_sd3), str(tmp_path / "run"), "cpu", 32, small)
    assert again["iterations"] == 2 and again["ratio_max_dev_bf16"] == part["ratio_max_dev_bf16"]


def test_a_second_gpu_bench_clears_only_its_own_run(tmp_path):
    from digen.bench.gpu import clear_bench_run

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for run, model in ((ours, tmp_path / "model"), (theirs, tmp_path / "elsewhere")):
        run.mkdir()
        (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(model)}}))
        (run / "metrics.jsonl").write_text("{}\n")
    clear_bench_run(ours, str(tmp_path / "model"))
    clear_bench_run(theirs, str(tmp_path / "model"))
    assert not ours.exists() and (theirs / "metrics.jsonl").exists()


@pytest.mark.slow
def test_digen_worker_gpus_auto_starts_one_pinned_worker_per_gpu(tmp_path):
    """``digen worker --gpus auto`` on a node with a fake inventory of three GPUs of two kinds:
    three worker processes join the scheduler, each reading back its own GPU and type."""
    import signal
    import subprocess

    from distributed import Client, LocalCluster

    from digen.cluster.cluster import list_workers

    with LocalCluster(
        n_workers=0, processes=False, protocol="tcp", host="127.0.0.1", dashboard_address=None
    ) as cluster:
        env = dict(os.environ, **{FAKE_ENV: "1xh100,2xl40s", "OMP_NUM_THREADS": "1"})
        env.pop("DIGEN_SCHEDULER", None)
        log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 - closed below
        cmd = [*DIGEN, "worker", "--scheduler", cluster.scheduler_address]
        proc = subprocess.Popen(
            [*cmd, "--gpus", "auto", "--role", "trainer=1,rollout"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            with Client(cluster) as client:
                client.wait_for_workers(3, timeout=120)
                seen = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
                got = sorted((w.role.value, w.gpu_type, seen[w.address]) for w in list_workers(client))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover
                proc.kill()
            log.close()
    assert got == [("rollout", "l40s", "1"), ("rollout", "l40s", "2"), ("trainer", "h100", "0")], (
        tmp_path / "worker.log"
    ).read_text()


@pytest.mark.parametrize(
    ("device", "env", "expected"),
    [
        ("auto", None, "cuda:0"),  # digen worker without --device, add_local_worker, gpus: auto
        ("cuda", None, "cuda:0"),
        ("auto", "cuda", "cuda:0"),
        ("cuda:3", None, "cuda:3"),
        ("auto", "cpu", "cpu"),
    ],
)
def test_a_worker_on_cuda_computes_on_an_indexed_device(monkeypatch, device, env, expected):
    """torch patched to report 8 CUDA devices: the device a worker gets always has an index,
    which ``torch.cuda.set_device`` (run when a trainer, FSDP or sequence-parallel group forms)
    needs: it raised ValueError on the plain ``cuda`` ``model.device: auto`` used to give."""
    import torch

    from digen.workers.preload import worker_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    if env is None:
        monkeypatch.delenv("DIGEN_DEVICE", raising=False)
    else:
        monkeypatch.setenv("DIGEN_DEVICE", env)
    cfg = _on_device(cfg_of(1, 1), device)
    got = worker_device(cfg)
    assert got == expected
    if got.startswith("cuda"):
        chosen: list[int] = []
        monkeypatch.setattr(torch._C, "_cuda_setDevice", chosen.append, raising=False)  # a CPU build has none
        torch.cuda.set_device(torch.device(got))  # torch's own check of the index
        assert chosen == [int(expected.split(":")[1])]


def test_the_trainer_group_backend_follows_the_placement(monkeypatch):
    import torch

    from digen.cluster.placement import BACKEND_ENV
    from digen.parallel.comm import TRAINER_BACKEND_ENV, comm_device, trainer_backend

    assert BACKEND_ENV == TRAINER_BACKEND_ENV  # spelled twice: placement imports no torch
    cuda = torch.device("cuda:0")
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert trainer_backend(cuda) == "nccl" and trainer_backend(torch.device("cpu")) == "gloo"
    assert comm_device("nccl", cuda) == cuda
    monkeypatch.setenv(BACKEND_ENV, "gloo")
    assert trainer_backend(cuda) == "gloo" and comm_device("gloo", cuda) == torch.device("cpu")


def test_the_bench_all_reduce_ranks_are_placed_as_trainers_are(monkeypatch):
    """``digen doctor --gpu-bench``'s all-reduce ranks get the environment digen's placement
    gives trainers: each sees only its own GPU and computes on cuda:0 (not every GPU visible to
    every rank); a machine whose GPUs the placement cannot list is said, not guessed."""
    from digen.bench.gpu import allreduce_ranks
    from digen.cluster.placement import FAKE_ENV

    monkeypatch.setenv(FAKE_ENV, "4xh100")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    envs = allreduce_ranks(4)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["DIGEN_DEVICE"] for e in envs} == {"cuda:0"}
    monkeypatch.setenv(FAKE_ENV, "")
    with pytest.raises(RuntimeError, match="placement sees 0 GPU"):
        allreduce_ranks(2)


@pytest.mark.slow
def test_the_bench_all_reduce_forms_its_group_through_digens_rendezvous_and_store():
    """The part's code on CPU (its ranks pinned to the host: gloo): two spawned ranks meet
    through the trainer group's rendezvous and a Redis store in the embedded Redis, with the
    collective timeout a trainer group gets; on GPUs the same code runs on NCCL."""
    from digen.bench.gpu import ALLREDUCE_LEASE_S, _allreduce_part

    cpu = {"CUDA_VISIBLE_DEVICES": "", "DIGEN_DEVICE": "cpu"}
    got = _allreduce_part(2, envs=[cpu, cpu], mib=1)
    assert "error" not in got, got
    assert (got["ranks"], got["backend"], got["store"]) == (2, "gloo", "redis")
    assert got["timeout_s"] == ALLREDUCE_LEASE_S and got["visible"] == ["", ""] and got["ms"] > 0
