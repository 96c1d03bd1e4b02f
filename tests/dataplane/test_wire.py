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


def test_on_host_passes_host_tensors_through_without_a_copy():
    """What nothing rewrites (a task's gradient, a version's cast weights) is served as it is
    when it is on the host already; a device tensor would be copied by :func:`host_copy`."""
    from digen.dataplane.wire import on_host

    grads = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    got = on_host(grads)
    assert got.keys() == grads.keys() and all(got[k] is grads[k] for k in grads)
