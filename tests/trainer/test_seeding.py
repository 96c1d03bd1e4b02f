"""digen.seeding.permutation draws what torch.randperm draws from the same stream, without torch:
the controller plans the prompts of an iteration with it, the reference loop too."""

from __future__ import annotations

import pytest
import torch

from digen.seeding import generator, iteration_generator, permutation
from digen.task_records import iteration_prompts


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 16, 100, 1000, 50_000])
def test_permutation_is_torchs_randperm(n: int) -> None:
    for parts in [(0, 0, "prompts"), (42, 3, "prompts"), (7, 1, 2, "timesteps"), (2**40 + 5, "x")]:
        assert permutation(n, *parts) == torch.randperm(n, generator=generator(*parts)).tolist()


def test_iteration_prompts_keep_the_torch_drawn_order() -> None:
    prompts = [f"p{i}" for i in range(13)]
    for k in range(5):
        order = torch.randperm(13, generator=iteration_generator(11, k, "prompts")).tolist()
        assert iteration_prompts(prompts, 11, k, 20) == [prompts[order[i % 13]] for i in range(20)]
