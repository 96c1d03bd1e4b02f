"""The bad-input catalogue: each mistake gives one line naming the problem and the fix, exit code
2 (input) or 1 (runtime), and nothing already stored is lost.

``digen train`` runs in-process (typer's CliRunner); a ``--resume`` (and a mistake caught by
the config's loading) goes to a run directory that already holds a finished run, a fresh run to
a new folder (into the stored run it would be refused for that alone); at the end every file of
the stored run is unchanged."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from digen.cli.main import app
from tests.conftest import small_config_data


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def stored_run(tiny_sd3: Path, tmp_path_factory) -> Path:
    """A finished one-iteration run: what a mistake must not damage."""
    from digen.config import build_config
    from digen.reference import run_reference

    out = tmp_path_factory.mktemp("stored") / "run"
    run_reference(build_config(small_config_data(tiny_sd3, iterations=1)), out)
    return out


@pytest.fixture(scope="module")
def before(stored_run: Path) -> dict[str, str]:
    return snapshot(stored_run)


@pytest.fixture(scope="module", autouse=True)
def nothing_stored_is_lost(stored_run: Path, before: dict[str, str]):
    yield
    assert snapshot(stored_run) == before


def write_config(folder: Path, model_dir: Path, **sections) -> Path:
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(small_config_data(model_dir, **sections)))
    return path


def train(*args: str, out: Path) -> tuple[int, str]:
    """``digen train ARGS --out OUT --log-format quiet``: (exit code, stderr)."""
    res = CliRunner().invoke(app, ["train", *args, "--out", str(out), "--log-format", "quiet"])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.stderr


@pytest.fixture()
def started(monkeypatch) -> list[str]:
    """Whether a distributed run started its local cluster (where the workers load the
    model): the slow part of a start. A mistake must be refused before (it then fails in seconds)."""
    from digen.runtime import controller

    calls: list[str] = []

    def refuse(name: str):
        def call(*args, **kwargs):
            calls.append(name)
            raise RuntimeError(f"{name} ran before the input was checked")

        return call

    monkeypatch.setattr(controller, "_local_cluster", refuse("_local_cluster"))
    return calls


def one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text
    assert lines[0].startswith("error: ")
    return lines[0]


CONFIG_MISTAKES = [
    # (what, config sections or raw YAML, --set overrides, expected words)
    ("malformed YAML", "seed: [1, 2\niterations: 3\n", [], ["is not valid YAML at line"]),
    ("unknown key", {}, ["rollout.groupsize=4"], ["rollout.groupsize: unknown key", "check the spelling"]),
    ("wrong type", {}, ["iterations=many"], ["iterations ('many')", "integer"]),
    (
        "impossible sizes",
        {"rollout__batch_size": 10},
        [],
        ["rollout.group_size (4) must divide rollout.batch_size (10)"],
    ),
    (
        "group of one",
        {"rollout__batch_size": 3, "rollout__group_size": 1},
        [],
        ["rollout.group_size (1) must be at least 2"],
    ),
    (
        "missing model folder",
        {"model__path": "/nonexistent/sd3"},
        [],
        ["model.path (/nonexistent/sd3) does not exist", "digen make-tiny-model"],
    ),
]


@pytest.mark.parametrize(
    ("what", "sections", "sets", "words"), CONFIG_MISTAKES, ids=[m[0] for m in CONFIG_MISTAKES]
)
def test_config_mistakes_exit_2_with_one_line(
    what, sections, sets, words, tiny_sd3: Path, stored_run: Path, tmp_path: Path
):
    if isinstance(sections, str):
        path = tmp_path / "job.yaml"
        path.write_text(sections)
    else:
        path = write_config(tmp_path, tiny_sd3, **sections)
    code, err = train(str(path), *[x for s in sets for x in ("--set", s)], out=stored_run)
    line = one_line(err)
    assert code == 2, err
    for w in words:
        assert w in line


def test_a_folder_that_is_not_a_diffusers_pipeline(tiny_sd3: Path, stored_run: Path, tmp_path: Path):
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "weights.bin").write_bytes(b"x")
    path = write_config(tmp_path, tmp_path / "not-a-model")
    code, err = train(str(path), out=tmp_path / "run")
    assert code == 2 and "is not a diffusers pipeline folder (no model_index.json)" in one_line(err)


def test_a_reward_that_does_not_exist(tiny_sd3: Path, stored_run: Path, tmp_path: Path, started: list[str]):
    path = write_config(tmp_path, tiny_sd3, reward=[{"name": "brightnes"}], schedule={"mode": "digen"})
    code, err = train(str(path), out=tmp_path / "run")
    line = one_line(err)
    assert code == 2 and "reward 'brightnes' does not exist; did you mean 'brightness'? (available:" in line
    assert started == []  # refused before any cluster starts


@pytest.mark.slow
def test_an_unreachable_reward_server(tiny_sd3: Path, stored_run: Path, tmp_path: Path, started: list[str]):
    path = write_config(
        tmp_path,
        tiny_sd3,
        reward=[{"name": "http", "kwargs": {"url": "http://127.0.0.1:1"}}],
        schedule={"mode": "digen"},
    )
    code, err = train(str(path), out=tmp_path / "run")
    line = one_line(err)
    assert code == 1 and "reward server http://127.0.0.1:1" in line and "connection refused" in line
    assert "digen reward-server" in line and started == []


@pytest.mark.slow
def test_an_unreachable_redis_fails_before_anything_starts_naming_it(
    tiny_sd3: Path, stored_run: Path, tmp_path: Path, started: list[str]
):
    path = write_config(tmp_path, tiny_sd3, schedule={"mode": "digen"})
    code, err = train(str(path), "--redis-url", "redis://127.0.0.1:1/0", out=tmp_path / "run")
    line = one_line(err)
    assert code == 1 and "cannot reach Redis at redis://127.0.0.1:1/0 (connection refused)" in line
    assert "--redis-url" in line and started == []


@pytest.mark.slow
def test_an_unreachable_scheduler_fails_before_anything_starts_naming_it(
    tiny_sd3: Path, stored_run: Path, tmp_path: Path, started: list[str]
):
    path = write_config(tmp_path, tiny_sd3, schedule={"mode": "digen"})
    code, err = train(str(path), "--scheduler", "tcp://127.0.0.1:1", out=tmp_path / "run")
    line = one_line(err)
    assert code == 1 and "cannot reach the Dask scheduler at tcp://127.0.0.1:1" in line
    assert "dask scheduler" in line and started == []


@pytest.mark.slow
def test_a_gpu_type_no_task_may_use(tiny_sd3: Path, stored_run: Path, tmp_path: Path, started: list[str]):
    path = write_config(tmp_path, tiny_sd3, schedule={"mode": "digen"}, cluster={"gpu_types": ["h100"]})
    code, err = train(str(path), out=tmp_path / "run")
    line = one_line(err)
    assert code == 2 and "cluster.local.gpu_type (cpu) is not in cluster.gpu_types ['h100']" in line
    assert "add cpu to cluster.gpu_types" in line and started == []


def test_a_corrupted_checkpoint_on_resume(tiny_sd3: Path, stored_run: Path, tmp_path: Path):
    run = tmp_path / "copy"
    shutil.copytree(stored_run, run)
    (run / "checkpoints/iter_0000/weights.safetensors").write_bytes(b"not a safetensors file")
    kept = snapshot(run)
    path = write_config(tmp_path, tiny_sd3, iterations=2)
    code, err = train(str(path), "--resume", out=run)
    line = one_line(err)
    assert code == 2 and "cannot be read" in line and "iter_0000" in line
    assert snapshot(run) == kept  # metrics not truncated, nothing rewritten


def test_rewards_that_are_all_nan(tiny_sd3: Path, tmp_path: Path, monkeypatch):
    import digen.reference as trainer

    real = trainer.build_reward

    def all_nan(cfg):
        reward = real(cfg)
        return lambda images, prompts: torch.full_like(reward(images, prompts), float("nan"))

    monkeypatch.setattr(trainer, "build_reward", all_nan)
    path = write_config(tmp_path, tiny_sd3, iterations=1)
    code, err = train(str(path), out=tmp_path / "run")
    line = one_line(err)
    assert code == 1 and "iteration 0: no sample can be trained (8 of 8 rewards are NaN or inf" in line
    assert "check the reward" in line
    # some NaN rewards are not an error: tests/trainer/test_reference.py::test_nan_rewards_drop_samples_not_the_update


class _Trap:
    """Unpickling this creates ``marker``: proof that something unpickled it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.mkdir, (str(self.marker),)


