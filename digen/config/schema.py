"""The run configuration's schema: one pydantic model per section of a config file, every field
with its docstring (``configs/*.yaml`` show them in use), the limits on sizes, and the keys a
config must name (:data:`REQUIRED`).

Types and their own bounds only: what a value must be beside the others (``rollout.group_size``
divides ``rollout.batch_size``, a known reward) is :mod:`digen.config.load`'s, which reads a
YAML file into a :class:`Config` and reports every problem at once. The algorithm registry
(:mod:`digen.algos.registry`) names these types in its signatures and imports nothing else of
the config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from digen.config.names import WHOLE_GROUP_ALGORITHMS
from digen.prompts import metadata_by_prompt, read_prompts, split_file

Mode = Literal["reference", "colocated", "disaggregated", "digen"]
CfgGrad = Literal["cond", "both"]


class _Section(BaseModel):
    # no inf or NaN anywhere: a float config value is a finite number (``.inf`` as a noise
    # level or a reward weight would only surface as NaN samples or a crash mid-run)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# Limits on sizes: far above any real run (the largest published recipes generate a few
# thousand samples per iteration on up to a few hundred GPUs), low enough that a typo
# (``rollout.batch_size=1e12``, 100000 local workers) is one line at load instead of
# gigabytes of plans or a machine full of processes. configs/README.md lists them.
MAX_SAMPLES = 65_536
"""``rollout.batch_size``, ``eval.batch_size``: samples in one iteration or evaluation task."""
MAX_GROUP = 4_096
"""``rollout.group_size``, ``rollout.max_batch``, ``train.groups_per_task``, ``train.mini_batches``."""
MAX_STEPS = 1_000
"""``rollout.num_steps``, ``rollout.eval_steps``: a diffusion schedule's full length."""
MAX_PIXELS = 16_384
"""``model.resolution`` (pixels a side)."""
MAX_FRAMES = 4_096
"""``model.num_frames``."""
MAX_LOCAL_WORKERS = 1_024
"""Workers of the embedded cluster (``cluster.local``), each role and all together."""
MAX_DEGREE = 1_024
"""Parallel degrees and counts of one machine: ``sequence_parallel``, ``workers_per_gpu``,
``threads_per_worker``."""
MAX_ITERATIONS = 10_000_000
"""``iterations`` and the per-N-iterations keys."""
MAX_ROWS = 1_048_576
"""``train.rows_per_forward``, ``lora.rank``, ``model.max_sequence_length``."""


Dtype = Literal["float32", "bfloat16", "float16", "float64"]

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
"""Bytes per element of each :data:`Dtype`."""


def trained_dtype_name(dtype: str, lora: bool, lora_dtype: str) -> str:
    """The dtype of a policy's trained tensors, so of a version as the trainers serve it (the
    bits the trainer computes with, ``docs/precision.md``): ``lora_dtype`` for an adapter
    (``lora``), the transformer's ``dtype`` for a full fine-tune, float64 for a float64 model.
    The one rule for the runtime (:func:`digen.assembly.trained_dtype`) and the simulator's
    data plane (:attr:`digen.sim.costmodel.ModelSpec.version_bytes_per_param`)."""
    if dtype == "float64" or not lora:
        return dtype
    return lora_dtype


class LoraConfig(_Section):
    enabled: bool = True
    """Train a LoRA adapter (True) or the whole transformer (False)."""
    rank: int = Field(8, ge=1, le=MAX_ROWS)
    alpha: int = Field(16, ge=1)
    target_modules: list[str] | None = None
    """Module names to adapt; None uses the family's default (as the peers use it)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The adapter's weights as the policy holds and computes with them (Flow-GRPO and
    DanceGRPO keep them float32). The optimizer's master copy is float32 whatever this says;
    every process of a run loads the same cast of it, so a rollout computes with the bits the
    trainer computes with (docs/precision.md). A float64 model keeps float64 adapters."""


class ModelConfig(_Section):
    path: str
    """Local diffusers pipeline folder (``model_index.json`` inside). Never downloaded.
    Required: there is no default model."""
    resolution: int = Field(32, ge=8, le=MAX_PIXELS)
    """Square image side in pixels for rollouts (at most :data:`MAX_PIXELS`)."""
    num_frames: int | None = Field(None, ge=1, le=MAX_FRAMES)
    """Frames per video (video families only; at most :data:`MAX_FRAMES`)."""
    dtype: Dtype = "float32"
    """The transformer's weights (its frozen base weights with LoRA). SDE math and stored
    latents/log-probs are float32 for the first three. ``float64`` (model, LoRA adapters, SDE
    math, loss and task gradients all in float64; ``digen.algos.precision``) is for numerical
    checks of the training math against a peer's formula (tests/trainer/test_gradient_oracle.py),
    not for training runs. docs/precision.md maps it to the peers' settings."""
    text_encoder_dtype: Dtype | None = None
    """The frozen text encoders (None: ``model.dtype``). Flow-GRPO casts them to its
    ``mixed_precision`` dtype."""
    vae_dtype: Dtype = "float32"
    """The frozen VAE (decoding only). Flow-GRPO keeps it float32, DanceGRPO bfloat16."""
    autocast: Literal["bfloat16"] | None = None
    """Run every transformer forward (rollout and training alike) under ``torch.autocast`` in
    this dtype, as Flow-GRPO's ``accelerator.prepare`` and DanceGRPO's ``torch.autocast`` do
    (their weights stay float32). None: no autocast, each module computes in its own dtype.
    Only bfloat16: float16 autocast needs a loss scaler (Flow-GRPO's fp16 runs under
    accelerate's GradScaler), which digen's optimizer does not have."""
    device: str = "auto"
    """Device for the reference trainer and the embedded cluster's workers: ``auto`` (``cuda:0``
    where torch sees a GPU, else cpu), ``cpu``, ``cuda`` (= ``cuda:0``) or ``cuda:N``. A worker
    pinned to one GPU (``CUDA_VISIBLE_DEVICES``) sees it as ``cuda:0``."""
    deterministic: bool = True
    """On CUDA, compute with deterministic kernels (:func:`digen.assembly.deterministic_kernels`:
    ``torch.use_deterministic_algorithms``, a fixed cuBLAS workspace), so that the same inputs
    give the same bits in every process and every time: what the bit-for-bit guarantees
    (docs/guarantees.md) and a lost group's regeneration from its seeds rest on. The cost is in
    docs/precision.md ("Deterministic kernels"). No effect on CPU, whose kernels are."""
    max_sequence_length: int | None = Field(None, ge=1, le=MAX_ROWS)
    """Text-encoder tokens per prompt (T5, UMT5, Llama, Qwen2.5-VL). None: the family's own
    length (docs/precision.md lists them: sd3 128 as Flow-GRPO, flux 512 as FluxPipeline, ...);
    a config error when the model's text encoder takes fewer (the tiny models: 32, so their
    configs set it)."""
    embed_cache_mib: float = Field(512.0, ge=0.0)
    """Memory cap of each worker's prompt-embedding cache (:mod:`digen.prompt_cache`): the
    text encoders' outputs per distinct prompt, kept on the device they were computed on and
    evicted least recently used first. 512 MiB holds ~200 prompts of SD3.5 at 128 tokens with
    CFG, a whole epoch of Flow-GRPO's 48 prompts; 0 keeps nothing (every prompt is encoded
    each time it is used)."""
    lora: LoraConfig = LoraConfig()


