"""Pictures of a run: sample grids (one row per prompt group, labelled with prompt and reward)."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image, ImageDraw

from digen.rollout import GroupTask, Trajectories

LABEL_H = 12


def _frame(img: torch.Tensor) -> Image.Image:
    """uint8 ``[3, H, W]`` (or video ``[F, 3, H, W]``: frames side by side) -> PIL image."""
    if img.dim() == 4:
        img = torch.cat(list(img), dim=-1)
    return Image.fromarray(img.permute(1, 2, 0).contiguous().numpy())


def write_sample_grid(path: Path, trajs: dict[int, Trajectories], groups: list[GroupTask],
                      max_groups: int = 8, cell: int = 64) -> None:
    """A PNG grid: one row per group (prompt on the left), each image labelled with its reward."""
    shown = [g.group for g in groups if g.group in trajs][:max_groups]
    if not shown:
        return
    first = trajs[shown[0]].images
    n_cols = first.shape[0]
    aspect = _frame(first[0]).width / _frame(first[0]).height
    cw, ch = int(cell * aspect), cell
    label_w = 120
    grid = Image.new("RGB", (label_w + n_cols * cw, len(shown) * (ch + LABEL_H)), "white")
    draw = ImageDraw.Draw(grid)
    for r, g in enumerate(shown):
        t = trajs[g]
        y = r * (ch + LABEL_H)
        draw.text((2, y + ch // 2), t.task.prompt[:20], fill="black")
        for c in range(t.images.shape[0]):
            im = _frame(t.images[c]).resize((cw, ch), Image.NEAREST)
            grid.paste(im, (label_w + c * cw, y))
            draw.text((label_w + c * cw + 2, y + ch), f"{float(t.rewards[c]):.3f}", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
