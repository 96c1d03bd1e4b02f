"""Every test here serves and fetches blobs of a few made-up jobs: this process holds their
keys, as a worker holds its job's once its loop has read it from the job's Redis."""

from __future__ import annotations

import pytest

from digen.dataplane.auth import keyring, new_key

JOBS = ("job", "w", "x", "y", "g", "nope")
"""The jobs of the blob names these tests use (a blob belongs to the job its name starts with)."""


@pytest.fixture(autouse=True)
def job_keys():
    for job in JOBS:
        keyring().add(job, new_key())
    yield
    for job in JOBS:
        keyring().drop(job)
