"""samples/iter_NNNN.png: layout, prompt and reward labels, best/worst colors, video frames."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from digen.rollout import GroupTask, Trajectories
from digen.viz import BEST, HEADER_H, LABEL_H, LABEL_W, WORST, group_label, write_sample_grid


def _trajs(
    n_groups: int, g: int = 4, frames: int | None = None
) -> tuple[list[GroupTask], dict[int, Trajectories]]:
    groups = [
        GroupTask(7, i, f"prompt number {i}", tuple(range(i * g, i * g + g)), 6) for i in range(n_groups)
    ]
    gen = torch.Generator().manual_seed(0)
    shape = (g, 3, 32, 32) if frames is None else (g, frames, 3, 32, 32)
    trajs = {}
    for t in groups:
        images = torch.randint(0, 256, shape, generator=gen).to(torch.uint8)
        rewards = torch.tensor([0.2, 0.9, 0.5, float("nan")][:g])
        trajs[t.group] = Trajectories(t, torch.zeros(0), torch.zeros(0), torch.zeros(0), images, rewards)
    return groups, trajs


def _count(img: Image.Image, color: tuple[int, int, int], box: tuple[int, int, int, int]) -> int:
    a = np.asarray(img.convert("RGB").crop(box)).astype(int)
    return int((np.abs(a - np.array(color)).max(axis=-1) <= 40).sum())


def test_grid_layout_and_labels(tmp_path):
    groups, trajs = _trajs(3)
    del trajs[1]  # a group that is missing is skipped
    path = tmp_path / "samples" / "iter_0007.png"
    write_sample_grid(path, trajs, groups, cell=64)
    img = Image.open(path)
    assert img.size == (LABEL_W + 4 * 64, HEADER_H + 2 * (64 + LABEL_H))
    # the image cells hold the images, pixel for pixel (nearest upscaling x2)
    cell = np.asarray(img.convert("RGB"))[HEADER_H : HEADER_H + 64, LABEL_W : LABEL_W + 64]
    src = trajs[0].images[0].permute(1, 2, 0).numpy()
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
    groups, trajs = _trajs(1, g=2, frames=3)
    write_sample_grid(tmp_path / "v.png", trajs, groups, cell=32)
    assert Image.open(tmp_path / "v.png").size == (LABEL_W + 2 * 96, HEADER_H + 32 + LABEL_H)


def test_group_label_wraps_the_prompt_and_ends_with_mean_and_std():
    lines = group_label(
        "a photograph of a cat riding a bicycle through paris at dusk, high detail",
        torch.tensor([1.0, 3.0, float("nan")]),
        width_chars=20,
        max_lines=2,
    )
    assert len(lines) == 3
    assert lines[1].endswith("…")
    assert lines[-1] == "2.000 ± 1.000"


def test_nothing_to_draw_writes_nothing(tmp_path):
    groups, _ = _trajs(2)
    write_sample_grid(tmp_path / "none.png", {}, groups)
    assert not (tmp_path / "none.png").exists()
