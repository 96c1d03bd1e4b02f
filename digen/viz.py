"""Pictures of a run: sample grids (one row per prompt group, labelled with prompt and reward).

A grid (``samples/iter_NNNN.png``) has a header naming the iteration and the policy version
that generated it, then one row per group: on the left the prompt (wrapped), the group's
reward mean and std; then the group's images, each with its reward underneath, the best of
the group in green and the worst in red (the samples GRPO pushes towards and away from).

Images reach a grid as *cells*: the images of a group (or an evaluation chunk) side by side,
each resized to the grid's cell height (:func:`image_cells`). The worker that generated them
makes the cells and sends them as one small PNG (:func:`to_png`; a few kB even for 1024-pixel
images), so the process that draws the grid needs neither the tensors nor torch.
"""

from __future__ import annotations

import io
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image, ImageDraw, ImageFont

from digen.errors import PayloadError

if TYPE_CHECKING:
    import torch

LABEL_H = 14
"""Height of the reward line under each image (pixels)."""
HEADER_H = 18
LABEL_W = 132
"""Width of the prompt column (pixels)."""
CELL = 64
"""Height of an image cell in a grid (pixels)."""
MAX_CELLS_PIXELS = 64 * 2**20
"""Largest cell strip a PNG may decode to (a guard against a decompression bomb from Redis)."""
BEST, WORST, TEXT = (0, 128, 0), (200, 0, 0), (0, 0, 0)


def _frame(img: torch.Tensor) -> Image.Image:
    """uint8 ``[3, H, W]`` (or video ``[F, 3, H, W]``: frames side by side) -> PIL image."""
    import torch

    if img.dim() == 4:
        img = torch.cat(list(img), dim=-1)
    return Image.fromarray(img.permute(1, 2, 0).contiguous().numpy())


def image_cells(images: torch.Tensor, cell: int = CELL) -> Image.Image:
    """uint8 images ``[N, 3, H, W]`` (video ``[N, F, 3, H, W]``: each sample's frames side by
    side) as one strip: each resized (nearest) to ``cell`` pixels high, its aspect kept."""
    frames = [_frame(images[i]) for i in range(images.shape[0])]
    cw = int(cell * frames[0].width / frames[0].height)
    strip = Image.new("RGB", (cw * len(frames), cell), "white")
    for i, im in enumerate(frames):
        strip.paste(im.resize((cw, cell), Image.Resampling.NEAREST), (i * cw, 0))
    return strip


def to_png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def from_png(data: bytes) -> Image.Image:
    """A cell strip sent as PNG (untrusted: refused when not a PNG or too large)."""
    try:
        im = Image.open(io.BytesIO(data))
        if im.format != "PNG" or im.width * im.height > MAX_CELLS_PIXELS:
            raise PayloadError(f"not a cell strip: {im.format} {im.width}x{im.height}")
        return im.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise PayloadError(f"not a PNG cell strip ({exc})") from None


def cell(strip: Image.Image, n: int, i: int) -> Image.Image:
    """Cell ``i`` of a strip of ``n``."""
    w = strip.width // n
    return strip.crop((i * w, 0, (i + 1) * w, strip.height))


@dataclass
class GridRow:
    """One group's row of a sample grid: its prompt, the version that generated it, each
    sample's reward (NaN: dropped) and its cells (:func:`image_cells`)."""

    group: int
    prompt: str
    version: int
    rewards: list[float]
    cells: Image.Image


def _font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=11)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()


def _reward_colors(rewards: list[float]) -> list[tuple[int, int, int]]:
    """Green for the group's best finite reward, red for its worst, black otherwise."""
    finite = [v for v in rewards if math.isfinite(v)]
    if len(finite) < 2 or max(finite) == min(finite):
        return [TEXT] * len(rewards)
    hi, lo = max(finite), min(finite)
    return [BEST if v == hi else WORST if v == lo else TEXT for v in rewards]


