"""Shared fixtures: a tiny SD3 pipeline folder (built once per session) and small configs."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest  # noqa: E402
import redis  # noqa: E402

from tests.processes import digen_home  # noqa: E402, F401 - a fixture of every folder (the service's, test_node's)

DIGEN = (sys.executable, "-m", "digen.cli.main")
"""The ``digen`` command for a test's subprocess: the installed script's module, run by this
interpreter (``[*DIGEN, "train", ...]``)."""


@pytest.fixture(scope="session", autouse=True)
def _digen_home(tmp_path_factory: pytest.TempPathFactory):
    """Keep the embedded Redis and every digen file of the test session in a temp folder."""
    home = tmp_path_factory.mktemp("digen_home")
    old = os.environ.get("DIGEN_HOME")
    os.environ["DIGEN_HOME"] = str(home)
    yield home
    from digen.controlplane.redis_conn import stop_embedded

    stop_embedded()
    if old is None:
        os.environ.pop("DIGEN_HOME", None)
    else:
        os.environ["DIGEN_HOME"] = old


PURE_TEST_DIRS = {"core", "algos", "sim", "config"}
"""Test folders that start no worker process."""


def pytest_sessionstart(session: pytest.Session) -> None:
    """Fork the workers' fork server from this process before collection, as ``digen train``
    does first thing (digen.cluster.cluster.prefork_server). Before collection, because
    importing the test modules starts threads a fork must not copy (onnxruntime's, with
    test_ocr; a torch op's OpenMP pool): forked after them, the server and its workers
    inherited their locks and state, and in one CI run in several the server died mid-suite.
    A session whose arguments all lie in pure test folders starts none."""
    tests = Path(__file__).parent
    dirs = set()
    for arg in session.config.args or [str(tests)]:
        path = (Path(session.config.invocation_params.dir) / arg.split("::")[0]).resolve()
        dirs.add(path.relative_to(tests).parts[0] if path.is_relative_to(tests) and path != tests else "")
    if dirs - PURE_TEST_DIRS:
        from digen.cluster.cluster import prefork_server

        prefork_server()


@contextmanager
def faults_on() -> Iterator[None]:
    """Worker processes started inside run the fault hooks of digen.testing.faults (they
    inherit the environment)."""
    old = os.environ.get("DIGEN_FAULTS")
    os.environ["DIGEN_FAULTS"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DIGEN_FAULTS", None)
        else:
            os.environ["DIGEN_FAULTS"] = old


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_models(arch, resolution=32)`` -> a tiny random-weight pipeline folder of that
    family, built once per test session (seed 0)."""
    from digen.models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[tuple[str, int], Path] = {}

    def get(arch: str, resolution: int = 32) -> Path:
        if (arch, resolution) not in cache:
            cache[(arch, resolution)] = make_tiny_model(
                root / f"{arch}-{resolution}", arch, seed=0, resolution=resolution
            )
        return cache[(arch, resolution)]

    return get


@pytest.fixture(scope="session")
def tiny_sd3(tiny_models) -> Path:
    """A tiny random-weight SD3 pipeline folder (32 px)."""
    return tiny_models("sd3")


REQUIRED_DATA: dict = {
    "model": {"path": "models/unused"},
    "prompts": {"items": ["a red square", "a blue circle"]},
    "reward": [{"name": "brightness"}],
}
"""What every config must name (digen has no default model, prompts or reward)."""


def required(data: dict) -> dict:
    """``data`` with :data:`REQUIRED_DATA`'s keys added where it lacks them, for tests of
    other sections that load with ``check_paths=False`` (the model folder is never read)."""
    out = dict(data)
    for key, value in REQUIRED_DATA.items():
        if key == "model":
            out["model"] = {**value, **out.get("model", {})}
        else:
            out.setdefault(key, value)
    return out


def small_config_data(model_dir: Path, **sections) -> dict:
    """A config small enough for a test run: 2 iterations of 2 groups x 4 samples, 4 steps."""
    data = {
        "seed": 3,
        "iterations": 2,
        "model": {
            "path": str(model_dir),
            "resolution": 32,
            "max_sequence_length": 32,  # the tiny models' text encoders take 32 tokens
            "lora": {"enabled": True, "rank": 4, "alpha": 8},
        },
        "prompts": {"items": ["a red square", "a blue circle", "a green tree"]},
        # one group per forward: the runs are compared with the reference bit for bit
        "rollout": {"batch_size": 8, "group_size": 4, "num_steps": 4, "max_batch": 1},
        "train": {"timesteps": {"strategy": "prefix", "fraction": 0.5}, "lr": 1e-3},
        "reward": [{"name": "brightness"}],
        "schedule": {"mode": "reference"},
        "output": {"sample_grid_every": 1, "plots": False},
    }
    for key, value in sections.items():
        node = data
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return data


@pytest.fixture
def small_config(tiny_sd3: Path):
    """``small_config(**overrides)`` -> a validated Config; keys like ``schedule__mode="digen"``."""
    from digen.config import build_config

    def make(**sections):
        return build_config(small_config_data(tiny_sd3, **sections))

    return make


@pytest.fixture(scope="session")
def redis_db_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The db file of the session's embedded Redis for the control-plane and runtime tests
    (stopped at the end of the session)."""
    from digen.controlplane.redis_conn import stop_embedded

    path = tmp_path_factory.mktemp("redis") / "test.db"
    yield path
    stop_embedded(path)


@pytest.fixture()
def redis_client(redis_db_path: Path) -> Iterator[redis.Redis]:
    """A client of the session's embedded Redis, on an empty database."""
    from digen.controlplane.redis_conn import connect

    client = connect(None, db_path=redis_db_path)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="module")
def warm_cluster() -> Iterator:
    """``warm_cluster(rollout, trainers)`` -> the scheduler address of a local Dask cluster of
    ``rollout`` rollout and ``trainers`` trainer workers (CPU, one thread each, forked from the
    fork server, plain TCP on loopback), started at the module's first call of that shape and
    closed after the module's last test.

    A job given it (``run_distributed(cfg, out, scheduler=warm_cluster(1, 2))``) runs on warm
    workers, as jobs do on an external cluster (``digen worker --scheduler``): the processes,
    their imports and blob servers stay up from one job to the next, each job's loop builds its
    own policy (no preload), and every worker the scheduler lists works on the job, whatever
    ``cluster.local`` says (in ``colocated`` mode every one generates and trains). A test whose
    guarantee needs a fresh process (a kill, a restart, a start-up profile, the job's own TLS,
    faults armed through the environment) starts its own cluster instead.

    The jobs of a module share the processes in the order the module runs them; what a job
    computes does not depend on the jobs before it (each builds version 0 from the seed, and
    keeps its tasks, blobs and counters under its own job id), which the bit-for-bit tests on
    a warm cluster check again each time."""
    from digen.cluster.cluster import close_local_cluster, start_local_cluster

    clusters: dict[tuple[int, int], tuple] = {}

    def get(rollout: int, trainers: int) -> str:
        if (rollout, trainers) not in clusters:
            clusters[(rollout, trainers)] = start_local_cluster(
                rollout, trainers, "cpu", 1, start_method="forkserver"
            )
        return clusters[(rollout, trainers)][0].scheduler_address

    yield get
    for cluster, client in clusters.values():
        client.close()
        close_local_cluster(cluster)