class PromptsConfig(_Section):
    dataset: str | None = None
    """Prompt dataset folder (Flow-GRPO's layout): ``train.txt``/``test.txt``, one prompt a
    line, or GenEval-style ``train_metadata.jsonl``/``test_metadata.jsonl`` whose per-prompt
    metadata reaches the rewards. Training uses its train split (see :mod:`digen.prompts`)."""
    file: str | None = None
    """Text file, one prompt per line (``.jsonl``: one ``{"prompt": ..., ...}`` object a line,
    with metadata); used when ``dataset`` is unset. Relative paths resolve against the config file."""
    items: list[str] = []
    """Inline prompts, used when ``dataset`` and ``file`` are unset. One of the three is required."""
    test_file: str | None = None
    """Held-out prompts for ``eval`` (``.txt`` one prompt a line, or ``.jsonl``; relative paths
    resolve against the config file); unset: ``dataset``'s test split, if any."""


class SdeConfig(_Section):
    kind: Literal["sde", "cps", "dance"] = "sde"
    """Stochastic step: Flow-GRPO ``sde``, coefficients-preserving ``cps``, DanceGRPO ``dance``."""
    noise_level: float = Field(0.7, ge=0.0)
    """a for sde/cps (0.7 SD3.5, 0.9 FLUX, 0.8 cps), eta for dance (0.3 images)."""


class RolloutConfig(_Section):
    batch_size: int = Field(16, ge=1, le=MAX_SAMPLES)
    """Samples per iteration (prompts_per_iteration x group_size; at most :data:`MAX_SAMPLES`)."""
    group_size: int = Field(4, ge=1, le=MAX_GROUP)
    """Samples per prompt (a GRPO group; at most :data:`MAX_GROUP`). Also the generation micro-batch: one task = one group."""
    max_batch: int = Field(4, ge=1, le=MAX_GROUP)
    """Generation tasks (prompt groups) a rollout or TAG worker leases at once and runs as one
    batched forward per denoising step, each acknowledged on its own (configs/README.md,
    "Batched generation"). 4: 1.6-2.0x the samples per second of one group at a time in
    ``digen bench`` on the quickstart (docs/benchmarks.md), and the peers batch 8 requests per
    call on a GPU. 1: one group per forward, the reference's bits (set it for
    ``train.reduce: exact`` comparisons). A sequence-parallel replica
    (``rollout.sequence_parallel`` > 1) generates one group at a time: left at its default,
    ``max_batch`` applies to the workers outside the replicas only; set explicitly above 1 beside
    ``sequence_parallel`` > 1, it is refused."""
    num_steps: int = Field(8, ge=2, le=MAX_STEPS)
    """Denoising steps of training rollouts (the denoising reduction: few steps; at most
    :data:`MAX_STEPS`)."""
    eval_steps: int = Field(20, ge=2, le=MAX_STEPS)
    """Steps of the ODE sampler for evaluation grids."""
    guidance_scale: float = Field(1.0, ge=0.0)
    """CFG scale (true CFG families) or embedded guidance (FLUX, HunyuanVideo). 1 = no CFG."""
    sde: SdeConfig = SdeConfig()
    shared_noise: bool = False
    """DanceGRPO: every member of a group starts from the same initial noise."""
    sequence_parallel: int = Field(1, ge=1, le=MAX_DEGREE)
    """Ulysses sequence-parallel degree d of a rollout replica (Wan, HunyuanVideo and FLUX
    families; disaggregated or digen mode): d rollout workers of one GPU type (or one ``digen
    worker --sp-group``) generate each sample together, 1/d of its video/image tokens each, text
    tokens replicated on every rank (``digen.runtime.sp_group``, ``digen.parallel.ulysses``);
    leftover workers run at d=1."""

    @property
    def prompts_per_iteration(self) -> int:
        return self.batch_size // self.group_size


class TimestepConfig(_Section):
    strategy: Literal["prefix", "random", "window"] = "prefix"
    """prefix: first floor(T*fraction) steps (Flow-GRPO); random: per-sample subset, last step
    dropped (DanceGRPO); window: a random window of ``window`` SDE steps (Flow-GRPO-Fast)."""
    fraction: float = Field(0.5, gt=0.0, le=1.0)
    window: int = Field(2, ge=1)
    window_range: list[int] | None = Field(None, min_length=2, max_length=2)
    """``[lo, hi]``: the steps the window may cover, its start drawn uniformly in
    ``[lo, hi - window]`` (Flow-GRPO's and VeRL-Omni's ``sde_window_range``). None: ``[0,
    num_steps // 2]``, the first half, as every windowed recipe of both peers sets it."""


