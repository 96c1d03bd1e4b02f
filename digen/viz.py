"""Pictures of a run: sample grids (one row per prompt group, labelled with prompt and reward).

A grid (``samples/iter_NNNN.png``) has a header naming the iteration and the policy version
that generated it, then one row per group: on the left the prompt (wrapped), the group's
reward mean and std; then the group's images, each with its reward underneath, the best of
the group in green and the worst in red (the samples GRPO pushes towards and away from).
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont

from digen.rollout import GroupTask, Trajectories

LABEL_H = 14
"""Height of the reward line under each image (pixels)."""
HEADER_H = 18
LABEL_W = 132
"""Width of the prompt column (pixels)."""
BEST, WORST, TEXT = (0, 128, 0), (200, 0, 0), (0, 0, 0)


def _frame(img: torch.Tensor) -> Image.Image:
    """uint8 ``[3, H, W]`` (or video ``[F, 3, H, W]``: frames side by side) -> PIL image."""
    if img.dim() == 4:
        img = torch.cat(list(img), dim=-1)
    return Image.fromarray(img.permute(1, 2, 0).contiguous().numpy())


def _font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=11)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()


def _reward_colors(rewards: torch.Tensor) -> list[tuple[int, int, int]]:
    """Green for the group's best finite reward, red for its worst, black otherwise."""
    vals = [float(x) for x in rewards]
    finite = [v for v in vals if math.isfinite(v)]
    if len(finite) < 2 or max(finite) == min(finite):
        return [TEXT] * len(vals)
    hi, lo = max(finite), min(finite)
    return [BEST if v == hi else WORST if v == lo else TEXT for v in vals]


def group_label(prompt: str, rewards: torch.Tensor, width_chars: int = 21, max_lines: int = 3) -> list[str]:
    """Lines of a row's left label: the wrapped prompt, then ``mean ± std`` of the finite rewards
    (``rewards: [G]``)."""
    lines = textwrap.wrap(prompt, width_chars) or [""]
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1][: width_chars - 1] + "…"
    finite = rewards[torch.isfinite(rewards)].float()
    if len(finite):
        lines.append(f"{float(finite.mean()):.3f} ± {float(finite.std(unbiased=False)):.3f}")
    return lines


def write_sample_grid(
    path: Path, trajs: dict[int, Trajectories], groups: list[GroupTask], max_groups: int = 8, cell: int = 64
) -> None:
    """A PNG grid: one row per group (prompt on the left), each image labelled with its reward.

    ``trajs`` maps group index to its trajectories (``images: [G, 3, H, W]`` uint8, or
    ``[G, F, 3, H, W]`` for video); groups missing from it are skipped.
    """
    shown = [g.group for g in groups if g.group in trajs][:max_groups]
    if not shown:
        return
    first = trajs[shown[0]].images
    n_cols = max(trajs[g].images.shape[0] for g in shown)
    aspect = _frame(first[0]).width / _frame(first[0]).height
    cw, ch = int(cell * aspect), cell
    row_h = ch + LABEL_H
    font = _font()
    grid = Image.new("RGB", (LABEL_W + n_cols * cw, HEADER_H + len(shown) * row_h), "white")
    draw = ImageDraw.Draw(grid)
    t0 = trajs[shown[0]].task
    versions = sorted({trajs[g].task.version for g in shown})
    header = f"iteration {t0.iteration} · policy v{'/'.join(map(str, versions))} · reward under each image"
    draw.text((2, 2), header, fill=TEXT, font=font)
    for r, g in enumerate(shown):
        t = trajs[g]
        y = HEADER_H + r * row_h
        lines = group_label(t.task.prompt, t.rewards, max_lines=max(1, (row_h - 4) // 12 - 1))
        for i, line in enumerate(lines):
            draw.text((2, y + 2 + i * 12), line, fill=TEXT if i < len(lines) - 1 else (80, 80, 80), font=font)
        colors = _reward_colors(t.rewards)
        for c in range(t.images.shape[0]):
            im = _frame(t.images[c]).resize((cw, ch), Image.Resampling.NEAREST)
            grid.paste(im, (LABEL_W + c * cw, y))
            draw.text((LABEL_W + c * cw + 2, y + ch), f"{float(t.rewards[c]):.3f}", fill=colors[c], font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)


def write_eval_grid(
    path: Path,
    images: torch.Tensor,
    prompts: list[str],
    rewards: torch.Tensor,
    header: str,
    columns: int = 8,
    max_images: int = 64,
    cell: int = 64,
) -> None:
    """A PNG of a held-out evaluation: one cell per test prompt (image, then its reward and the
    start of its prompt), ``columns`` per row, the best reward in green and the worst in red.

    ``images``: uint8 ``[N, 3, H, W]`` (video ``[N, F, 3, H, W]``); ``rewards``: ``[N]``.
    """
    n = min(images.shape[0], max_images)
    if n == 0:
        return
    aspect = _frame(images[0]).width / _frame(images[0]).height
    cw, ch = max(int(cell * aspect), LABEL_W // 2), cell
    cols = min(columns, n)
    rows = math.ceil(n / cols)
    row_h = ch + 2 * LABEL_H
    font = _font()
    grid = Image.new("RGB", (cols * cw, HEADER_H + rows * row_h), "white")
    draw = ImageDraw.Draw(grid)
    draw.text((2, 2), header, fill=TEXT, font=font)
    colors = _reward_colors(rewards[:n])
    chars = max(4, cw // 6)
    for i in range(n):
        x, y = (i % cols) * cw, HEADER_H + (i // cols) * row_h
        grid.paste(_frame(images[i]).resize((int(cell * aspect), ch), Image.Resampling.NEAREST), (x, y))
        draw.text((x + 2, y + ch), f"{float(rewards[i]):.3f}", fill=colors[i], font=font)
        draw.text(
            (x + 2, y + ch + LABEL_H),
            textwrap.shorten(prompts[i], chars, placeholder="…"),
            fill=TEXT,
            font=font,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
