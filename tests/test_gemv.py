"""ddbench.kernels.gemv (CUDA, compiled with NVRTC): the preloading GEMV against its torch reference at
every tile shape and fusion, and as a chain of dependent launches with PDL, eagerly and in a
CUDA graph; on CPU, the reference against the engine's own references (the GPU tests check
the kernel against the right meaning)."""
import pytest
import torch

from ddbench.engine.config import preset
from ddbench.kernels import fused_ops, gemv, skinny


def test_config_fits_two_programs_an_sm_and_tiles_divide_k():
    for n, k in preset("k2.6", tp=8).dense_shapes().values():   # every dense decode GEMM of K2.6 TP-8
        c = gemv.config(n, k)
        assert k % c["KC"] == 0 and 32 % (c["KC"] // 8 // c["WARPS"]) == 0 and c["STAGES"] >= 2
        assert c["STAGES"] * c["ROWS"] * c["KC"] * 2 + 4 * k <= gemv.SHARED_BUDGET
    with pytest.raises(ValueError, match="multiple of 256"):
        gemv.config(64, 100)


def test_reference_means_what_the_engine_references_mean():
    g = torch.Generator().manual_seed(0)
    w, x, res, nw = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in [(96, 256), (1, 256), (1, 256), (256,)])
    want, h, _ = skinny.norm_linear_ref(x, nw, 1e-6, w, res)
    h_out = torch.empty(256, dtype=torch.bfloat16)
    got = gemv.reference(w, x, norm=(nw, 1e-6, res, h_out))
    torch.testing.assert_close(got, want.float(), rtol=2e-2, atol=0.1)     # want: xn and y rounded to bf16
    assert torch.equal(h_out, h.view(-1))
    cos, sin = torch.randn(2, 8, generator=g).unbind(0)                 # 6 heads of 16, rope on the last 16 - 0
    want = (x.float() @ w.float().T).view(1, 1, 6, 16)
    fused_ops.rope_ref_(want, cos.view(1, 1, 8), sin.view(1, 1, 8), 0)
    torch.testing.assert_close(gemv.reference(w, x, rope=(cos, sin, 16, 0)), want.view(1, 96))
    add = torch.randn(3, 96, generator=g)
    torch.testing.assert_close(gemv.reference(w, x, add=add), x.float() @ w.float().T + add.sum(0))


def _rnd(*shape, g, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,dtype", [(2112, 7168, torch.float32), (1536, 1536, torch.bfloat16),
                                       (7168, 1024, torch.bfloat16), (384, 7168, torch.float32),
                                       (7168, 256, torch.bfloat16), (100, 512, torch.float32),
                                       (37, 2048, torch.bfloat16)])
def test_gpu_gemv_matches_torch(n, k, dtype):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = _rnd(n, k, g=g, dtype=torch.bfloat16)
    x = _rnd(1, k, g=g, dtype=dtype)
    y = gemv.gemv(w, x)
    assert y.shape == (1, n) and y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), gemv.reference(w, x), rtol=tol, atol=tol * k ** 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2112, 7168), (512, 1024)])