def test_an_invalid_payload_in_redis_is_dead_lettered_and_never_unpickled(tmp_path: Path):
    import pickle

    from digen.controlplane.queue import TaskQueue
    from digen.controlplane.redis_conn import connect, stop_embedded

    marker = tmp_path / "unpickled"
    r = connect(None, db_path=tmp_path / "payload.db")
    try:
        q = TaskQueue(r, "bad-payload")
        q.put("gen", "gen:0:1", {"task": "fine"})
        for tid, raw in (("gen:0:0", pickle.dumps(_Trap(marker))), ("gen:0:2", b"\xc1 not msgpack")):
            r.hset(
                f"digen:bad-payload:task:{tid}",
                mapping={"queue": "gen", "payload": raw, "attempts": 0, "state": "pending"},
            )
            r.lpush("digen:bad-payload:q:gen", tid)  # ahead of the good task
        leased = q.lease(["gen"], "w0")
        assert leased is not None and leased.task_id == "gen:0:1"  # the bad ones were skipped
        dead = {d.task_id: d for d in q.dead_letters()}
        assert dead["gen:0:0"].error.startswith("PayloadError: refusing a pickle payload")
        assert dead["gen:0:2"].error.startswith("PayloadError: not a msgpack payload")
        assert {d.attempts for d in dead.values()} == {1}  # dead at once: a retry cannot decode it either
        r.set("digen:bad-payload:result:gen:0:3", pickle.dumps(_Trap(marker)))
        r.hset("digen:bad-payload:task:gen:0:3", mapping={"state": "done", "result_kind": "msgpack"})
        assert q.get_result("gen:0:3") is None  # a pickled result is quarantined, never unpickled
        assert "refusing a pickle payload" in q.quarantined()[-1]["reason"]
        assert not marker.exists()
    finally:
        r.close()
        stop_embedded(tmp_path / "payload.db")


