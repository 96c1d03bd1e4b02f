"""The digits demo model: a tiny SD3 text-to-image pipeline trained on scikit-learn's digits.

:func:`build_digits_assets` (run by ``scripts/make_digits_model.py``) makes everything the
digits demo needs, on one CPU thread in a few minutes, from fixed seeds:

1. the reward's classifier (:class:`digen.rewards.digits.DigitClassifier`), trained on 75%
   of the 1,797 8x8 digits and measured on the other 25%;
2. a small ``AutoencoderKL``: 16x16 RGB (the 8x8 digits nearest-upscaled, white ink on
   black, in ``[-1, 1]``) <-> one 8x8 latent channel;
3. the tiny random text stack of :mod:`digen.models.text` (two CLIP encoders and a T5, frozen,
   16-token tokenizers: the MMDiT sees 32 text tokens);
4. a small ``SD3Transformer2DModel`` (4 MMDiT blocks, width 64, patch 2: 16 image tokens)
   trained with rectified flow on the VAE latents, conditioned on "a handwritten {d}" (10% of
   captions dropped to the empty prompt, for CFG). It is trained *briefly on purpose*: its
   digits are well formed but, without CFG, follow the prompt only about half the time. That
   is the base model RL improves (prompt alignment, as in real text-to-image RL);
5. the ``StableDiffusion3Pipeline`` folder, a grid of base samples and a JSON report with the
   base model's mean reward, measured through digen's own :class:`FlowPolicy` path.

Sampling settings of the demo: 8 steps, guidance 1 (no CFG), model.max_sequence_length 16
(the T5 length the transformer was trained with), resolution 16.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from digen.models import text
from digen.models.tiny import autoencoder_kl, save_pipeline, sd3_text_stack, sd3_transformer
from digen.rewards.digits import DigitClassifier, DigitClassifierReward, to_classifier_input

IMAGE_SIZE = 16
"""Side of the demo's images: the 8x8 digits upscaled 2x (nearest)."""

TEXT_LENGTH = 16
"""CLIP and T5 token length ("a handwritten 7" is 9 CLIP / 14 T5 tokens)."""

LATENT_CHANNELS = 1
"""One latent channel: with four, this KL-regularised VAE used one and left three at the prior,
pure noise that would only dilute RL's per-element mean log-prob."""

PROMPT = "a handwritten {digit}"
"""The caption template; ``configs/prompts/digits.txt`` lists its ten prompts."""


def digit_prompts() -> list[str]:
    """The ten prompts ``"a handwritten 0"`` .. ``"a handwritten 9"``."""
    return [PROMPT.format(digit=d) for d in range(10)]


@dataclass(frozen=True)
class DigitsRecipe:
    """How the demo assets are made (defaults: the committed ones)."""

    seed: int = 0
    classifier_steps: int = 1000
    vae_steps: int = 600
    transformer_steps: int = 600
    """Deliberately short: the base model should follow prompts only about half the time."""
    transformer_width: int = 64
    transformer_layers: int = 4
    shift: float = 1.0
    """The scheduler's static shift (8x8 latents need none)."""
    eval_steps: int = 8
    eval_guidance: float = 1.0
    eval_per_digit: int = 50
    test_fraction: float = 0.25


# --- data ------------------------------------------------------------------------------------
def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits.

    Returns:
        (images ``[N, 1, 8, 8]`` float32 in ``[0, 1]`` (ink = 1), labels ``[N]`` int64), N = 1797.
    """
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    images = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
    return images, torch.tensor(data.target, dtype=torch.long)


def split(n: int, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random (train indices, test indices) split of ``range(n)``."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = int(round(n * test_fraction))
    return perm[n_test:], perm[:n_test]


def to_pixels(images8: torch.Tensor, size: int = IMAGE_SIZE) -> torch.Tensor:
    """``[N, 1, 8, 8]`` in ``[0, 1]`` -> RGB ``[N, 3, size, size]`` in ``[-1, 1]`` (nearest upscale)."""
    x = F.interpolate(images8, size=(size, size), mode="nearest")
    return (x * 2 - 1).expand(-1, 3, -1, -1).contiguous()


# --- classifier ------------------------------------------------------------------------------
def train_classifier(
    images8: torch.Tensor, labels: torch.Tensor, *, steps: int, seed: int, batch_size: int = 128
) -> DigitClassifier:
    """Train :class:`DigitClassifier` on ``images8 [N, 1, 8, 8]`` / ``labels [N]`` (AdamW,
    cosine lr, label smoothing 0.05). Augmentation, so it also judges generated digits:
    shifts of up to 1 pixel and Gaussian pixel noise (std 0.05)."""
    gen = torch.Generator().manual_seed(seed)
    model = text.seeded(seed, DigitClassifier)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    for step in range(steps):
        _set_lr(opt, cosine_lr(step, steps, 3e-3))
        idx = torch.randint(0, len(images8), (batch_size,), generator=gen)
        loss = F.cross_entropy(model(_augment(images8[idx], gen)), labels[idx], label_smoothing=0.05)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Shift each ``[1, 8, 8]`` image by -1..1 pixel per axis (zero fill), add noise std 0.05."""
    padded = F.pad(x, (1, 1, 1, 1))
    dy, dx = torch.randint(0, 3, (2, len(x)), generator=gen)
    out = torch.stack([padded[i, :, dy[i] : dy[i] + 8, dx[i] : dx[i] + 8] for i in range(len(x))])
    return (out + 0.05 * torch.randn(out.shape, generator=gen)).clamp(0, 1)


