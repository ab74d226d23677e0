"""ddbench.kernels.pdl: the decode chain launched with programmatic dependent launch gives the same
bits as launched without it (a kernel that read its input before its predecessor finished
would not), eagerly and replayed in a CUDA graph, at K2.6 TP-8 shapes; the same for the CUDA Marlin MoE's launches."""
import pytest
import torch

from ddbench.engine.config import preset
from ddbench.kernels import fused_ops, pdl, skinny
from ddbench.kernels.moe import fused_moe, random_marlin_moe


def test_pdl_is_off_for_cpu_tensors():
    x = torch.randn(1, 64)
    assert pdl.on(x) == 0 and pdl.on(x, 1) == 0 and pdl.on(x, 0) == 0
    assert pdl.args(0) == {"PDL": 0} and pdl.args(2) == {"PDL": 2, "launch_pdl": True}
    with pytest.raises(ValueError, match="PDL mode"):
        pdl.on(x, 3)


def _chain(x, res, p, cfg, mode):
    """One MoE layer's few-row chain, launched in PDL mode `mode`: norm + wide GEMM, norm +
    router, route, the CUDA-core MoE (w13, SiLU*up in fp16, w2 with the k rows unsummed;
    kernels.moe's own launches take the default mode), shared expert with the k-sum."""
    qkv, h, _, _ = skinny.norm_linear(x, p["n1"], 1e-6, p["wa"], res, pdl_mode=mode)    # [1, 2112]
    a = skinny.skinny_linear(qkv[:, :1024], p["wo"], pdl_mode=mode)                     # N > K: [1, H]
    logits, h, xf, xh = skinny.norm_linear(a, p["n2"], 1e-6, p["gate"], h, out_xn=True, out_xh=True, pdl_mode=mode)
    ids, w = fused_ops.route(logits, p["bias"], cfg.top_k, 2.5, pdl_mode=mode)
    rows = fused_moe(xf, ids, w, p["moe"], "triton", x_half=xh, sum_k=False, kernel="gemv")  # [k, H] fp32
    act = skinny.skinny_linear(xf, p["w13"], glu=True, pdl_mode=mode)
    return skinny.skinny_linear(act, p["w2"], add=rows, add_rows=cfg.top_k, pdl_mode=mode), h


@pytest.mark.gpu
def test_gpu_pdl_chain_equals_plain_launches():
    if not pdl.on(torch.empty(1, device="cuda")):
        pytest.skip("needs sm_90+")
    cfg = preset("k2.6", tp=8)
    hid, dev, bf = cfg.hidden, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(3)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(bf)
    p = dict(n1=rnd(hid), n2=rnd(hid), wa=rnd(2112, hid, scale=hid ** -0.5), wo=rnd(hid, 1024, scale=1024 ** -0.5),
             gate=rnd(64, hid, scale=hid ** -0.5), bias=torch.randn(64, generator=g, device=dev) * 0.1,
             w13=rnd(512, hid, scale=hid ** -0.5), w2=rnd(hid, 256, scale=256 ** -0.5),
             moe=random_marlin_moe(64, hid, cfg.moe_inter_local, cfg.group_size, cfg.top_k, device=dev, seed=4))

    def layers(x, res, mode, n=6):
        for _ in range(n):
            x, res = _chain(x, res, p, cfg, mode)
        return x, res

    _same_bits_in_every_mode(layers, lambda: (rnd(1, hid), rnd(1, hid)), replays=5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [9, 90])
def test_gpu_pdl_marlin_moe_chain_equals_plain_launches(rows):
    """The CUDA Marlin MoE's three launches (plan, w13, w2) in PDL modes 2 and 1 give the bits of
    mode 0 in a chain where each layer's input comes from the launch before (norm and route
    PDL launches, the router GEMM cuBLAS, as the engine's verify), eagerly and replayed in a
    CUDA graph with new inputs."""
    if not pdl.on(torch.empty(1, device="cuda")):
        pytest.skip("needs sm_90+")
    cfg = preset("k2.6", tp=8)
    hid, dev, bf = cfg.hidden, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(5)
    n_w = torch.randn(hid, generator=g, device=dev).to(bf)
    gate = (torch.randn(64, hid, generator=g, device=dev) * hid ** -0.5).to(bf)
    bias = torch.randn(64, generator=g, device=dev) * 0.1
    moe = random_marlin_moe(64, hid, cfg.moe_inter_local, cfg.group_size, cfg.top_k, device=dev, seed=6)

    def layers(x, res, mode, n=4):
        for _ in range(n):
            xf, res = fused_ops.rms_norm(x, n_w, 1e-6, res, pdl_mode=mode)
            ids, w = fused_ops.route(xf @ gate.T, bias, cfg.top_k, 2.5, pdl_mode=mode)
            x = fused_moe(xf, ids, w, moe, "triton", kernel="marlin", pdl_mode=mode)
        return x, res

    _same_bits_in_every_mode(layers, lambda: tuple(torch.randn(rows, hid, generator=g, device=dev).to(bf)
                                                   for _ in range(2)), replays=3)


def _same_bits_in_every_mode(layers, inputs, replays):
    """layers(x, res, mode) gives mode 0's bits in PDL modes 2 and 1, eagerly, and replayed in a
    CUDA graph captured in mode 2 with new inputs (`inputs()`: (x, res)) each replay."""
    x, res = inputs()
    want = layers(x, res, 0)
    for mode in (2, 1):
        assert all(torch.equal(a, b) for a, b in zip(layers(x, res, mode), want)), f"mode {mode}"
    graph = torch.cuda.CUDAGraph()
    xs, rs = x.clone(), res.clone()
    with torch.cuda.graph(graph):
        out = layers(xs, rs, 2)
    for i in range(replays):
        xi, ri = inputs()
        want = layers(xi, ri, 0)
        xs.copy_(xi)
        rs.copy_(ri)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, want)), f"replay {i}"
