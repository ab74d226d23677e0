"""ddbench.kernels.skinny (few-row dense GEMM) against torch, under the interpreter on CPU."""
import pytest
import torch

from ddbench.kernels import skinny
from ddbench.kernels.skinny import heads_linear, linear, skinny_bmm, skinny_linear, tiles

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
    assert (bm, bn) == (1, 8) and bm * bn * bk <= skinny.TILE_VALUES
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


@pytest.mark.parametrize("m", [1, 6])
def test_linear_reuse_add_accumulates_in_place(m):
    """reuse_add: the cuBLAS path adds into `add` itself (no copy of it first), same values."""
    x, w, a = torch.randn(m, 32).to(DEV), torch.randn(300, 32).to(DEV), torch.randn(m, 300).to(DEV)
    want = linear(x, w, a)
    got = linear(x, w, a, reuse_add=True)
    assert got.data_ptr() == a.data_ptr()
    torch.testing.assert_close(got, want)


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


# ---- fused prologue (RMSNorm + residual) and epilogue (SiLU(gate) * up) ------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,res,glu", [(1, 40, 96, True, False), (3, 24, 160, False, True),
                                           (4, 33, 224, True, True), (2, 7, 64, True, False)])
def test_norm_linear_matches_unfused(dtype, m, n, k, res, glu):
    """norm_linear == rms_norm (+ residual) -> linear (-> silu_mul), and its side outputs:
    the new residual, the normed rows and their fp16 copy (moe_gemv.half_rows)."""
    from ddbench.kernels.moe_gemv import half_rows
    from ddbench.kernels.skinny import norm_linear, norm_linear_ref

    g = torch.Generator().manual_seed(m * 100 + n)
    x, r = (torch.randn(m, k, generator=g).to(DEV, dtype) for _ in range(2))
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(DEV, dtype)
    w = (torch.randn(n * (2 if glu else 1), k, generator=g) * k ** -0.5).to(DEV, dtype)
    y, h, xn, xh = norm_linear(x, nw, 1e-5, w, r if res else None, glu=glu, out_xn=True, out_xh=True)
    y0, h0, xn0 = norm_linear_ref(x, nw, 1e-5, w, r if res else None, glu=glu)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)
    assert y.shape == (m, n) and y.dtype == dtype and xh.shape == (m, k) and xh.dtype == torch.float16
    torch.testing.assert_close(y, y0, **tol)
    torch.testing.assert_close(xn, xn0, **tol)
    assert (h is None) == (not res) and (h is None or torch.equal(h, h0))   # same rounding as the reference
    assert torch.equal(xh, half_rows(xn))
    # without side outputs: the same y, nothing else written
    y1, h1, xn1, xp1 = norm_linear(x, nw, 1e-5, w, r if res else None, glu=glu)
    assert torch.equal(y1, y) and xn1 is None and xp1 is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,heads,tile", [(1, 3, None), (3, 2, (4, 2, 64)), (4, 5, None), (1, 3, (1, 8, 64)),
                                          (2, 4, (2, 16, 32))])
