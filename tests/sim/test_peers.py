"""The peers as simulator modes, and the cost model checked against VeRL-Omni's published run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from digen.bench.dataplane import SIZES
from digen.errors import ConfigError
from digen.sim.catalog import load_sim_config
from digen.sim.costmodel import EfficiencyCurve, pass_efficiency, sample_memory_gb
from digen.sim.driver import PEERS, parse_modes
from digen.sim.peers import peer_phases
from digen.sim.report import json_rows
from digen.sim.study import SimSettings, run_study

from .conftest import uniform_model

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "sim"
FAST = SimSettings(iterations=3, warmup=1, trailing=1, neighbours=0)


def test_no_peer_carries_a_fitted_factor_and_every_recipe_names_its_commit():
    """Every term of a peer is its code or a published measurement (or a named assumption):
    no recipe field scales its phases, and each recipe says which commit it restates."""
    from dataclasses import fields

    from digen.sim.peers import PeerRecipe

    assert not any("calibration" in f.name or "factor" in f.name for f in fields(PeerRecipe))
    setup = load_sim_config(CONFIGS / "verl-omni-published.yaml")
    peers = setup.cost.paper.peers
    assert all(r.commit for r in peers.values())
    # VeRL-Omni before batched generation (9401c4b0) and at a1139ba (MAX_NUM_SEQS=8)
    assert peers["verl-omni-unbatched"].gen_batch == 1 and "9401c4b0" in peers["verl-omni-unbatched"].commit
    assert peers["verl-omni"].gen_batch == 8 and "a1139ba" in peers["verl-omni"].commit


def test_default_modes_include_every_peer_in_the_json_rows():
    setup = load_sim_config(CONFIGS / "qwen-image_C.yaml")
    modes = parse_modes(None)
    assert set(PEERS) <= set(modes)
    study = run_study(setup.cost, [*PEERS, "digen"], FAST)
    rows = {r["mode"]: r for r in json_rows(study)}
    have = set(PEERS) - set(study.no_pipeline)  # GenRL has no Qwen-Image pipeline
    assert set(rows) == {*have, "digen"} and have == set(PEERS) - {"genrl"}
    assert all(rows[p]["s_per_iteration"] > 0 for p in have)
    for p in have:  # digen's speedup over each peer, in its row
        want = rows["digen"]["samples_per_s"] / rows[p]["samples_per_s"]
        assert rows["digen"]["speedup_vs_peers"][p] == pytest.approx(want)


def test_peer_phase_orders_follow_their_code():
    setup = load_sim_config(CONFIGS / "verl-omni-published.yaml")
    paper = setup.cost.paper
    gpu = paper.testbed.gpus[0][0]
    names = {p: [x.name for x in peer_phases(paper.peers[p], paper, gpu, 1, 128)] for p in paper.peers}
    names["genrl"] = [
        x.name
        for x in peer_phases(
            load_sim_config(CONFIGS / "wan2.1_B.yaml").cost.paper.peers["genrl"], paper, gpu, 1, 8
        )
    ]
    v = names["verl-omni"]
    order = ["generate", "rollout sleep", "reward wake", "reward", "reward sleep", "actor onload"]
    order += ["old log-prob", "train", "optimizer steps", "actor offload", "weight sync", "rollout wake"]
    assert [n for n in v if n in order] == order
    for p in ("genrl", "flow-grpo"):  # log-probs kept from sampling
        assert "old log-prob" not in names[p]
        assert "weight sync" not in names[p]  # they sample with the training model
    assert "reference forward" in names["genrl"]  # beta 3e-4
    assert "reference forward" not in names["flow-grpo"]  # pickscore_qwenimage: beta 0


def test_verl_omni_reward_is_the_measured_ocr_cost():
    """0.47 H800-GPU-s per image (60 s x 4 GPUs / 512 images), as measured: no factor."""
    setup = load_sim_config(CONFIGS / "verl-omni-published.yaml")
    paper = setup.cost.paper
    recipe = paper.peers["verl-omni"]
    gpu = paper.testbed.gpus[0][0]
    reward = next(x for x in peer_phases(recipe, paper, gpu, 1, 128) if x.name == "reward")
    assert reward.seconds == pytest.approx(128 * 0.47, rel=1e-6)


def test_adapter_size_is_counted_from_the_architecture_as_the_dataplane_bench_does():
    model = load_sim_config(CONFIGS / "verl-omni-published.yaml").workload.model
    assert model.adapter_gb == pytest.approx(SIZES["qwen-image-lora-r64"] / 2 / 1e9, rel=0.01)
    flux = load_sim_config(CONFIGS / "flux_B.yaml").workload.model
    assert flux.adapter_gb == pytest.approx(SIZES["flux-lora-r64"] / 2 / 1e9, rel=0.01)


def test_fit_check_counts_the_vae_and_a_text_encoder_larger_than_the_transformer():
    model = load_sim_config(CONFIGS / "verl-omni-published.yaml").workload.model
    assert sample_memory_gb(model, 1) == pytest.approx(model.weights_gb + model.activation_gb + model.vae_gb)
    from dataclasses import replace

    big_te = replace(model, text_encoder_gb=60.0)
    assert sample_memory_gb(big_te, 1) == pytest.approx(60.0 + model.vae_gb)


def test_efficiency_grows_with_the_tokens_of_a_pass():
    curve = EfficiencyCurve(half_tokens=256, ref_tokens=4096, cap=1.05)
    effs = [pass_efficiency(curve, n) for n in (256, 1024, 4096, 16384, 10**6)]
    assert effs == sorted(effs) and effs[2] == pytest.approx(1.0) and effs[-1] == pytest.approx(1.05)
    assert pass_efficiency(EfficiencyCurve(), 10) == 1.0


def test_micro_batching_makes_the_peers_faster_per_sample():
    """The curve is why a peer's micro-batch of 16 beats 16 passes of one."""
    setup = load_sim_config(CONFIGS / "verl-omni-published.yaml")
    paper = setup.cost.paper
    gpu = paper.testbed.gpus[0][0]
    from dataclasses import replace

    recipe = paper.peers["verl-omni"]
    one = replace(recipe, train_micro_batch=1)
    train = {
        r.train_micro_batch: next(x for x in peer_phases(r, paper, gpu, 1, 128) if x.name == "train")
        for r in (recipe, one)
    }
    assert train[16].seconds < 0.9 * train[1].seconds