def test_workers_of_a_gpu_type_no_task_may_use_get_no_task(small_config):
    from digen.cluster.cluster import WorkerInfo
    from digen.core.events import Role
    from digen.errors import ConfigError
    from digen.runtime.membership import Membership

    cfg = small_config(schedule__mode="digen", cluster__gpu_types=["h100", "a100"])
    ctl = Membership(cfg, client=None, job=None, redis_url="", loop_fn=print, exit_fn=print)
    workers = [
        WorkerInfo("tcp://a:1", "rollout-a10g", Role.ROLLOUT, "a10g"),
        WorkerInfo("tcp://b:1", "trainer-h100", Role.TRAINER, "h100"),
        WorkerInfo("tcp://c:1", "trainer-cpu", Role.TRAINER, "cpu"),
    ]
    usable = [w for w in workers if ctl.usable(w)]
    assert [w.name for w in usable] == ["trainer-h100"]
    ctl.workers = {w.name: w for w in usable}
    with pytest.raises(ConfigError) as err:  # no rollout worker may run this digen job
        ctl.check_gpu_types()
    msg = str(err.value)
    assert msg.startswith("no rollout worker may run this job: cluster.gpu_types is ['h100', 'a100']")
    assert "rollout-a10g, trainer-cpu" in msg and "--gpu-type h100" in msg and err.value.exit_code == 2


