"""VeRL-Omni's diffusion trainer config (Hydra) as a digen config.

Input: a composed config YAML (a run's ``.hydra/config.yaml``, or the repository's
``verl_omni/trainer/config/_generated_diffusion_trainer.yaml``), or one of its launch scripts
(``examples/*_trainer/**/*.sh``): then the script's ``key=value`` overrides of
``verl_omni.trainer.main_diffusion`` (read by :mod:`digen.importers.shell`, never run) apply
on top of the generated default config found by walking up from the script. ``${KEY}`` and
``${oc.select:KEY,DEFAULT}`` interpolations are resolved within the config. :data:`CARRIED`
names every key translated; every other key is reported with the reason of its section
(:data:`SECTIONS`), collapsed to ``section.*`` where the whole section has one reason.
docs/coming-from-verl-omni.md is the same mapping for a reader.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from digen.config import read_yaml
from digen.errors import ConfigError
from digen.importers.common import (
    Imported,
    family_problem,
    flow_grpo_member,
    served_reward,
    set_dotted,
    set_mini_batches,
)
from digen.importers.shell import read_script, scalar, unresolved

GENERATED = "verl_omni/trainer/config/_generated_diffusion_trainer.yaml"
ENTRY = "verl_omni.trainer.main_diffusion"

A = "actor_rollout_ref."
CARRIED = {
    f"{A}model.path", f"{A}model.lora_rank", f"{A}model.lora_alpha", f"{A}model.target_modules",
    f"{A}model.algorithm", f"{A}actor.optim.lr", f"{A}actor.optim.weight_decay", f"{A}actor.optim.betas",
    f"{A}actor.optim.clip_grad", f"{A}actor.grad_clip", f"{A}actor.diffusion_loss.clip_ratio",
    f"{A}actor.diffusion_loss.adv_clip_max", f"{A}actor.use_kl_loss", f"{A}actor.kl_loss_coef",
    f"{A}actor.fsdp_config.model_dtype", f"{A}actor.ppo_mini_batch_size",
    f"{A}actor.ppo_micro_batch_size_per_gpu", f"{A}actor.ppo_epochs", f"{A}rollout.n",
    f"{A}rollout.pipeline.height", f"{A}rollout.pipeline.width", f"{A}rollout.pipeline.num_inference_steps",
    f"{A}rollout.pipeline.guidance_scale", f"{A}rollout.pipeline.true_cfg_scale",
    f"{A}rollout.pipeline.max_sequence_length", f"{A}rollout.algo.noise_level", f"{A}rollout.algo.sde_type",
    f"{A}rollout.algo.sde_window_size", f"{A}rollout.algo.sde_window_range", f"{A}rollout.algo.sample_strategy", f"{A}rollout.val_kwargs.pipeline.num_inference_steps",
    f"{A}actor.diffusion_loss.loss_mode", f"{A}actor.diffusion_loss.kl_mask_threshold",
    f"{A}actor.diffusion_loss.add_kl_coefficient", f"{A}actor.diffusion_loss.dpo_beta",
    "algorithm.trainer_type", "algorithm.sample_source", "algorithm.global_std", "algorithm.timestep_fraction", "algorithm.adv_estimator",
    "data.train_files", "data.val_files", "data.val_max_samples", "data.train_batch_size", "data.seed",
    "trainer.total_training_steps", "trainer.save_freq", "trainer.test_freq", "trainer.max_actor_ckpt_to_keep",
    "reward.custom_reward_function.name", "reward.custom_reward_function.path", "reward.aggregation",
}  # fmt: skip

SECTIONS = {
    "global_profiler": "profiling: digen bench and the run's timing records instead",
    "ray_kwargs": "digen runs on Dask, not Ray (cluster.*)",
    "transfer_queue": "digen's data plane moves samples worker to worker (docs/dataplane.md)",
    "skip": "rollout caching for debugging: no equivalent",
    "distillation": "distillation trainers are not in digen",
    "critic": "digen's algorithms have no critic",
    f"{A}ref": "the reference policy is the frozen base (LoRA off): no separate worker",
    f"{A}rollout": "vLLM-Omni engine settings: digen's rollout workers run the diffusers pipeline",
    f"{A}actor.fsdp_config": "train.fsdp shards the transformer (FULL_SHARD); offload is not in digen",
    f"{A}actor.optim": "digen's optimizer is AdamW at a constant rate (no warm-up or decay)",
    f"{A}actor": "engine, checkpoint and profiler settings of the actor: no equivalent",
    f"{A}model": "model-loading details: digen reads the diffusers snapshot at model.path",
    f"{A}": "engine placement (hybrid engine, timeouts): digen's schedule.mode and cluster",
    "algorithm.rollout_correction": "digen's optimizer steps are on-policy or one version stale, not importance-corrected",
    "algorithm": "digen's advantage is per group with std (train.global_std); no other estimator",
    "data": "prompt-loader settings: digen reads prompts.dataset (one prompt a line)",
    "trainer": "logging and placement: digen's logging.*, cluster.* and the run directory (--out)",
    "reward": "the reward model's engine: digen's reward names a scorer (docs/rewards.md)",
}

KEYS = {
    "diffusion/model_engine": "VeRL-Omni's Hydra model-engine schema (veomni_diffusion: VeOmni's engine); "
    "digen trains with its own trainers (train.fsdp shards a full fine-tune)",
    f"{A}rollout.val_kwargs.algo.noise_level": "digen evaluates with the deterministic ODE sampler (noise 0)",
    f"{A}rollout.pipeline.guidance_scale": "rollout.guidance_scale is set from true_cfg_scale",
    f"{A}model.lora_init_weights": "digen's LoRA starts at zero (B = 0), as PEFT's default",
    f"{A}model.lora_adapter_path": "digen starts LoRA from zero: a pre-trained adapter is not loaded",
    f"{A}actor.fsdp_config.param_offload": "digen keeps parameters on the GPU (no CPU offload)",
    f"{A}actor.fsdp_config.optimizer_offload": "digen keeps the optimizer state on the GPU (no CPU offload)",
    f"{A}actor.fsdp_config.ulysses_sequence_parallel_size": "digen's sequence parallelism is in the rollout "
    "(rollout.sequence_parallel); training is data-parallel",
    f"{A}actor.strategy": "train.fsdp shards a full fine-tune; LoRA is replicated",
    "trainer.total_epochs": "digen runs `iterations` rollout batches (trainer.total_training_steps)",
    "trainer.n_gpus_per_node": "scale cluster.local (rollout_workers, trainer_workers) to your GPUs",
    "trainer.nnodes": "several machines: see docs/deploy.md (digen worker on each)",
    "data.max_prompt_length": "model.max_sequence_length bounds the text",
    "algorithm.paired_preference": "online-dpo always trains one chosen/rejected pair per group "
    "(its best and worst sample)",
}

REWARD_FUNCTIONS = "reward.reward_functions."
"""The sub-rewards of MultiVisualRewardManager (``+reward.reward_functions.<key>.weight=...``): carried
as one reward each (:func:`_reward`)."""

OFF_BY_DEFAULT = {"algorithm.paired_preference"}
"""Switches of the base config that only matter when a recipe turns them on (the DPO recipes'
``paired_preference=true``): listed as not carried only then."""

_ALGORITHMS = {"flow_grpo": "flow-grpo", "grpo_guard": "grpo-guard", "mix_grpo": "mix-grpo",
               "flow_dppo": "flow-dppo", "diffusion_nft": "diffusion-nft", "dance_grpo": "dance-grpo",
               "dpo": "online-dpo"}  # fmt: skip
_SDE_TYPES = {"sde": "sde", "cps": "cps", "dance_sde": "dance"}  # rollout.algo.sde_type
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "fp32": "float32", "float32": "float32",
           "fp16": "float16", "float16": "float16"}  # fmt: skip


def import_verl_omni(spec: str) -> Imported:
    """The digen config of VeRL-Omni config ``spec`` (a ``.yaml`` or a launch ``.sh``)."""
    path = Path(spec)
    overridden: set[str] = set()
    if path.suffix == ".sh":
        base_path = _generated_for(path)
        data = read_yaml(base_path, "VeRL-Omni config")
        for word in read_script(path, ENTRY):
            key, sep, value = word.partition("=")
            if key == "--config-name" and "offline" in value:
                raise ConfigError(
                    f"VeRL-Omni {path.name}: --config-name={value}: offline DPO trains on a fixed dataset "
                    "of preference pairs; digen trains on its own rollouts (online-dpo pairs each group's "
                    "best and worst sample)"
                )
            if sep and not word.startswith("-"):
                _set(data, key.lstrip("+~"), scalar(value))
                overridden.add(key.lstrip("+~"))
        source = f"VeRL-Omni {path.name} (on {base_path.name})"
    else:
        data = read_yaml(path, "VeRL-Omni config")
        source = f"VeRL-Omni {path.name}"
    if not isinstance(data, dict):
        raise ConfigError(f"{spec} is not a VeRL-Omni config (a mapping of sections)")
    flat = _resolve(_flatten(data))
    out = Imported(source=source, config={})
    dataset = str(flat.get("data.custom_cls.path") or "")
    offline = str(flat.get("algorithm.sample_source") or "online") != "online"
    if offline or "offline" in dataset:
        key = "algorithm.sample_source" if offline else "data.custom_cls.path"
        raise ConfigError(
            f"{source}: {key}={flat[key]}: offline DPO trains on a "
            "fixed dataset of preference pairs; digen trains on its own rollouts (online-dpo pairs each "
            "group's best and worst sample)"
        )
    if why := family_problem(str(flat.get(f"{A}model.path") or ""), str(path.parent)):
        raise ConfigError(f"{source}: {A}model.path {why}")
    for key in sorted(CARRIED & flat.keys()):  # a path is only a placeholder's name: kept as written
        if not key.endswith(("path", "files", "name")) and (why := unresolved(key, flat[key])):
            raise ConfigError(f"{source}: {why}")
    _translate(flat, out)
    dropped: dict[str, str] = {}
    for key in flat:
        if key in CARRIED or key.rsplit(".", 1)[-1] == "_target_" or key.startswith(REWARD_FUNCTIONS):
            continue
        if key in OFF_BY_DEFAULT and flat[key] is False:
            continue  # a switch left off changes nothing digen trains
        section = max(
            (s for s in SECTIONS if key == s or key.startswith(s + ".") or key.startswith(s)),
            key=len,
            default="",
        )
        reason = KEYS.get(key) or SECTIONS.get(section, "not a key digen's importer knows")
        if key in overridden or key in KEYS:
            out.dropped.setdefault(key, reason)
        else:
            dropped[key] = reason
    out.dropped.update(_collapse(dropped))
    return out


def _generated_for(script: Path) -> Path:
    for parent in script.resolve().parents:
        if (parent / GENERATED).is_file():
            return parent / GENERATED
    raise ConfigError(f"no {GENERATED} above {script}: run from a VeRL-Omni checkout or pass its YAML")


def _set(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[leaf] = value


def _flatten(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


_INTERP = re.compile(r"^\$\{(?:oc\.select:)?([A-Za-z0-9_.]+)(?:,\s*(.*))?\}$")


def _resolve(flat: dict[str, Any]) -> dict[str, Any]:
    def one(value: Any, depth: int = 0) -> Any:
        if not isinstance(value, str) or depth > 10:
            return value
        match = _INTERP.match(value.strip())
        if not match:
            return value
        key, default = match.groups()
        if key in flat:
            return one(flat[key], depth + 1)
        return scalar(default) if default is not None else None

    return {k: one(v) for k, v in flat.items()}


def _collapse(dropped: dict[str, str]) -> dict[str, str]:
    """``section.* (N keys)``: the keys of a section, left at their defaults, that go for its reason
    (a key the script sets, or one with a reason of its own, is listed by name)."""
    out: dict[str, str] = {}
    for section, reason in SECTIONS.items():
        keys = [k for k, r in dropped.items() if r == reason and k.startswith(section)]
        if keys:
            out[f"{section.rstrip('.')}.* ({len(keys)} more keys)" if len(keys) > 1 else keys[0]] = reason
            for k in keys:
                del dropped[k]
    out.update(dropped)
    return out


def _translate(f: dict[str, Any], out: Imported) -> None:
    c = out.config
    seed = f.get("data.seed")
    c["seed"] = seed if isinstance(seed, int) else 42
    steps = f.get("trainer.total_training_steps")
    if isinstance(steps, int) and steps > 0:
        c["iterations"] = steps
    model = str(f.get(f"{A}model.path") or "")
    local = f"models/{model.rstrip('/').rsplit('/', 1)[-1] or 'MODEL'}"
    set_dotted(c, "model.path", local)
    out.placeholders["model.path"] = (
        f"a local diffusers snapshot of {model}: huggingface-cli download {model} --local-dir {local}"
    )
    height, width = f.get(f"{A}rollout.pipeline.height", 512), f.get(f"{A}rollout.pipeline.width", 512)
    set_dotted(c, "model.resolution", height)
    if width != height:
        out.dropped[f"{A}rollout.pipeline.width"] = f"digen's images are square: model.resolution {height}"
    set_dotted(c, "model.dtype", _DTYPES.get(str(f.get(f"{A}actor.fsdp_config.model_dtype")), "float32"))
    set_dotted(c, "model.device", "cuda")
    if f.get(f"{A}rollout.pipeline.max_sequence_length"):
        set_dotted(c, "model.max_sequence_length", f[f"{A}rollout.pipeline.max_sequence_length"])
    rank = f.get(f"{A}model.lora_rank") or 0
    lora: dict[str, Any] = {"enabled": rank > 0}
    if rank > 0:
        lora |= {"rank": rank, "alpha": f.get(f"{A}model.lora_alpha", 2 * rank), "dtype": "float32"}
        targets = f.get(f"{A}model.target_modules")
        if isinstance(targets, list):
            lora["target_modules"] = [str(t) for t in targets]
        elif targets is not None:
            out.dropped[f"{A}model.target_modules"] = (
                f"{targets!r} (peft: every linear layer) has no digen spelling: the family's default "
                "targets instead (docs/models.md, LoRA targets)"
            )
    set_dotted(c, "model.lora", lora)
    train_files = str(f.get("data.train_files") or "")
    parts = train_files.split("/")
    # .../data/ocr/qwen_image/train.parquet -> data/ocr (the task's folder under data/)
    name = (
        parts[parts.index("data") + 1]
        if "data" in parts[:-2]
        else posixpath.basename(posixpath.dirname(train_files))
    )
    name = name or "prompts"
    set_dotted(c, "prompts.dataset", f"data/{name}")
    out.placeholders["prompts.dataset"] = (
        f"the prompts of {train_files or 'data.train_files'} (parquet) as data/{name}/train.txt and test.txt, one a line"
    )
    _rollout(f, out)
    _train(f, out)
    _reward(f, out)
    test_freq, save_freq = f.get("trainer.test_freq"), f.get("trainer.save_freq")
    set_dotted(c, "eval.every", test_freq if isinstance(test_freq, int) and test_freq > 0 else 0)
    set_dotted(c, "output.checkpoint_every", save_freq if isinstance(save_freq, int) and save_freq > 0 else 1)
    val = f.get("data.val_max_samples")
    if isinstance(val, int) and val > 0:
        set_dotted(c, "eval.num_prompts", val)
    keep = f.get("trainer.max_actor_ckpt_to_keep")
    if isinstance(keep, int) and keep > 0:
        set_dotted(c, "output.keep_checkpoints", keep)
    set_dotted(c, "schedule.mode", "disaggregated")
    c["cluster"] = {"local": {"rollout_workers": 1, "trainer_workers": 1}}


def _rollout(f: dict[str, Any], out: Imported) -> None:
    c = out.config
    group = int(f.get(f"{A}rollout.n") or 1)
    prompts = int(f.get("data.train_batch_size") or 1)
    set_dotted(c, "rollout.batch_size", prompts * group)
    set_dotted(c, "rollout.group_size", group)
    set_dotted(c, "rollout.num_steps", f.get(f"{A}rollout.pipeline.num_inference_steps", 10))
    set_dotted(c, "rollout.eval_steps", f.get(f"{A}rollout.val_kwargs.pipeline.num_inference_steps") or 20)
    guidance = (
        f.get(f"{A}rollout.pipeline.true_cfg_scale") or f.get(f"{A}rollout.pipeline.guidance_scale") or 1.0
    )
    set_dotted(c, "rollout.guidance_scale", float(guidance))
    sde_type = str(f.get(f"{A}rollout.algo.sde_type") or "sde")  # unknown: kept, and refused by name
    set_dotted(
        c,
        "rollout.sde",
        {
            "kind": _SDE_TYPES.get(sde_type, sde_type),
            "noise_level": f.get(f"{A}rollout.algo.noise_level", 1.0),
        },
    )


def _train(f: dict[str, Any], out: Imported) -> None:
    c = out.config
    # model.algorithm names the rollout and the loss unless diffusion_loss.loss_mode (whose
    # default interpolates model.algorithm) names another loss than Flow-GRPO's: GRPO-Guard's
    # and Flow-DPPO's examples set model.algorithm=flow_grpo beside loss_mode=grpo_guard /
    # flow_dppo; MixGRPO's sets model.algorithm=mix_grpo with Flow-GRPO's loss
    loss_key, model_key = f"{A}actor.diffusion_loss.loss_mode", f"{A}model.algorithm"
    if f.get(loss_key) and f.get(loss_key) not in ("flow_grpo", f.get(model_key)):
        key = loss_key
    else:
        key = next((k for k in (model_key, "algorithm.adv_estimator") if f.get(k)), model_key)
    algo = str(f.get(key) or "flow_grpo")
    if algo not in _ALGORITHMS:
        raise ConfigError(
            f"{out.source}: {key}={algo} is not an algorithm digen trains "
            f"(it has {', '.join(sorted(_ALGORITHMS))}; digen algorithms lists them)"
        )
    set_dotted(c, "train.algorithm", _ALGORITHMS[algo])
    if algo == "dpo":
        _online_dpo(f, out)
        return
    if algo == "flow_dppo":
        threshold = f.get(f"{A}actor.diffusion_loss.kl_mask_threshold")
        if isinstance(threshold, (int, float)) and threshold > 0:
            set_dotted(c, "train.flow_dppo.kl_threshold", float(threshold))
        if f.get(f"{A}actor.diffusion_loss.add_kl_coefficient", True) is False:
            raise ConfigError(
                f"{out.source}: {A}actor.diffusion_loss.add_kl_coefficient=False: digen's flow-dppo "
                "weighs the mask's KL with the SDE variance (the peer's True, its default) only"
            )
    prompts = int(f.get("data.train_batch_size") or 1)
    mini = int(f.get(f"{A}actor.ppo_mini_batch_size") or prompts)
    # VeRL's ppo_mini_batch_size counts prompts (each with its rollout.n samples)
    set_mini_batches(out, prompts // max(1, mini), f"{A}actor.ppo_mini_batch_size", "VeRL-Omni takes")
    window = f.get(f"{A}rollout.algo.sde_window_size")
    strategy = f.get(f"{A}rollout.algo.sample_strategy")
    if c["train"]["algorithm"] == "mix-grpo" and window:
        # MixGRPO's window is its own (train.mix_grpo): the rollout algo's size and strategy
        mix: dict[str, Any] = {"window": int(window)}
        if strategy in ("progressive", "random", "decay"):
            mix["schedule"] = strategy
        set_dotted(c, "train.mix_grpo", mix)
        out.dropped[f"{A}rollout.algo.sde_window_range"] = (
            "MixGRPO's window moves over the steps digen's mix-grpo allows (train.mix_grpo), not a range"
        )
        window = None
    if window:
        # the rollout adapters' default range when the script passes none (sd3_flow_grpo
        # vllm_omni_rollout_adapter.py: ``_coalesce_not_none(..., (0, 5))``)
        window_range = f.get(f"{A}rollout.algo.sde_window_range") or [0, 5]
        if isinstance(window_range, str):
            window_range = scalar(window_range)
        set_dotted(
            c,
            "train.timesteps",
            {"strategy": "window", "window": window, "window_range": [int(v) for v in window_range]},
        )
    else:
        set_dotted(
            c,
            "train.timesteps",
            {"strategy": "prefix", "fraction": f.get("algorithm.timestep_fraction", 1.0)},
        )
    if c["train"]["algorithm"] == "flow-grpo":
        c["train"]["algorithm"] = flow_grpo_member(c)
    set_dotted(c, "train.clip_range", f.get(f"{A}actor.diffusion_loss.clip_ratio", 1e-4))
    set_dotted(c, "train.adv_clip", float(f.get(f"{A}actor.diffusion_loss.adv_clip_max", 5.0)))
    set_dotted(c, "train.global_std", bool(f.get("algorithm.global_std", True)))
    set_dotted(
        c, "train.kl_beta", f.get(f"{A}actor.kl_loss_coef", 0.0) if f.get(f"{A}actor.use_kl_loss") else 0.0
    )
    set_dotted(c, "train.lr", f.get(f"{A}actor.optim.lr", 1e-6))
    set_dotted(c, "train.weight_decay", f.get(f"{A}actor.optim.weight_decay", 0.01))
    betas = f.get(f"{A}actor.optim.betas")
    if isinstance(betas, list) and len(betas) == 2:
        set_dotted(c, "train.betas", betas)
    set_dotted(
        c, "train.grad_clip", float(f.get(f"{A}actor.grad_clip") or f.get(f"{A}actor.optim.clip_grad") or 1.0)
    )
    micro = f.get(f"{A}actor.ppo_micro_batch_size_per_gpu")
    if isinstance(micro, int) and micro > 0:
        set_dotted(c, "train.rows_per_forward", micro)
    if f.get(f"{A}actor.ppo_epochs", 1) != 1:
        out.dropped[f"{A}actor.ppo_epochs"] = "digen takes one pass over each rollout batch"
    if not c["model"]["lora"]["enabled"]:
        set_dotted(c, "train.fsdp", True)


def _online_dpo(f: dict[str, Any], out: Imported) -> None:
    """VeRL-Omni's online ``dpo`` loss (``DPOLoss``): digen's online-dpo pairs each group's best
    and worst sample as the peer's ``build_online_dpo_pair_indices``; its timestep and noise per
    pair are the loss's own, so the rollout's SDE, timestep and clip keys have no role."""
    c = out.config
    set_dotted(c, "train.online_dpo", {"beta": float(f.get(f"{A}actor.diffusion_loss.dpo_beta", 2000.0))})
    prompts = int(f.get("data.train_batch_size") or 1)
    mini = int(f.get(f"{A}actor.ppo_mini_batch_size") or prompts)
    set_mini_batches(out, prompts // max(1, mini), f"{A}actor.ppo_mini_batch_size", "VeRL-Omni takes")
    del c["rollout"]["sde"]  # a deterministic solver (train.online_dpo.solver: euler, the peer's)
    if f.get(f"{A}actor.use_kl_loss") and f.get(f"{A}actor.kl_loss_coef"):
        raise ConfigError(
            f"{out.source}: {A}actor.use_kl_loss=True: online-dpo's reference is inside its loss (no KL term)"
        )
    set_dotted(c, "train.lr", f.get(f"{A}actor.optim.lr", 1e-6))
    set_dotted(c, "train.weight_decay", f.get(f"{A}actor.optim.weight_decay", 0.01))
    betas = f.get(f"{A}actor.optim.betas")
    if isinstance(betas, list) and len(betas) == 2:
        set_dotted(c, "train.betas", betas)
    set_dotted(
        c, "train.grad_clip", float(f.get(f"{A}actor.grad_clip") or f.get(f"{A}actor.optim.clip_grad") or 1.0)
    )
    micro = f.get(f"{A}actor.ppo_micro_batch_size_per_gpu")
    if isinstance(micro, int) and micro > 0:
        set_dotted(c, "train.rows_per_forward", micro)
    if f.get(f"{A}actor.ppo_epochs", 1) != 1:
        out.dropped[f"{A}actor.ppo_epochs"] = "digen takes one pass over each rollout batch"
    for key in (f"{A}actor.diffusion_loss.clip_ratio", f"{A}actor.diffusion_loss.adv_clip_max",
                "algorithm.timestep_fraction", f"{A}rollout.algo.noise_level", f"{A}rollout.algo.sde_type"):  # fmt: skip
        if key in f:
            out.dropped[key] = (
                "online-dpo has no ratio, SDE or trained-step window: each pair draws its timestep"
            )


def _reward_functions(f: dict[str, Any]) -> dict[str, float]:
    """``reward.reward_functions.<key>.{path, name, weight}``: each sub-reward's weight, by key."""
    subs: dict[str, float] = {}
    for key, value in f.items():
        if key.startswith(REWARD_FUNCTIONS):
            sub, _, field = key[len(REWARD_FUNCTIONS) :].partition(".")
            subs.setdefault(sub, 1.0)
            if field == "weight":
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ConfigError(f"{key}={value!r} must be a number (the sub-reward's weight)")
                subs[sub] = float(value)
    return subs


