"""Triton MLA attention against `mla_attention_ref`: tree verify, decode and prefill masks,
different prefix lengths per stream, with and without split-K. Small latent/rope dims under
the CPU interpreter; K2.6 dims (512 + 64) and bf16 on the GPU."""
import pytest
import torch

from ddbench.kernels.mla_attn import mla_attention, mla_attention_ref, project


def tree_visible(b, t, gen, device="cpu"):
    """Ancestor-or-self masks of random trees (parent < child)."""
    vis = torch.zeros(b, t, t, dtype=torch.bool)
    for s in range(b):
        for i in range(t):
            vis[s, i, i] = True
            if i:
                vis[s, i] |= vis[s, int(torch.randint(0, i, (1,), generator=gen))]
    return vis.to(device)


def make(b, t, h, s_len, plens, dl, dr, dtype, gen, device="cpu"):
    q_lat = torch.randn(b, t, h, dl, generator=gen).to(device, dtype)
    q_rope = torch.randn(b, t, h, dr, generator=gen).to(device, dtype)
    ckv = torch.randn(b, s_len, dl, generator=gen).to(device, dtype)
    kpe = torch.randn(b, s_len, dr, generator=gen).to(device, dtype)
    return q_lat, q_rope, ckv, kpe, torch.tensor(plens, device=device)


ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}

CASES = [  # streams, new tokens, heads, cache len, prefix per stream, splits (None = heuristic)
    (3, 6, 2, 96, [7, 0, 80], None),
    (3, 6, 2, 96, [7, 0, 80], 1),          # one split: normalized output written directly
    (2, 9, 4, 70, [61, 25], 5),            # splits smaller than the tree region
    (2, 1, 8, 80, [79, 33], None),         # decode
    (2, 3, 2, 160, [150, 40], 10),         # more splits than one combine load holds
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=[f"b{c[0]}t{c[1]}h{c[2]}s{c[3]}ns{c[5]}" for c in CASES])
def test_tree_attention_equals_reference(case, dtype):
    b, t, h, s_len, plens, ns = case
    gen = torch.Generator().manual_seed(sum(plens) + t)
    q_lat, q_rope, ckv, kpe, plen = make(b, t, h, s_len, plens, 64, 16, dtype, gen)
    vis = tree_visible(b, t, gen)
    ref = mla_attention_ref(q_lat, q_rope, ckv, kpe, plen, vis, 0.125)
    out = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, 0.125, num_splits=ns, block_n=16)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=ATOL[dtype])


def test_prefill_causal_and_strided_queries():
    """Causal visibility (prefill), prefix 0 for one stream, q views with non-packed strides."""
    gen = torch.Generator().manual_seed(9)
    b, t, h = 2, 20, 2
    qkv = torch.randn(b, t, h, 64 + 16 + 8, generator=gen)
    q_lat, q_rope = qkv[..., :64], qkv[..., 64:80]                 # strided views
    ckv = torch.randn(b, 40, 64, generator=gen)
    kpe = torch.randn(b, 40, 16, generator=gen)
    plen = torch.tensor([0, 17])
    vis = torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, t, t)
    ref = mla_attention_ref(q_lat, q_rope, ckv, kpe, plen, vis, 0.2)
    for ns in (None, 3):
        out = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, 0.2, num_splits=ns, block_n=16)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_ignores_cache_past_the_new_tokens():
    """Garbage (huge values) beyond prefix+T must not leak into the result."""
    gen = torch.Generator().manual_seed(1)
    q_lat, q_rope, ckv, kpe, plen = make(2, 3, 2, 64, [10, 30], 32, 8, torch.float32, gen)
    ckv[0, 13:] = 1e4
    ckv[1, 33:] = float("nan")
    vis = tree_visible(2, 3, gen)
    out = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, 0.1, num_splits=4, block_n=16)
    assert torch.isfinite(out).all()
    ck, kp = ckv.clone(), kpe.clone()
    ck[0, 13:], ck[1, 33:] = 0, 0
    ref = mla_attention_ref(q_lat, q_rope, ck, kp, plen, vis, 0.1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


WORK_CASES = [  # streams, new tokens, heads, cache len S, prefix per stream, knobs
    (1, 1, 4, 300, [250], dict(min_chunk=16)),                      # one stream, many chunks
    (5, 1, 2, 400, [3, 390, 0, 64, 150], dict(min_chunk=16)),        # S >> most prefixes, B not 2^k
    (5, 3, 2, 400, [3, 390, 0, 64, 150], dict(min_chunk=16, waves=9.0)),  # > BLOCK_S chunks to merge
    (4, 2, 4, 512, [40, 7, 33, 20], {}),                             # default heuristic, S >> live
    (3, 1, 2, 256, [200, 10, 120], dict(num_splits=4, block_n=16)),
]


@pytest.mark.parametrize("case", WORK_CASES, ids=[f"b{c[0]}t{c[1]}s{c[3]}-{i}" for i, c in enumerate(WORK_CASES)])
def test_work_split_by_live_length(case):
    """Chunks come from the live lengths (prefix + T) on the device, not from the cache
    capacity S: long and short streams side by side, streams with no prefix, S far past
    every live length, more chunks than one combine load holds."""
    b, t, h, s_len, plens, kw = case
    gen = torch.Generator().manual_seed(s_len + b + t)
    q_lat, q_rope, ckv, kpe, plen = make(b, t, h, s_len, plens, 32, 8, torch.float32, gen)
    vis = tree_visible(b, t, gen)
    for x, p in zip(ckv, plens):
        x[p + t:] = float("nan")                       # past the live KV: must never be read
    ref = mla_attention_ref(q_lat, q_rope, torch.nan_to_num(ckv), kpe, plen, vis, 0.15)
    out = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, 0.15, block_n=kw.pop("block_n", 16), **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cap", [0, 2])
def test_chunk_cap_per_stream(cap):
    """max_chunks caps the chunks of the longest stream (2: chunks grow to half of it), or
    not at all (0); a short stream beside it still attends to its own KV only."""
    gen = torch.Generator().manual_seed(17 + cap)
    q_lat, q_rope, ckv, kpe, plen = make(2, 1, 2, 400, [300, 20], 32, 8, torch.float32, gen)
    vis = tree_visible(2, 1, gen)
    ref = mla_attention_ref(q_lat, q_rope, ckv, kpe, plen, vis, 0.15)
    out = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, 0.15, block_n=16, min_chunk=16, max_chunks=cap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def value_proj(h, dv, dl, dtype, gen, device="cpu"):
    """Each head's value rows `[H, Dv, L]` as the model passes them: a strided view of wkv_b."""
    wkv_b = torch.randn(h, 2 * dv, dl, generator=gen).to(device, dtype) * dl ** -0.5
    return wkv_b[:, dv:]


@pytest.mark.parametrize("t,splits", [(1, None), (3, None), (20, None), (1, 1)])
def test_value_projection(t, splits):
    """out_proj: decode-size calls with a merge do the product in the merge launch, the others
    after the attention; both equal the reference's projected output and the projection
    of the unprojected output."""
    gen = torch.Generator().manual_seed(40 + t)
    b, h, dv = 2, 4, 32
    q_lat, q_rope, ckv, kpe, plen = make(b, t, h, 120, [79, 33], 64, 16, torch.float32, gen)
    vis = tree_visible(b, t, gen)
    wv = value_proj(h, dv, 64, torch.float32, gen)
    ref = mla_attention_ref(q_lat, q_rope, ckv, kpe, plen, vis, 0.125, out_proj=wv)
    out = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, 0.125, block_n=16, num_splits=splits, out_proj=wv)
    assert out.shape == (b, t, h, dv)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    plain = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, 0.125, block_n=16, num_splits=splits)
    torch.testing.assert_close(out, project(plain, wv), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2])