@pytest.fixture()
def refused_early(monkeypatch) -> list[str]:
    """A run that got past the input checks (digen.engine's body: Redis, Dask, the run
    directory). A mistake below is refused before: nothing has started, nothing is written."""
    import digen.engine

    calls: list[str] = []

    def refuse(*args, **kwargs):
        calls.append("run")
        raise RuntimeError("the run started before its inputs were checked")

    monkeypatch.setattr(digen.engine, "_run", refuse)
    return calls


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"
INPUT_MISTAKES = [
    # (what, config sections, --set overrides, prompt file bytes or None, expected words)
    ("prompt file of PNG bytes", {}, [], PNG, ["is not UTF-8 text: byte 0x89 at offset 0 (line 1)"]),
    ("latin-1 prompt file", {}, [], "a red café\n".encode("latin-1"), ["byte 0xe9 at offset 9 (line 1)"]),
    (
        "binary prompt file",
        {},
        [],
        b"a red square\n\x00\x01\x02",
        ["is not a text file: a NUL byte at offset 13"],
    ),
    ("empty prompt file", {}, [], b"\n\n", ["holds no prompt"]),
    (
        "reward URL with a port that is not a number",
        {"reward": [{"name": "http", "kwargs": {"url": "http://127.0.0.1:notaport"}}]},
        [],
        None,
        ["reward[0].kwargs.url (http://127.0.0.1:notaport): port 'notaport' is not a number from 1 to 65535"],
    ),
    (
        "reward URL with a port out of range",
        {"reward": [{"name": "http", "kwargs": {"url": "http://127.0.0.1:99999"}}]},
        [],
        None,
        ["port '99999' is not a number from 1 to 65535"],
    ),
    (
        "infinite noise level",
        {},
        ["rollout.sde.noise_level=.inf"],
        None,
        ["rollout.sde.noise_level (inf)", "finite"],
    ),
    (
        "NaN reward weight",
        {"reward": [{"name": "brightness", "weight": float("nan")}]},
        [],
        None,
        ["weight (nan)"],
    ),
    (
        "sequence length beyond the text encoder",
        {},
        ["model.max_sequence_length=100000"],
        None,
        ["model.max_sequence_length (100000) exceeds 32", "tokenizer_3's model_max_length"],
    ),
    (
        "resolution the VAE and patch cannot take",
        {},
        ["model.resolution=17"],
        None,
        ["model.resolution (17) must be a multiple of 16", "VAE scale 8 x patch 2", "try 16 or 32"],
    ),
    (
        "prompts the digit reward cannot read",
        {"reward": [{"name": "digit_classifier"}]},
        [],
        None,
        ["reward[0] (digit_classifier): 3 prompt(s) name no digit or several: 'a red square'"],
    ),
    (
        "a misspelt reward",
        {"reward": [{"name": "digit_clasifier"}]},
        [],
        None,
        ["reward 'digit_clasifier' does not exist; did you mean 'digit_classifier'?"],
    ),
]


@pytest.mark.parametrize(
    ("what", "sections", "sets", "prompt_bytes", "words"), INPUT_MISTAKES, ids=[m[0] for m in INPUT_MISTAKES]
)
@pytest.mark.parametrize("mode", ["reference", "digen"])
@pytest.mark.parametrize("resume", [False, True], ids=["new", "resume"])
@pytest.mark.slow
def test_inputs_are_checked_before_anything_starts(
    what, sections, sets, prompt_bytes, words, mode, resume, tiny_sd3, stored_run, tmp_path, refused_early
):
    """Each bad input: exit 2, one line naming it, before Redis, Dask or the run directory,
    in every mode, also on ``--resume`` (which leaves the stored run as it was)."""
    if prompt_bytes is not None:
        (tmp_path / "prompts.txt").write_bytes(prompt_bytes)
        sections = {**sections, "prompts": {"file": str(tmp_path / "prompts.txt")}}
    path = write_config(tmp_path, tiny_sd3, schedule={"mode": mode}, **sections)
    args = [str(path), *[x for s in sets for x in ("--set", s)], *(["--resume"] if resume else [])]
    kept = snapshot(stored_run)
    code, err = train(*args, out=stored_run if resume else tmp_path / "run")
    assert snapshot(stored_run) == kept  # not even config.yaml rewritten, no eval.jsonl created
    line = one_line(err)
    assert code == 2, err
    for w in words:
        assert w in line, line
    assert refused_early == []


