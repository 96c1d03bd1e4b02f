"""A Flow-Factory recipe (``examples/<trainer>/<lora|full>/<model>/*.yaml``) as a digen config.

Flow-Factory (X-GenGroup/Flow-Factory, read at a0b2bc5) describes a run in one YAML file:
``model`` (``model_type``, ``finetune_type``, LoRA), ``train`` (``trainer_type``, batch and
optimizer, KL, EMA), ``scheduler`` (the SDE: ``dynamics_type``, ``noise_level``, the steps
eligible for noise ``sde_steps`` of which ``num_sde_steps`` are drawn each rollout), ``eval``
and ``rewards``. The file is read with ``yaml.safe_load`` (never executed).

This importer carries what digen trains: the trainers of :data:`TRAINERS` on the model types
of digen's families (:data:`MODEL_TYPES`); anything else is refused in one line naming the
key. ``grpo`` becomes a Flow-GRPO member; ``dgpo``, ``awm``, ``nft`` and ``dpo`` (the
clean-sample trainers: an ODE rollout keeping the final latents, a flow-matching loss on them
noised forward) become digen's algorithm of the same objective, each key mapped where digen's
math is the peer's (:func:`_clean_sample`), the recipe refused in one line naming every key
whose math digen's algorithm does not have. docs/coming-from-flow-factory.md is the same
mapping for a reader, with the peer's file and line of each key.
Per epoch Flow-Factory samples ``unique_sample_num_per_epoch`` prompts, ``group_size``
images each, and takes ``gradient_step_per_epoch`` optimizer steps over them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from digen.config import read_yaml
from digen.errors import ConfigError
from digen.importers.common import Imported, family_problem, served_reward, set_dotted, set_mini_batches

# model.model_type -> digen family (None: not a digen family, with what it is)
MODEL_TYPES: dict[str, str | None] = {
    "sd3-5": "sd3", "flux1": "flux", "qwen-image": "qwen-image", "wan2_t2v": "wan",
    "flux1-kontext": None, "flux2": None, "flux2-klein": None, "qwen-image-edit-plus": None,
    "wan2_i2v": None, "wan2_v2v": None, "z-image": None, "ltx2_t2av": None, "ltx2_i2av": None,
}  # fmt: skip

# train.trainer_type -> digen algorithm (the rollout decides the Flow-GRPO member)
TRAINERS: dict[str, str] = {
    "grpo": "flow-grpo", "dgpo": "dgpo", "awm": "awm", "nft": "diffusion-nft", "dpo": "online-dpo",
}  # fmt: skip
CLEAN_SAMPLE = ("dgpo", "awm", "nft", "dpo")
"""The trainers whose rollout is Flow-Factory's ``dynamics_type: ODE`` and whose loss reads the
clean final latents only (digen/algos/clean_sample.py)."""

# Flow-Factory's defaults for the keys a clean-sample trainer reads where the recipe leaves them
# unset (src/flow_factory/hparams/training_args.py at a0b2bc5: TrainingArguments l.103-242 and
# each trainer's subclass; create_decay_fn's l.154-162 in ema/ema_utils.py for the EMA schedule)
PEER_DEFAULTS: dict[str, Any] = {
    "per_device_batch_size": 1, "gradient_step_per_epoch": 2, "gradient_accumulation_steps": "auto",
    "max_grad_norm": 1.0, "num_inner_epochs": 1, "group_size": 1, "unique_sample_num_per_epoch": 8,
    "num_inference_steps": 10, "guidance_scale": 3.5, "seed": 42, "learning_rate": 1e-5,
    "adam_weight_decay": 1e-4, "adam_betas": [0.9, 0.999], "adam_epsilon": 1e-8, "ema_decay": 0.995,
    "ema_update_interval": 10, "ema_decay_schedule": "power", "warmup_steps": 10, "initial_decay": 0.0,
    "flat_steps": 0, "ramp_rate": 0.001, "global_std": True, "advantage_aggregation": "gdpo",
    "adv_clip_range": 5.0, "kl_beta": 0.0, "off_policy": False,
}  # fmt: skip
TRAINER_DEFAULTS: dict[str, dict[str, Any]] = {
    # GRPOTrainingArguments (l.409-452)
    "grpo": {"clip_range": 1e-4},
    # DGPOTrainingArguments (l.716-807), on GRPOTrainingArguments (l.409-452: clip_range 1e-4)
    "dgpo": {"clip_range": 1e-4, "dpo_beta": 100.0, "use_shared_noise": True, "clip_dsm": True,
             "clip_kl": False, "switch_ema_ref": 200, "kl_cfg": 1.0, "use_ema_ref": False,
             "ema_ref_max_decay": 0.3, "ema_ref_ramp_rate": 0.001, "num_train_timesteps": 0,
             "time_sampling_strategy": "discrete", "timestep_range": 0.6},
    # AWMTrainingArguments (l.534-623)
    "awm": {"ema_kl_beta": 0.0, "awm_weighting": "Uniform", "ghuber_power": 0.25, "clip_range": 1e-4,
            "num_train_timesteps": 0, "time_sampling_strategy": "discrete", "timestep_range": 0.9},
    # NFTTrainingArguments (l.455-531)
    "nft": {"nft_beta": 1.0, "num_train_timesteps": 0, "time_sampling_strategy": "discrete",
            "timestep_range": 0.9},
    # DPOTrainingArguments (l.626-713)
    "dpo": {"beta": 2000.0, "weighting_scheme": "logit_normal", "logit_mean": 0.0, "logit_std": 1.0,
            "num_train_timesteps": 1, "time_shift": 1.0, "timestep_range": 0.99},
}  # fmt: skip

# model.model_type -> the static shift of its published scheduler config, for the steps a
# clean-sample trainer's timestep_range selects (read off the rollout schedule, below)
STATIC_SHIFT: dict[str, float] = {"sd3-5": 3.0}
_WEIGHTING = {"Uniform": "uniform", "t": "t", "t**2": "t2", "huber": "huber", "ghuber": "ghuber"}
# digen's DiffusionNFT old-weight decays (digen/algos/diffusion_nft.py nft_decay): type ->
# Flow-Factory's piecewise_linear (flat_steps, ramp_rate, max decay), ema/ema_utils.py l.78-102
_NFT_DECAYS = {1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}

_DYNAMICS = {"Flow-SDE": "sde", "CPS": "cps", "Dance-SDE": "dance"}
_REWARDS = {"pick_score": "pickscore", "pickscore": "pickscore", "clip_score": "clipscore",
            "clipscore": "clipscore", "hpsv2": "hpsv2", "image_reward": "imagereward",
            "aesthetic": "aesthetic", "ocr": "ocr"}  # fmt: skip
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}

NO_EQUIVALENT = {
    "launcher": "digen starts its own workers (cluster.*)",
    "config_file": "DeepSpeed/accelerate settings: train.fsdp shards a full fine-tune",
    "num_processes": "scale cluster.local (rollout_workers, trainer_workers) to your GPUs",
    "main_process_port": "digen's processes find each other through Dask",
    "log": "logs, checkpoints and samples go to the run directory (--out); logging.*",
    "data.preprocessing_batch_size": "digen encodes prompts as it goes",
    "data.dataloader_num_workers": "digen's prompt loader has no worker processes",
    "data.force_reprocess": "digen keeps no prompt cache",
    "data.cache_dir": "digen keeps no prompt cache",
    "data.max_dataset_size": "digen reads every prompt of prompts.dataset",
    "data.sampler_type": "digen draws each iteration's prompts from `seed`",
    "model.resume_path": "a command-line flag in digen: digen train CONFIG --out RUN_DIR --resume",
    "model.resume_type": "digen resumes its own checkpoints (--resume)",
    "model.attn_backend": "digen uses PyTorch's scaled-dot-product attention",
    "train.ref_param_device": "the reference is the base weights with LoRA off: no copy",
    "train.ema_device": "the EMA lives beside the weights",
    "scheduler.seed": "digen draws the SDE window from `seed`",
    "eval.resolution": "digen evaluates at model.resolution",
    "eval.per_device_batch_size": "eval.batch_size",
    "eval.guidance_scale": "digen evaluates with rollout.guidance_scale",
    "eval.seed": "eval.seed is digen's `seed`",
    "eval_rewards": "digen evaluates with the training reward",
}


def import_recipe(spec: str) -> Imported:
    """The digen config of the Flow-Factory recipe at ``spec``."""
    path = Path(spec)
    data = read_yaml(path, "Flow-Factory recipe")
    if not isinstance(data, dict) or not isinstance(data.get("train"), dict):
        raise ConfigError(f"{spec} is not a Flow-Factory recipe (a mapping with a train section)")
    out = Imported(source=f"Flow-Factory {path.name}", config={})
    model, train = data.get("model") or {}, data["train"]
    trainer = str(train.get("trainer_type", "grpo"))
    if trainer not in TRAINERS:
        raise ConfigError(
            f"{out.source}: train.trainer_type={trainer} is not an algorithm this importer maps to digen "
            f"(it maps {', '.join(sorted(TRAINERS))})"
        )
    model_type = str(model.get("model_type", ""))
    name = str(model.get("model_name_or_path") or "")
    if MODEL_TYPES.get(model_type) is None or "wan2.2" in name.lower():
        why = family_problem(name) or (
            f"{name}: Wan2.2 is not a digen model family (digen's wan is Wan2.1)"
            if "wan2.2" in name.lower()
            else f"{model_type or name} is not a digen model family"
        )
        raise ConfigError(f"{out.source}: model.model_type={model_type}: {why} (docs/models.md lists them)")
    _translate(data, out, MODEL_TYPES[model_type] or "")
    return out


def _translate(data: dict[str, Any], out: Imported, family: str) -> None:
    c = out.config
    model, train = data.get("model") or {}, data["train"]
    sched, ev = data.get("scheduler") or {}, data.get("eval") or {}
    c["seed"] = train.get("seed", 42) if isinstance(train.get("seed", 42), int) else 42
    name = str(model.get("model_name_or_path") or "MODEL")
    local = f"models/{name.rstrip('/').rsplit('/', 1)[-1]}"
    set_dotted(c, "model.path", local)
    out.placeholders["model.path"] = (
        f"a local diffusers snapshot of {name}: huggingface-cli download {name} --local-dir {local}"
    )
    resolution = train.get("resolution", 512)
    if isinstance(resolution, list):
        if len(set(resolution)) != 1:
            out.dropped["train.resolution"] = f"digen's frames are square: model.resolution {resolution[0]}"
        resolution = resolution[0]
    set_dotted(c, "model.resolution", int(resolution))
    if family == "wan" and train.get("num_frames"):
        set_dotted(c, "model.num_frames", int(train["num_frames"]))
    set_dotted(c, "model.dtype", "float32")
    precision = str(data.get("mixed_precision", "bf16"))
    set_dotted(c, "model.text_encoder_dtype", _DTYPES.get(precision, "float32"))
    if precision in ("bf16", "fp16"):
        set_dotted(c, "model.autocast", "bfloat16")
    if precision == "fp16":
        out.dropped["mixed_precision (fp16)"] = (
            "digen autocasts in bfloat16 (no loss scaler: docs/precision.md)"
        )
    set_dotted(c, "model.device", "cuda")
    lora = str(model.get("finetune_type", "lora")) == "lora"
    if lora:
        spec: dict[str, Any] = {"enabled": True, "rank": int(model.get("lora_rank", 32)),
                                "alpha": int(model.get("lora_alpha", 64)), "dtype": "float32"}  # fmt: skip
        targets = model.get("target_modules", "default")
        if isinstance(targets, list):
            spec["target_modules"] = [str(t) for t in targets]
        elif targets != "default":
            out.dropped["model.target_modules"] = f"{targets!r}: digen adapts the family's default targets"
        else:
            out.dropped["model.target_modules (default)"] = (
                "Flow-Factory's per-model default list; digen's family default (docs/models.md, LoRA targets)"
            )
        set_dotted(c, "model.lora", spec)
    else:
        set_dotted(c, "model.lora", {"enabled": False})
        set_dotted(c, "train.fsdp", True)
    dataset = str((data.get("data") or {}).get("dataset_dir") or "dataset/PROMPTS")
    set_dotted(c, "prompts.dataset", f"data/{Path(dataset).name}")
    out.placeholders["prompts.dataset"] = (
        f"Flow-Factory's {dataset} (train.txt / test.txt), copied to data/{Path(dataset).name}"
    )
    trainer = str(train.get("trainer_type", "grpo"))
    if trainer in CLEAN_SAMPLE:
        _clean_sample(data, trainer, out)
    else:
        _rollout(train, sched, ev, out)
        _train(train, sched, out)
    _rewards(data.get("rewards") or [], out)
    eval_every = ev.get("eval_freq", 10)  # training_args.py l.60-63
    set_dotted(c, "eval.every", int(eval_every) if isinstance(eval_every, int) else 0)
    save = (data.get("log") or {}).get("save_freq", 20)
    set_dotted(c, "output.checkpoint_every", int(save) if isinstance(save, int) and save > 0 else 1)
    set_dotted(c, "schedule.mode", "disaggregated")
    c["cluster"] = {"local": {"rollout_workers": 1, "trainer_workers": 1}}
    for section in ("launcher", "config_file", "num_processes", "main_process_port", "log", "eval_rewards"):
        if section in data:
            out.dropped.setdefault(section, NO_EQUIVALENT[section])
    for sect_name, sect in (("data", data.get("data") or {}), ("model", model), ("train", train),
                            ("scheduler", sched), ("eval", ev)):  # fmt: skip
        for key in sect:
            full = f"{sect_name}.{key}"
            if full in NO_EQUIVALENT:
                out.dropped.setdefault(full, NO_EQUIVALENT[full])


def _peer(train: dict[str, Any], key: str) -> Any:
    """``train[key]``, or Flow-Factory's default for it where the recipe leaves it unset
    (:data:`PEER_DEFAULTS`; the GRPO trainer's own in ``TRAINER_DEFAULTS["grpo"]``)."""
    value = train.get(key)
    return {**PEER_DEFAULTS, **TRAINER_DEFAULTS["grpo"]}.get(key) if value is None else value


def _half_width(value: Any) -> tuple[float, bool]:
    """A Flow-Factory clip range (a number ``c`` is ``(-c, c)``, training_args.py l.385-390,
    or ``[lo, hi]``): its upper end and whether it is symmetric (digen's clip ranges are)."""
    lo, hi = (float(v) for v in value) if isinstance(value, list) else (-abs(float(value)), abs(float(value)))
    return hi, lo == -hi


def _symmetric(train: dict[str, Any], key: str, source: str) -> float:
    """The half-width of a Flow-Factory clip range; an asymmetric ``[lo, hi]`` is refused."""
    value = _peer(train, key)
    half, symmetric = _half_width(value)
    if not symmetric:
        raise ConfigError(f"{source}: train.{key}={value}: digen's clip ranges are symmetric")
    return half


def _rollout(train: dict[str, Any], sched: dict[str, Any], ev: dict[str, Any], out: Imported) -> None:
    c = out.config
    group = int(_peer(train, "group_size"))
    prompts = int(_peer(train, "unique_sample_num_per_epoch"))
    set_dotted(c, "rollout.batch_size", prompts * group)
    set_dotted(c, "rollout.group_size", group)
    set_dotted(c, "rollout.num_steps", int(_peer(train, "num_inference_steps")))
    set_dotted(c, "rollout.eval_steps", int(ev.get("num_inference_steps", 30)))
    set_dotted(c, "rollout.guidance_scale", float(_peer(train, "guidance_scale")))
    dynamics = str(sched.get("dynamics_type", "Flow-SDE"))
    if dynamics not in _DYNAMICS:
        raise ConfigError(
            f"{out.source}: scheduler.dynamics_type={dynamics} samples no SDE a GRPO trainer scores "
            f"(digen's: {', '.join(_DYNAMICS)})"
        )
    set_dotted(
        c, "rollout.sde", {"kind": _DYNAMICS[dynamics], "noise_level": float(sched.get("noise_level", 0.7))}
    )


def _train(train: dict[str, Any], sched: dict[str, Any], out: Imported) -> None:
    c = out.config
    set_dotted(c, "train.algorithm", TRAINERS[str(train.get("trainer_type", "grpo"))])
    steps = _peer(train, "gradient_step_per_epoch")
    set_mini_batches(
        out,
        int(steps) if isinstance(steps, int) else 1,
        "train.gradient_step_per_epoch",
        "Flow-Factory takes",
    )
    n = c["rollout"]["num_steps"]
    pool = sched.get("sde_steps")
    pool = [int(i) for i in pool] if isinstance(pool, list) and pool else list(range(max(1, n - 1)))
    count = min(int(sched.get("num_sde_steps") or 1), len(pool))  # scheduler_args.py l.35-37: default 1
    lo, hi = min(pool), max(pool) + 1
    set_dotted(c, "train.timesteps", {"strategy": "window", "window": count, "window_range": [lo, hi]})
    if count < len(pool) or pool != list(range(lo, hi)):
        out.dropped["scheduler.sde_steps / num_sde_steps"] = (
            f"Flow-Factory draws {count} of {pool} at random each rollout, not necessarily adjacent "
            "(flow_match_euler_discrete.py current_sde_steps: randperm of the pool); digen trains a contiguous "
            f"window of {count} inside [{lo}, {hi}]"
        )
    if c["train"]["algorithm"] == "flow-grpo":
        c["train"]["algorithm"] = "cps" if c["rollout"]["sde"]["kind"] == "cps" else "flow-grpo-fast"
    set_dotted(c, "train.clip_range", _symmetric(train, "clip_range", out.source))
    set_dotted(c, "train.adv_clip", _symmetric(train, "adv_clip_range", out.source))
    set_dotted(c, "train.global_std", bool(_peer(train, "global_std")))
    # advantage_processor.py l.259-262, 385: (r - group mean) / max(std, 1e-6); digen divides by
    # std + std_eps: with 1e-6 the same to 1e-6 / std relative (a flat group is 0 in both)
    set_dotted(c, "train.std_eps", 1e-6)
    set_dotted(c, "train.kl_beta", float(train.get("kl_beta", 0.0)))
    if float(train.get("kl_beta", 0.0)) > 0:
        set_dotted(c, "train.kl_target", "velocity" if train.get("kl_type") == "v-based" else "mean")
    _aggregation(c, _peer(train, "advantage_aggregation"), out.source)
    if train.get("enable_gradient_checkpointing"):
        set_dotted(c, "train.activation_checkpointing", True)
    set_dotted(c, "train.lr", float(_peer(train, "learning_rate")))
    set_dotted(c, "train.weight_decay", float(train.get("adam_weight_decay", 1e-4)))
    betas = _peer(train, "adam_betas")
    set_dotted(c, "train.betas", [float(b) for b in betas])
    set_dotted(c, "train.adam_eps", float(train.get("adam_epsilon", 1e-8)))
    set_dotted(c, "train.grad_clip", float(train.get("max_grad_norm", 1.0)))
    set_dotted(c, "train.rows_per_forward", int(train.get("per_device_batch_size", 1)))
    if float(_peer(train, "ema_decay")) > 0:
        out.dropped["train.ema_decay / ema_update_interval"] = (
            "Flow-Factory's EMA (every N epochs) is not mapped: set train.ema (docs/algorithms.md, EMA) to keep one"
        )


def _aggregation(c: dict[str, Any], aggregation: Any, source: str) -> None:
    """``train.advantage_aggregation`` as ``train.multi_reward``: ``sum``, the weighted reward sum
    normalised in its group; ``gdpo``, each reward normalised in its group and the weighted sum
    over the batch (advantage_processor.py compute_weighted_sum, compute_gdpo)."""
    if aggregation not in ("sum", "gdpo"):
        raise ConfigError(
            f"{source}: train.advantage_aggregation={aggregation} is not Flow-Factory's sum or gdpo "
            "(advantage_processor.py compute_advantages)"
        )
    set_dotted(c, "train.multi_reward", aggregation)


def _rewards(rewards: list[Any], out: Imported) -> None:
    specs: list[dict[str, Any]] = []
    for r in rewards if isinstance(rewards, list) else [rewards]:
        if not isinstance(r, dict):
            continue
        name, weight = str(r.get("name", "reward")), float(r.get("weight", 1.0))
        ours = _REWARDS.get(name.lower())
        specs.append({"name": ours, "weight": weight} if ours else served_reward(name, weight))
        if not ours:
            out.placeholders[f"reward ({name})"] = (
                f"Flow-Factory's {r.get('reward_model', name)} is not a digen reward: serve it at the http reward's url"
            )
    out.config["reward"] = specs or [served_reward("reward")]


# --- the clean-sample trainers: dgpo, awm, nft, dpo ---------------------------------------------


def peer_timesteps(model_type: str, n: int) -> list[float] | None:
    """Flow-Factory's rollout timesteps (scheduler scale, 0-1000) for ``n`` steps of
    ``model_type``: ``sigmas = linspace(1, 1/n, n)`` (scheduler/flow_match_euler_discrete.py
    l.57) through the model's static shift ``s' = shift s / (1 + (shift - 1) s)``; None where the
    shift is not static or not known here (:data:`STATIC_SHIFT`)."""
    shift = STATIC_SHIFT.get(model_type)
    if shift is None:
        return None
    sigmas = [1.0 - i * (1.0 - 1.0 / n) / (n - 1) for i in range(n)] if n > 1 else [1.0]
    return [1000.0 * shift * s / (1.0 + (shift - 1.0) * s) for s in sigmas]


def peer_strata(
    ts: list[float], frac: tuple[float, float], count: int, strategy: str
) -> list[tuple[int, int]]:
    """The index strata Flow-Factory's ``TimeSampler.discrete`` draws one step from each of
    (utils/noise_schedule.py l.185-259): the steps whose timestep lies in ``[1000 (1 - hi),
    1000 (1 - lo)]``, from their first (``discrete``; ``discrete_wo_init``: the one after) to
    their last, cut at ``linspace(start, last, count + 1).long()``; a stratum ``(a, b)`` draws
    ``a + floor(u (b - a))``, so a step in ``[a, b - 1]`` (``a`` when ``b == a``).
    ``discrete_with_init`` takes the first step always and ``count - 1`` strata after it."""
    t_min, t_max = 1000.0 * (1.0 - frac[1]), 1000.0 * (1.0 - frac[0])
    valid = [i for i, t in enumerate(ts) if t_min - 1e-3 <= t <= t_max + 1e-3]
    first, last = min(valid), max(valid)

    def cut(k: int, start: int) -> list[tuple[int, int]]:
        bounds = [int(start + (last - start) * i / k) for i in range(k + 1)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    if strategy == "discrete_with_init":
        return [(first, first + 1)] + (cut(count - 1, first + 1) if count > 1 else [])
    return cut(count, first if strategy == "discrete" else first + 1)


def _support(strata: list[tuple[int, int]]) -> list[int]:
    return sorted({i for a, b in strata for i in (range(a, b) if b > a else [a])})


def _ema_ramp(get: Any) -> tuple[int, float, float] | None:
    """Flow-Factory's adapter EMA as ``(flat, rate, cap)``, its decay at epoch ``e`` being
    ``0`` before ``flat`` and ``min((e - flat) rate, cap)`` after (ema/ema_utils.py l.55-102:
    ``linear`` from ``initial_decay`` 0, ``piecewise_linear``); None for another schedule."""
    schedule, decay = str(get("ema_decay_schedule")), float(get("ema_decay"))
    if schedule == "linear" and float(get("initial_decay")) == 0.0:
        return 0, decay / max(1, int(get("warmup_steps"))), decay
    if schedule == "piecewise_linear":
        return int(get("flat_steps")), float(get("ramp_rate")), decay
    return None


def _clean_sample(data: dict[str, Any], trainer: str, out: Imported) -> None:
    """Map a ``dgpo``/``awm``/``nft``/``dpo`` recipe onto digen's algorithm of that objective;
    raise one :class:`ConfigError` line naming every key whose math digen's algorithm lacks."""
    c, train = out.config, data["train"]
    sched, ev, model = data.get("scheduler") or {}, data.get("eval") or {}, data.get("model") or {}
    defaults = {**PEER_DEFAULTS, **TRAINER_DEFAULTS[trainer]}

    def get(key: str) -> Any:
        value = train.get(key)
        return defaults.get(key) if value is None else value

    refuse: list[str] = []
    algo = TRAINERS[trainer]
    # --- rollout: Flow-Factory's ODE (Euler on the model's schedule), CFG at rollout
    dynamics = str(sched.get("dynamics_type", "Flow-SDE"))
    if dynamics != "ODE":
        refuse.append(
            f"scheduler.dynamics_type={dynamics}: {algo} samples with a deterministic solver (Flow-Factory's ODE)"
        )
    group, prompts = int(get("group_size")), int(get("unique_sample_num_per_epoch"))
    n = int(get("num_inference_steps"))
    guidance = float(get("guidance_scale"))
    set_dotted(c, "rollout.batch_size", prompts * group)
    set_dotted(c, "rollout.group_size", group)
    set_dotted(c, "rollout.num_steps", n)
    set_dotted(c, "rollout.eval_steps", int(ev.get("num_inference_steps", 30)))
    set_dotted(c, "rollout.guidance_scale", guidance)
    set_dotted(c, "train.algorithm", algo)
    if str(model.get("finetune_type", "lora")) != "lora":
        refuse.append(
            f"model.finetune_type={model.get('finetune_type')}: digen's {algo} keeps its old weights as a LoRA copy"
        )
    # --- optimizer steps per epoch
    if int(get("num_inner_epochs")) != 1:
        refuse.append(
            f"train.num_inner_epochs={get('num_inner_epochs')}: digen trains each rollout batch once"
        )
    steps, steps_key = int(get("gradient_step_per_epoch")), "train.gradient_step_per_epoch"
    gas = get("gradient_accumulation_steps")
    if gas != "auto":
        # hparams/training_args.py l.295-311, l.696-709 and args.py l.402-404: a set count is
        # backward passes (one per trained timestep) per optimizer step, over the epoch's
        # micro-batches of per_device_batch_size samples (dpo: pairs) on num_processes ranks
        world, bsz = int(data.get("num_processes") or 1), int(get("per_device_batch_size"))
        units = prompts if trainer == "dpo" else prompts * group
        per_rank = (units // max(1, world)) // max(1, bsz)
        timesteps = int(get("num_train_timesteps")) or 1
        steps, steps_key = (
            max(1, per_rank * timesteps // max(1, int(gas))),
            "train.gradient_accumulation_steps",
        )
    set_mini_batches(out, steps, steps_key, "Flow-Factory takes")
    # --- advantages (advantage/advantage_processor.py l.372-386: (r - group mean) / max(std, 1e-6))
    set_dotted(c, "train.global_std", bool(get("global_std")))
    set_dotted(c, "train.std_eps", 1e-6)
    _aggregation(c, get("advantage_aggregation"), out.source)
    if get("enable_gradient_checkpointing"):
        set_dotted(c, "train.activation_checkpointing", True)
    adv = get("adv_clip_range")
    half, symmetric = _half_width(adv)
    if not symmetric:
        refuse.append(f"train.adv_clip_range={adv}: digen clamps advantages to a symmetric +-train.adv_clip")
    set_dotted(c, "train.adv_clip", half)
    set_dotted(c, "train.kl_beta", float(get("kl_beta")))
    if float(get("kl_beta")) > 0:  # Flow-Factory's kl_type v-based (digen refuses a target with no KL)
        set_dotted(c, "train.kl_target", "velocity")
    # --- the optimizer (TrainingArguments l.189-205)
    set_dotted(c, "train.lr", float(get("learning_rate")))
    set_dotted(c, "train.weight_decay", float(get("adam_weight_decay")))
    set_dotted(c, "train.betas", [float(b) for b in get("adam_betas")])
    set_dotted(c, "train.adam_eps", float(get("adam_epsilon")))
    set_dotted(c, "train.grad_clip", float(get("max_grad_norm")))
    set_dotted(c, "train.rows_per_forward", int(get("per_device_batch_size")))
    # --- the trained steps: the strata of TimeSampler.discrete on Flow-Factory's schedule
    count, frac = int(get("num_train_timesteps")), get("timestep_range")
    frac = (float(frac[0]), float(frac[1])) if isinstance(frac, list) else (0.0, float(frac))
    if count <= 0:  # training_args.py l.522-523 (and its siblings): int(n (hi - lo))
        count = max(1, int(n * (frac[1] - frac[0])))
    strategy = str(get("time_sampling_strategy") if trainer != "dpo" else get("weighting_scheme"))
    ts = peer_timesteps(str(model.get("model_type", "")), n)
    strata = peer_strata(ts, frac, count, strategy) if ts and strategy.startswith("discrete") else None
    if trainer != "dpo" and strategy.startswith("discrete") and ts is None:
        refuse.append(
            f"train.timestep_range={get('timestep_range')}: the steps Flow-Factory trains are read off "
            f"{model.get('model_type')}'s resolution-dependent schedule, which this importer does not compute "
            f"(it knows {', '.join(STATIC_SHIFT)})"
        )
    elif trainer != "dpo" and not strategy.startswith("discrete"):
        refuse.append(
            f"train.time_sampling_strategy={strategy}: Flow-Factory trains continuous timesteps; digen's {algo} "
            "trains steps of the rollout schedule"
        )
    if "time_shift" in train and trainer != "dpo" and strategy.startswith("discrete"):
        out.dropped["train.time_shift"] = f"read only by the continuous strategies, not by {strategy}"
    if ts is not None:
        out.dropped["scheduler (the rollout schedule)"] = (
            "Flow-Factory sets sigmas = linspace(1, 1/n, n) before the shift (flow_match_euler_discrete.py l.57); "
            "digen the pipeline's set_timesteps(n): the sigma of step i differs slightly, most at the last step"
        )
    step_key = f"train.timestep_range={get('timestep_range')} with {strategy}, num_train_timesteps={count}"
    {"dgpo": _dgpo, "awm": _awm, "nft": _nft, "dpo": _dpo}[trainer](get, c, out, refuse, strata, step_key, n)
    if refuse:
        raise ConfigError(f"{out.source}: " + "; ".join(refuse))


def _dgpo(get: Any, c: dict, out: Imported, refuse: list[str], strata: Any, step_key: str, n: int) -> None:
    """trainers/dgpo.py: DGPOTrainer (l.125-169 reads the keys)."""
    d: dict[str, Any] = {"solver": "euler"}
    d["beta_dpo"] = float(get("dpo_beta"))
    clip = get("clip_range")
    d["clip_range"], symmetric = _half_width(clip)
    if not symmetric:
        refuse.append(f"train.clip_range={clip}: digen's dgpo clips the ratio to a symmetric 1 +- clip_range")
    d["clip_dsm"] = bool(get("clip_dsm"))
    d["shared_noise"] = bool(get("use_shared_noise"))
    d["use_ema_ref"] = bool(get("use_ema_ref"))
    d["switch_ema_ref"] = int(get("switch_ema_ref"))
    if not (d["clip_dsm"] or d["use_ema_ref"] or get("clip_kl")):
        # dgpo.py l.169, l.200: no ema_ref at all, so the rollout never switches to it
        d["switch_ema_ref"] = 10**9
        out.dropped["train.switch_ema_ref"] = (
            "Flow-Factory keeps no ema_ref without clip_dsm/use_ema_ref: never"
        )
    if get("clip_kl"):
        refuse.append("train.clip_kl=true: digen's dgpo does not clip the KL term (dgpo.py l.697-698)")
    if float(get("kl_cfg")) > 1.0:
        refuse.append(
            f"train.kl_cfg={get('kl_cfg')}: digen's dgpo reference forward is conditional (no CFG; dgpo.py l.613)"
        )
    if bool(get("off_policy")):
        refuse.append(
            "train.off_policy=true: digen's dgpo samples with the current weights until switch_ema_ref "
            "(Flow-Factory: its sampling EMA, dgpo.py l.203-205)"
        )
    if (float(get("ema_ref_max_decay")), float(get("ema_ref_ramp_rate"))) != (0.3, 0.001):
        refuse.append(
            f"train.ema_ref_max_decay={get('ema_ref_max_decay')} / ema_ref_ramp_rate={get('ema_ref_ramp_rate')}: "
            "digen's dgpo moves its EMA reference by min(0.3, 0.001 step), as Luo-Yihong/DGPO"
        )
    if strata is not None:
        support = _support(strata)
        count = len(strata)
        if support != list(range(0, support[-1] + 1)):
            refuse.append(
                f"{step_key}: Flow-Factory trains steps {support[0]}..{support[-1]}; digen's dgpo draws its "
                "steps from 0 .. train.dgpo.trunc_steps"
            )
        else:
            d["timesteps"], d["trunc_steps"] = count, support[-1]
            sizes = {b - a for a, b in strata}
            how = "every step equally likely" if len(sizes) == 1 else "unequal strata"
            out.dropped["train.time_sampling_strategy / timestep_range"] = (
                f"Flow-Factory draws one step in each of the strata {strata} of steps 0..{support[-1]} "
                f"(noise_schedule.py TimeSampler.discrete; {how}); digen's dgpo draws {count} of them without "
                "replacement, as Luo-Yihong/DGPO"
            )
    if d["shared_noise"]:
        out.dropped["train.use_shared_noise"] = (
            "Flow-Factory's group noise is the same at every trained step (dgpo.py l.403-445); digen's is one per "
            "group and step, as Luo-Yihong/DGPO's generate_shared_noise_for_groups"
        )
    if c["train"]["mini_batches"] > 1:
        out.dropped["train.ema_ref (per step)"] = (
            "Flow-Factory moves its ema_ref after every optimizer step (dgpo.py l.1014); digen after each "
            "iteration's last"
        )
    _sampling_ema(get, out)
    c["train"]["dgpo"] = d


def _sampling_ema(get: Any, out: Imported) -> None:
    if float(get("ema_decay")) > 0:
        out.dropped["train.ema_decay / ema_update_interval"] = (
            "Flow-Factory's sampling EMA (every N epochs) is not mapped: set train.ema (docs/algorithms.md, EMA) to keep one"
        )


def _awm(get: Any, c: dict, out: Imported, refuse: list[str], strata: Any, step_key: str, n: int) -> None:
    """trainers/awm.py: AWMTrainer (l.57-73 reads the keys; the loss l.467-537)."""
    a: dict[str, Any] = {"solver": "euler", "advantage_max": None}
    weighting = str(get("awm_weighting"))
    if weighting not in _WEIGHTING:
        refuse.append(f"train.awm_weighting={weighting}: not one of {', '.join(_WEIGHTING)}")
    a["weighting"] = _WEIGHTING.get(weighting, "uniform")
    a["ghuber_power"] = float(get("ghuber_power"))
    clip = get("clip_range")
    a["clip_range"], symmetric = _half_width(clip)
    if not symmetric:
        refuse.append(f"train.clip_range={clip}: digen's awm clips the ratio to a symmetric 1 +- clip_range")
    a["ema_beta"] = float(get("ema_kl_beta"))
    if a["ema_beta"] > 0 and float(get("kl_beta")) == 0:
        refuse.append(
            f"train.ema_kl_beta={get('ema_kl_beta')} with kl_beta 0: Flow-Factory adds the EMA KL alone "
            "(awm.py l.524-535); digen's awm adds it only with train.kl_beta > 0"
        )
    if float(get("guidance_scale")) > 1.0:
        refuse.append(
            f"train.guidance_scale={get('guidance_scale')}: Flow-Factory's AWM trains with CFG (awm.py l.357-366 "
            "passes it to the forward); digen's awm training forwards are conditional"
        )
    if bool(get("off_policy")):
        refuse.append("train.off_policy=true: digen's awm samples with the current weights (on-policy)")
    ramp = _ema_ramp(get)
    if ramp is None or ramp[0] != 0 or int(get("ema_update_interval")) != 1:
        refuse.append(
            f"train.ema_decay_schedule={get('ema_decay_schedule')}, ema_decay={get('ema_decay')}, warmup_steps="
            f"{get('warmup_steps')}, flat_steps={get('flat_steps')}, ema_update_interval={get('ema_update_interval')}: "
            "digen's awm ramps its EMA decay from 0 each iteration, min(train.awm.ema_decay, train.awm.ema_ramp "
            "steps) ('linear' from initial_decay 0, or 'piecewise_linear' with flat_steps 0, every epoch)"
        )
    else:
        a["ema_decay"], a["ema_ramp"] = ramp[2], ramp[1]
        out.dropped["train.ema_decay_schedule"] = (
            f"Flow-Factory's EMA decay at its k-th update is min({ramp[2]}, {ramp[1]:g} (k - 1)) (ema.py l.113, "
            f"epoch from 0); digen's min({ramp[2]}, {ramp[1]:g} k)"
        )
    if strata is not None:
        first, last = strata[0][0], strata[-1][1]
        # digen/algos/awm.py stratified_steps: linspace(1, int(n fraction), K + 1).long()
        fraction = next(
            (f for f in (round(last / n, 4), round((last + 0.5) / n, 4)) if int(n * f) == last), None
        )
        if get("time_sampling_strategy") != "discrete_wo_init" or first != 1 or fraction is None:
            refuse.append(
                f"{step_key}: Flow-Factory's strata {strata}; digen's awm stratifies steps 1 .. int(T fraction)"
            )
        else:
            a["timesteps"], a["fraction"] = len(strata), fraction
            out.dropped["train.timestep_range"] = (
                f"{get('timestep_range')} ends Flow-Factory's strata at step {last} of its schedule (noise_schedule.py "
                f"TimeSampler.discrete): train.awm.fraction {fraction} gives digen's awm the same strata {strata}"
            )
    if get("kl_weight") is not None:
        out.dropped["train.kl_weight"] = (
            "not a field of AWMTrainingArguments: Flow-Factory ignores it (extra_kwargs)"
        )
    c["train"]["awm"] = a


def _nft(get: Any, c: dict, out: Imported, refuse: list[str], strata: Any, step_key: str, n: int) -> None:
    """trainers/nft.py: NFTTrainer (l.57-67 reads the keys; the loss l.400-445)."""
    nft: dict[str, Any] = {"solver": "euler", "beta": float(get("nft_beta"))}
    if strata is not None:
        start, end, count = strata[0][0], strata[-1][1], len(strata)
        # digen/algos/diffusion_nft.py trained_steps: int(T fraction) strata of linspace(start, end, K + 1)
        fraction = next(f for f in (round(count / n, 4), round((count + 0.5) / n, 4)) if int(n * f) == count)
        if get("time_sampling_strategy") == "discrete_with_init" or end - start < count:
            refuse.append(
                f"{step_key}: Flow-Factory's strata {strata}; digen's diffusion-nft draws one step in each of "
                "train.timesteps.fraction x T non-empty strata of train.nft.step_range"
            )
        else:
            nft["step_range"] = [start, end]
            set_dotted(c, "train.timesteps.fraction", fraction)
            out.dropped["train.timestep_range"] = (
                f"{get('timestep_range')} with {get('time_sampling_strategy')}: Flow-Factory's strata {strata} "
                f"(noise_schedule.py TimeSampler.discrete) are train.nft.step_range {[start, end]} with "
                f"int({n} x train.timesteps.fraction {fraction}) = {count}; Flow-Factory draws one set per "
                "micro-batch, digen one per sample"
            )
    ramp = _ema_ramp(get)
    if not bool(get("off_policy")):
        nft["decay_type"] = 0  # v_old is the current weights (nft.py l.75-81, l.359-375)
        if c["train"]["mini_batches"] > 1:
            refuse.append(
                "train.off_policy=false with gradient_step_per_epoch > 1: Flow-Factory's v_old is the weights of each "
                "micro-batch; digen's old weights are the iteration's first"
            )
    else:
        match = [k for k, r in _NFT_DECAYS.items() if ramp is not None and r == (ramp[0], ramp[1], ramp[2])]
        if not match or int(get("ema_update_interval")) != 1:
            refuse.append(
                f"train.ema_decay_schedule={get('ema_decay_schedule')}, ema_decay={get('ema_decay')}: Flow-Factory's "
                "old (sampling) EMA is not one of digen's train.nft.decay_type schedules"
            )
        else:
            nft["decay_type"] = match[0]
    c["train"]["nft"] = nft


def _dpo(get: Any, c: dict, out: Imported, refuse: list[str], strata: Any, step_key: str, n: int) -> None:
    """trainers/dpo.py: DPOTrainer (timesteps l.432-462, the loss l.563-611)."""
    d: dict[str, Any] = {"solver": "euler", "beta": float(get("beta"))}
    d["logit_mean"], d["logit_std"] = float(get("logit_mean")), float(get("logit_std"))
    if int(get("num_train_timesteps")) != 1:
        refuse.append(
            f"train.num_train_timesteps={get('num_train_timesteps')}: digen's online-dpo trains one per pair"
        )
    scheme, shift, span = str(get("weighting_scheme")), float(get("time_shift")), get("timestep_range")
    lo_hi = [float(span[0]), float(span[1])] if isinstance(span, list) else [0.0, float(span)]
    if scheme != "logit_normal" or shift != 1.0:
        refuse.append(
            f"train.weighting_scheme={scheme}, time_shift={get('time_shift')}: digen's online-dpo draws Flow-Factory's "
            "logit_normal unshifted (time_shift 1; train.online_dpo.timestep_draw: unshifted) or VeRL-Omni's "
            "shifted schedule"
        )
    else:
        # dpo.py l.443-453: TimeSampler.logit_normal_shifted(stratified=False), sigma = 1 - frac (l.565-566)
        d["timestep_draw"], d["timestep_range"] = "unshifted", lo_hi
        out.dropped["train.weighting_scheme"] = (
            f"logit_normal, time_shift 1, timestep_range {span}: train.online_dpo.timestep_draw unshifted over "
            f"{lo_hi}; Flow-Factory draws one noise level per micro-batch of per_device_batch_size pairs "
            "(dpo.py l.546-550), digen one per pair"
        )
    if float(get("ema_decay")) > 0:
        out.dropped["train.ema_decay / ema_update_interval"] = (
            "Flow-Factory's DPO evaluates with an EMA of the weights (dpo.py l.113, l.125; training does not read "
            "it): not mapped, set train.ema (docs/algorithms.md, EMA) to keep one"
        )
    c["train"]["online_dpo"] = d
