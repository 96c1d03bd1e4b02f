"""``digen bench --dataplane`` at test sizes: it runs every phase over real processes and its
counts show what the data plane promises (nothing through the controller, a ring's traffic)."""

from __future__ import annotations

import json

import pytest

from digen.bench.dataplane import MiB, compare, run_dataplane_bench, write_dataplane_report

pytestmark = pytest.mark.slow


def test_a_small_dataplane_bench_moves_nothing_through_the_controller_and_writes_its_table(tmp_path):
    rounds = run_dataplane_bench({"lora-8mib": 8 * MiB, "full-8mib": 8 * MiB}, old_bytes=4 * MiB)
    new, full, old = rounds
    assert [x.path for x in rounds] == ["dataplane", "dataplane", "through-redis"]
    assert new.step_s is not None and full.step_s is None  # a "full" stand-in is reduced, not stepped
    for x in (new, full):
        assert x.reduce_s > 0 and x.distribute_s > 0 and x.trajectory_s and x.trajectory_s > 0
        assert x.controller_bytes < 1 * MiB  # the controller only coordinates (Dask messages)
        assert x.redis_bytes < 1 * MiB  # no tensor passes through Redis
        assert len(x.reduce_traffic_per_trainer) == 2
        assert all(0.9 <= t <= 2.2 for t in x.reduce_traffic_per_trainer)  # ring: 2 (N-1)/N = 1.0
    # the old path put 4 gradients and one version in Redis, and read them back: > 5 copies
    assert old.redis_bytes > 5 * 4 * MiB and old.controller_bytes > 5 * 4 * MiB
    cmp = compare(rounds)
    assert set(cmp) == {"lora-8mib", "full-8mib"} and all(c["speedup"] > 0 for c in cmp.values())
    js, md = write_dataplane_report(rounds, tmp_path, "digen bench --dataplane", "abc1234", "2026-12-06")
    assert json.loads(js.read_text())["commit"] == "abc1234"
    text = md.read_text()
    assert "| lora-8mib (8 MiB) | dataplane |" in text and "through-redis" in text
    # the digest: its cost per round, and the candidate hashes at the first size
    assert new.digest_s is not None and new.digest_put_s is not None and new.digest_share() is not None
    assert {d["algorithm"] for d in new.digests} >= {"sha256", "blake2b", "crc32", "xxh3-128"}
    assert not full.digests and "hash / distribute" in text and "| xxh3-128 | bfloat16 |" in text
