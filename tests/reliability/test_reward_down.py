"""A reward server that stops answering: a circuit breaker per URL, shared by every reward of a
process and through Redis by every worker, fails calls at once once the server has not
answered for ``down_after_s``, instead of each task waiting ``timeout_s x retries`` in turn;
the job fails with a message that names the URL. With the defaults a hung server fails the
job within 3 minutes (the bound below, from the breaker on a clock the test controls)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from digen.errors import RewardError
from digen.rewards import http
from digen.rewards.http import Breaker, HttpReward, RewardServiceDown
from tests.conftest import DIGEN, small_config_data
from tests.reliability.reward_servers import RewardServer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_breakers(monkeypatch):
    monkeypatch.setattr(http, "_BREAKERS", {})
    monkeypatch.setattr(http, "_SHARED", None)


def images(n: int = 2):
    import torch

    return torch.rand(n, 3, 8, 8)


def test_with_the_defaults_a_hung_server_is_down_within_three_minutes():
    """Requests that each time out after ``timeout_s`` (the default 30 s), on a fake clock: the
    breaker opens once they have failed for DOWN_AFTER_S; the call in flight then is the last
    to wait, every later call (any task, any attempt) fails at once."""
    t = {"now": 0.0}
    br = Breaker("http://x", clock=lambda: t["now"])
    timeout = 30.0
    opened_at = None
    while opened_at is None:
        began = t["now"]
        t["now"] += timeout  # the request hangs until its timeout
        if br.failed(began, "no answer", http.DOWN_AFTER_S):
            opened_at = t["now"]
        t["now"] += 0.5  # backoff
    assert opened_at <= http.DOWN_AFTER_S + timeout <= 180
    assert not br.allow()  # the next task's call fails at once...
    t["now"] += http.PROBE_S
    assert br.allow() and not br.allow()  # ...but for one probe per PROBE_S
    br.answered()
    assert br.allow() and br.down_since is None


def test_a_hung_server_fails_every_later_call_at_once():
    with RewardServer("hang") as server:
        first = HttpReward(server.url, timeout_s=0.3, retries=5, backoff_s=0.0, down_after_s=0.5)
        with pytest.raises(RewardServiceDown) as err:
            first(images(), ["a", "b"])
        tried = server.scores
        assert 2 <= tried <= 3  # it stopped trying once down, before its 5 tries
        msg = str(err.value)
        assert msg.startswith(f"reward server {server.url} has not answered for ")
        assert "every call to it fails at once" in msg and "--resume" in msg
        other = HttpReward(server.url, timeout_s=0.3, retries=5, backoff_s=0.0, down_after_s=0.5)
        for _ in range(3):  # another task, another reward object: no request at all
            with pytest.raises(RewardServiceDown):
                other(images(), ["a", "b"])
        assert server.scores == tried


def test_an_answering_server_closes_the_breaker(monkeypatch):
    monkeypatch.setattr(http, "PROBE_S", 0.0)
    with RewardServer("hang") as server:
        reward = HttpReward(server.url, timeout_s=0.2, retries=3, backoff_s=0.0, down_after_s=0.3)
        with pytest.raises(RewardServiceDown):
            reward(images(), ["a", "b"])
        server.mode = "ok"
        assert reward(images(), ["a", "b"]).shape == (2,)  # the probe went through
        assert http.breaker(server.url).down_since is None


def test_an_error_answer_is_not_a_server_down():
    with RewardServer("bad") as server:
        reward = HttpReward(server.url, timeout_s=5, retries=2, down_after_s=0.0001)
        for _ in range(3):
            with pytest.raises(RewardError) as err:
                reward(images(), ["a", "b"])
            assert not isinstance(err.value, RewardServiceDown)


def test_the_breaker_is_shared_through_redis(tmp_path: Path):
    from digen.controlplane.redis_conn import connect, stop_embedded

    r = connect(None, db_path=tmp_path / "b.db")
    try:
        http.share_breakers(r)
        with RewardServer("hang") as server:
            with pytest.raises(RewardServiceDown):
                HttpReward(server.url, timeout_s=0.2, retries=4, backoff_s=0.0, down_after_s=0.3)(
                    images(), ["a", "b"]
                )
            assert r.exists(f"digen:reward-down:{server.url}")
            http._BREAKERS.clear()  # another process: only Redis knows
            tried = server.scores
            with pytest.raises(RewardServiceDown) as err:
                HttpReward(server.url, timeout_s=0.2, retries=4, backoff_s=0.0, down_after_s=60)(
                    images(), ["a", "b"]
                )
            assert server.scores <= tried + 1  # at most one probe
            assert "has not answered" in str(err.value)
    finally:
        http.share_breakers(None)
        r.close()
        stop_embedded(tmp_path / "b.db")


@pytest.mark.slow
def test_a_job_whose_reward_server_hangs_fails_naming_it(tiny_sd3: Path, tmp_path: Path):
    """``digen train`` in digen mode (two workers generate: TAG) against a server that accepts
    and never answers: exit 1, one error line naming the URL, no traceback on the console,
    and a bounded number of requests (the workers did not each wait out every task). Its
    health is asked once before anything starts (the input checks' child asks it, the
    controller's preflight then does not ask again)."""
    with RewardServer("hang") as server:
        data = small_config_data(tiny_sd3, iterations=2, schedule={"mode": "digen"})
        data["reward"] = [
            {
                "name": "http",
                "kwargs": {
                    "url": server.url,
                    "timeout_s": 0.5,
                    "retries": 2,
                    "backoff_s": 0.1,
                    "down_after_s": 1.0,
                },
            }
        ]
        data["output"] = {"sample_grid_every": 0, "plots": False}
        cfg = tmp_path / "job.yaml"
        cfg.write_text(yaml.safe_dump(data))
        out = tmp_path / "run"
        cmd = [
            *DIGEN,
            "train",
            str(cfg),
            "--out",
            str(out),
            "--log-format",
            "quiet",
        ]
        res = subprocess.run(
            cmd,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            capture_output=True,
            text=True,
            timeout=900,
        )
        requests, healths = server.scores, server.healths
    console = res.stdout + res.stderr
    assert res.returncode == 1, console
    assert "Traceback" not in console, console
    errors = [ln for ln in console.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, console
    assert f"reward server {server.url} has not answered for" in errors[0]
    assert "--resume" in errors[0] and "on_poison" not in errors[0]
    assert errors[0].endswith(f"(log: {out / 'digen.log'})")
    assert healths == 1, healths
    assert requests <= 8, (
        requests
    )  # 2 tries per worker, then none; without the breaker: 2 per attempt per task
