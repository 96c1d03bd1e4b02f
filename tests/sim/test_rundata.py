"""digen.sim.rundata: a run directory as the simulator's calibrations read it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from digen.errors import ConfigError
from digen.sim.rundata import is_follower_row, read_config, read_jsonl


def test_missing_files_name_themselves(tmp_path: Path):
    with pytest.raises(ConfigError, match="timeline.jsonl does not exist"):
        read_jsonl(tmp_path / "timeline.jsonl")
    with pytest.raises(ConfigError, match="config.yaml does not exist"):
        read_config(tmp_path)


def test_jsonl_stops_at_a_line_cut_by_a_crash(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"iteration": 0}) + "\n\n" + json.dumps({"iteration": 1}) + '\n{"iter')
    assert read_jsonl(path) == [{"iteration": 0}, {"iteration": 1}]


def test_config_reads_the_resolved_yaml(tmp_path: Path):
    (tmp_path / "config.yaml").write_text("rollout:\n  group_size: 4\n")
    assert read_config(tmp_path) == {"rollout": {"group_size": 4}}
    (tmp_path / "config.yaml").write_text("")
    assert read_config(tmp_path) == {}


def test_only_the_leader_row_of_a_replica_stands_for_its_task():
    ranks = ["rollout-0", "rollout-1"]
    assert not is_follower_row({"worker": "rollout-0", "ranks": ranks})
    assert is_follower_row({"worker": "rollout-1", "ranks": ranks})
    assert not is_follower_row({"worker": "rollout-2"})


def test_every_file_the_simulator_reads_fails_the_same_way(tmp_path: Path):
    from digen.sim.catalog import load_sim_config
    from digen.sim.dataplane import DataPlaneModel
    from digen.sim.sp_calibration import load_calibration

    broken, listed = tmp_path / "broken.json", tmp_path / "list.yaml"
    broken.write_text('{"rounds": [')
    listed.write_text("- workload\n- testbed\n")
    for read in (DataPlaneModel.load, load_calibration):
        with pytest.raises(ConfigError, match="broken.json is not valid JSON"):
            read(broken)
    with pytest.raises(
        ConfigError, match="list.yaml must hold a mapping, got list: pass a simulation config"
    ):
        load_sim_config(listed)
    with pytest.raises(ConfigError, match="nope.yaml does not exist or is not a file"):
        load_sim_config(tmp_path / "nope.yaml")
