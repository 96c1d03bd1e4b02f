"""The blob-name grammar: every name a worker makes parses back to its parts; junk does not."""

from __future__ import annotations

import pytest

from digen.core import blobnames
from digen.core.blobnames import BlobName


def test_made_names_parse_back():
    assert blobnames.weights("j1", 3) == "j1:weights:3"
    assert blobnames.state("j1", 4) == "j1:state:4"
    assert blobnames.trajectories("j1", "gen:2:1") == "j1:traj:gen:2:1"
    assert blobnames.gradient("j1", "train:2:1:0") == "j1:grad:train:2:1:0"
    assert blobnames.parse("j1:grad:train:2:1:0") == BlobName("j1", "grad", "train:2:1:0")
    assert blobnames.parse(blobnames.weights("j1", 3)).version == 3
    assert blobnames.job_of("j1:traj:gen:2:1") == "j1"


@pytest.mark.parametrize(
    "junk",
    [
        "",
        "j1",
        "j1:weights",
        "j1:weights:",
        "j1:weights:x",
        "j1:weights:-1",
        "j1:blob:1",
        ":weights:1",
        "j1:state:²",
    ],
)
def test_junk_is_not_a_name(junk: str):
    assert blobnames.parse(junk) is None


def test_a_task_blob_has_no_version():
    with pytest.raises(ValueError, match="no version"):
        _ = BlobName("j1", "traj", "gen:1:0").version


def test_versions_of_one_job_ascending():
    names = [
        "j1:weights:10",
        "j1:weights:9",
        "j2:weights:1",
        "j1:state:10",
        "j1:weights:x",
        "j1:traj:gen:1:0",
    ]
    assert blobnames.versions(names, "j1") == [9, 10]
    assert [str(b) for b in blobnames.of_job(names, "j1", blobnames.STATE)] == ["j1:state:10"]
