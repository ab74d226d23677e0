"""kernels.skinny (few-row dense GEMM) against torch, under the interpreter on CPU."""
import pytest
import torch

from kernels.skinny import heads_linear, linear, skinny_bmm, skinny_linear, tiles

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


def test_skinny_bmm_batches_and_strided_weights():
    """Per-batch W given transposed (unit stride along N), as the MLA query absorption does."""
    x = torch.randn(3, 2, 40).to(DEV, torch.float16)
    wt = torch.randn(3, 40, 24).to(DEV, torch.float16)              # [B, K, N] -> view [B, N, K]
    out = torch.empty(3, 2, 24, dtype=torch.float16, device=DEV)
    skinny_bmm(x, wt.transpose(1, 2), out)
    assert torch.allclose(out.float(), x.float() @ wt.float(), atol=2e-2, rtol=2e-3)


def test_linear_falls_back_to_torch_off_gpu_or_for_many_rows():
    x = torch.randn(6, 32)
    w = torch.randn(8, 32)
    a = torch.randn(6, 8)
    assert torch.allclose(linear(x, w), x @ w.t(), atol=1e-5)
    assert torch.allclose(linear(x, w, a), a + x @ w.t(), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 9])
def test_heads_linear_bf16_mla_shapes(t):
    q = torch.randn(1, t, 8, 192, device="cuda", dtype=torch.bfloat16)[..., :128]   # q_nope slice
    wkv_b = torch.randn(8, 256, 512, device="cuda", dtype=torch.bfloat16) * 0.05
    for x, w in ((q, wkv_b[:, :128].transpose(1, 2)), (torch.randn(1, t, 8, 512, device="cuda", dtype=torch.bfloat16),
                                                        wkv_b[:, 128:])):
        want = torch.einsum("bthk,hnk->bthn", x.float(), w.float())
        got = heads_linear(x, w)
        assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 2112, 7168), (1, 512, 7168), (1, 7168, 1024), (4, 7168, 256), (2, 1536, 1536)])
def test_skinny_bf16_k26_shapes(m, n, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    want = x.float() @ w.float().t()
    got = linear(x, w)
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