@torch.no_grad()
def accuracy(model: DigitClassifier, images8: torch.Tensor, labels: torch.Tensor) -> float:
    """Top-1 accuracy of ``model`` on ``images8 [N, 1, 8, 8]``."""
    return float((model(images8).argmax(-1) == labels).float().mean())


# --- VAE -------------------------------------------------------------------------------------
def build_vae(seed: int):
    """``AutoencoderKL`` 16x16x3 <-> ``LATENT_CHANNELS`` x 8 x 8 (two levels of widths 8/16, no
    attention, no quant convs like SD3's VAE; about 40k parameters)."""
    return autoencoder_kl(
        seed=seed,
        block_out_channels=(8, 16),
        latent_channels=LATENT_CHANNELS,
        sample_size=IMAGE_SIZE,
        mid_block_add_attention=False,
    )


def train_vae(
    vae, pixels: torch.Tensor, *, steps: int, seed: int, batch_size: int = 32, lr: float = 3e-3
) -> None:
    """Train ``vae`` in place on ``pixels [N, 3, 16, 16]`` in ``[-1, 1]``: MSE of the decoded
    posterior sample + KL to N(0, I) per pixel element (weight 1)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    vae.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the posterior's sampling noise
        for step in range(steps):
            _set_lr(opt, cosine_lr(step, steps, lr))
            x = pixels[torch.randint(0, len(pixels), (batch_size,), generator=gen)]
            post = vae.encode(x).latent_dist
            loss = F.mse_loss(vae.decode(post.sample()).sample, x) + post.kl().mean() / x[0].numel()
            opt.zero_grad()
            loss.backward()
            opt.step()
    vae.eval()


@torch.no_grad()
def encode_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Set ``vae.config`` ``shift_factor``/``scaling_factor`` so the posterior means of
    ``pixels [N, 3, 16, 16]`` become zero-mean, unit-std (SD3's ``z = (x - shift) * scale``)
    and return those normalised latents ``[N, C, 8, 8]``.

    The flow model learns the posterior *means*: with this VAE's strong KL the posterior
    std is large (~0.6), and the decoder reads the means better than samples.
    """
    mean = vae.encode(pixels).latent_dist.mean
    vae.register_to_config(shift_factor=float(mean.mean()), scaling_factor=float(1.0 / mean.std()))
    return (mean - vae.config.shift_factor) * vae.config.scaling_factor


# --- pipeline --------------------------------------------------------------------------------
def build_transformer(*, seed: int, width: int, layers: int):
    """``SD3Transformer2DModel`` over ``LATENT_CHANNELS x 8 x 8`` latents: patch 2 (16 image
    tokens), ``layers`` MMDiT blocks of ``width`` (heads of 32), RMS qk-norm like SD3.5."""
    return sd3_transformer(
        seed=seed,
        sample_size=IMAGE_SIZE // 2,
        latent_channels=LATENT_CHANNELS,
        layers=layers,
        width=width,
        head_dim=32,
        pos_embed_max_size=IMAGE_SIZE // 4,
    )


