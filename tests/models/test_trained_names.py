"""A policy's trained tensors are named without copying them: every train task names them
(a full fine-tune's copy was the whole model, to the host). ``meta`` stands in for CUDA: a
tensor there cannot be copied anywhere."""

from __future__ import annotations

import pytest

from digen.models import load_policy


@pytest.mark.parametrize("lora", [True, False])
def test_trained_names_need_no_copy_and_match_the_state_dicts_keys(tiny_sd3, lora):
    on_meta = load_policy(str(tiny_sd3), height=32, width=32, device="meta")
    on_cpu = load_policy(str(tiny_sd3), height=32, width=32)
    for policy in (on_meta, on_cpu):
        if lora:
            policy.enable_lora(rank=4, alpha=8)
        else:
            policy.transformer.requires_grad_(True)
    named = on_meta.named_trainable_parameters()  # raised "Cannot copy out of meta tensor" before
    assert [n for n, _ in named] == list(on_cpu.trainable_state_dict())
    assert all(p.device.type == "meta" and p.requires_grad for _, p in named)
    assert on_meta.trainable_names() == on_cpu.trainable_names()