class EmaConfig(_Section):
    """An exponential moving average of the trained tensors, kept beside them in every
    checkpoint (``ema/<name>``; ``digen export --ema`` exports it). Each update is
    ``ema += (1 - d) (w - ema)`` with ``d = min((1 + n) / (10 + n), decay)`` after ``n``
    optimizer steps when ``warmup`` (Flow-GRPO's flow_grpo/ema.py ``get_current_decay``),
    else ``decay``. docs/algorithms.md, "EMA", restates both peers'."""

    enabled: bool = False
    decay: float = Field(0.9, gt=0.0, lt=1.0)
    warmup: bool = True
    """Warm the decay up from 0.1 (Flow-GRPO's); False: the fixed ``decay`` (DanceGRPO's)."""
    update: Literal["micro_batch", "step", "iteration"] = "micro_batch"
    """When the EMA moves. ``micro_batch`` (Flow-GRPO: scripts/train_sd3.py l.959-960): once per
    micro-batch of ``micro_batches`` a step, when ``(n + 1) % every == 0`` for the ``n``
    optimizer steps taken at that micro-batch (a step's last micro-batch sees it counted);
    ``step``: after every ``every``-th optimizer step; ``iteration`` (DanceGRPO:
    train_grpo_flux.py l.866-867): once after each rollout batch's last step."""
    every: int = Field(8, ge=1)
    """Flow-GRPO's ``update_step_interval`` (8 in its scripts), in optimizer steps."""
    micro_batches: int = Field(1, ge=1)
    """For ``update: micro_batch``: the peer's micro-batches per optimizer step (Flow-GRPO's
    ``train.gradient_accumulation_steps``), each an EMA update."""
    eval: bool = False
    """Evaluate (``eval.every``) with the EMA weights instead of the policy's, as Flow-GRPO's
    ``eval`` does (scripts/train_sd3.py l.218-219, 315-316: swapped in, sampled, swapped back).
    The versions evaluated carry their EMA beside the weights (``ema/<name>``), only those:
    training and generation never read it."""
    export: bool = False
    """``digen export`` of the run exports the EMA weights unless told ``--no-ema`` (Flow-GRPO's
    ``save_ckpt`` saves the EMA as the checkpoint, l.328-332). The checkpoint keeps both: the
    policy's weights resume the run, the EMA is ``ema/<name>`` in ``optimizer.safetensors``."""


class MixGrpoConfig(_Section):
    """MixGRPO's sliding SDE window (``train.algorithm: mix-grpo``; digen/algos/mix_grpo.py,
    Tencent-Hunyuan/MixGRPO fastvideo/utils/grpo_states.py ``GRPOTrainingStates``)."""

    window: int = Field(4, ge=1)
    """SDE steps in the window, all trained (the peer's ``group_size``: 4)."""
    schedule: Literal["progressive", "random", "decay"] = "progressive"
    """How the window moves between iterations: ``progressive`` by ``shift`` steps every
    ``iters_per_window`` iterations; ``decay`` the same with the iterations per window falling
    from ``max_iters`` to ``min_iters`` as it moves; ``random`` a seeded uniform start each
    iteration (the peer's ``sample_strategy``)."""
    iters_per_window: int = Field(25, ge=1)
    """Iterations before the window moves (the peer's ``iters_per_group``: 25; Flash 20)."""
    shift: int | None = Field(1, ge=1)
    """Steps the window moves by (the peer's ``prog_overlap_step``: 1); None: by ``window``
    (no overlap)."""
    max_iters: int | None = Field(None, ge=1)
    """``decay``: iterations per window at the start (None: ``iters_per_window``)."""
    min_iters: int | None = Field(None, ge=1)
    """``decay``: iterations per window at the end (None: ``max(1, iters_per_window // 4)``)."""
    roll_back: bool = True
    """Past the last start (``rollout.num_steps - 2``) the window returns to step 0 (else it stays)."""
    flash: bool = False
    """MixGRPO-Flash: after the window, DPM-Solver++(2M) on a compressed schedule instead of
    Euler steps (the peer's ``dpm_algorithm_type dpmsolver++``, ``dpm_apply_strategy post``)."""
    flash_compress: float = Field(0.4, gt=0.0, le=1.0)
    """Flash: the fraction of the post-window steps kept (the peer's ``dpm_post_compress_ratio``)."""


class NftConfig(_Section):
    """DiffusionNFT's options (``train.algorithm: diffusion-nft``; digen/algos/diffusion_nft.py,
    NVlabs/DiffusionNFT config/nft.py)."""

    beta: float = Field(1.0, gt=0.0)
    """Strength of the implicit positive/negative velocities ``beta v + (1 - beta) v_old`` and
    ``(1 + beta) v_old - beta v`` (the peer's ``config.beta``: 1.0; 0.1 for OCR)."""
    decay_type: Literal[0, 1, 2] = 1
    """The old weights' EMA after each iteration (the peer's ``decay_type``): 0 copies the
    policy; 1 decays ``min(0.001 steps, 0.5)``; 2 copies for 75 steps, then ``min(0.0075
    (steps - 75), 0.999)``."""
    solver: Literal["dpm2", "euler"] = "dpm2"
    """The rollout's deterministic solver: DPM-Solver++(2M) (the recipes' ``dpm2``) or Euler."""
    step_range: tuple[int, int] | None = None
    """None: the ``int(T train.timesteps.fraction)`` trained steps of a sample are drawn without
    replacement from all T (the authors' ``perms_time``). ``[start, end]``: one in each of as
    many strata of schedule steps ``start .. end - 1``, cut at ``linspace(start, end, K +
    1).long()`` (Flow-Factory's ``TimeSampler.discrete``; its SD3.5 recipe: ``[0, 10]`` of 14)."""


class FlowDppoConfig(_Section):
    """Flow-DPPO's trust region (``train.algorithm: flow-dppo``; digen/algos/flow_dppo.py,
    verl-project/verl-omni ``FlowDPPOLoss``)."""

    kl_threshold: float = Field(1e-5, gt=0.0)
    """The per-step KL ``mean((mu - mu_old)^2) / (2 s^2)`` at and above which an update that
    still moves away from the rollout policy is dropped (the peer's ``kl_mask_threshold``: 1e-5)."""


# --- the clean-sample family beyond DiffusionNFT (digen/algos/dgpo.py, awm.py, online_dpo.py) ---