def build_pipeline(*, seed: int, vae, transformer, shift: float):
    """A ``StableDiffusion3Pipeline`` around ``vae`` and ``transformer`` with the tiny random
    text stack of :mod:`digen.models.text` (the same encoders ``make_tiny_model`` uses, with
    :data:`TEXT_LENGTH`-token tokenizers) and a static-shift flow-matching Euler scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    clip_tok = text.tiny_clip_tokenizer(model_max_length=TEXT_LENGTH)
    t5_tok = text.tiny_t5_tokenizer(model_max_length=TEXT_LENGTH)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift),
        vae=vae,
        **sd3_text_stack(seed, clip_tok, t5_tok),
    )


@torch.no_grad()
def encode_digit_prompts(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """The ten digit prompts and the empty prompt through the pipeline's ``encode_prompt``.

    Returns:
        (``encoder_hidden_states [11, 2 * TEXT_LENGTH, 64]``, ``pooled_projections [11, 64]``);
        row ``d`` is "a handwritten d", row 10 the empty prompt.
    """
    embeds, _, pooled, _ = pipe.encode_prompt(
        prompt=[*digit_prompts(), ""],
        prompt_2=None,
        prompt_3=None,
        do_classifier_free_guidance=False,
        max_sequence_length=TEXT_LENGTH,
    )
    return embeds.float(), pooled.float()


# --- flow matching ---------------------------------------------------------------------------
def train_flow(
    transformer,
    latents: torch.Tensor,
    labels: torch.Tensor,
    prompt_embeds: tuple[torch.Tensor, torch.Tensor],
    *,
    steps: int,
    seed: int,
    uncond_fraction: float = 0.1,
    batch_size: int = 64,
    lr: float = 1e-3,
    log: Callable[[str], None] | None = None,
) -> None:
    """Rectified-flow training of ``transformer`` in place.

    Per sample: ``z0 = latents[i]`` (``[C, 8, 8]``), ``eps ~ N(0, I)``, ``sigma ~ U(0, 1)``,
    ``x = (1 - sigma) z0 + sigma eps``, target velocity ``eps - z0`` (the sign
    ``FlowMatchEulerDiscreteScheduler.step`` integrates: ``x_next = x + (sigma_next - sigma) v``),
    timestep ``1000 sigma``. Caption: row ``labels[i]`` of ``prompt_embeds`` (from
    :func:`encode_digit_prompts`), or row 10 (empty prompt) with probability ``uncond_fraction``.
    """
    embeds, pooled = prompt_embeds
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=1e-4)
    transformer.train()
    start = time.perf_counter()
    for step in range(steps):
        _set_lr(opt, cosine_lr(step, steps, lr))
        idx = torch.randint(0, len(latents), (batch_size,), generator=gen)
        z0, rows = latents[idx], labels[idx].clone()
        rows[torch.rand(batch_size, generator=gen) < uncond_fraction] = 10
        eps = torch.randn(z0.shape, generator=gen)
        sigma = torch.rand(batch_size, generator=gen)
        s = sigma.view(-1, 1, 1, 1)
        pred = transformer(
            hidden_states=(1 - s) * z0 + s * eps,
            timestep=sigma * 1000,
            encoder_hidden_states=embeds[rows],
            pooled_projections=pooled[rows],
            return_dict=False,
        )[0]
        loss = F.mse_loss(pred, eps - z0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        if log and ((step + 1) % 100 == 0 or step + 1 == steps):
            log(
                f"  transformer step {step + 1}/{steps} loss {loss.item():.4f} ({time.perf_counter() - start:.0f}s)"
            )
    transformer.eval()


def cosine_lr(step: int, steps: int, base: float, warmup: int = 50) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10% of ``base``."""
    if step < warmup:
        return base * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def _set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


# --- sampling and evaluation through digen's FlowPolicy --------------------------------------
@torch.no_grad()
def sample_policy(
    policy,
    digits: list[int],
    *,
    steps: int,
    guidance: float,
    seed: int,
    noise_level: float = 0.0,
) -> torch.Tensor:
    """Images of "a handwritten d" for each ``d`` in ``digits``, drawn with digen's step math.

    ``noise_level`` 0: the Euler ODE (what the pipeline does); > 0: Flow-GRPO's SDE step (what
    RL rollouts do). Returns ``[B, 3, 16, 16]`` float32 in ``[0, 1]``.
    """
    from digen.algos.sde import euler_step, sde_step

    gen = torch.Generator().manual_seed(seed)
    embeds = policy.encode_prompts([PROMPT.format(digit=d) for d in digits], with_uncond=guidance > 1.0)
    sigmas = policy.sigmas(steps).cpu()
    x = torch.stack([policy.initial_noise(gen) for _ in digits])
    for i in range(steps):
        v = policy.velocity(x, sigmas[i].expand(len(digits)), embeds, guidance)
        if noise_level > 0:
            x = sde_step(
                v,
                x,
                sigmas[i],
                sigmas[i + 1],
                noise_level=noise_level,
                generator=gen,
                sigma_max=float(sigmas[1]),
            ).prev_sample
        else:
            x = euler_step(v, x, sigmas[i], sigmas[i + 1])
    return policy.decode(x)


def policy_reward(
    policy,
    reward: DigitClassifierReward,
    recipe: DigitsRecipe,
    *,
    noise_level: float = 0.0,
    guidance: float | None = None,
) -> float:
    """Mean ``digit_classifier`` reward of ``recipe.eval_per_digit`` samples of each digit."""
    digits = [d for d in range(10) for _ in range(recipe.eval_per_digit)]
    g = recipe.eval_guidance if guidance is None else guidance
    images = sample_policy(
        policy, digits, steps=recipe.eval_steps, guidance=g, seed=recipe.seed + 1, noise_level=noise_level
    )
    return float(reward(images, [PROMPT.format(digit=d) for d in digits]).mean())


