"""ddbench.kernels.mla_decode (CUDA, decode attention in one launch): what it takes; on CPU its torch
reference against the three-step path it replaces; on the GPU the kernel against that
reference on fresh random inputs (several prefix lengths in one batch, the token seeing
itself or not), with PDL in a replayed CUDA graph after the kernel that writes its query,
and in the model (same logits as the three launches, graph decode == eager)."""
import pytest
import torch

from ddbench.kernels import mla_decode
from ddbench.kernels.mla_attn import mla_attention_ref

DN, DR, DV, L = mla_decode.DN, mla_decode.DR, mla_decode.DV, mla_decode.L


def _inputs(b, nh, s, plens, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g, device=device) * scale).bfloat16()  # noqa: E731
    return dict(q=rnd(b, 1, nh, DN + DR), wkv_b=rnd(nh * (DN + DV), L, scale=L ** -0.5), ckv=rnd(b, s, L),
                kpe=rnd(b, s, DR), prefix_len=torch.tensor(plens, dtype=torch.int32, device=device),
                visible=torch.ones(b, 1, 1, dtype=torch.bool, device=device), scale=(DN + DR) ** -0.5)


def test_reference_is_the_three_step_path():
    """q absorption through wkv_b's key rows, latent attention, value rows: as engine.model's
    fallback computes it."""
    p = _inputs(2, 3, 40, [5, 30], "cpu")
    nh = 3
    w = p["wkv_b"].view(nh, DN + DV, L)
    q_lat = torch.einsum("bthd,hdl->bthl", p["q"][..., :DN].float(), w[:, :DN].float()).bfloat16()
    o = mla_attention_ref(q_lat, p["q"][..., DN:], p["ckv"], p["kpe"], p["prefix_len"], p["visible"], p["scale"])
    want = torch.einsum("bthl,hvl->bthv", o.float(), w[:, DN:].float())
    got = mla_decode.reference(**p)
    assert got.shape == (2, 1, nh, DV) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_fits_refuses_cpu_tensors_and_the_launch_says_so():
    p = _inputs(1, 2, 16, [3], "cpu")
    args = [p[k] for k in ("q", "wkv_b", "ckv", "kpe", "prefix_len", "visible")]
    assert not mla_decode.fits(*args)                                   # CPU tensors
    with pytest.raises(ValueError, match="does not take"):
        mla_decode.mla_decode(**p)


def _check(got, p):
    want = mla_decode.reference(**p).float()
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert (got.float() - want).norm() < 1e-2 * want.norm(), ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("b,nh,s,plens", [(1, 8, 192, [128]), (1, 8, 256, [255]), (3, 8, 256, [0, 1, 100]),
                                          (2, 16, 512, [7, 511]), (4, 2, 64, [9, 31, 32, 63])])
def test_gpu_matches_reference(b, nh, s, plens):
    p = _inputs(b, nh, s, plens, "cuda", seed=s + b)
    args = [p[k] for k in ("q", "wkv_b", "ckv", "kpe", "prefix_len", "visible")]
    assert mla_decode.fits(*args, max_streams=None) and mla_decode.fits(*args, max_streams=b)
    assert not mla_decode.fits(*args, max_streams=b - 1)
    _check(mla_decode.mla_decode(**p, pdl=False), p)
    p["visible"][-1] = False                                            # the last stream does not see itself
    _check(mla_decode.mla_decode(**p, pdl=False), p)


@pytest.mark.gpu
def test_gpu_refuses_a_cache_too_long():
    p = _inputs(1, 8, mla_decode.MAX_POSITIONS + 8, [10], "cuda")
    assert not mla_decode.fits(*[p[k] for k in ("q", "wkv_b", "ckv", "kpe", "prefix_len", "visible")])


@pytest.mark.gpu
def test_gpu_with_pdl_in_a_replayed_graph():
    """As in the decode step: the new token's KV row is written, a GEMV launched with PDL
    (kernels.gemv: it lets its dependents in before its own wait) writes the query, and the
    kernel runs as its PDL dependent; captured once, replayed with new inputs and a longer
    prefix each time."""
    from ddbench.kernels.gemv import gemv

    p = _inputs(1, 8, 256, [100], "cuda", seed=5)
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(256, generator=g, device="cuda").bfloat16()
    wq = (torch.randn(8 * (DN + DR), 256, generator=g, device="cuda") / 16).bfloat16()
    row = torch.randn(L + DR, generator=g, device="cuda").bfloat16()
    plen = p["prefix_len"]

    def step():
        p["ckv"][0].index_copy_(0, plen.long(), row[None, :L])
        p["kpe"][0].index_copy_(0, plen.long(), row[None, L:])
        q = gemv(wq, x, pdl=True).view(1, 1, 8, DN + DR)
        return mla_decode.mla_decode(**dict(p, q=q), pdl=True), q

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, q = step()
    for _ in range(2):
        x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        row.copy_(torch.randn(row.shape, generator=g, device="cuda"))
        plen += 3
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(p["ckv"][0, plen[0]], row[:L])
        _check(out, dict(p, q=q))


@pytest.mark.gpu
def test_gpu_model_with_the_one_launch_attention_matches_three_launches(monkeypatch):
    from ddbench.engine.decode import Decoder
    from ddbench.kernels.select import KernelChoice
    from tests.test_engine import gpu_model

    # K2.6's head dims; q_lora_rank 256 so that wq_b runs on kernels.gemv at one stream, as in the step
    dims = dict(n_heads=8, q_lora_rank=256, kv_lora_rank=L, qk_nope_dim=DN, qk_rope_dim=DR, v_head_dim=DV)
    m = gpu_model(kernels=KernelChoice(attn="cluster"), **dims)         # the cluster kernel at any stream count
    calls = []
    launch = mla_decode.mla_decode
    monkeypatch.setattr(mla_decode, "mla_decode", lambda *a, **k: calls.append(1) or launch(*a, **k))
    for b in (1, 2):
        calls.clear()
        prompts = torch.randint(0, 1024, (b, 5), generator=torch.Generator().manual_seed(3))
        eager = Decoder(m, b, 32, use_graph=False).generate(prompts, 6)
        assert len(calls) == 5 * m.cfg.n_layers                           # the decode steps, not the prefill
        assert torch.equal(Decoder(m, b, 32, use_graph=True).generate(prompts, 6), eager)
    dec = Decoder(m, 2, 32, use_graph=False)
    tok = dec.prefill(prompts).view(2, 1)
    with torch.no_grad():
        args = (tok, dec.prefix_len.long().view(2, 1), dec.cache, dec.prefix_len, dec.visible)
        on = m(*args)[0]
        calls.clear()
        off = gpu_model(kernels=KernelChoice(attn="split"), **dims)(*args)[0]   # same weights, three launches
        assert not calls
    assert (on - off).abs().max() < 0.05 * off.abs().max()
    auto = gpu_model(**dims)                                            # attn=auto: at one stream only
    Decoder(auto, 2, 32, use_graph=False).generate(prompts, 3)
    assert not calls
    Decoder(auto, 1, 32, use_graph=False).generate(prompts[:1], 3)
    assert len(calls) == 2 * m.cfg.n_layers
