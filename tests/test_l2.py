"""kernels.l2.regions: the kernel arguments of an L2 prefetch (CPU; the kernels that issue
it are tested on the GPU in test_mla_decode.py and test_moe_w2.py)."""
import torch

from kernels import l2


def test_regions_cut_the_tensors_to_the_budget_in_turn():
    a, b, c = torch.empty(1000, dtype=torch.bfloat16), torch.empty(100, 8), torch.empty(64)
    assert l2.regions((a, b, c), 0) == [None, 0, None, 0]
    assert l2.regions((), 1 << 20) == [None, 0, None, 0]
    r = l2.regions((a, b, c), 1000)                                  # inside a: whole 16-byte units
    assert r[0] is a and r[1:] == [992, None, 0]
    r = l2.regions((a, b, c), 2000 + 1600)                           # all of a, all of b
    assert r[0] is a and r[1] == 2000 and r[2] is b and r[3] == 1600
    r = l2.regions((a, b, c), 10 ** 6)                               # at most SLOTS regions: c is left
    assert [x for x in r if not torch.is_tensor(x)] == [2000, 3200] and len(r) == 2 * l2.SLOTS


def test_regions_skip_views_that_are_not_contiguous():
    a = torch.empty(64, 64)
    r = l2.regions((a[:, :32], a[1:]), 1 << 20)                      # a strided view; one offset by 256 bytes
    assert r[1] == 63 * 64 * 4 and r[2:] == [None, 0]