class DgpoConfig(_Section):
    """DGPO's options (``train.algorithm: dgpo``; digen/algos/dgpo.py, Luo-Yihong/DGPO
    config/dgpo.py). The defaults are its SD3.5-M GenEval recipe ``geneval_sd3_4gpu``."""

    beta_dpo: float = Field(100.0, gt=0.0)
    """The group preference's temperature (the peer's ``train.beta_dpo``: 100; 2000 with the
    EMA reference)."""
    clip_range: float = Field(1e-2, gt=0.0)
    """The PPO-style clip of the flow-matching ratio ``exp(dsm_old - dsm)`` (the peer's
    ``clip_range``: 1e-2 GenEval/OCR, 5e-2 compressibility, 1e-5 with the EMA reference)."""
    clip_dsm: bool = True
    """Detach the flow-matching loss of rows whose ratio left the clip range (``clip_dsm``)."""
    timesteps: int = Field(4, ge=1)
    """Trained steps per iteration, shared by every sample (``num_train_timesteps``: 4)."""
    trunc_steps: int = Field(4, ge=0)
    """The trained steps are drawn from schedule steps ``0 .. trunc_steps`` (``trunc_steps``:
    4 GenEval, 6 OCR/PickScore)."""
    shared_noise: bool = True
    """One forward noise per group and trained step, shared by its samples (``use_shared_noise``)."""
    switch_ema_ref: int = Field(500, ge=0)
    """After this many optimizer steps the rollout samples with the EMA ``old`` weights
    (``switch_ema_ref``: 500 GenEval, 200 OCR/PickScore)."""
    use_ema_ref: bool = False
    """The preference's reference is the EMA ``old`` weights instead of the base weights
    (``use_ema_ref``; config/dgpo_wocfg_emaref.py)."""
    solver: Literal["dpm2", "euler"] = "dpm2"
    """The rollout's deterministic solver (the peer's ``use_dpm``: DPM-Solver multistep)."""


class AwmConfig(_Section):
    """AWM's options (``train.algorithm: awm``; digen/algos/awm.py,
    scxue/advantage_weighted_matching config/dgx_awm.py). The defaults are its SD3.5-M GenEval
    recipe ``geneval_sd3_no_cfg_1node``."""

    timesteps: int = Field(6, ge=1)
    """Trained steps per sample, one per stratum of ``1 .. int(T fraction)`` (``train_timesteps``: 6)."""
    fraction: float = Field(0.9, gt=0.0, le=1.0)
    """The strata end at step ``int(T fraction)`` (``timestep_fraction``: 0.9; ``time_type``
    ``discrete_wo_init``)."""
    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "ghuber"
    """How the flow-matching error becomes the log-likelihood surrogate (``weighting``:
    ``ghuber``; ``t2`` is the peer's ``t**2``)."""
    ghuber_power: float = Field(0.25, gt=0.0)
    """The generalised Huber's power (``ghuber_power``: 0.25)."""
    advantage_max: float | None = Field(1.0, gt=0.0)
    """Advantages clamped to ``train.adv_clip`` are rescaled to ``[-advantage_max,
    advantage_max]`` (``advantage_max``: 1); None keeps them."""
    clip_range: float = Field(1.0, gt=0.0)
    """The ratio clip (the peer's ``train.clip_range``: 1)."""
    ema_beta: float = Field(1.0, ge=0.0)
    """Weight of the velocity KL to the EMA ``old`` weights (not scaled by ``train.kl_beta``),
    added only when ``train.kl_beta > 0``, as the peer (``ema_beta``: 1)."""
    ema_decay: float = Field(0.3, ge=0.0, lt=1.0)
    """The EMA weights' decay after each iteration, ``min(ema_decay, ema_ramp steps)``
    (``kl_ema_decay``: 0.3, ``kl_ema_decay_type: linear``)."""
    ema_ramp: float = Field(0.001, gt=0.0)
    """The EMA decay's rise per optimizer step, up to ``ema_decay`` (the authors' ``linear``
    ramp: 0.001; Flow-Factory's ``linear`` schedule: ``ema_decay / warmup_steps``)."""
    solver: Literal["dpm2", "euler"] = "dpm2"
    """The rollout's deterministic solver (the peer's SA-Solver with ``sde_frac = 0``, a
    deterministic multistep solver, is not in digen: DPM-Solver++(2M) stands in)."""


class OnlineDpoConfig(_Section):
    """Online Diffusion-DPO's options (``train.algorithm: online-dpo``; digen/algos/online_dpo.py,
    verl-project/verl-omni ``DPOLoss``)."""

    beta: float = Field(100.0, gt=0.0)
    """The DPO inverse temperature (``diffusion_loss.dpo_beta``: 100 in the online Qwen-Image
    recipe; VeRL-Omni's config default 2000)."""
    logit_mean: float = 0.0
    """Mean of the logit-normal draw of each pair's training timestep (VeRL-Omni's
    ``sample_noise_and_timesteps``: 0)."""
    logit_std: float = Field(1.0, gt=0.0)
    """Its standard deviation (1)."""
    timestep_draw: Literal["schedule", "unshifted"] = "schedule"
    """Where the draw ``u = sigmoid(N(logit_mean, logit_std))`` puts the pair's noise level:
    ``schedule``, the model's shifted 1000-step training schedule at index ``int(1000 u)``
    (VeRL-Omni); ``unshifted``, the continuous ``sigma = 1 - (lo + clamp(u, 0.01, 1 - 1e-6) (hi -
    lo))`` over ``timestep_range`` with no shift (Flow-Factory's ``weighting_scheme:
    logit_normal`` at ``time_shift: 1``)."""
    timestep_range: tuple[float, float] = (0.0, 0.99)
    """``[lo, hi]`` of the ``unshifted`` draw, fractions of the way from noise (0) to clean (1)
    (Flow-Factory's ``timestep_range``: 0.99, i.e. ``[0, 0.99]``); unused by ``schedule``."""
    solver: Literal["dpm2", "euler"] = "euler"
    """The rollout's deterministic solver (VeRL-Omni's rollout: the pipeline's Euler flow-matching
    scheduler)."""