def save_grid(images: torch.Tensor, path: Path, *, columns: int, scale: int = 4) -> None:
    """Write ``images [B, 3, H, W]`` in ``[0, 1]`` as a PNG grid, ``columns`` per row, each
    image upscaled ``scale``x (nearest), with 2-pixel gray gutters."""
    from PIL import Image

    b, _, h, w = images.shape
    rows = math.ceil(b / columns)
    cell_h, cell_w = h * scale + 2, w * scale + 2
    canvas = torch.full((3, rows * cell_h + 2, columns * cell_w + 2), 0.5)
    big = F.interpolate(images.float().clamp(0, 1), scale_factor=scale, mode="nearest")
    for i in range(b):
        r, c = divmod(i, columns)
        top, left = 2 + r * cell_h, 2 + c * cell_w
        canvas[:, top : top + h * scale, left : left + w * scale] = big[i]
    Image.fromarray((canvas * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()).save(path)


# --- the whole build -------------------------------------------------------------------------
def build_digits_assets(
    assets: Path, recipe: DigitsRecipe = DigitsRecipe(), log: Callable[[str], None] = print
) -> dict:
    """Write ``assets/digits-classifier.safetensors``, ``assets/digits-sd3/`` (the pipeline),
    ``assets/digits-base-grid.png`` (10 ODE samples per digit, one row per digit, at the demo's
    settings) and ``assets/digits-build.json`` (this function's return value: the recipe and
    the measurements)."""
    from digen.models import load_policy

    t0 = time.perf_counter()
    assets.mkdir(parents=True, exist_ok=True)
    images8, labels = load_digits()
    train_idx, test_idx = split(len(labels), recipe.test_fraction, recipe.seed)

    log("classifier ...")
    clf = train_classifier(
        images8[train_idx], labels[train_idx], steps=recipe.classifier_steps, seed=recipe.seed
    )
    clf_path = assets / "digits-classifier.safetensors"
    save_file({k: v.contiguous() for k, v in clf.state_dict().items()}, str(clf_path))
    report: dict = {
        "recipe": asdict(recipe),
        "classifier_test_accuracy": accuracy(clf, images8[test_idx], labels[test_idx]),
    }
    log(f"  test accuracy {report['classifier_test_accuracy']:.4f}")

    log("VAE ...")
    pixels = to_pixels(images8)
    vae = build_vae(recipe.seed + 1)
    train_vae(vae, pixels, steps=recipe.vae_steps, seed=recipe.seed + 1)
    latents = encode_latents(vae, pixels)
    with torch.no_grad():
        recon = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor).sample
    report["vae_recon_classifier_accuracy"] = accuracy(
        clf, to_classifier_input((recon / 2 + 0.5).clamp(0, 1)), labels
    )
    log(f"  classifier accuracy on VAE reconstructions {report['vae_recon_classifier_accuracy']:.4f}")

    log("transformer ...")
    transformer = build_transformer(
        seed=recipe.seed + 2, width=recipe.transformer_width, layers=recipe.transformer_layers
    )
    pipe = build_pipeline(seed=recipe.seed, vae=vae, transformer=transformer, shift=recipe.shift)
    train_flow(
        transformer,
        latents,
        labels,
        encode_digit_prompts(pipe),
        steps=recipe.transformer_steps,
        seed=recipe.seed + 3,
        log=log,
    )
    out_dir = assets / "digits-sd3"
    save_pipeline(pipe, out_dir, ("tokenizer", "tokenizer_2"))
    report["build_s"] = round(time.perf_counter() - t0, 1)

    log("evaluating the base model ...")
    policy = load_policy(out_dir, height=IMAGE_SIZE, width=IMAGE_SIZE, max_sequence_length=TEXT_LENGTH)
    reward = DigitClassifierReward(clf_path)
    report["base_reward_ode"] = policy_reward(policy, reward, recipe)
    report["base_reward_sde_0.7"] = policy_reward(policy, reward, recipe, noise_level=0.7)
    report["base_reward_ode_cfg_4.5"] = policy_reward(policy, reward, recipe, guidance=4.5)
    grid = sample_policy(
        policy,
        [d for d in range(10) for _ in range(10)],
        steps=recipe.eval_steps,
        guidance=recipe.eval_guidance,
        seed=recipe.seed + 1,
    )
    save_grid(grid, assets / "digits-base-grid.png", columns=10)
    report["model_bytes"] = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    report["total_s"] = round(time.perf_counter() - t0, 1)
    (assets / "digits-build.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