@pytest.mark.slow
def test_too_little_disk_space_is_refused_before_anything_starts(
    tiny_sd3: Path, tmp_path: Path, refused_early: list[str], monkeypatch
):
    import digen.checks

    monkeypatch.setattr(digen.checks, "free_bytes", lambda path: 1000)
    path = write_config(tmp_path, tiny_sd3, schedule={"mode": "digen"})
    code, err = train(str(path), out=tmp_path / "run")
    line = one_line(err)
    assert code == 1 and "has 1000 bytes (0.0 MiB) free; this run needs about" in line
    assert "a checkpoint of about" in line and "free some space or choose another --out" in line
    assert refused_early == [] and not (tmp_path / "run").exists()


def test_submit_checks_every_input_before_it_enqueues(tiny_sd3: Path, tmp_path: Path, monkeypatch):
    from digen.controlplane.redis_conn import connect, stop_embedded

    monkeypatch.setenv("DIGEN_HOME", str(tmp_path / "home"))
    (tmp_path / "prompts.txt").write_bytes(PNG)
    path = write_config(tmp_path, tiny_sd3, prompts={"file": str(tmp_path / "prompts.txt")})
    res = CliRunner().invoke(app, ["submit", str(path), "--out", str(tmp_path / "run")])
    assert res.exit_code == 2 and "is not UTF-8 text: byte 0x89 at offset 0" in one_line(res.stderr)
    r = connect(None, db_path=tmp_path / "home" / "digen.db")
    try:
        assert not r.keys("rq:job:*")
    finally:
        r.close()
        stop_embedded(tmp_path / "home" / "digen.db")


RESUMES_THAT_DO_NOT_FIT = [
    # (what, --set overrides, expected words): the stored run trained a rank-4 adapter
    ("another LoRA rank", ["model.lora.rank=2"], ["holds a LoRA adapter of rank 4", "model.lora.rank=2"]),
    ("LoRA off", ["model.lora.enabled=false"], ["holds a LoRA adapter", "model.lora.enabled=false"]),
    (
        "other target modules",
        ["model.lora.target_modules=[to_q]"],
        ["was trained with model.lora.target_modules=None", "['to_q']"],
    ),
]


@pytest.mark.parametrize(
    ("what", "sets", "words"), RESUMES_THAT_DO_NOT_FIT, ids=[m[0] for m in RESUMES_THAT_DO_NOT_FIT]
)
@pytest.mark.parametrize("mode", ["reference", "digen"])
@pytest.mark.slow
def test_a_resume_whose_weights_do_not_fit_changes_nothing(
    what, sets, words, mode, tiny_sd3, stored_run, tmp_path, refused_early
):
    """``--resume`` with a config whose trained tensors are not the checkpoint's: one line,
    exit 2, before anything starts; the run directory byte for byte as it was (config.yaml
    was rewritten before the weights were checked)."""
    path = write_config(tmp_path, tiny_sd3, iterations=2, schedule={"mode": mode})
    kept = snapshot(stored_run)
    code, err = train(str(path), "--resume", *[x for s in sets for x in ("--set", s)], out=stored_run)
    line = one_line(err)
    assert code == 2, err
    for w in words:
        assert w in line, line
    assert "resume with the run's own config" in line and refused_early == []
    assert snapshot(stored_run) == kept


def test_a_resume_refused_by_the_weights_themselves_changes_nothing(tiny_sd3, stored_run, tmp_path):
    """A checkpoint the file checks cannot judge (its run's config.yaml is gone) whose weights
    do not fit the policy: the load refuses, and neither the metrics are truncated nor a
    config.yaml written (the run directory changes only once the weights have loaded)."""
    run = tmp_path / "copy"
    shutil.copytree(stored_run, run)
    (run / "config.yaml").unlink()
    kept = snapshot(run)
    path = write_config(tmp_path, tiny_sd3, iterations=2, model__lora__target_modules=["to_q"])
    code, err = train(str(path), "--resume", out=run)
    assert code == 2 and "LoRA adapter state dict does not match the model" in one_line(err)
    assert snapshot(run) == kept