def test_gpu_value_projection_k26(t):
    """K2.6 dims, bf16, 10 streams of up to 8k cached positions: the merge with the value
    projection (eager and in a CUDA graph with PDL) equals the reference."""
    gen = torch.Generator().manual_seed(50 + t)
    b, h = 10, 8
    plens = torch.randint(1, 8192, (b,), generator=gen).tolist()
    q_lat, q_rope, ckv, kpe, plen = make(b, t, h, 8192 + 2, plens, 512, 64, torch.bfloat16, gen, "cuda")
    vis = tree_visible(b, t, gen, "cuda")
    wv = value_proj(h, 128, 512, torch.bfloat16, gen, "cuda")
    scale = 192 ** -0.5
    ref = mla_attention_ref(q_lat, q_rope, ckv, kpe, plen, vis, scale, out_proj=wv)
    out = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, scale, out_proj=wv)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, scale, out_proj=wv, use_pdl=True)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp16: interpreter tests
@pytest.mark.parametrize("t,h", [(1, 8), (17, 8), (65, 8), (1, 64), (33, 64)])
def test_gpu_k26_dims(t, h, dtype):
    gen = torch.Generator().manual_seed(t * h)
    b, s_len = 10, 8192 + 65
    plens = torch.randint(1, 8192, (b,), generator=gen).tolist()
    q_lat, q_rope, ckv, kpe, plen = make(b, t, h, s_len, plens, 512, 64, dtype, gen, "cuda")
    vis = tree_visible(b, t, gen, "cuda")
    scale = 192 ** -0.5
    ref = mla_attention_ref(q_lat, q_rope, ckv, kpe, plen, vis, scale)
    out = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.gpu
def test_gpu_graph_replay_follows_prefix_len():
    """Captured once in a CUDA graph with the cache allocated far past the live lengths (as
    the engine does), then replayed after prefix_len changes: the split is re-derived on
    the device each replay and the output matches the reference."""
    gen = torch.Generator().manual_seed(5)
    b, t, h, s_len = 10, 1, 8, 32768 + 64
    q_lat, q_rope, ckv, kpe, plen = make(b, t, h, s_len, [100] * b, 512, 64, torch.bfloat16, gen, "cuda")
    vis = torch.ones(b, t, t, dtype=torch.bool, device="cuda")
    scale = 192 ** -0.5
    out = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, scale)       # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, scale)
    for plens in ([100] * b, torch.randint(1, 32768, (b,), generator=gen).tolist(), [8192] * b):
        plen.copy_(torch.tensor(plens))
        g.replay()
        ref = mla_attention_ref(q_lat, q_rope, ckv, kpe, plen, vis, scale)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("use_pdl", [False, True])
def test_gpu_pdl_on_and_off_equal_reference(use_pdl):
    """Split and merge launched with and without programmatic dependent launch, eager and
    captured in a CUDA graph, equal the reference."""
    gen = torch.Generator().manual_seed(8)
    b, t, h = 10, 1, 8
    plens = torch.randint(1, 8192, (b,), generator=gen).tolist()
    q_lat, q_rope, ckv, kpe, plen = make(b, t, h, 8192 + 1, plens, 512, 64, torch.bfloat16, gen, "cuda")
    vis = torch.ones(b, t, t, dtype=torch.bool, device="cuda")
    scale = 192 ** -0.5
    ref = mla_attention_ref(q_lat, q_rope, ckv, kpe, plen, vis, scale)
    out = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, scale, use_pdl=use_pdl)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = mla_attention(q_lat, q_rope, ckv, kpe, plen, vis, scale, use_pdl=use_pdl)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
