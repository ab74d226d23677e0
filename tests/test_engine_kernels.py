"""ddbench.kernels.fused_ops: each Triton kernel against its torch reference on fresh random inputs
(TRITON_INTERPRET=1 on CPU, fp32; bf16 on the GPU)."""
from __future__ import annotations

import pytest
import torch

from ddbench.kernels import fused_ops as F

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else [])


def gen(seed=0):
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


def tol(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 200])
def test_rms_norm(dtype, d):
    g = gen(1)
    x, r, w = randn(3, 2, d, g=g, dtype=dtype), randn(3, 2, d, g=g, dtype=dtype), 1 + randn(d, g=g, dtype=dtype)
    torch.testing.assert_close(F.rms_norm(x, w, 1e-5), F.rms_norm_ref(x, w, 1e-5), **tol(dtype))
    y, h = F.rms_norm(x, w, 1e-6, residual=r)
    y0, h0 = F.rms_norm_ref(x, w, 1e-6, residual=r)
    torch.testing.assert_close(h, h0, **tol(dtype))
    torch.testing.assert_close(y, y0, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_a_post_norms_and_stores(dtype):
    g = gen(2)
    b, t, s, qd, lat, r = 3, 2, 9, 40, 48, 16
    full = randn(b, t, 8 + qd + lat + r, g=g, dtype=dtype)
    qkv = full[..., 8:]                              # a strided view, as after a fused GEMM
    qw, kvw = 1 + randn(qd, g=g, dtype=dtype), 1 + randn(lat, g=g, dtype=dtype)
    ang = randn(b, t, r // 2, g=g)
    plen = torch.tensor([0, 4, 7], dtype=torch.int32, device=DEV)
    cache = (randn(b, s, lat, g=g, dtype=dtype), randn(b, s, r, g=g, dtype=dtype))
    want, got = tuple(c.clone() for c in cache), tuple(c.clone() for c in cache)
    q0 = F.mla_a_post_ref(qkv, qw, kvw, ang.cos(), ang.sin(), *want, plen, 1e-5)
    q1 = F.mla_a_post(qkv, qw, kvw, ang.cos(), ang.sin(), *got, plen, 1e-5)
    torch.testing.assert_close(q1, q0, **tol(dtype))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, **tol(dtype))
    assert not torch.equal(want[0], cache[0]) and not torch.equal(want[1], cache[1])  # both written


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_inplace_on_q_slice(dtype):
    g = gen(3)
    b, t, h, dn, r = 2, 3, 5, 12, 8
    q = randn(b, t, h, dn + r, g=g, dtype=dtype)
    ang = randn(b, t, r // 2, g=g)
    want = F.rope_ref_(q.clone(), ang.cos(), ang.sin(), dn)
    got = F.rope_(q.clone(), ang.cos(), ang.sin(), dn)
    torch.testing.assert_close(got, want, **tol(dtype))
    torch.testing.assert_close(got[..., :dn], q[..., :dn])  # nope dims untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    x = randn(4, 2, 2 * 96, g=gen(4), dtype=dtype)
    torch.testing.assert_close(F.silu_mul(x), F.silu_mul_ref(x), **tol(dtype))


@pytest.mark.parametrize("e, k", [(16, 4), (48, 8)])
def test_route_matches_reference_and_kernels_moe(e, k):
    from ddbench.kernels.moe import route as moe_route

    g = gen(5)
    x, gate, bias = randn(7, 32, g=g), randn(e, 32, g=g) / 6, 0.1 * randn(e, g=g)
    ids, w = F.route(x @ gate.t(), bias, k, 2.827)
    ids0, w0 = F.route_ref(x @ gate.t(), bias, k, 2.827)
    ids1, w1 = moe_route(x, gate, bias, k, 2.827)
    assert torch.equal(ids, ids0) and torch.equal(ids0, ids1)
    torch.testing.assert_close(w, w0)
    torch.testing.assert_close(w0, w1)


# ---- the engine's fused skinny path (norm prologue, SiLU epilogue, fp16 x for the MoE GEMV) ---------

def _decode_step(model, seed=3, plen=5):
    """One c=1 decode step on a random cache: (logits `[1, 1, vocab]`, the cache)."""
    cache = model.new_cache(1, 8)
    g = torch.Generator().manual_seed(seed)
    cache.ckv.copy_(torch.randn(cache.ckv.shape, generator=g))
    cache.kpe.copy_(torch.randn(cache.kpe.shape, generator=g))
    pl = torch.tensor([plen], dtype=torch.int32, device=model.device)
    tok = torch.randint(0, model.cfg.vocab, (1, 1), generator=g).to(model.device)
    with torch.no_grad():
        return model(tok, pl.long().view(1, 1), cache, pl, torch.ones(1, 1, 1, dtype=torch.bool, device=model.device))[0], cache


def _small_inter_models(dtype, device, ref_fused="torch", attn="torch", ref_kernels=None, kernels=None):
    """tiny with w13 [256, 256] and wq_b [128, 128] (N <= K, as in K2.6, so the skinny path
    takes them): a reference and a fused-ops model with the same weights, each under its
    kernel choice (None: the defaults)."""
    from ddbench.engine.config import preset
    from ddbench.engine.model import Transformer
    from ddbench.engine.weights import init_random

    cfg = preset("tiny", dense_inter=128, moe_inter=128, n_heads=4, q_lora_rank=128)
    ref = Transformer(cfg, moe_backend="triton", attn_backend=attn, device=device, dtype=dtype, fused=ref_fused,
                      kernels=ref_kernels)
    init_random(ref, 0, mode="exact")
    tri = Transformer(cfg, moe_backend="triton", attn_backend=attn, device=device, dtype=dtype, fused="triton",
                      kernels=kernels)
    tri.load_state_dict(ref.state_dict())
    return ref, tri


@pytest.mark.parametrize("max_rows,fuse", [(4, True), pytest.param(4, False, marks=pytest.mark.slow), (0, True)])
def test_model_fused_skinny_path_equals_unfused(monkeypatch, max_rows, fuse):
    """Ops 'triton' with `skinny.fits` opened to any device and fp32 (the interpreter on
    CPU): attn_norm in wqkv_a, ffn_norm in the router gate (which also writes the MoE's
    fp16 x and, with the choice's route=fused, routes) and in the dense w13, SiLU(gate) * up in the w13
    GEMMs, q's rope in wq_b, the sum over the k expert rows in the shared down GEMM give the
    logits and cache of the torch ops (mla_a_post stays one launch per layer). With the
    choice's skinny=0 nothing is fused: every norm is an rms_norm launch again.
    `tiles` is sized for 8 SMs here, not 132: 8-16 columns a program instead of 1 (the
    interpreter runs programs one by one: 65 s -> about 10 s on 2 CPU cores; the router's gate
    GEMM keeps 1 column a program, 16 programs for its ticket); narrow tiles, incl. 1 and
    2 columns, are covered by test_skinny."""
    from ddbench.kernels import fused_ops, moe_gemv, skinny
    from ddbench.kernels.select import KernelChoice

    monkeypatch.setattr(skinny, "sm_count", lambda device: 8)
    # the skinny path on any device (the interpreter on CPU) and fp32, within the choice's rows
    monkeypatch.setattr(skinny, "fits", lambda x, w, max_rows=skinny.MAX_ROWS: 0 < x.numel() // x.shape[-1] <= max_rows
                        and w.shape[0] <= w.shape[1])
    calls = {"norm_linear": 0, "half_rows": 0, "rms_norm": 0, "silu_mul": 0, "rope_": 0, "sum_k": 0,
             "route": 0, "mla_a_post": 0}
    for mod, name in ((skinny, "norm_linear"), (moe_gemv, "half_rows"), (fused_ops, "rms_norm"),
                      (fused_ops, "silu_mul"), (fused_ops, "rope_"), (fused_ops, "route"), (fused_ops, "mla_a_post")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _fn=fn, _n=name, **k: calls.__setitem__(_n, calls[_n] + 1) or _fn(*a, **k))
    w2 = moe_gemv.gemv_w2   # counts the MoE's own sums over k (the _sum_k launch)
    monkeypatch.setattr(moe_gemv, "gemv_w2", lambda *a, sum_k=True: calls.__setitem__("sum_k", calls["sum_k"] + sum_k)
                        or w2(*a, sum_k=sum_k))
    choice = KernelChoice(skinny=max_rows, route="fused" if fuse else "separate")
    ref, tri = _small_inter_models(torch.float32, DEV, ref_kernels=choice, kernels=choice)
    (want, c0), (got, c1) = _decode_step(ref), _decode_step(tri)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c1.ckv, c0.ckv)
    torch.testing.assert_close(c1.kpe, c0.kpe)
    cfg = ref.cfg
    n_moe = cfg.n_layers - cfg.n_dense_layers
    # counts over both models; the reference (torch ops) casts x and (unless the gemv config's
    # fuse_act folds it into w13) the w2 input per MoE layer
    from ddbench.kernels.moe_triton import MoeTritonConfig

    act = 0 if MoeTritonConfig().fuse_act else 1
    if max_rows:  # 2 norms per block fused (the final norm stays); the MoE converts only its w2 input
        want = {"norm_linear": 2 * cfg.n_layers, "half_rows": n_moe + 2 * act * n_moe, "rms_norm": 1, "silu_mul": 0,
                "rope_": 0, "sum_k": n_moe,
                # route=fused: the gate GEMM's last program routes (no route launch per MoE layer)
                "route": 0 if fuse else n_moe, "mla_a_post": cfg.n_layers}
    else:
        want = {"norm_linear": 0, "half_rows": 2 * (1 + act) * n_moe, "rms_norm": 2 * cfg.n_layers + 1,
                "silu_mul": cfg.n_layers, "rope_": cfg.n_layers, "sum_k": 2 * n_moe,
                "route": n_moe, "mla_a_post": cfg.n_layers}
    assert calls == want, calls


@pytest.mark.gpu
def test_gpu_bf16_fused_decode_step_close_to_unfused():
    """bf16 on the GPU with the real `skinny.fits`: the fused decode step against the same
    model under the choice skinny=0 (the unfused launches) and against the fp32 torch model."""
    from ddbench.kernels.select import KernelChoice

    ref, tri = _small_inter_models(torch.bfloat16, "cuda", ref_fused="triton", attn="triton",
                                   ref_kernels=KernelChoice(skinny=0))
    got, _ = _decode_step(tri)
    want, _ = _decode_step(ref)
    f32, _ = _small_inter_models(torch.float32, "cuda")
    f32.load_state_dict({k: v.to(f32.state_dict()[k].dtype) for k, v in ref.state_dict().items()})
    exact, _ = _decode_step(f32)
    for a in (got, want):
        assert a.isfinite().all() and ((a.float() - exact).norm() / exact.norm()).item() < 5e-2
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 5e-2


def test_route_negative_scores_and_ties_pick_lowest_index():
    """The int64 keys order negative score + bias correctly and break ties to the lower expert."""
    e, k = 40, 6
    logits = torch.zeros(3, e, device=DEV)
    logits[1] = torch.linspace(-3, 3, e, device=DEV)                  # distinct, some scores below -bias
    logits[2, ::5] = 2.0                                               # 8 tied maxima at 0, 5, 10, ..
    bias = torch.full((e,), -1.2, device=DEV)                          # every score + bias < 0
    ids, w = F.route(logits, bias, k, 2.827)
    assert ids[0].tolist() == list(range(k))                           # all tied: lowest indices
    assert ids[1].tolist() == list(range(e - 1, e - 1 - k, -1))
    assert ids[2].tolist() == [0, 5, 10, 15, 20, 25]
    ids1, w1 = F.route_ref(logits[1:2], bias, k, 2.827)
    assert torch.equal(ids[1:2], ids1)
    torch.testing.assert_close(w[1:2], w1)
    torch.testing.assert_close(w.sum(-1), torch.full((3,), 2.827, device=DEV))
