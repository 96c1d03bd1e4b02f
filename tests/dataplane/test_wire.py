"""The frame helpers of :mod:`digen.dataplane.wire` that run without a socket."""

from __future__ import annotations

import torch

from digen.dataplane.wire import host_copy


def test_a_host_copy_owns_its_memory_and_casts_only_floats():
    live = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(), "n": torch.arange(3)}
    snap = host_copy(live, torch.bfloat16)
    assert snap["w"].dtype == torch.bfloat16 and snap["n"].dtype == torch.int64
    assert snap["w"].is_contiguous() and torch.equal(snap["w"].float(), live["w"])
    live["w"].add_(1.0)  # what a step does to a parameter it serves
    live["n"].add_(1)
    assert torch.equal(snap["w"].float(), live["w"] - 1.0)
    assert torch.equal(snap["n"], torch.arange(3))
    same = host_copy(live)  # no cast: a copy still
    assert same["w"].dtype == torch.float32
    assert same["w"].untyped_storage().data_ptr() != live["w"].untyped_storage().data_ptr()