def test_rope_epilogue_matches_rope_after_linear(dtype, m, heads, tile):
    """skinny_linear(rope=) == linear then fused_ops.rope_ref_ on each head's rope dims (as
    MLA's wq_b then q rope), incl. tiles of 2 columns (one pair)."""
    from ddbench.kernels.fused_ops import rope_ref_

    g = torch.Generator().manual_seed(m + heads)
    dn, dr, k = 12, 8, 64
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    w = (torch.randn(heads * (dn + dr), k, generator=g) * k ** -0.5).to(DEV, dtype)
    ang = torch.randn(m, dr // 2, generator=g).to(DEV)
    want = (x.float() @ w.float().t()).view(1, m, heads, dn + dr)
    rope_ref_(want, ang.cos().view(1, m, -1), ang.sin().view(1, m, -1), dn)
    got = skinny_linear(x, w, tile=tile, rope=(ang.cos(), ang.sin(), dn + dr, dn))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(got.float(), want.view(m, -1), **tol)


@pytest.mark.parametrize("m,k_rows", [(1, 8), (3, 2)])
def test_add_rows_sums_k_rows_per_output_row(m, k_rows):
    """add_rows: fp32 add `[M * k, N]` (a token's k expert rows) summed into the epilogue,
    N > K as the shared expert's down GEMM."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 32, generator=g).to(DEV, torch.float16)
    w = (torch.randn(72, 32, generator=g) * 0.2).to(DEV, torch.float16)
    rows = torch.randn(m * k_rows, 72, generator=g).to(DEV)
    want = x.float() @ w.float().t() + rows.view(m, k_rows, 72).sum(1)
    got = skinny_linear(x, w, add=rows, add_rows=k_rows)
    assert got.shape == (m, 72) and got.dtype == x.dtype
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2e-3)
    with pytest.raises(ValueError, match="add"):
        skinny_linear(x, w, add=rows[:-1], add_rows=k_rows)


@pytest.mark.parametrize("m", [1, 3])
def test_glu_epilogue_matches_silu_mul(m):
    from ddbench.kernels.fused_ops import silu_mul_ref

    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 96, generator=g).to(DEV, torch.float16)
    w = (torch.randn(2 * 40, 96, generator=g) * 0.1).to(DEV, torch.float16)
    want = silu_mul_ref(x.float() @ w.float().t())
    got = skinny_linear(x, w, glu=True)
    assert got.shape == (m, 40)
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


def test_glu_tiles_keep_the_product_budget():
    """With glu a program holds two [BM, BN, BK] products (gate and up): BK halves."""
    for m, n in ((1, 2304), (4, 256), (2, 8)):
        bm, bn, bk = tiles(m, n, 7168, glu=True)
        assert 2 * bm * bn * bk <= 8192 and (bm, bn) == tiles(m, n, 7168)[:2]


@pytest.mark.gpu
def test_max_rows_zero_turns_the_triton_path_off():
    import ddbench.kernels.skinny as S

    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    assert S.fits(x, w) and S.fits(x.expand(4, 64), w, max_rows=4)
    assert not S.fits(x, w, max_rows=0) and not S.fits(x.expand(4, 64), w, max_rows=3)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("name,n,glu,res,side", [("wqkv_a", 2112, False, True, False),
                                                 ("router", 384, False, True, True),
                                                 ("dense_w13", 2304, True, True, False)])
def test_norm_linear_bf16_k26_shapes(m, name, n, glu, res, side):
    """K2.6 TP-8 shapes: attn_norm + wqkv_a, ffn_norm + router gate (+ normed x and its fp16
    order), ffn_norm + dense w13 with SiLU(gate) * up; bf16 against the fp32 unfused maths."""
    from ddbench.kernels.moe_gemv import half_rows
    from ddbench.kernels.skinny import norm_linear, norm_linear_ref

    k = 7168
    x, r = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    nw = 1 + 0.2 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n * (2 if glu else 1), k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    y, h, xn, xh = norm_linear(x, nw, 1e-5, w, r if res else None, glu=glu, out_xn=side, out_xh=side)
    y0, h0, xn0 = norm_linear_ref(x.float(), nw.float(), 1e-5, w.float(), r.float() if res else None, glu=glu)
    assert _rel(y, y0) < 1e-2, name
    assert torch.equal(h, (x.float() + r.float()).bfloat16())
    if side:
        assert _rel(xn, xn0) < 1e-2 and torch.equal(xh, half_rows(xn))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("n", [256, 2304])
def test_glu_bf16_k26_shapes(m, n):
    """Shared expert (2 x 256 local rows) and dense MLP (2 x 2304) w13 with the SiLU epilogue."""
    from ddbench.kernels.fused_ops import silu_mul_ref

    x = torch.randn(m, 7168, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * n, 7168, device="cuda", dtype=torch.bfloat16) * 7168 ** -0.5
    want = silu_mul_ref(x.float() @ w.float().t())
    assert _rel(skinny_linear(x, w, glu=True), want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_rope_bf16_k26_wq_b(m):
    """MLA's wq_b at TP-8 (8 heads x (128 nope + 64 rope) <- 1536) with q's rope in the epilogue."""
    from ddbench.kernels.fused_ops import rope_ref_

    x = torch.randn(m, 1536, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 1536, device="cuda", dtype=torch.bfloat16) * 1536 ** -0.5
    ang = torch.randn(m, 32, device="cuda") * 3
    want = (x.float() @ w.float().t()).view(1, m, 8, 192)
    rope_ref_(want, ang.cos().view(1, m, -1), ang.sin().view(1, m, -1), 128)
    assert _rel(skinny_linear(x, w, rope=(ang.cos(), ang.sin(), 192, 128)), want.view(m, -1)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_add_rows_bf16_k26_shared_w2(m):
    """The shared expert's down GEMM (7168 <- 256) with the 8 routed expert rows (fp32) summed in."""
    x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(7168, 256, device="cuda", dtype=torch.bfloat16) * 256 ** -0.5
    rows = torch.randn(m * 8, 7168, device="cuda")
    want = x.float() @ w.float().t() + rows.view(m, 8, -1).sum(1)
    assert _rel(skinny_linear(x, w, add=rows, add_rows=8), want) < 1e-2


# ---- side job: the router's top-k (route=fused) -------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,e,k,ties", [(1, 40, 6, False), (2, 24, 4, True), (3, 64, 8, False), (4, 33, 5, True)])
def test_norm_linear_route_epilogue_matches_route_ref(dtype, m, e, k, ties):
    """norm_linear(route=) == fused_ops.route_ref on its own logits: the same ids, with ties
    (tied gate rows and biases give tied scores) going to the lower expert (torch.topk's order
    among ties is unspecified: the reference order is a stable sort), close weights; the
    ticket counter is zero after."""
    from ddbench.kernels import ticket
    from ddbench.kernels.fused_ops import route_ref
    from ddbench.kernels.skinny import norm_linear

    g = torch.Generator().manual_seed(10 * m + e)
    x, r = (torch.randn(m, 64, generator=g).to(DEV, dtype) for _ in range(2))
    nw = (1 + 0.2 * torch.randn(64, generator=g)).to(DEV, dtype)
    gate = torch.randn(e, 64, generator=g) / 8
    bias = (0.1 * torch.randn(e, generator=g)).to(DEV)
    if ties:                                   # experts 1, 3, 5, .. copy expert 0's row and bias
        gate[1::2] = gate[0]
        bias[1::2] = bias[0]
    gate = gate.to(DEV, dtype)
    y, h, xn, xh, ids, w = norm_linear(x, nw, 1e-5, gate, r, out_xn=True, route=(bias, k, 2.5))
    ids0, w0 = route_ref(y, bias, k, 2.5)
    order = torch.sort(torch.sigmoid(y.float()) + bias, dim=-1, descending=True, stable=True).indices[:, :k]
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == w.shape == (m, k)
    assert torch.equal(ids, order.int()) and (ties or torch.equal(ids, ids0))
    torch.testing.assert_close(w, w0, atol=1e-5, rtol=1e-5)   # tied experts have equal weights
    y1, h1, xn1, _ = norm_linear(x, nw, 1e-5, gate, r, out_xn=True)          # the same GEMM without it
    assert torch.equal(y1, y) and torch.equal(h1, h) and torch.equal(xn1, xn)
    assert ticket.counters(x.device, "route", 1).item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_linear_strided_rows(dtype):
    """The norm prologue reads x rows with any row stride (a column slice), its outputs too."""
    from ddbench.kernels.moe_gemv import half_rows
    from ddbench.kernels.skinny import norm_linear, norm_linear_ref

    g = torch.Generator().manual_seed(5)
    wide, r = torch.randn(3, 2, 100, generator=g).to(DEV, dtype), torch.randn(3, 2, 64, generator=g).to(DEV, dtype)
    x = wide[..., 8:72]                                                       # [3, 2, 64], row stride 100
    nw = (1 + 0.2 * torch.randn(64, generator=g)).to(DEV, dtype)
    w = (torch.randn(24, 64, generator=g) / 8).to(DEV, dtype)
    y, h, xn, xh = norm_linear(x, nw, 1e-5, w, r, out_xn=True, out_xh=True)
    y0, h0, xn0 = norm_linear_ref(x, nw, 1e-5, w, r)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(y, y0, **tol)
    torch.testing.assert_close(xn, xn0, **tol)
    assert torch.equal(h, h0) and torch.equal(xh, half_rows(xn.reshape(6, 64)))


def _k26_router(m, seed):
    """K2.6 TP-8 router inputs (bf16): x, residual, ffn_norm weight, gate [384, 7168], bias."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, r = (torch.randn(m, 7168, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    nw = (1 + 0.2 * torch.randn(7168, generator=g, device="cuda")).bfloat16()
    gate = (torch.randn(384, 7168, generator=g, device="cuda") * 7168 ** -0.5).bfloat16()
    return x, r, nw, gate, 0.1 * torch.randn(384, generator=g, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_route_epilogue_bf16_k26(m):
    """The router GEMM (384 <- 7168, k = 8) with its top-k in the last program == fused_ops.route
    on its logits, bf16; the counter is zero after."""
    from ddbench.kernels import ticket
    from ddbench.kernels.fused_ops import route, route_ref
    from ddbench.kernels.skinny import norm_linear

    x, r, nw, gate, bias = _k26_router(m, m)
    y, h, xn, xh, ids, w = norm_linear(x, nw, 1e-6, gate, r, out_xn=True, out_xh=True, route=(bias, 8, 2.827))
    ids1, w1 = route(y, bias, 8, 2.827)
    ids0, w0 = route_ref(y, bias, 8, 2.827)
    assert torch.equal(ids, ids1) and torch.equal(ids.sort(-1).values, ids0.sort(-1).values)
    torch.testing.assert_close(w, w1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, w0, atol=1e-4, rtol=1e-4)
    assert torch.equal(y, norm_linear(x, nw, 1e-6, gate, r)[0])
    assert ticket.counters(x.device, "route", 1).item() == 0


@pytest.mark.gpu
def test_route_epilogue_cuda_graph_replay_new_inputs():
    """The fused router captured in a CUDA graph, replayed on new inputs copied into the
    captured buffers: the same bits as eager calls on those inputs, counter zero."""
    from ddbench.kernels import ticket
    from ddbench.kernels.skinny import norm_linear

    x, r, nw, gate, bias = _k26_router(2, 0)

    def step():
        y, h, _, _, ids, wts = norm_linear(x, nw, 1e-6, gate, r, route=(bias, 8, 2.827))
        return y, h, ids, wts

    step()                                                      # compile and allocate the counters first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (1, 2):
        x1, r1, _, _, _ = _k26_router(2, 10 + seed)
        x.copy_(x1)
        r.copy_(r1)
        want = step()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, e) for a, e in zip(outs, want)), seed
        assert ticket.counters(x.device, "route", 1).item() == 0