def group_label(prompt: str, rewards: list[float], width_chars: int = 21, max_lines: int = 3) -> list[str]:
    """Lines of a row's left label: the wrapped prompt, then ``mean ± std`` of the finite rewards."""
    lines = textwrap.wrap(prompt, width_chars) or [""]
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1][: width_chars - 1] + "…"
    finite = [float(v) for v in rewards if math.isfinite(v)]
    if finite:
        mean = math.fsum(finite) / len(finite)
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in finite) / len(finite))
        lines.append(f"{mean:.3f} ± {std:.3f}")
    return lines


MAX_GRID_GROUPS = 64
"""The most prompt groups one sample grid shows (its header says when an iteration had more)."""


def write_sample_grid(
    path: Path,
    iteration: int,
    rows: list[GridRow],
    prompts: list[str] | None = None,
    max_groups: int = MAX_GRID_GROUPS,
) -> None:
    """A PNG grid: one row per group (prompt on the left), each image labelled with its reward;
    nothing is written when there is no row.

    Every group of the iteration is shown (up to ``max_groups``), in prompt order: by the
    position of its prompt in ``prompts`` (the run's prompt list), then by group, so the same
    prompt sits on the same row at every iteration where it is drawn, and iteration 0's grid
    and the last one's compare row by row. A prompt outside ``prompts`` (or no list) goes
    after, by group."""
    place = {p: i for i, p in reversed(list(enumerate(prompts or [])))}
    ordered = sorted(rows, key=lambda r: (place.get(r.prompt, len(place)), r.group))
    shown = ordered[:max_groups]
    if not shown:
        return
    ch = shown[0].cells.height
    cw = shown[0].cells.width // len(shown[0].rewards)
    n_cols = max(len(r.rewards) for r in shown)
    row_h = ch + LABEL_H
    font = _font()
    grid = Image.new("RGB", (LABEL_W + n_cols * cw, HEADER_H + len(shown) * row_h), "white")
    draw = ImageDraw.Draw(grid)
    versions = sorted({r.version for r in shown})
    header = f"iteration {iteration} · policy v{'/'.join(map(str, versions))} · reward under each image"
    if len(ordered) > len(shown):
        header += f" · first {len(shown)} of {len(ordered)} groups"
    draw.text((2, 2), header, fill=TEXT, font=font)
    for k, r in enumerate(shown):
        y = HEADER_H + k * row_h
        lines = group_label(r.prompt, r.rewards, max_lines=max(1, (row_h - 4) // 12 - 1))
        for i, line in enumerate(lines):
            draw.text((2, y + 2 + i * 12), line, fill=TEXT if i < len(lines) - 1 else (80, 80, 80), font=font)
        colors = _reward_colors(r.rewards)
        n = len(r.rewards)
        for c in range(n):
            grid.paste(cell(r.cells, n, c).resize((cw, ch), Image.Resampling.NEAREST), (LABEL_W + c * cw, y))
            draw.text((LABEL_W + c * cw + 2, y + ch), f"{r.rewards[c]:.3f}", fill=colors[c], font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)


def write_eval_grid(
    path: Path,
    chunks: list[tuple[Image.Image, int]],
    prompts: list[str],
    rewards: list[float],
    header: str,
    columns: int = 8,
    max_images: int = 64,
) -> None:
    """A PNG of a held-out evaluation: one cell per test prompt (image, then its reward and the
    start of its prompt), ``columns`` per row, the best reward in green and the worst in red.

    ``chunks``: (cells, count) of the evaluation's chunks (:func:`image_cells`), in prompt
    order, one cell per prompt; ``rewards``: one per prompt.
    """
    cells = [cell(strip, k, i) for strip, k in chunks for i in range(k)]
    n = min(len(cells), max_images)
    if n == 0:
        return
    ch = cells[0].height
    iw = cells[0].width
    cw = max(iw, LABEL_W // 2)
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
        grid.paste(cells[i], (x, y))
        draw.text((x + 2, y + ch), f"{rewards[i]:.3f}", fill=colors[i], font=font)
        draw.text(
            (x + 2, y + ch + LABEL_H),
            textwrap.shorten(prompts[i], chars, placeholder="…"),
            fill=TEXT,
            font=font,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