def test_a_peer_mode_on_a_measured_cost_model_is_a_config_error():
    with pytest.raises(ConfigError, match="paper-scale"):
        run_study(uniform_model(), ["verl-omni"], FAST)


def test_the_results_table_compares_digen_with_each_peer():
    from digen.sim.report import markdown_results

    setup = load_sim_config(CONFIGS / "verl-omni-published.yaml")
    study = run_study(setup.cost, [*PEERS, "digen"], FAST)
    text = markdown_results([("w", "t", study)])
    head = text.splitlines()[0]
    assert all(f"digen vs {p}" in head and f"{p} s/it" in head for p in PEERS)
    row = text.splitlines()[2].split("|")
    ratio = float(row[head.split("|").index(" digen vs verl-omni ")].strip().rstrip("x"))
    got = {r.mode: r.sim.samples_per_s for r in study.results}
    assert ratio == pytest.approx(got["digen"] / got["verl-omni"], abs=0.006)


def test_each_peer_runs_its_own_recipe_per_model_and_none_where_it_has_no_pipeline():
    """Flow-GRPO's pickscore_qwenimage (batch 4, beta 0, FSDP) and pickscore_flux (batch 3,
    beta 0, ZeRO-2); VeRL-Omni has no FLUX pipeline, GenRL only Wan ones, nobody HunyuanVideo."""
    qwen = load_sim_config(CONFIGS / "qwen-image_B.yaml").cost.paper
    flux = load_sim_config(CONFIGS / "flux_B.yaml").cost.paper
    fq, ff = qwen.peers["flow-grpo"], flux.peers["flow-grpo"]
    assert (fq.gen_batch, fq.train_micro_batch, fq.reference_forward, fq.fsdp) == (4, 4, False, True)
    assert (ff.gen_batch, ff.train_micro_batch, ff.reference_forward, ff.fsdp) == (3, 3, False, False)
    assert set(flux.no_pipeline) == set(PEERS) - {"flow-grpo"}
    video = load_sim_config(CONFIGS / "hunyuan-video_B.yaml").cost.paper
    assert not video.peers and set(video.no_pipeline) == set(PEERS)
    study = run_study(load_sim_config(CONFIGS / "flux_C.yaml").cost, [*PEERS, "digen"], FAST)
    assert [r.mode for r in study.results] == ["flow-grpo", "digen"]
    assert set(study.no_pipeline) == set(PEERS) - {"flow-grpo"}
    from digen.sim.report import markdown_results

    assert "no such pipeline" in markdown_results([("flow-grpo-flux", "C", study)])
    from digen.sim.driver import MODES, simulate

    with pytest.raises(ConfigError, match="no such pipeline"):
        simulate(load_sim_config(CONFIGS / "flux_C.yaml").cost, MODES["genrl"])