@pytest.mark.slow
def test_out_that_cannot_be_a_run_directory_is_refused_and_left_alone(tiny_sd3, tmp_path, refused_early):
    """``--out`` at a file, under a file, or at a folder of the user's own (its config.yaml
    was silently replaced): one line, exit 2, every byte there kept."""
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: own config\n")
    (mine / "notes.txt").write_text("mine\n")
    afile = tmp_path / "a-file"
    afile.write_text("not a folder\n")
    path = write_config(tmp_path, tiny_sd3, schedule={"mode": "digen"})
    cases = [
        (afile, f"--out: {afile} is a file, not a folder"),
        (afile / "run", f"--out: {afile / 'run'} is under {afile}, a file, not a folder"),
        (mine, f"--out: {mine} is a folder that is not a run directory (it holds config.yaml, notes.txt)"),
    ]
    kept = snapshot(tmp_path)
    for out, words in cases:
        for resume in ([], ["--resume"]):
            code, err = train(str(path), *resume, out=out)
            assert code == 2 and words in one_line(err), err
    assert snapshot(tmp_path) == kept and refused_early == []
    empty = tmp_path / "empty"  # a new or an empty folder is where a run goes
    empty.mkdir()
    from digen.checks import out_problems

    assert out_problems(empty) == [] and out_problems(tmp_path / "new") == []


REFUSED_BEFORE_ANYTHING_SHOWS = [
    # (what, config sections, --set overrides, prompt file bytes or None, run directory, --resume, words)
    ("--resume with no checkpoint", {}, [], None, "new", True, "has no checkpoint yet"),
    ("--resume to a reached target", {}, ["iterations=1"], None, "stored", True, "nothing to run"),
    ("a fresh run into a run directory", {}, [], None, "stored", False, "already holds a run"),
    ("model.resolution=17", {}, ["model.resolution=17"], None, "new", False, "must be a multiple of 16"),
    ("an empty prompts file", {}, [], b"", "new", False, "holds no prompt"),
    ("a non-UTF-8 prompts file", {}, [], "café\n".encode("latin-1"), "new", False, "is not UTF-8 text"),
    ("a binary prompts file", {}, [], PNG, "new", False, "is not UTF-8 text"),
    (
        "max_sequence_length=100000",
        {},
        ["model.max_sequence_length=100000"],
        None,
        "new",
        False,
        "exceeds 32",
    ),
    (
        "a bad reward port",
        {"reward": [{"name": "http", "kwargs": {"url": "http://127.0.0.1:99999"}}]},
        [],
        None,
        "new",
        False,
        "is not a number from 1 to 65535",
    ),
]


@pytest.mark.parametrize(
    ("what", "sections", "sets", "prompt_bytes", "where", "resume", "words"),
    REFUSED_BEFORE_ANYTHING_SHOWS,
    ids=[m[0] for m in REFUSED_BEFORE_ANYTHING_SHOWS],
)
@pytest.mark.slow
def test_refusals_are_one_line_before_the_placement_or_the_bar(
    what,
    sections,
    sets,
    prompt_bytes,
    where,
    resume,
    words,
    tiny_sd3,
    stored_run,
    tmp_path,
    refused_early,
    started,
):
    """``digen train`` in digen mode with its own console (rich): a refusal that the files
    decide is the whole output, one line, exit 2; no placement, no progress bar, no start-up
    line (they were printed first), no run started, nothing written."""
    if prompt_bytes is not None:
        (tmp_path / "prompts.txt").write_bytes(prompt_bytes)
        sections = {**sections, "prompts": {"file": str(tmp_path / "prompts.txt")}}
    path = write_config(tmp_path, tiny_sd3, schedule={"mode": "digen"}, **sections)
    out = stored_run if where == "stored" else tmp_path / "run"
    kept = snapshot(stored_run)
    args = ["train", str(path), "--out", str(out), *[x for s in sets for x in ("--set", s)]]
    res = CliRunner().invoke(app, [*args, *(["--resume"] if resume else [])])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines
    assert res.exit_code == 2
    assert refused_early == [] and started == []
    assert snapshot(stored_run) == kept and not (tmp_path / "run").exists()
