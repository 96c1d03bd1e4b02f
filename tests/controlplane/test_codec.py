"""digen.controlplane.codec: msgpack and safetensors only; pickle bytes are refused, never loaded."""

from __future__ import annotations

import io
import os
import pickle
import struct
from pathlib import Path

import msgpack
import pytest
import torch

from digen.controlplane.codec import looks_like_pickle, pack, pack_tensors, unpack, unpack_tensors
from digen.errors import PayloadError

torch.set_num_threads(1)


class _Boom:
    """Unpickling this creates a file: proof that a decoder ran pickle."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pack_round_trips_plain_data():
    obj = {
        "prompt": "a cat",
        "seed": 7,
        "scale": 4.5,
        "ok": True,
        "none": None,
        "raw": b"\x00\xff",
        "ids": [1, 2, 3],
        "nested": {"k": [1.0, "x"]},
    }
    assert unpack(pack(obj)) == obj


def test_pack_rejects_objects():
    with pytest.raises(PayloadError, match="cannot pack"):
        pack({"x": object()})


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_unpack_refuses_pickle_without_running_it(tmp_path: Path, protocol: int):
    marker = tmp_path / "pwned"
    data = pickle.dumps(_Boom(str(marker)), protocol=protocol)
    assert looks_like_pickle(data)
    with pytest.raises(PayloadError, match="pickle"):
        unpack(data)
    with pytest.raises(PayloadError, match="pickle"):
        unpack_tensors(data)
    assert not marker.exists()


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x81\xa1a", pack({"a": 1}) + b"\x00"])
def test_unpack_rejects_invalid_bytes(data: bytes):
    with pytest.raises(PayloadError, match="not a msgpack payload"):
        unpack(data)


def test_unpack_rejects_msgpack_extension_types():
    with pytest.raises(PayloadError, match="extension type 5"):
        unpack(msgpack.packb(msgpack.ExtType(5, b"code")))


def test_looks_like_pickle_is_false_for_digen_formats():
    assert not looks_like_pickle(pack({"a": 1}))
    assert not looks_like_pickle(pack_tensors({"x": torch.zeros(2)}))
    assert not looks_like_pickle(b"")


def test_tensors_round_trip_with_dtypes_shapes_and_metadata():
    tensors = {
        "latents": torch.randn(2, 4, 8, 8),
        "log_probs": torch.randn(2, 10, dtype=torch.float64),
        "mask": torch.tensor([True, False]),
        "half": torch.randn(3, 5).to(torch.bfloat16),
        "steps": torch.arange(10)[2:7],  # a view with a storage offset
        "t": torch.randn(5, 3).t(),  # non-contiguous
    }
    out, meta = unpack_tensors(pack_tensors(tensors, {"version": "3", "kind": "gen"}))
    assert meta == {"version": "3", "kind": "gen"}
    assert set(out) == set(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t)


def test_tensors_sharing_storage_are_packed():
    base = torch.randn(6)
    out, meta = unpack_tensors(pack_tensors({"all": base, "head": base[:2]}))
    assert torch.equal(out["head"], base[:2]) and torch.equal(out["all"], base)
    assert meta == {}


def test_pack_tensors_rejects_non_string_metadata():
    with pytest.raises(PayloadError, match="metadata"):
        pack_tensors({"x": torch.zeros(1)}, {"version": 3})  # type: ignore[dict-item]


def test_unpack_tensors_rejects_torch_save_and_garbage():
    buf = io.BytesIO()
    torch.save({"x": torch.zeros(2)}, buf)
    for data in (buf.getvalue(), b"junk", b"\x00" * 8, os.urandom(64)):
        with pytest.raises(PayloadError):
            unpack_tensors(data)


def test_safetensors_that_starts_like_a_pickle_still_decodes():
    """A header of 640 bytes is written b'\\x80\\x02\\0...': the pickle check must not reject it."""
    tensors = {"x": torch.tensor([1, 2, ord(".")], dtype=torch.uint8)}  # last byte is pickle's STOP
    for n in range(1, 800):
        data = pack_tensors(tensors, {"pad": "a" * n})
        if struct.unpack("<Q", data[:8])[0] == 0x280:
            break
    else:  # pragma: no cover
        pytest.fail("could not build a 640-byte header")
    assert looks_like_pickle(data)
    out, meta = unpack_tensors(data)
    assert torch.equal(out["x"], tensors["x"]) and meta["pad"] == "a" * n