def _reward(f: dict[str, Any], out: Imported) -> None:
    subs = _reward_functions(f)
    if subs:
        # MultiVisualRewardManager: sum_k weight_k score_k over reward.reward_functions
        # (verl_omni/reward_loop/reward_manager/multi.py l.150-188), digen's weighted reward sum
        aggregation = str(f.get("reward.aggregation") or "weighted_sum")
        if aggregation != "weighted_sum":
            raise ConfigError(
                f"reward.aggregation={aggregation}: digen combines rewards as a weighted sum (weighted_sum) "
                "or DanceGRPO's per-reward advantages (train.multi_reward)"
            )
        out.config["reward"] = [served_reward(sub, weight) for sub, weight in subs.items()]
        set_dotted(out.config, "train.multi_reward", "sum")
        out.placeholders["reward"] = (
            f"VeRL-Omni's sub-rewards {', '.join(subs)} are custom functions: serve each at its http reward's url; "
            "a sub-reward that raises scores 0 there (multi.py l.181-185), a NaN here drops the sample"
        )
        return
    fn = f"{f.get('reward.custom_reward_function.path') or ''} {f.get('reward.custom_reward_function.name') or ''}".lower()
    for name in ("ocr", "pickscore", "clipscore", "aesthetic", "hpsv2", "imagereward", "geneval"):
        if name in fn:
            out.config["reward"] = [{"name": name, "weight": 1.0}]
            if name == "ocr":
                out.placeholders["reward"] = (
                    "VeRL-Omni scores OCR with a VLM judge (GenRM-OCR); digen's ocr reward is RapidOCR's edit distance"
                )
            return
    out.config["reward"] = [served_reward("custom_reward_function")]
    out.placeholders["reward"] = (
        "VeRL-Omni's reward is a custom function: serve it at the http reward's url (a placeholder), "
        "or name a digen reward (digen rewards)"
    )
