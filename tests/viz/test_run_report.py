"""digen report: one self-contained HTML page with embedded charts, grids and the summary."""

from __future__ import annotations

import base64
import io
import re

import pytest
from PIL import Image
from typer.testing import CliRunner

from digen.cli.main import app
from digen.errors import ConfigError
from digen.run_report import pick_grids, render_report

from ._runs import write_run


def _grid_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 20), (255, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


def _images(page: str) -> list[Image.Image]:
    return [
        Image.open(io.BytesIO(base64.b64decode(b)))
        for b in re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    ]


def test_report_embeds_charts_grid_and_summary(tmp_path):
    run = write_run(tmp_path / "run", grid_png=_grid_png())
    page = render_report(run)
    images = _images(page)
    assert len(images) == 3  # timeline, rewards (drawn in memory), one grid
    assert all(im.format == "PNG" for im in images)
    assert (40, 20) in [im.size for im in images]
    assert "0.4321" in page and "reward_last" in page  # the summary table
    assert "mode: digen" in page  # the config
    assert "<td>0.44</td>" in page  # the iterations table (reward_mean of iteration 4)
    assert not re.search(r'(src|href)="(http|/|\.\.?/)', page)  # nothing outside the file
    assert not (run / "timeline.png").exists()  # the run directory is only read


def test_report_of_a_running_job_has_no_summary(tmp_path):
    page = render_report(write_run(tmp_path / "run", summary=False))
    assert "no summary.json yet" in page
    assert "no sample grids" in page


def test_not_a_run_directory(tmp_path):
    with pytest.raises(ConfigError, match="not a digen run directory"):
        render_report(tmp_path)


def test_pick_grids_keeps_first_and_last(tmp_path):
    paths = [tmp_path / f"iter_{i:04d}.png" for i in range(20)]
    picked = pick_grids(list(reversed(paths)), 4)
    assert picked[0] == paths[0] and picked[-1] == paths[-1] and len(picked) == 4


def test_cli_report(tmp_path):
    run = write_run(tmp_path / "run", grid_png=_grid_png())
    res = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "r.html").read_text().count("data:image/png;base64,") == 3
    bad = CliRunner().invoke(app, ["report", str(tmp_path / "missing")])
    assert bad.exit_code == 2