def test_a_kl_weight_charges_a_reference_forward_to_digen_as_to_a_peer():
    """train.kl_beta > 0 (the workload's kl_beta) adds one forward per trained row: a train
    task costs (factor + 1) / factor of the same task without it."""
    from dataclasses import replace

    from digen.sim.costmodel import worker_cost

    setup = load_sim_config(CONFIGS / "wan2.1_B.yaml")
    w = setup.workload
    assert w.kl_beta > 0  # GenRL's beta 3e-4: the same algorithm on both sides
    gpu = setup.testbed.gpus[0][0]
    with_kl, _ = worker_cost(w, gpu, setup.cost.workers[0].gpus)
    without, _ = worker_cost(replace(w, kl_beta=0.0), gpu, setup.cost.workers[0].gpus)
    f = w.model.train_flops_factor
    assert with_kl.passes.row_s == pytest.approx(without.passes.row_s * (f + 1) / f)
    assert with_kl.gen_s == without.gen_s
    assert setup.cost.paper.peers["genrl"].reference_forward


def test_a_peer_runs_one_parallel_degree_on_every_gpu_of_a_mixed_testbed():
    """Wan2.1 needs sequence parallel 2 on an L20 and 1 on an H20: digen's replicas differ,
    the SPMD peer's are all 2 GPUs, each with the same share."""
    from digen.sim.driver import MODES, simulate

    cost = load_sim_config(CONFIGS / "wan2.1_AC.yaml").cost
    assert {w.gpu_type: w.gpus for w in cost.workers} == {"l20": 2, "h20": 1}
    res = simulate(cost, MODES["genrl"], iterations=3, warmup=1, trailing=1)
    assert {r["gpus"] for r in res.rows} == {2}
    workers = {r["worker"] for r in res.rows}
    assert len(workers) == (32 + 16) // 2
    gens = {
        r["worker"]: r["end"] - r["start"] for r in res.rows if r["kind"] == "gen" and r["iteration"] == 0
    }
    l20 = max(v for k, v in gens.items() if k.startswith("l20"))
    h20 = max(v for k, v in gens.items() if k.startswith("h20"))
    assert l20 > h20  # the same share: the L20 pairs set the pace


def test_the_async_peers_overlap_generation_with_training_and_differ_at_the_sync():
    """VeRL-Omni separate_async aborts in-flight generations at a sync (lost work when the
    rollout is the longer side) and scores as it generates; UniRL drains them, scoring each as
    the drain reaps it, so its reward waits for training and holds both sides."""
    from digen.sim.peers import async_iteration, best_async_split

    paper = load_sim_config(CONFIGS / "verl-omni-published.yaml").cost.paper
    abort, drain = paper.peers["verl-omni-async"], paper.peers["unirl-async"]
    assert (abort.async_sync, drain.async_sync) == ("abort", "drain")
    assert (abort.async_staleness, drain.async_staleness) == (1, 1)
    for r in (1, 2, 3):
        a, d = async_iteration(abort, paper, r), async_iteration(drain, paper, r)
        assert (a.train_s, a.sync_s) == (d.train_s, d.sync_s) and d.lost_s == 0 and a.drain_s == 0
        assert d.drain_s > 0 and a.gen_s == pytest.approx(d.gen_s + d.drain_s)  # the same reward
        assert a.seconds == pytest.approx(max(a.gen_s + a.lost_s, a.train_s) + a.sync_s)
        assert d.seconds == pytest.approx(max(d.gen_s, d.train_s) + d.drain_s + d.sync_s)
        assert (a.lost_s > 0) == (a.gen_s > a.train_s)
    best = best_async_split(drain, paper)
    assert best.seconds == min(async_iteration(drain, paper, r).seconds for r in (1, 2, 3))
    study = run_study(load_sim_config(CONFIGS / "verl-omni-published.yaml").cost, ["unirl-async"], FAST)
    res = study.result("unirl-async")
    assert res.sim.s_per_iteration == pytest.approx(best.seconds)
    assert res.rollout_gpus == best.rollout_gpus and res.trainer_gpus == 4 - best.rollout_gpus


