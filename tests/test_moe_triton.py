"""Triton INT4 MoE (kernels.moe_triton) against the torch reference, under the interpreter on CPU."""
import dataclasses

import pytest
import torch

from ddbench.engine.config import preset
from ddbench.kernels.moe import fused_moe_ref, random_marlin_moe, synthetic_routing
from ddbench.kernels.device import sm_count
from ddbench.kernels.moe_align import align_tokens
from ddbench.kernels.moe_triton import MoeTritonConfig, check_inputs, default_config, fused_moe_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_weights(tp: int, seed: int = 0):
    cfg = preset("tiny", tp=tp)
    return cfg, random_marlin_moe(cfg.n_experts, cfg.hidden, cfg.moe_inter_local, cfg.group_size,
                                  cfg.top_k, device=DEV, seed=seed)


def rel_err(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("tp,tokens,routing,dtype", [
    (8, 1, "uniform", torch.float16),
    (8, 7, "skewed", torch.float32),
    (8, 40, "balanced", torch.float16),
    (8, 48, "uniform", torch.float32),      # 12 tokens a expert: the tl.dot kernel
    (1, 3, "uniform", torch.float16),
    pytest.param(1, 19, "skewed", torch.float32, marks=pytest.mark.slow),
])
def test_triton_matches_reference(tp, tokens, routing, dtype):
    cfg, w = tiny_weights(tp, seed=tokens)
    x = torch.randn(tokens, cfg.hidden, device=DEV).to(dtype)
    ids, tw = synthetic_routing(routing, tokens, cfg.n_experts, cfg.top_k, device=DEV, seed=tokens + 1)
    ref = fused_moe_ref(x.float(), ids, tw, w)
    y = fused_moe_triton(x, ids, tw, w)
    assert y.shape == ref.shape and y.dtype == dtype
    # the CUDA-core path multiplies fp16 activations whatever x's dtype (kernels.moe_gemv)
    gemv = default_config(tokens, cfg.top_k, cfg.n_experts, w.inter, w.hidden).gemv
    assert rel_err(y, ref) < (1e-5 if dtype == torch.float32 and not gemv else 2e-3)


@pytest.mark.parametrize("mcfg", [
    MoeTritonConfig(block_m=32, block_n13=32, block_n2=64, split_k=3),       # fp32 atomics + SiLU in w2's load
    MoeTritonConfig(block_m=16, block_n13=32, block_n2=128, atomic_out=True),  # sum over k by atomics
    MoeTritonConfig(block_m=16, block_n13=32, block_n2=64, acc_scale=True),    # 32-row steps, scales on products
    MoeTritonConfig(block_m=16, block_n13=32, block_n2=64, block_k13=64, block_k2=256),
    MoeTritonConfig(block_m=16, block_n13=32, block_n2=64, block_k13=128, join=True),  # words loaded once
    MoeTritonConfig(block_m=16, block_n13=32, block_n2=64, join=True, acc_scale=True, split_k=2),
])
def test_triton_config_variants(mcfg):
    cfg, w = tiny_weights(8, seed=3)
    x = torch.randn(9, cfg.hidden, device=DEV, dtype=torch.float16)
    ids, tw = synthetic_routing("uniform", 9, cfg.n_experts, cfg.top_k, device=DEV, seed=4)
    assert rel_err(fused_moe_triton(x, ids, tw, w, mcfg), fused_moe_ref(x.float(), ids, tw, w)) < 2e-3


@pytest.mark.parametrize("tp,tokens,mcfg", [
    (8, 1, MoeTritonConfig(gemv=True, block_m=1, block_n13=64, block_n2=64, split_k=0)),
    (8, 6, MoeTritonConfig(gemv=True, block_m=1, block_n13=64, block_n2=128, split_k=3)),  # ragged last split
    (8, 11, MoeTritonConfig(gemv=True, block_m=4, block_n13=64, block_n2=64, split_k=2)),
    (2, 4, MoeTritonConfig(gemv=True, block_m=2, block_n13=128, block_n2=64, split_k=0)),  # w2 K = I = 128: 4 groups
])
def test_gemv_matches_reference(tp, tokens, mcfg):
    """CUDA-core path (kernels.moe_gemv): direct (block_m 1) and sorted rows, K splits,
    grouped and per-channel scales (tiny tp8's w2 has K = I = the group size)."""
    cfg, w = tiny_weights(tp, seed=10 + tokens)
    x = torch.randn(tokens, cfg.hidden, device=DEV, dtype=torch.float16)
    ids, tw = synthetic_routing("skewed", tokens, cfg.n_experts, cfg.top_k, device=DEV, seed=tokens)
    y = fused_moe_triton(x, ids, tw, w, mcfg)
    assert y.dtype == x.dtype and rel_err(y, fused_moe_ref(x.float(), ids, tw, w)) < 2e-3


def test_gemv_half_rows():
    """half_rows: x cast to fp16 in its natural order; the gated form is SiLU(sum gate) *
    sum up * weight over the K splits of w13's partials, in fp16."""
    from ddbench.kernels.moe_gemv import half_rows
    x = torch.randn(3, 64, device=DEV)
    assert torch.equal(half_rows(x), x.half())
    part = torch.randn(2, 3, 128, device=DEV)                  # [S, rows, 2K]
    tw = torch.rand(3, device=DEV)
    g, u = part.sum(0).split(64, -1)
    want = (torch.nn.functional.silu(g) * u * tw[:, None]).half()
    torch.testing.assert_close(half_rows(part, tw, 2), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("seed", [1, 2])
def test_fused_moe_gemv_options_x_half_and_rows(seed):
    """fused_moe's CUDA-core options: a pre-permuted x (as the fused router GEMM writes it) and
    the unsummed k rows give the default call's result; sum_k=False off that path is an error."""
    from ddbench.kernels.moe import fused_moe, uses_gemv
    from ddbench.kernels.moe_gemv import half_rows

    tokens = 1   # 4 of 16 experts: the CUDA-core path
    cfg, w = tiny_weights(8, seed=20 + seed)
    x = torch.randn(tokens, cfg.hidden, device=DEV, dtype=torch.float16)
    ids, tw = synthetic_routing("uniform", tokens, cfg.n_experts, cfg.top_k, device=DEV, seed=seed)
    assert uses_gemv(tokens, cfg.top_k, w, x.device)
    want = fused_moe(x, ids, tw, w, "triton")
    got = fused_moe(x, ids, tw, w, "triton", x_half=half_rows(x))
    assert torch.equal(got, want)
    rows = fused_moe(x, ids, tw, w, "triton", x_half=half_rows(x), sum_k=False)
    assert rows.shape == (tokens * cfg.top_k, cfg.hidden) and rows.dtype == torch.float32
    torch.testing.assert_close(rows.view(tokens, cfg.top_k, -1).sum(1).to(x.dtype), want, atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="sum_k"):
        fused_moe(x, ids, tw, w, "torch", sum_k=False)


def _counters_zero(x: torch.Tensor) -> bool:
    """Whether the "moe_act" ticket counters of x's device are all zero."""
    from ddbench.kernels import ticket
    return not ticket.counters(x.device, "moe_act", ticket.MAX_COUNTERS).any()


@pytest.mark.parametrize("tp,tokens,bn13,split,act_block,dtype,seed", [
    (8, 1, 64, 0, 512, torch.float16, 0),    # decode: one column tile, one split
    (8, 3, 64, 2, 512, torch.float32, 1),    # 2 splits
    (2, 1, 64, 3, 32, torch.float16, 2),     # 4 column tiles x 3 splits (ragged) per assignment; I = 128 in 4 steps
])
def test_gemv_fused_act_equals_unfused(monkeypatch, tp, tokens, bn13, split, act_block, dtype, seed):
    """block_m 1 with FUSE_ACT: w13's last program per assignment writes exactly the act
    `half_rows(partials, weights, S)` writes, so the MoE output is bit-identical to the
    unfused launches; both match the reference; the ticket counters are zero again after."""
    from ddbench.kernels import moe_gemv as mg

    monkeypatch.setattr(mg, "ACT_BLOCK", act_block)
    cfg, w = tiny_weights(tp, seed=30 + seed)
    x = torch.randn(tokens, cfg.hidden, device=DEV).to(dtype)
    ids, tw = synthetic_routing("skewed", tokens, cfg.n_experts, cfg.top_k, device=DEV, seed=seed)
    mcfg = MoeTritonConfig(gemv=True, block_m=1, block_n13=bn13, block_n2=64, split_k=split)
    act = mg.gemv_w13(x, ids, None, w, mcfg, topk_weights=tw)
    fused = mg.fused_moe_gemv(x, ids, tw, w, mcfg)
    assert _counters_zero(x)
    unfused_cfg = dataclasses.replace(mcfg, fuse_act=False)
    part = mg.gemv_w13(x, ids, None, w, unfused_cfg, topk_weights=tw)
    assert part.dim() == 3 and act.shape == (tokens * cfg.top_k, cfg.moe_inter_local)
    assert torch.equal(act, mg.half_rows(part, tw.reshape(-1).float(), part.shape[0]))
    unfused = mg.fused_moe_gemv(x, ids, tw, w, unfused_cfg)
    assert torch.equal(fused, unfused)
    assert rel_err(fused, fused_moe_ref(x.float(), ids, tw, w)) < 2e-3   # fp16 activations, whatever x's dtype


def test_default_config_blocks_rows_of_a_stream():
    """Several tokens a stream (a tree verify): sorted blocks on the CUDA-core path by
    STREAM_TILES up to its last bound (0.3 a expert), TILE_TABLE beyond; one token a stream
    (decode) keeps TILE_TABLE's one row a block there; both sort into 16-row blocks up to
    10.7 a expert (T = 512 at K2.6) and take the tl.dot kernel above."""
    from ddbench.kernels import moe_triton as mt

    cfg = preset("k2.6", tp=8)
    shape = (cfg.top_k, cfg.n_experts, cfg.moe_inter_local, cfg.hidden)
    assert mt.default_config(9, *shape).block_m == 1
    assert mt.default_config(1, *shape).block_n13 == 512 and mt.default_config(10, *shape).block_n13 == 256
    tree = mt.default_config(9, *shape, stream_rows=9)
    assert tree.gemv and tree.block_m == mt.STREAM_TILES[0][1] > 1
    for tokens in (16, 90, 512):
        for rows in (1, 9):
            c = mt.default_config(tokens, *shape, stream_rows=rows)
            assert c.gemv and c.block_m == 16 and c.block_n13 == c.block_n2 == 256, (tokens, rows)
    assert not mt.default_config(520, *shape).gemv             # 10.8 a expert
    assert not mt.default_config(1000, *shape, stream_rows=100).gemv


def test_default_config_picks_gemv_for_few_tokens():
    cfg = preset("k2.6", tp=8)
    small = default_config(1, cfg.top_k, cfg.n_experts, cfg.moe_inter_local, cfg.hidden)
    large = default_config(4096, cfg.top_k, cfg.n_experts, cfg.moe_inter_local, cfg.hidden)
    assert small.gemv and not large.gemv
    assert (2 * cfg.moe_inter_local) % small.block_n13 == 0 and cfg.hidden % small.block_n2 == 0


def test_align_tokens_sorts_and_pads():
    torch.manual_seed(0)
    e, k, t, bm = 12, 3, 21, 16
    ids, _ = synthetic_routing("skewed", t, e, k, device=DEV, seed=5, hot=2, hot_share=0.6)
    sorted_ids, block_expert, expert_start, counts = [v.cpu() for v in align_tokens(ids, e, bm)]
    flat = ids.reshape(-1).cpu().long()
    assert torch.equal(counts, torch.bincount(flat, minlength=e).int())
    padded = (counts + bm - 1) // bm * bm
    assert torch.equal(expert_start, torch.cumsum(padded, 0).int() - padded)
    seen = []
    for ex in range(e):
        rows = sorted_ids[expert_start[ex]: expert_start[ex] + counts[ex]]
        assert bool((flat[rows.long()] == ex).all())
        seen += rows.tolist()
        for b in range(int(expert_start[ex]) // bm, int(expert_start[ex] + padded[ex]) // bm):
            assert block_expert[b] == ex
    assert sorted(seen) == list(range(t * k))
    assert bool((block_expert[int(padded.sum()) // bm:] == -1).all())


@pytest.mark.parametrize("change,message", [
    (dict(block_m=24), "block_m"),
    (dict(block_n13=48), "block_n13"),
    (dict(block_n13=32, block_n2=512), "block_n2"),
    (dict(block_n13=32, block_k13=96), "block_k13"),
    (dict(gemv=True, block_m=3), "block_m"),
    (dict(gemv=True, block_m=1, block_n13=32), "block_n13"),
])
def test_check_inputs_rejects_bad_tiles(change, message):
    cfg, w = tiny_weights(8)
    x = torch.randn(2, cfg.hidden)
    ids, tw = synthetic_routing("uniform", 2, cfg.n_experts, cfg.top_k)
    with pytest.raises(ValueError, match=message):
        check_inputs(x, ids, tw, w, MoeTritonConfig(**change))
    with pytest.raises(ValueError, match="x must be"):
        check_inputs(x[:, :128], ids, tw, w, MoeTritonConfig())


# ---------------------------------------------------------------- GPU: bf16 at K2.6 shapes

@pytest.mark.gpu
@pytest.mark.parametrize("tp,tokens", [(8, 1), (8, 16), (8, 300), (1, 5)])
def test_triton_bf16_k26_shapes(tp, tokens):
    cfg = preset("k2.6", tp=tp)
    n_exp = 32  # K2.6 expert shapes, fewer experts to keep the reference quick
    w = random_marlin_moe(n_exp, cfg.hidden, cfg.moe_inter_local, cfg.group_size, cfg.top_k, device="cuda")
    x = torch.randn(tokens, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    ids, tw = synthetic_routing("uniform", tokens, n_exp, cfg.top_k, device="cuda", seed=1)
    ref = fused_moe_ref(x.float(), ids, tw, w)
    assert rel_err(fused_moe_triton(x, ids, tw, w), ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,bm", [(1, 1), (16, 1), (40, 2), (100, 4)])
def test_gemv_bf16_k26_shapes(tokens, bm):
    cfg = preset("k2.6", tp=8)
    w = random_marlin_moe(32, cfg.hidden, cfg.moe_inter_local, cfg.group_size, cfg.top_k, device="cuda")
    x = torch.randn(tokens, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    ids, tw = synthetic_routing("uniform", tokens, 32, cfg.top_k, device="cuda", seed=5)
    mcfg = MoeTritonConfig(gemv=True, block_m=bm, block_n13=128, block_n2=128, split_k=0)
    y = fused_moe_triton(x, ids, tw, w, mcfg)
    assert rel_err(y, fused_moe_ref(x.float(), ids, tw, w)) < 1e-2
    assert torch.equal(y, fused_moe_triton(x, ids, tw, w, mcfg))   # no atomics: repeatable


@pytest.mark.gpu
@pytest.mark.parametrize("change", [dict(join=True), dict(acc_scale=True), dict(atomic_out=True), dict(split_k=4)])
def test_triton_bf16_variants(change):
    cfg = preset("k2.6", tp=8)
    w = random_marlin_moe(32, cfg.hidden, cfg.moe_inter_local, cfg.group_size, cfg.top_k, device="cuda")
    x = torch.randn(20, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    ids, tw = synthetic_routing("skewed", 20, 32, cfg.top_k, device="cuda", seed=3)
    mcfg = MoeTritonConfig(block_m=16, block_k13=64, block_k2=64, **change)
    assert rel_err(fused_moe_triton(x, ids, tw, w, mcfg), fused_moe_ref(x.float(), ids, tw, w)) < 1e-2


@pytest.mark.gpu
def test_triton_cuda_graph_capture():
    cfg = preset("k2.6", tp=8)
    w = random_marlin_moe(64, cfg.hidden, cfg.moe_inter_local, cfg.group_size, cfg.top_k, device="cuda")
    x = torch.randn(4, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    ids, tw = synthetic_routing("uniform", 4, 64, cfg.top_k, device="cuda", seed=2)
    want = fused_moe_triton(x, ids, tw, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_moe_triton(x, ids, tw, w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused_moe_triton(x, ids, tw, w)
    ids.copy_(torch.flip(ids, [0]))  # new routing, same buffers: the graph must follow it
    tw.copy_(torch.flip(tw, [0]))
    x.copy_(torch.flip(x, [0]))
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out.float(), torch.flip(want, [0]).float(), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gemv_fused_act_bf16_k26_graph():
    """K2.6 TP-8 shapes, bf16, block_m 1 (T = 1, 16): w13 with the act fused gives the bits of
    the unfused launches, eagerly and in a CUDA graph replayed 3 times on new inputs; the
    ticket counters are zero after each."""
    from ddbench.kernels import moe_gemv as mg
    from ddbench.kernels.moe_triton import default_config

    cfg = preset("k2.6", tp=8)
    w = random_marlin_moe(32, cfg.hidden, cfg.moe_inter_local, cfg.group_size, cfg.top_k, device="cuda")
    for tokens in (1, 16):
        mcfg = MoeTritonConfig(gemv=True, block_m=1, block_n13=256, block_n2=256, split_k=0)
        x = torch.randn(tokens, cfg.hidden, device="cuda", dtype=torch.bfloat16)
        ids, tw = synthetic_routing("uniform", tokens, 32, cfg.top_k, device="cuda", seed=tokens)

        def run(fuse):
            return mg.fused_moe_gemv(x, ids, tw, w, dataclasses.replace(mcfg, fuse_act=fuse), sm_count(x.device))

        want = run(False)
        assert rel_err(want, fused_moe_ref(x.float(), ids, tw, w)) < 1e-2
        assert torch.equal(run(True), want) and _counters_zero(x)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run(True)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = run(True)
        for rep in range(3):
            x.copy_(torch.randn_like(x))
            new_ids, new_tw = synthetic_routing("uniform", tokens, 32, cfg.top_k, device="cuda", seed=100 + rep)
            ids.copy_(new_ids)
            tw.copy_(new_tw)
            g.replay()
            torch.cuda.synchronize()
            assert _counters_zero(x)
            assert torch.equal(out, run(False)), (tokens, rep)
    assert default_config(1, cfg.top_k, cfg.n_experts, cfg.moe_inter_local, cfg.hidden).block_m == 1


@pytest.mark.gpu
@pytest.mark.parametrize("name,tp,tokens,bm,bn", [
    ("tiny", 8, 5, 2, 64),        # per-channel w2 scales (K = group), one Marlin block a tile
    ("tiny", 1, 9, 8, 128),
    ("k2.6", 8, 9, 4, 256),
    ("k2.6", 8, 13, 2, 256),
    ("k2.6", 8, 30, 4, 128),
    ("k2.6", 8, 60, 8, 256),
    ("k2.6", 8, 60, 16, 128),     # rows g + 8 of each lane too
])
def test_gemv_tensor_cores_match_reference(name, tp, tokens, bm, bn):
    """The gemv's tensor-core loop (kernels.moe_gemv `_mma_loop`, sorted row blocks) against
    the reference and against its packed fp16 loop, 2-16 rows a block, 1-4 warps (BN 64-256),
    grouped and per-channel scales."""
    from ddbench.kernels import moe_gemv as mg

    cfg = preset(name, tp=tp)
    n_exp = min(32, cfg.n_experts)
    w = random_marlin_moe(n_exp, cfg.hidden, cfg.moe_inter_local, cfg.group_size, cfg.top_k, device="cuda",
                          seed=tokens)
    x = torch.randn(tokens, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    ids, tw = synthetic_routing("skewed", tokens, n_exp, cfg.top_k, device="cuda", seed=tokens)
    mcfg = MoeTritonConfig(gemv=True, block_m=bm, block_n13=bn, block_n2=bn, split_k=0)
    ref = fused_moe_ref(x.float(), ids, tw, w)
    y = fused_moe_triton(x, ids, tw, w, mcfg)
    y_cores = fused_moe_triton(x, ids, tw, w, dataclasses.replace(mcfg, mma=False))
    assert rel_err(y, ref) < 2e-3 and rel_err(y_cores, ref) < 2e-3