class TrainConfig(_Section):
    algorithm: str | None = None
    """The training algorithm, by registry name (``digen algorithms`` lists them): flow-grpo,
    flow-grpo-fast, cps, dance-grpo, mix-grpo, grpo-guard, flow-dppo, diffusion-nft, dgpo, awm, online-dpo. None: the Flow-GRPO
    family member ``rollout.sde.kind`` and ``train.timesteps.strategy`` name (cps, dance-grpo,
    flow-grpo-fast for the window strategy, else flow-grpo)."""
    mini_batches: int = Field(1, ge=1, le=MAX_GROUP)
    """Optimizer steps per iteration (rollout batch): the iteration's trained samples split
    into this many mini-batches (how: ``mini_batch_split``), each trained with the weights the
    previous one's step made and stepped on the mean over its own rows (the peers'
    ``num_batches_per_epoch / gradient_accumulation_steps``: 2 for Flow-GRPO's SD3.5/FLUX
    recipes). Runs in every mode (docs/algorithms.md, "Mini-batches")."""
    mini_batch_split: Literal["groups", "samples"] = "groups"
    """How the iteration is cut into ``mini_batches``. ``groups``: consecutive equal runs of
    whole prompt groups (``mini_batches`` must divide ``rollout.batch_size /
    rollout.group_size``); with group-local advantages (no ``global_std``) and GAP (digen
    mode) a mini-batch's training starts as soon as its own groups are scored, while later
    groups still generate: that overlap is why this split exists. ``samples``: Flow-GRPO's
    (yifan123/flow_grpo scripts/train_sd3.py ``main``): the iteration's trained samples
    (``zero_advantage: drop`` leaves out the zero-advantage ones, switching random ones back
    on until the count divides ``mini_batches``, as Flow-GRPO does for its micro-batches) in a
    seeded random order (:func:`digen.seeding.permutation` of the iteration's
    ``"mini_batches"`` stream, the same in every mode) cut into ``mini_batches`` equal parts;
    a group's samples then train in several mini-batches (one train task per group and
    mini-batch). Its cost: no mini-batch can start before every group of the iteration is
    scored (the shuffle needs them all), so training never overlaps the last groups'
    generation, in digen mode too; RAT does not split train tasks further. ``mini_batches``
    must divide ``rollout.batch_size``; when the trained count does not (only when non-finite
    rewards dropped samples: Flow-GRPO has no such case), the first ``count % mini_batches``
    parts take one sample more; every step divides by its own rows."""
    kl_target: Literal["mean", "velocity"] | None = None
    """What ``kl_beta`` penalises: ``mean``, the SDE transition mean's KL to the base weights
    (Flow-GRPO's); ``velocity``, ``mean((v - v_ref)^2)``, the KL Flow-GRPO's maintainer
    recommends when training without CFG (``rollout.guidance_scale: 1``) and sampling with CFG
    at test time (yifan123/flow_grpo issue #198), and DiffusionNFT's. None: ``mean`` for the
    GRPO family, ``velocity`` for diffusion-nft."""
    mix_grpo: MixGrpoConfig = MixGrpoConfig()
    nft: NftConfig = NftConfig()
    flow_dppo: FlowDppoConfig = FlowDppoConfig()
    dgpo: DgpoConfig = DgpoConfig()
    awm: AwmConfig = AwmConfig()
    online_dpo: OnlineDpoConfig = OnlineDpoConfig()
    timesteps: TimestepConfig = TimestepConfig()
    clip_range: float = Field(1e-4, gt=0.0)
    """PPO ratio clip epsilon (log-probs are per-element means, hence tiny ranges)."""
    adv_clip: float = Field(5.0, gt=0.0)
    global_std: bool = False
    """Normalise advantages by the whole batch's std instead of the group's."""
    std_eps: float = Field(1e-4, gt=0.0)
    unbiased_std: bool = False
    """DanceGRPO: torch.std (ddof 1) and eps 1e-8."""
    multi_reward: Literal["sum", "per_reward", "gdpo"] = "sum"
    """How several rewards (the ``reward`` list) make one advantage. ``sum``: the group
    advantage of the weighted reward sum ``sum_k w_k r_k``, normalised once (Flow-GRPO's and
    VeRL-Omni's multi-reward, digen's default). ``per_reward``: DanceGRPO's
    (XueZeyue/DanceGRPO fastvideo/train_grpo_hunyuan.py l.370-392, 449-477, ``--use_videoalign
    --vq_coef --mq_coef``): one group advantage per reward, each clamped to ``adv_clip``, then
    weighted by its ``weight`` and summed, ``A = sum_k w_k clamp(adv(r_k))``
    (:func:`digen.core.advantages.per_reward_advantages`), so a reward of small spread is not
    drowned by one of large spread. Each sample's per-reward scores travel with its group's
    rewards to the iteration's book, which computes the advantages in every mode (the
    reference loop's too). DanceGRPO sums one clipped loss per reward; training on the summed
    advantage is the same loss and gradient wherever the ratio is inside ``clip_range`` or the
    weighted per-reward advantages agree in sign (docs/algorithms.md, "Several rewards"). A
    sample with a non-finite score in any reward is dropped, as with ``sum``. With one reward
    of weight 1 both give the same advantages. ``gdpo``: Flow-Factory's default
    (advantage_processor.py ``compute_gdpo``): each reward normalised in its group by
    ``max(std, 1e-6)``, weighted and summed, then the sum normalised over the whole batch
    (:func:`digen.core.advantages.gdpo_advantages`); it ignores ``global_std``, ``std_eps``
    and ``unbiased_std``, and like ``global_std`` no group trains before the last is scored."""

    @property
    def group_local_advantages(self) -> bool:
        """Whether a group's advantages need only its own rewards (GAP can train it at once):
        not with ``global_std`` or ``multi_reward: gdpo``, which normalise over the batch."""
        return not self.global_std and self.multi_reward != "gdpo"

    kl_beta: float = Field(0.0, ge=0.0)
    """KL-to-reference weight (needs LoRA: the reference is the base weights)."""
    cfg_grad: CfgGrad = "both"
    """Which CFG branch carries the gradient when the training forward uses true CFG
    (``rollout.guidance_scale > 1`` on an SD3/Wan/Qwen-Image/FLUX-schnell-style model).
    ``both``: back-propagate through ``uncond + s * (cond - uncond)`` whole, as
    Flow-GRPO (yifan123/flow_grpo scripts/train_sd3.py ``compute_log_prob``), VeRL-Omni
    (verl_omni/experimental/sd3_flow_grpo/diffusers_training_adapter.py
    ``StableDiffusion3FlowGRPO.forward_and_sample_previous_step``) and GenRL
    (ModelTC/GenRL genrl/trainer/diffusion.py ``wan_compute_log_prob``) do. ``cond``:
    the unconditional branch is detached (``uncond.detach() + s * (cond - uncond.detach())``),
    as derived copies of Flow-GRPO's ``compute_log_prob`` do; the forward value, hence every
    log-prob and ratio, is the same, only the gradient differs. DanceGRPO
    (XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py ``grpo_one_step``) trains FLUX with
    embedded guidance (one pass), where this setting has no effect."""
    zero_advantage: Literal["keep", "drop"] = "keep"
    """Samples whose advantage is exactly 0 (every sample of a flat group, whose rewards are all
    equal; digen sets those to 0 exactly). ``keep``: they train like the others and count in
    the loss's mean (their policy term is 0, their KL term is not), as DanceGRPO does
    (XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py ``train_one_step``: every sample trains,
    each loss divided by ``gradient_accumulation_steps * train_timesteps``). ``drop``: they
    train no row and the mean runs over the other rows only (policy and KL terms alike, in
    every mode: the optimizer step divides by the rows that trained), as Flow-GRPO does
    (yifan123/flow_grpo scripts/train_sd3.py ``main``: ``mask = advantages.abs().sum(dim=1)
    != 0``, ``samples = samples[mask]``, before rebatching into
    ``sample.num_batches_per_epoch`` micro-batches). Flow-GRPO then switches random dropped
    samples back on until the kept count divides ``num_batches_per_epoch``; digen does not
    (it needs no equal micro-batches), so ``drop`` is Flow-GRPO's mean whenever its count
    divides. An iteration with every sample dropped has nothing to step on and fails (as
    Flow-GRPO's empty rebatch does). Default ``keep`` (the plain GRPO mean, unchanged
    behaviour, and Flow-GRPO's scripts/train_flux.py, which has no such filter); the SD3.5
    recipes (configs/models/sd3.5-medium_flow-grpo.yaml, configs/examples/*-sd35.yaml) set
    ``drop``."""
    lr: float = Field(3e-4, gt=0.0)
    weight_decay: float = Field(1e-4, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    rows_per_forward: int = Field(64, ge=1, le=MAX_ROWS)
    """The most (sample, timestep) rows one training forward/backward takes, in every mode: TSP
    packs up to this many rows of any timesteps; without TSP each timestep's rows (a group's
    samples, or a batched task's) are cut into forwards of at most this many. What bounds a
    trainer's activation memory: lower it where a forward does not fit the GPU (each row keeps
    its blocks' activations until the backward, unless ``activation_checkpointing``). At most :data:`MAX_ROWS`."""
    groups_per_task: int = Field(1, ge=1, le=MAX_GROUP)
    """Whole prompt groups one train task carries (1: one group per task). A batched task's
    rows, all its groups' (sample, timestep) pairs, are packed together into forwards of up to
    ``rows_per_forward`` rows, so a trainer makes fewer, fuller passes: with ``fsdp`` each pass
    all-gathers the sharded weights once, and a group of fewer rows than ``rows_per_forward``
    (G samples x K trained steps) no longer pays a pass of its own: the passes of a task are
    ``ceil(groups_per_task * G * K / rows_per_forward)`` (with TSP; without, one per
    denoising step, its rows taken from every group of the task), as the peers micro-batch 16
    samples per pass. The groups of a task are consecutive: each mini-batch's
    groups (with ``mini_batch_split: samples``, the iteration's) are cut from its first in runs
    of ``groups_per_task``, the last run taking what is left; the task is named by its first
    group (``train:<iteration>:<first group>``). The composition follows from the config
    alone, never from which groups happened to be scored first, so a run's float results do not
    depend on timing; GAP releases a task as soon as its own groups are scored (generation is
    released and pulled in group order, so these are the first ones scored). A batched task
    is never split in halves for RAT (halves only exist at 1); a rollout worker's RAT budget
    then counts whole tasks. The step sums the same rows and divides by the same count: the
    update equals the unbatched one up to float summation order (docs/guarantees.md).
    Not chosen automatically: the right value depends on the activation memory of
    ``rows_per_forward`` rows, which is what already bounds a pass, and on how many groups GAP
    should wait for; set it so that ``groups_per_task * group_size * trained timesteps`` is
    about ``rows_per_forward`` when training with ``fsdp``."""
    sequence_parallel: int = Field(1, ge=1, le=MAX_DEGREE)
    """Ulysses sequence-parallel degree of a trainer replica (Wan family): model-level support
    only (``digen.parallel.ulysses``, gradients summed over the group); trainer replicas are
    not formed, so ``digen train`` refuses values above 1."""
    ema: EmaConfig = EmaConfig()
    reduce: Literal["allreduce", "exact"] = "allreduce"
    """How the trainers of a distributed mode sum a step's gradients (:mod:`digen.dataplane.reduce`).
    ``allreduce``: each trainer adds the train tasks it ran into one running sum, and the
    trainers all-reduce their sums (a gloo or NCCL ring: about twice the gradient's bytes per
    trainer, whatever the task count); the result equals the reference's up to float32
    summation order (docs/guarantees.md). ``exact``: every task's gradient stays where it was
    computed and every trainer folds them all in (group, part) order, as the reference loop
    sums: the synchronous modes then equal the reference bit for bit, but every gradient
    travels to every trainer (for tests and checks, not for speed). The reference mode
    ignores it."""

    @property
    def exact_sum(self) -> bool:
        """``reduce: exact``: every train task's gradient stays a blob of its own and the step
        folds them in (group, part) order: decided here for the dispatcher (which asks the task
        to keep its gradient) and the step control (which lists the blobs in that order)."""
        return self.reduce == "exact"

    fsdp: bool = False
    """Shard the trained weights, gradients and AdamW state over the job's trainer workers
    (FSDP2), for a model whose full fine-tune does not fit one device. The trainer workers
    then act as one trainer (one torch.distributed group, ``digen.parallel.fsdp``); needs
    schedule.mode disaggregated or digen; turns TAG off; ``train.ema`` is sharded too (each
    rank averages its shards). The group is fixed at job start: a trainer that dies fails the
    job (rerun with --resume), one that joins later idles."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in the backward instead of keeping its activations:
    a forward then keeps about one block's activations per row instead of every block's (less
    memory, about one more forward of time). FSDP ranks (``fsdp``) and replicated trainers
    alike (:func:`digen.parallel.fsdp.checkpoint_blocks`); the gradient is the same bits."""


class RewardSpec(_Section):
    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = {}


class ScheduleConfig(_Section):
    mode: Mode = "reference"
    """reference (single process oracle), colocated, disaggregated, or digen."""
    gap: bool | None = None
    """Generation-axis pipeline: train a group as soon as it is scored. None: on in digen mode."""
    tsp: bool | None = None
    """Time-step parallelism: K timesteps of a task in one batched forward. None: on in digen."""
    tag: bool | None = None
    """Trainer-assisted generation. None: on in digen mode, off with ``train.fsdp`` (sharded
    trainer ranks cannot generate on their own)."""
    rat: bool | None = None
    """Rollout-assisted training, TAG's mirror for training-bound iterations: idle rollout
    workers train when the measured speeds say it shortens the iteration. None: on in digen
    mode. Off when rollout workers cannot hold a training step (memory)."""
    task_seconds: dict[Literal["gen", "train"], Annotated[float, Field(gt=0.0)]] = {}
    """Pinned seconds per prompt group of generation (``gen``) and of training (``train``), the
    same on every worker, that TAG and RAT decide from instead of the measured durations (read
    from an earlier run's timeline.jsonl, say). Pinned, every iteration's roles and half-group splits
    follow from the config alone, not from how fast the machine was that minute. Empty: measured."""
    max_staleness: Literal[0, 1] | None = None
    """Policy lag of rollouts. None: 1 in digen mode, else 0."""
    lease_s: float = Field(120.0, gt=0.0)
    """A leased task not acknowledged within this time is re-delivered."""
    max_attempts: int = Field(3, ge=1, le=1_000)
    """A task failing this many times goes to the dead-letter list."""
    on_poison: Literal["fail", "drop"] = "fail"
    """What a dead-lettered task does to the job: fail it, or drop its samples."""
    redis_outage_s: float = Field(120.0, gt=0.0)
    """How long the controller and the workers pause for Redis to come back (a restart, a
    failover) before the job fails."""

    def resolved(self) -> ScheduleConfig:
        """A copy with every None toggle replaced by the mode's default. With ``train.fsdp``
        the :class:`Config` sets ``tag`` and ``rat`` to False when they are None (the trainer
        group's weights are sharded: no trainer generates alone, no rollout worker trains)."""
        digen = self.mode == "digen"
        return self.model_copy(
            update={
                "gap": digen if self.gap is None else self.gap,
                "tsp": digen if self.tsp is None else self.tsp,
                "tag": digen if self.tag is None else self.tag,
                "rat": digen if self.rat is None else self.rat,
                "max_staleness": (1 if digen else 0) if self.max_staleness is None else self.max_staleness,
            }
        )


class LocalClusterConfig(_Section):
    rollout_workers: int = Field(1, ge=0, le=MAX_LOCAL_WORKERS)
    """Rollout workers of the embedded cluster (the three roles together at most
    :data:`MAX_LOCAL_WORKERS`)."""
    trainer_workers: int = Field(1, ge=0, le=MAX_LOCAL_WORKERS)
    reward_workers: int = Field(0, ge=0, le=MAX_LOCAL_WORKERS)
    """Workers that only score (``digen worker --role reward``): with any, generation tasks
    hand their decoded images to ``reward`` tasks instead of scoring inline."""
    gpu_type: str = "cpu"
    """Resource tag (``gpu-<TYPE>``) of embedded workers placed on no GPU. A worker placed on
    a GPU (``gpus``) is tagged with that GPU's type, read from its name (``h100``, ``l40s``)."""
    gpus: Literal["auto"] | list[Annotated[int, Field(ge=0)]] = "auto"
    """GPUs the embedded workers are placed on (:mod:`digen.cluster.placement`): ``auto``
    every visible one, or a list of ids (``[0, 1, 2, 3]``); none visible, ``[]`` or
    ``model.device: cpu``: the workers run on CPU. Each worker process sees only its own GPU
    (``CUDA_VISIBLE_DEVICES``). ``digen plan CONFIG`` prints the placement."""
    workers_per_gpu: int = Field(1, ge=1, le=MAX_DEGREE)
    """Workers that may share one GPU. 1: each worker has a GPU of its own, and more workers
    than GPUs is refused before anything starts; 2 or more lets that many share one, once every
    GPU has one (ranks of one NCCL group never share: docs/deploy.md, "The placement")."""

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus_form(cls, value: Any) -> Any:
        """One message for a value that is neither ``auto`` nor a list of GPU ids."""
        if value == "auto" or (isinstance(value, list) and all(isinstance(i, int) and i >= 0 for i in value)):
            return value
        raise ValueError("must be auto or a list of GPU ids such as [0, 1, 2, 3]")

    threads_per_worker: int = Field(1, ge=1, le=MAX_DEGREE)
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    """How the embedded workers' processes start. ``forkserver``: one server process forks
    every worker, the imported code shared between them (fast); ``digen train`` and ``digen
    bench`` fork that server from their own process before anything computes, so it shares
    their torch, diffusers and Dask too (elsewhere, e.g. in a service job, or where CUDA is
    initialised, multiprocessing spawns it and it imports them itself); ``spawn``: each worker
    imports everything itself (Dask's default)."""
    dashboard: bool = False
    """Serve the Dask dashboard (bokeh) from the local scheduler; its link is in the start
    notice. Off: about 50 MiB less in the controller (``digen train --dashboard`` turns it on)."""


class ClusterConfig(_Section):
    local: LocalClusterConfig = LocalClusterConfig()
    gpu_types: list[str] = []
    """GPU types this job may run on (``digen worker --gpu-type``). A worker of another type
    gets no task. Empty: any type."""


class SecurityConfig(_Section):
    """This node's TLS files (PEM; ``digen certs`` makes them; docs/deploy.md). The
    controller's Dask client uses them for a ``tls://`` scheduler, and the embedded local
    cluster, when they are given, speaks ``tls://`` with them. ``digen worker|serve|train
    --security FILE`` reads the same section from a node's own file (a worker's blob server
    uses its node's files, never the job's)."""

    ca_file: str | None = None
    """CA certificate that signed the scheduler's and every node's certificate."""
    cert_file: str | None = None
    """This node's certificate."""
    key_file: str | None = None
    """This node's private key."""
    require_encryption: bool = True
    """Refuse plain ``tcp://`` connections once certificates are given."""
    auth_s: float = Field(5.0, gt=0, le=300)
    """Seconds a new connection to a worker's blob server has to authenticate (its TLS
    handshake and a first request signed with the job's key) before it is dropped: what a
    peer without credentials may hold one of the server's connections for."""

    @property
    def enabled(self) -> bool:
        return any((self.ca_file, self.cert_file, self.key_file))


class OutputConfig(_Section):
    checkpoint_every: int = Field(1, ge=1, le=MAX_ITERATIONS)
    keep_checkpoints: int = Field(2, ge=1, le=MAX_ITERATIONS)
    sample_grid_every: int = Field(5, ge=0, le=MAX_ITERATIONS)
    """Write samples/iter_NNNN.png every N iterations (0: never)."""
    plots: bool = True
    """Write timeline.png and rewards.png at the end."""


class EvalConfig(_Section):
    """Held-out evaluation: the current policy samples ``prompts.test_file`` with the
    deterministic ODE sampler (Euler, ``rollout.eval_steps``) and fixed seeds, scored by every
    reward of ``reward`` separately (``RUN_DIR/eval.jsonl``, ``RUN_DIR/eval/iter_NNNN.png``)."""

    every: int = Field(0, ge=0, le=MAX_ITERATIONS)
    """Evaluate after every N iterations and after the last one (0: never, the default).
    Off by default because a run names its held-out set only when it has one: a plain
    ``prompts.file`` (the quickstart's ten digit prompts) has no test split, and evaluating on
    the training prompts would show the training reward again, at the cost of the extra ODE
    samples. The peers' recipes evaluate periodically on their test split, and so do their
    imports (``digen import``: Flow-GRPO's ``eval_freq``, default 20; Flow-Factory's, 10);
    a run with ``prompts.test_file`` or a dataset with a test split sets ``eval.every``."""
    num_prompts: int = Field(0, ge=0, le=MAX_ITERATIONS)
    """The first N test prompts (0: all of them)."""
    seed: int = 0
    """Seed of the evaluation noise: sample i starts from the same noise at every evaluation,
    drawn from its own stream (training's streams are untouched)."""
    batch_size: int = Field(0, ge=0, le=MAX_SAMPLES)
    """Test prompts per evaluation task (one batched ODE sampling, one sample per prompt).
    0 (auto): the most whose denoising steps (``batch_size x rollout.eval_steps``) do not
    exceed one generation task's (``group_size x num_steps``), at least 1: an evaluation task
    in flight delays the next generation task by at most about one generation task."""


class LoggingConfig(_Section):
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "digen"


class Config(_Section):
    seed: int = 0
    iterations: int = Field(10, ge=1, le=MAX_ITERATIONS)
    """Iterations of the run (at most :data:`MAX_ITERATIONS`)."""
    model: ModelConfig
    """Required (``model.path`` at least)."""
    prompts: PromptsConfig
    """Required: ``prompts.items``, ``prompts.file`` or ``prompts.dataset``."""
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    reward: list[RewardSpec]
    """Required: at least one reward (``digen rewards`` lists them)."""
    schedule: ScheduleConfig = ScheduleConfig()
    cluster: ClusterConfig = ClusterConfig()
    output: OutputConfig = OutputConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    security: SecurityConfig = SecurityConfig()
    source_dir: str | None = Field(None, exclude=True)
    """Folder of the YAML file (relative paths resolve against it); not user-set."""

    @model_validator(mode="after")
    def _sharded_trainers_only_train(self) -> Config:
        """With ``train.fsdp`` TAG and RAT default to off: a trainer rank holds 1/N of the
        weights, so it cannot generate on its own, and a rollout worker's gradient would never
        reach the sharded optimizer. Explicit ``true`` values are reported by the cross-checks."""
        if self.train.fsdp:
            s = self.schedule
            if s.tag is None:
                s.tag = False
            if s.rat is None:
                s.rat = False
        return self

    @model_validator(mode="after")
    def _whole_groups_train_whole(self) -> Config:
        """An algorithm of :data:`~digen.config.names.WHOLE_GROUP_ALGORITHMS` trains whole
        groups: RAT (which splits a group into halves) defaults to off for it; an explicit
        ``true`` is reported by the algorithm's check."""
        if self.train.algorithm in WHOLE_GROUP_ALGORITHMS and self.schedule.rat is None:
            self.schedule.rat = False
        return self

    def resolve_path(self, value: str) -> Path:
        """A path from the config: absolute, else relative to the config file's folder
        (falling back to the current directory when that does not exist)."""
        p = Path(value).expanduser()
        if p.is_absolute():
            return p
        if self.source_dir is not None and (Path(self.source_dir) / p).exists():
            return Path(self.source_dir) / p
        return p

    def prompt_list(self) -> list[str]:
        """The training prompts: ``prompts.dataset``'s train split, else ``file``, else ``items``."""
        return self._train_prompts()[0]

    def test_prompt_list(self) -> tuple[list[str], list[dict[str, Any]] | None]:
        """Held-out prompts and their metadata (None without): ``prompts.test_file``, else
        ``prompts.dataset``'s test split; ``([], None)`` when there is neither."""
        p = self.prompts
        if p.test_file is not None:
            return read_prompts(self.resolve_path(p.test_file))
        if p.dataset is not None:
            folder = self.resolve_path(p.dataset)
            if any((folder / n).is_file() for n in ("test_metadata.jsonl", "test.txt")):
                return read_prompts(split_file(folder, "test"))
        return [], None

    def prompt_metadata(self, prompt: str) -> dict[str, Any] | None:
        """A training or test prompt's metadata (None when its file carries none)."""
        for prompts, metadata in (self._train_prompts(), self.test_prompt_list()):
            if metadata is not None and prompt in prompts:
                return metadata_by_prompt(prompts, metadata)[prompt]
        return None

    def _train_prompts(self) -> tuple[list[str], list[dict[str, Any]] | None]:
        p = self.prompts
        if p.dataset is not None:
            return read_prompts(split_file(self.resolve_path(p.dataset), "train"))
        if p.file is not None:
            return read_prompts(self.resolve_path(p.file))
        return list(p.items), None


_NO_MODEL = (
    "model.path is required: the local diffusers pipeline folder to train "
    "(`digen make-tiny-model .tiny/sd3 --arch sd3` makes a tiny one); digen has no default model"
)
REQUIRED = {
    "model": _NO_MODEL,
    "model.path": _NO_MODEL,
    "prompts": "prompts is required: give prompts.items, prompts.file or prompts.dataset",
    "reward": "reward is required: list at least one reward, e.g. [{name: brightness}] (digen rewards lists them)",
}
"""The keys a config must name (no silent defaults: :class:`Config` has none for them), with
the line that says so when one is missing."""