def test_unirl_drains_every_generation_before_a_sync_and_its_default_alternates():
    """UniRL's AsyncDiffusionTrainer (unirl@37ea9f27): before each weight sync every in-flight
    generation finishes and is scored, so on the timeline no rollout GPU generates or scores
    across a sync; with its default buffer_max_staleness 0 nothing is launched past a sync, so
    generation, reward and training follow one another."""
    from digen.sim.peers import async_iteration, simulate_async_peer

    cost = load_sim_config(CONFIGS / "verl-omni-full-h200.yaml").cost
    paper = cost.paper
    unirl = paper.peers["unirl-async"]
    res = simulate_async_peer(cost, unirl, iterations=4, warmup=1, trailing=1)
    syncs = sorted((r["start"], r["end"]) for r in res.rows if r.get("part") == "weight sync")
    work = [r for r in res.rows if r["kind"] in ("gen", "reward", "train")]
    assert work and syncs
    for r in work:  # nothing runs while a sync does
        assert all(r["end"] <= s + 1e-9 or r["start"] >= e - 1e-9 for s, e in syncs)
    trained = {r["iteration"]: r["end"] for r in work if r["kind"] == "train"}
    for r in work:
        if r["kind"] == "reward":  # scored in the drain: after the trainers are done
            assert r["start"] >= trained[r["iteration"]] - 1e-9
    one = replace(unirl, async_staleness=1)
    zero = replace(unirl, async_staleness=0)
    for rollouts in (1, 2, 3):
        a, b = async_iteration(one, paper, rollouts), async_iteration(zero, paper, rollouts)
        assert b.seconds == pytest.approx(b.gen_s + b.drain_s + b.train_s + b.sync_s)
        assert b.seconds > a.seconds
    res0 = simulate_async_peer(cost, zero, iterations=4, warmup=1, trailing=1)
    gens = {r["iteration"]: r for r in res0.rows if r["kind"] == "gen" and not r.get("part")}
    for r in res0.rows:
        if r["kind"] == "train":  # training waits for its batch's generation
            assert r["start"] >= gens[r["iteration"]]["end"] - 1e-9


def test_an_async_peer_on_a_mixed_testbed_is_marked_not_modelled():
    paper = load_sim_config(CONFIGS / "qwen-image_AC.yaml").cost.paper
    assert {"verl-omni-async", "unirl-async"} == set(paper.not_modelled)
    assert "verl-omni" in paper.peers


def test_the_batch_gain_is_the_published_batch_measurements():
    """The catalog's generation batching is the two published per-sample speedups (vLLM-Omni
    1.36x at 8, VeRL-Omni's rollout_batching.md 2.10x at 32), log-linear between them and flat
    beyond; nothing for a video's pass (before: 1.21x and 1.24x from the efficiency curve)."""
    setup = load_sim_config(CONFIGS / "verl-omni-published.yaml")
    gain, image = setup.cost.paper.batch_gain, setup.workload.model.tokens
    assert image <= gain.max_tokens
    assert gain(1, image) == 1.0 and gain(8, image) == 1.36 and gain(32, image) == 2.10
    assert 1.36 < gain(16, image) < 2.10 and gain(128, image) == 2.10
    assert gain(32, gain.max_tokens + 1) == 1.0
