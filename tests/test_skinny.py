"""kernels.skinny (few-row dense GEMM) against torch, under the interpreter on CPU."""
import pytest
import torch

from kernels.skinny import linear, skinny_linear, tiles

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m,n,k,add", [(1, 96, 200, False), (3, 40, 64, True), (4, 7, 130, False), (2, 512, 96, True)])
def test_skinny_matches_torch(m, n, k, add):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(DEV, torch.float16)
    w = torch.randn(n, k, generator=g).to(DEV, torch.float16)
    a = torch.randn(m, n, generator=g).to(DEV, torch.float16) if add else None
    want = x.float() @ w.float().t() + (a.float() if add else 0)
    got = skinny_linear(x, w, a)
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-3)


def test_skinny_keeps_leading_dims_and_picks_tiles():
    x = torch.randn(1, 2, 64).to(DEV, torch.float16)
    w = torch.randn(48, 64).to(DEV, torch.float16)
    assert skinny_linear(x, w).shape == (1, 2, 48)
    bm, bn, bk = tiles(1, 2112, 7168)
    assert (bm, bn) == (1, 8) and bm * bn * bk <= 8192
    assert tiles(4, 16, 64)[1] == 1


def test_linear_falls_back_to_torch_off_gpu_or_for_many_rows():
    x = torch.randn(6, 32)
    w = torch.randn(8, 32)
    a = torch.randn(6, 8)
    assert torch.allclose(linear(x, w), x @ w.t(), atol=1e-5)
    assert torch.allclose(linear(x, w, a), a + x @ w.t(), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 2112, 7168), (1, 512, 7168), (1, 7168, 1024), (4, 7168, 256), (2, 1536, 1536)])
def test_skinny_bf16_k26_shapes(m, n, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    want = x.float() @ w.float().t()
    got = linear(x, w)
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
