"""kernels.mla_decode (CUDA, a decode token's attention in one launch): on CPU its torch
reference against the model's own launch path (engine.model.MLA with the kernel off); on the
GPU the kernel against that reference on fresh random inputs (several prefix lengths in one
batch, the token seeing itself or not; output and the cache row it writes), with PDL in a
replayed CUDA graph after a GEMV that writes its input, and in the model (the same logits as
the launches it replaces, graph decode == eager)."""
import pytest
import torch

from engine.config import preset
from engine.model import Transformer
from engine.weights import init_random
from kernels import mla_decode

DN, DR, DV, L = mla_decode.DN, mla_decode.DR, mla_decode.DV, mla_decode.L
HEAD_DIMS = dict(kv_lora_rank=L, qk_nope_dim=DN, qk_rope_dim=DR, v_head_dim=DV)


def _inputs(b, nh, s, plens, q, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g, device=device) * scale).bfloat16()  # noqa: E731
    ang = torch.rand(b, 1, DR // 2, generator=g, device=device) * 6.3
    return dict(qkv=rnd(b, 1, q + L + DR), q_w=(1 + 0.1 * torch.randn(q, generator=g, device=device)).bfloat16(),
                kv_w=(1 + 0.1 * torch.randn(L, generator=g, device=device)).bfloat16(), cos=ang.cos(), sin=ang.sin(),
                wq_b=rnd(nh * (DN + DR), q, scale=q ** -0.5), wkv_b=rnd(nh * (DN + DV), L, scale=L ** -0.5),
                ckv=rnd(b, s, L), kpe=rnd(b, s, DR), prefix_len=torch.tensor(plens, dtype=torch.int32, device=device),
                visible=torch.ones(b, 1, 1, dtype=torch.bool, device=device), eps=1e-6, scale=(DN + DR) ** -0.5)


def test_reference_is_the_models_launch_path():
    """The model's MLA with the kernel off (mla_a_post, wq_b + rope, q absorption, attention,
    value rows, wo) gives wo(reference) and writes the same cache row."""
    cfg = preset("tiny", n_heads=4, q_lora_rank=256, **HEAD_DIMS)
    m = Transformer(cfg, device="cpu", dtype=torch.bfloat16)
    init_random(m, 0)
    attn = m.layers[1].attn
    p = _inputs(2, 4, 40, [5, 30], 256, "cpu", seed=1)
    p |= dict(q_w=attn.q_norm.weight, kv_w=attn.kv_norm.weight, wq_b=attn.wq_b.weight, wkv_b=attn.wkv_b.weight,
              eps=cfg.norm_eps, scale=cfg.softmax_scale)
    cache = m.new_cache(2, 40)
    cache.ckv[1].copy_(p["ckv"])
    cache.kpe[1].copy_(p["kpe"])
    with torch.no_grad():
        got = attn(p["qkv"], p["cos"], p["sin"], cache, p["prefix_len"], p["visible"])
        want = attn.wo(mla_decode.reference(**p).reshape(2, 1, -1))
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert torch.equal(cache.ckv[1], p["ckv"]) and torch.equal(cache.kpe[1], p["kpe"])


def test_fits_refuses_cpu_tensors():
    p = _inputs(1, 2, 16, [3], 256, "cpu")
    assert not mla_decode.fits(*[p[k] for k in ("qkv", "wq_b", "wkv_b", "ckv", "kpe", "cos", "prefix_len", "visible")])
    with pytest.raises(ValueError, match="does not take"):
        mla_decode.mla_decode(**p)


def _check(got, p, before):
    """got against the reference, run on a copy of the cache as it was (`before`), and the
    kernel's cache against the reference's."""
    ref = dict(p, ckv=before[0].clone(), kpe=before[1].clone())
    want = mla_decode.reference(**ref).float()
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert (got.float() - want).norm() < 1e-2 * want.norm(), ((got.float() - want).norm() / want.norm()).item()
    for mine, theirs in ((p["ckv"], ref["ckv"]), (p["kpe"], ref["kpe"])):
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("b,nh,s,plens,q", [(1, 8, 192, [128], 1536), (1, 8, 256, [255], 1536),
                                            (3, 8, 256, [0, 1, 100], 1536), (2, 16, 512, [7, 511], 512),
                                            (4, 2, 64, [9, 31, 32, 63], 256)])
def test_gpu_matches_reference(b, nh, s, plens, q, monkeypatch):
    monkeypatch.setattr(mla_decode, "MAX_STREAMS", 4)
    p = _inputs(b, nh, s, plens, q, "cuda", seed=s + b)
    assert mla_decode.fits(*[p[k] for k in ("qkv", "wq_b", "wkv_b", "ckv", "kpe", "cos", "prefix_len", "visible")])
    before = p["ckv"].clone(), p["kpe"].clone()
    _check(mla_decode.mla_decode(**p, pdl=False), p, before)
    p["visible"][-1] = False                                            # the last stream does not see itself
    _check(mla_decode.mla_decode(**p, pdl=False), p, before)


@pytest.mark.gpu
def test_gpu_refuses_a_cache_too_long():
    p = _inputs(1, 8, mla_decode.MAX_POSITIONS + 8, [10], 1536, "cuda")
    assert not mla_decode.fits(*[p[k] for k in ("qkv", "wq_b", "wkv_b", "ckv", "kpe", "cos", "prefix_len", "visible")])


@pytest.mark.gpu
def test_gpu_with_pdl_in_a_replayed_graph():
    """As in the decode step: a GEMV launched with PDL (kernels.gemv, which lets its dependents
    in before its own wait) writes the kernel's input row, and the kernel runs as its PDL
    dependent; captured once, replayed with new inputs and a longer prefix each time."""
    from kernels.gemv import gemv

    p = _inputs(1, 8, 256, [100], 1536, "cuda", seed=5)
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(1024, generator=g, device="cuda").bfloat16()
    wa = (torch.randn(1536 + L + DR, 1024, generator=g, device="cuda") / 32).bfloat16()

    def step():
        qkv = gemv(wa, x, pdl=True).view(1, 1, -1)
        return mla_decode.mla_decode(**dict(p, qkv=qkv), pdl=True), qkv

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, qkv = step()
    for _ in range(2):
        x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        p["prefix_len"] += 3
        before = p["ckv"].clone(), p["kpe"].clone()
        graph.replay()
        torch.cuda.synchronize()
        _check(out, dict(p, qkv=qkv), before)


@pytest.mark.gpu
def test_gpu_model_with_the_one_launch_attention_matches_the_launches(monkeypatch):
    from engine.decode import Decoder
    from tests.test_engine import gpu_model

    monkeypatch.setattr(mla_decode, "MAX_STREAMS", 2)
    # K2.6's head dims; q_lora_rank 256 so that wq_b runs on kernels.gemv at one stream, as in the step
    m = gpu_model(n_heads=8, q_lora_rank=256, **HEAD_DIMS)
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
        monkeypatch.setattr(mla_decode, "ENABLED", False)
        off = m(*args)[0]
    assert (on - off).abs().max() < 0.05 * off.abs().max()
