"""A stage's process computes the same bytes every time on CPU, whatever its thread count.

Indexing's backward (`x[rows, cols]`, `x[mask]`) adds its gradients with `index_put_(accumulate=True)`,
whose parallel CPU kernel adds colliding rows in the order its threads arrive: two float32 RLOO runs of the
default config on 2 threads parted in the last bits by step 3, and their trajectories after it.
`runtime.setup` switches torch to its deterministic kernels on a machine without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from rloo import runtime


@pytest.fixture
def restore_torch():
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det)


@pytest.mark.skipif(torch.cuda.is_available(), reason="setup leaves a GPU node's kernels as they are")
def test_accumulating_index_put_on_two_threads_repeats_to_the_bit(restore_torch):
    runtime.setup(2, seed=0)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 384, (12_800,), generator=g)  # many collisions: a vocabulary's rows
    values = torch.randn(12_800, 192, generator=g)

    def accumulate() -> torch.Tensor:
        return torch.zeros(384, 192).index_put_((rows,), values, accumulate=True)

    first = accumulate()
    differing = sum(not torch.equal(first, accumulate()) for _ in range(20))
    assert differing == 0, f"{differing} of 20 repeats differ from the first on 2 threads"
