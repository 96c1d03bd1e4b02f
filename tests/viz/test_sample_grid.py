"""samples/iter_NNNN.png: layout, prompt and reward labels, best/worst colors, video frames."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from digen.viz import (
    BEST,
    HEADER_H,
    LABEL_H,
    LABEL_W,
    WORST,
    GridRow,
    from_png,
    group_label,
    image_cells,
    to_png,
    write_sample_grid,
)


def _rows(n_groups: int, g: int = 4, frames: int | None = None, cell: int = 64) -> tuple[list[GridRow], dict]:
    gen = torch.Generator().manual_seed(0)
    shape = (g, 3, 32, 32) if frames is None else (g, frames, 3, 32, 32)
    rows, images = [], {}
    for i in range(n_groups):
        images[i] = torch.randint(0, 256, shape, generator=gen).to(torch.uint8)
        rewards = [0.2, 0.9, 0.5, float("nan")][:g]
        rows.append(GridRow(i, f"prompt number {i}", 6, rewards, image_cells(images[i], cell)))
    return rows, images


def _count(img: Image.Image, color: tuple[int, int, int], box: tuple[int, int, int, int]) -> int:
    a = np.asarray(img.convert("RGB").crop(box)).astype(int)
    return int((np.abs(a - np.array(color)).max(axis=-1) <= 40).sum())


def test_grid_layout_and_labels(tmp_path):
    rows, images = _rows(3)
    del rows[1]  # a group that is missing is skipped
    path = tmp_path / "samples" / "iter_0007.png"
    write_sample_grid(path, 7, rows)
    img = Image.open(path)
    assert img.size == (LABEL_W + 4 * 64, HEADER_H + 2 * (64 + LABEL_H))
    # the image cells hold the images, pixel for pixel (nearest upscaling x2)
    cell = np.asarray(img.convert("RGB"))[HEADER_H : HEADER_H + 64, LABEL_W : LABEL_W + 64]
    src = images[0][0].permute(1, 2, 0).numpy()
    assert np.array_equal(cell[::2, ::2], src)
    # the prompt column and the header carry text (dark pixels on white)
    label = np.asarray(img.convert("L").crop((0, HEADER_H, LABEL_W, HEADER_H + 64)))
    assert (label < 128).sum() > 50
    # best reward (0.9, column 1) written in green, worst (0.2, column 0) in red
    y = HEADER_H + 64
    assert _count(img, BEST, (LABEL_W + 64, y, LABEL_W + 128, y + LABEL_H)) > 5
    assert _count(img, WORST, (LABEL_W, y, LABEL_W + 64, y + LABEL_H)) > 5
    assert _count(img, BEST, (LABEL_W, y, LABEL_W + 64, y + LABEL_H)) == 0


def test_video_frames_side_by_side(tmp_path):
    rows, _ = _rows(1, g=2, frames=3, cell=32)
    write_sample_grid(tmp_path / "v.png", 0, rows)
    assert Image.open(tmp_path / "v.png").size == (LABEL_W + 2 * 96, HEADER_H + 32 + LABEL_H)


def test_group_label_wraps_the_prompt_and_ends_with_mean_and_std():
    lines = group_label(
        "a photograph of a cat riding a bicycle through paris at dusk, high detail",
        [1.0, 3.0, float("nan")],
        width_chars=20,
        max_lines=2,
    )
    assert len(lines) == 3
    assert lines[1].endswith("…")
    assert lines[-1] == "2.000 ± 1.000"


def test_nothing_to_draw_writes_nothing(tmp_path):
    write_sample_grid(tmp_path / "none.png", 0, [])
    assert not (tmp_path / "none.png").exists()


def test_cells_travel_as_a_small_png_and_come_back_pixel_for_pixel():
    rows, _ = _rows(1, g=8)
    data = to_png(rows[0].cells)
    assert data.startswith(b"\x89PNG") and len(data) < 8 * 64 * 64 * 3  # smaller than the raw cells
    assert from_png(data).tobytes() == rows[0].cells.tobytes()


def test_what_is_not_a_png_cell_strip_is_refused():
    import pytest

    from digen.errors import PayloadError

    with pytest.raises(PayloadError, match="not a PNG"):
        from_png(b"\x80\x04pickle")


def test_every_group_is_shown_in_prompt_order(tmp_path):
    """Ten groups whose prompts an iteration drew shuffled: ten rows, ordered by the prompt's
    place in the run's prompt list (8 rows by group index before), so a prompt keeps its row
    from one iteration's grid to the next."""
    rows, images = _rows(10)
    prompts = [r.prompt for r in rows]
    drawn = [3, 9, 0, 7, 1, 8, 2, 6, 4, 5]  # group i generated prompt drawn[i]
    shuffled = [GridRow(i, prompts[p], 6, rows[p].rewards, rows[p].cells) for i, p in enumerate(drawn)]
    path = tmp_path / "grid.png"
    write_sample_grid(path, 0, shuffled, prompts=prompts)
    img = np.asarray(Image.open(path).convert("RGB"))
    assert img.shape[0] == HEADER_H + 10 * (64 + LABEL_H)
    for k in range(10):  # row k holds prompt k's images
        y = HEADER_H + k * (64 + LABEL_H)
        first = img[y : y + 64, LABEL_W : LABEL_W + 64][::2, ::2]
        assert np.array_equal(first, images[k][0].permute(1, 2, 0).numpy()), k