def test_gpu_gemv_norm_prologue_matches_torch(n, k):
    g = torch.Generator(device="cuda").manual_seed(k)
    w = _rnd(n, k, g=g, dtype=torch.bfloat16, scale=k ** -0.5)
    x, res, nw = (_rnd(1, k, g=g, dtype=torch.bfloat16) for _ in range(3))
    h_got, h_want = (torch.empty(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    y = gemv.gemv(w, x, norm=(nw, 1e-6, res, h_got))
    want = gemv.reference(w, x, norm=(nw, 1e-6, res, h_want))
    assert torch.equal(h_got, h_want)
    torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gemv.gemv(w, x, norm=(nw, 1e-6, None, None)).float(),
                               gemv.reference(w, x, norm=(nw, 1e-6, None, None)), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_gpu_gemv_rope_and_add_epilogues_match_torch():
    g = torch.Generator(device="cuda").manual_seed(5)
    w = _rnd(1536, 1536, g=g, dtype=torch.bfloat16, scale=1536 ** -0.5)      # K2.6 wq_b shard: 8 heads of 192
    x = _rnd(1, 1536, g=g, dtype=torch.bfloat16)
    ang = torch.rand(32, generator=g, device="cuda") * 6
    rope = (ang.cos(), ang.sin(), 192, 128)
    torch.testing.assert_close(gemv.gemv(w, x, rope=rope).float(), gemv.reference(w, x, rope=rope),
                               rtol=1e-2, atol=1e-2)
    w2 = _rnd(7168, 256, g=g, dtype=torch.bfloat16, scale=256 ** -0.5)        # shared w2 + the 8 routed rows
    x2, add = _rnd(1, 256, g=g, dtype=torch.bfloat16), _rnd(8, 7168, g=g)
    torch.testing.assert_close(gemv.gemv(w2, x2, add=add).float(), gemv.reference(w2, x2, add=add),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_gpu_gemv_chain_with_pdl_equals_plain_launches_and_graph_replays():
    g = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(7168, 1024), (2112, 7168), (1536, 1536)] * 4   # each reads the first k of the one before
    ws = [_rnd(n, k, g=g, dtype=torch.bfloat16, scale=k ** -0.5) for n, k in shapes]
    x0 = _rnd(1, 1024, g=g)

    def chain(x, pdl):
        for w in ws:
            x = gemv.gemv(w, x[:, :w.shape[1]], pdl=pdl)
        return x
    want = chain(x0, False)
    ref = x0
    for w in ws:
        ref = gemv.reference(w, ref[:, :w.shape[1]])
    torch.testing.assert_close(want, ref, rtol=1e-3, atol=1e-3)
    assert torch.equal(chain(x0, True), want)
    xs = x0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(xs, True)
    for i in range(4):   # new inputs each replay
        xi = _rnd(1, 1024, g=g)
        xs.copy_(xi)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, chain(xi, False)), f"replay {i}"


@pytest.mark.gpu
def test_gpu_skinny_entry_points_with_cuda_gemv_match_the_triton_path():
    """cuda_gemv=True sends the engine's one-row calls to kernels.gemv: same results."""
    from ddbench.kernels import pdl
    if not pdl.on(torch.empty(1, device="cuda")):
        pytest.skip("needs sm_90+")
    g = torch.Generator(device="cuda").manual_seed(9)
    bf = torch.bfloat16
    x, res, nw = (_rnd(1, 1, 7168, g=g, dtype=bf) for _ in range(3))
    wa, wq, wo, w2 = (_rnd(n, k, g=g, dtype=bf, scale=k ** -0.5) for n, k in
                      [(2112, 7168), (1536, 1536), (7168, 1024), (7168, 256)])
    ang = torch.rand(1, 1, 32, generator=g, device="cuda")
    add = _rnd(8, 7168, g=g)

    def calls(on):
        qkv, h, _, _ = skinny.norm_linear(x, nw.view(-1), 1e-6, wa, res, cuda_gemv=on)
        q = skinny.skinny_linear(qkv[..., :1536], wq, rope=(ang.cos(), ang.sin(), 192, 128), cuda_gemv=on)
        a = skinny.linear(q[..., :1024], wo, cuda_gemv=on)
        return (qkv, h, q, a, skinny.skinny_linear(a[..., :256], w2, add=add, add_rows=8, cuda_gemv=on),
                skinny.linear(a, wa, cuda_gemv=on))
    want = calls(False)                                      # the Triton / cuBLAS path
    launches = []
    launch = gemv.gemv
    with pytest.MonkeyPatch.context() as mp:                 # count kernels.gemv's launches
        mp.setattr(gemv, "gemv", lambda *a, **k: launches.append(1) or launch(*a, **k))
        got = calls(True)
    assert len(launches) == 5                                # norm, rope, wo, w2 + add, head
    with pytest.MonkeyPatch.context() as mp:                 # PDL off: no kernels.gemv
        mp.setattr(gemv, "gemv", lambda *a, **k: launches.append(1) or launch(*a, **k))
        off = skinny.linear(want[3], wa, cuda_gemv=True, pdl_mode=0)
    assert len(launches) == 5
    torch.testing.assert_close(off.float(), want[5].float(), rtol=2e-2, atol=2e-2)
    for name, a, b in zip(["qkv", "h", "q", "wo", "w2 + add", "head"], got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)
