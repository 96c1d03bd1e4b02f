"""The compute precision of the SDE and loss math: float32, or float64 when the input is.

The transformer may run in bfloat16 or float16 (``model.dtype``); everything downstream of it
(the velocity's CFG combination, the SDE step, log-probs, the PPO loss, task gradients) runs in
float32. A float64 model (``model.dtype: float64``, a numerical check, not a training setting)
keeps float64 all the way, so a comparison with a peer's formula measures the math and not
float32 round-off. For float32, bfloat16 and float16 inputs nothing changes.
"""

from __future__ import annotations

import torch
from torch import Tensor


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any of ``tensors`` is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def at_least_float32(t: Tensor) -> Tensor:
    """``t`` as float32, unless it is float64 (kept)."""
    return t if t.dtype == torch.float64 else t.float()
