"""The controller's process imports no torch (docs/architecture.md, "The controller"): not
when its modules are imported, and not during a real run of ``digen train`` in digen mode
on the embedded Redis and a local Dask cluster, forked fork server included. Each check runs
in a fresh interpreter (this one has torch loaded). What it leaves to a child process, the
algorithm's and the rewards' checks, still stops a bad config before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from digen.checks import check_inputs
from digen.config import build_config
from digen.errors import ConfigError
from tests.conftest import small_config_data

CONTROLLER_MODULES = [
    "digen.runtime.controller",
    "digen.runtime.results",
    "digen.runtime.dispatch",
    "digen.runtime.evals",
    "digen.runtime.steps",
    "digen.runtime.ledger",
    "digen.runtime.fsdp_group",
    "digen.runtime.sp_group",
    "digen.runtime.membership",
    "digen.cluster.cluster",
    "digen.engine",
    "digen.checks",
    "digen.cli.main",
]

RUN = """
import json, subprocess, sys
from digen.cli.main import app
children = []
real_run = subprocess.run
def counted_run(args, *a, **kw):  # the real call; the checks' children are counted
    if "digen.checks" in args:
        children.append(args)
    return real_run(args, *a, **kw)
subprocess.run = counted_run
try:
    app(["train", sys.argv[1], "--out", sys.argv[2], "--log-format", "quiet"])
    code = 0
except SystemExit as exc:
    code = exc.code
maps = open("/proc/self/maps").read()
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "libtorch": "libtorch" in maps,
                  "check_children": len(children)}))
"""


def fresh_python(code: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, cwd=root
    )


@pytest.mark.slow
def test_importing_the_controller_imports_no_torch():
    code = f"import sys\nimport {', '.join(CONTROLLER_MODULES)}\nprint('torch' in sys.modules)"
    out = fresh_python(code, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout


@pytest.mark.slow
def test_a_digen_mode_run_keeps_torch_out_of_the_controller(tiny_sd3, tmp_path):
    """``digen train`` in digen mode: the workers train (torch), the run finishes with its
    metrics, and the controller's process never loaded torch's library. It started one child
    process to check the algorithm and the rewards (and ask their servers), not one per check."""
    data = small_config_data(tiny_sd3, schedule={"mode": "digen"}, eval={"every": 0})
    data["output"]["sample_grid_every"] = 1  # the grid travels as PNG cells, decoded here
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    out = fresh_python(RUN, str(cfg_path), str(tmp_path / "run"), timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"code": 0, "torch": False, "libtorch": False, "check_children": 1}, out.stderr[-4000:]
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["iteration"] for r in rows] == [0, 1]
    assert all(json.loads(r)["trained_rows"] > 0 for r in rows)


def test_the_names_of_a_distributed_run_are_checked_with_the_config(tiny_sd3, tmp_path):
    """Loaded as digen train loads it (``algorithms=False``, no torch), a digen-mode config
    with an unknown algorithm and an unknown reward fails with both problems and the
    config's others at once, from the torch-free tables of names."""
    data = small_config_data(
        tiny_sd3, schedule={"mode": "digen"}, train__algorithm="flow-grpoo", rollout__group_size=3
    )
    data["reward"] = [{"name": "brightnes"}]
    with pytest.raises(ConfigError) as err:
        build_config(data, algorithms=False)
    text = str(err.value)
    assert "train.algorithm ('flow-grpoo') is not a registered algorithm" in text
    assert "reward 'brightnes' does not exist" in text
    assert "rollout.group_size (3) must divide rollout.batch_size (8)" in text


@pytest.mark.slow
def test_the_child_checks_what_the_registries_say_of_a_distributed_run(tiny_sd3, tmp_path):
    """Names known, the child process still checks what only the registries know: a
    reward's kwargs."""
    data = small_config_data(tiny_sd3, schedule={"mode": "digen"})
    data["reward"] = [{"name": "brightness", "kwargs": {"nope": 1}}]
    cfg = build_config(data, algorithms=False)
    with pytest.raises(ConfigError) as err:
        check_inputs(cfg, tmp_path / "run")
    assert "reward 'brightness' got bad kwargs ['nope']" in str(err.value)
