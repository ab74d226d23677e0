"""experiments.moe_wgmma: its fragment and swizzle mappings, its shared-memory budget and the whole
kernel emulated on the CPU (every producer copy, consumer read and epilogue index of
moe_wgmma.cu mirrored, with PTX's A-fragment, 128-byte-swizzle and accumulator layouts), against
the fp32 reference; the sm_90a compile is in test_compile.py; on an H100/H200 the CUDA kernels
against the fp32 reference, run to run and in CUDA graphs."""
import pytest
import torch

from ddbench.kernels import marlin
from ddbench.kernels.moe import ROUTINGS, fused_moe_ref, random_marlin_moe, random_router, route, synthetic_routing
from experiments import moe_wgmma as mg


@pytest.mark.parametrize("seed", [0, 1])
def test_a_fragment_is_the_tile_transposed(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (32, 128), generator=g)                    # [K, N]
    packed = marlin.pack(q)
    for kt in range(2):
        for nb in range(2):
            for tile in range(4):
                words = packed[kt, nb * 128 + torch.arange(32) * 4 + tile]
                want = q[16 * kt:16 * kt + 16, 64 * nb + 16 * tile:64 * nb + 16 * tile + 16].T
                assert torch.equal(mg.a_fragment(words), want.long())


def test_b_offset_is_the_128_byte_swizzle():
    seen = set()
    for row in range(128):
        for k in range(64):
            plain = row * 128 + 2 * k
            off = mg.b_offset(row, k)
            assert off == plain ^ (((plain >> 7) & 7) << 4)                 # address bits 4-6 ^= bits 7-9
            assert row * 128 <= off < row * 128 + 128
            seen.add(off)
    assert len(seen) == 128 * 64


def test_shared_memory_and_sizes():
    assert mg.shared_bytes(4) == 1024 + 4 * 21504 + 32768 + 32768 + 2048 + 64
    assert mg.shared_bytes(8, (16, 32, 48)) == 1024 + 8 * (6144 + 5120) + 12288 + 12288 + 768 + 128
    for ch in range(16, 129, 16):
        assert mg.stage_bytes(ch) % 1024 == 0                           # every slot's token tile 1024-aligned
    mg.check_config(7, mg.SIZES)
    mg.check_config(12, (16, 32, 48))
    for stages, sizes in [(8, mg.SIZES), (1, mg.SIZES), (4, (48, 96)), (4, (40, 96, 128)), (4, (96, 48, 128)),
                          (4, (48, 96, 144))]:
        with pytest.raises(ValueError):
            mg.check_config(stages, sizes)


# ---------------------------------------------------------------- GPU (sm_90 only: wgmma)

@pytest.fixture(scope="module")
def k26():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    return random_marlin_moe(384, 7168, 256, 32, top_k=8, device=torch.device("cuda"), seed=5)


def _case(routing, tokens, w, seed):
    """tests/moe_cases.moe_case's inputs (not imported: `tests` is no package, and a GPU image's
    site-packages may hold one of that name)."""
    dev = torch.device("cuda")
    x = torch.randn(tokens, w.hidden, device=dev, generator=torch.Generator(dev).manual_seed(seed)).bfloat16()
    if routing == "router":
        gw, bias = random_router(w.hidden, w.n_experts, device=dev, seed=seed)
        return (x, *route(x, gw, bias, 8, 2.5))
    return (x, *synthetic_routing(routing, tokens, w.n_experts, 8, device=dev, seed=seed))


def _err(y, want):
    return ((y.float() - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", [1, 33, 512, 1024, 4096])
def test_wgmma_matches_reference(k26, routing, tokens):
    """Blocks of every default N (48, 96, 128 rows) and of 1 row; bitwise run to run."""
    x, ids, tw = _case(routing, tokens, k26, seed=tokens + 3)
    want = fused_moe_ref(x.float(), ids, tw, k26).float()
    y = mg.fused_moe_wgmma(x, ids, tw, k26)
    assert _err(y, want) <= 1e-2
    assert torch.equal(y, mg.fused_moe_wgmma(x, ids, tw, k26))


@pytest.mark.gpu
@pytest.mark.parametrize("stages, sizes, tokens", [(2, mg.SIZES, 2000), (3, mg.SIZES, 2000), (6, mg.SIZES, 2000),
                                                   (8, (16, 32, 48), 300), (12, (16, 32, 48), 2000)])
def test_wgmma_stages_sizes_and_graph_replay(k26, stages, sizes, tokens):
    """Skewed routing: blocks of every size class; eager = graph replay."""
    x, ids, tw = _case("skewed", tokens, k26, seed=stages)
    eager = mg.fused_moe_wgmma(x, ids, tw, k26, stages, sizes)
    assert _err(eager, fused_moe_ref(x.float(), ids, tw, k26).float()) <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mg.fused_moe_wgmma(x, ids, tw, k26, stages, sizes)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [64, 128])
def test_wgmma_other_groups_and_sizes(group):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    dev = torch.device("cuda")
    w = random_marlin_moe(16, 1024, 512, group, top_k=4, device=dev, seed=group)
    x = torch.randn(300, 1024, device=dev, generator=torch.Generator(dev).manual_seed(group)).bfloat16()
    ids, tw = synthetic_routing("uniform", 300, 16, 4, device=dev, seed=group)
    assert _err(mg.fused_moe_wgmma(x, ids, tw, w), fused_moe_ref(x.float(), ids, tw, w).float()) <= 1e-2


# ---------------------------------------------------------------- the kernel emulated on the CPU

def _bf16(bits: int) -> float:
    return torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().item()


def _dequant_a(q: int, sc: int) -> list[tuple[float, float]]:
    """moe_wgmma.cu's dequant_a: the 4 registers (low, high bf16) of word q, scale pair sc."""
    slo, shi = _bf16(sc), _bf16(sc >> 16)
    regs = [None] * 4
    for i in range(4):
        pair = [(q >> (4 * i + 16 * h)) & 0xF for h in (0, 1)]             # lop3: nibbles i, i + 4
        s = slo if i < 2 else shi
        regs[(i % 2) * 2 + i // 2] = tuple(torch.tensor((n - 8) * s).bfloat16().item() for n in pair)
    return regs


def _emulate_gemm(xin, words, scales, rows_of, w13: bool, w, sizes, top_k, sorted_ids, block_expert, topk_w, out):
    """One of moe_wgmma.cu's GEMM launches, item by item and stage by stage: the producer's copies
    into a slot's bytes (padding rows left NaN), the consumers' reads, dequantization and A
    fragments, wgmma's B read through the 128-byte swizzle, D by the accumulator layout, and the
    epilogue's exchange, staging and row copies."""
    h, i_, g_ = w.hidden, w.inter, w.group_size
    k_dim, n_dim = (h, 2 * i_) if w13 else (i_, h)
    ch, chunks, ngs = sizes[-1], (i_ // 64 if w13 else h // 128), (2 if g_ == 32 else 1)
    for blk in range(len(rows_of)):
        rows, e = rows_of[blk], int(block_expert[blk])
        nt = next(n for n in sizes if rows <= n)
        for c in range(chunks):
            nbs = [wg * (i_ // 64) + c for wg in (0, 1)] if w13 else [2 * c, 2 * c + 1]
            d = torch.zeros(2, 64, nt, dtype=torch.float64)
            for st in range(k_dim // 64):
                x_t = torch.full((ch * 128,), 0xFF, dtype=torch.uint8)        # NaN bf16 where nothing lands
                w_t = torch.zeros(4096, dtype=torch.uint8)
                s_t = torch.zeros(1024, dtype=torch.uint8)
                for tid in range(128):                                     # the producer
                    for i in range(ch // 16):
                        r = tid // 8 + 16 * i
                        if r < rows:
                            row = int(sorted_ids[blk * ch + r]) // top_k if w13 else blk * ch + r
                            src = xin[row, st * 64 + (tid % 8) * 8:][:8].contiguous().view(torch.uint8)
                            at = r * 128 + (((tid % 8) ^ (r % 8)) << 4)
                            x_t[at:at + 16] = src
                    for j in range(2):
                        v = tid + 128 * j
                        kt = st * 4 + v // 32 % 4
                        src = words[e, kt, nbs[v // 128] * 128 + (v % 32) * 4:][:4].contiguous().view(torch.uint8)
                        w_t[v * 16:v * 16 + 16] = src
                    if tid < 16 * ngs:
                        grp = 2 * st + tid // 8 % ngs if g_ == 32 else st * 64 // g_
                        src = scales[e, grp, nbs[tid // (8 * ngs)] * 64 + (tid % 8) * 8:][:8].contiguous()
                        s_t[tid * 16:tid * 16 + 16] = src.view(torch.uint8)
                w_u32 = w_t.view(torch.int32).long() & 0xFFFFFFFF
                s_u32 = s_t.view(torch.int32).long() & 0xFFFFFFFF
                for kk in range(4):                                        # wgmma's B: descriptor + 32 kk bytes
                    b = torch.empty(nt, 16, dtype=torch.float64)
                    for n in range(nt):
                        for k in range(16):
                            lin = kk * 32 + (n // 8) * 1024 + (n % 8) * 128 + 2 * k
                            at = lin ^ (((lin >> 7) & 7) << 4)
                            b[n, k] = x_t[at:at + 2].view(torch.bfloat16).double().item()
                    for wg in (0, 1):                                      # the consumers' A fragments
                        a = torch.empty(64, 16, dtype=torch.float64)
                        for warp in range(4):
                            for lane in range(32):
                                g, t = lane // 4, lane % 4
                                q = int(w_u32[(wg * 4 + kk) * 128 + lane * 4 + warp])
                                sc = int(s_u32[(wg * ngs + (kk // 2 if g_ == 32 else 0)) * 32 + 4 * g + warp])
                                for r, (lo, hi) in enumerate(_dequant_a(q, sc)):
                                    row, col = 16 * warp + g + 8 * (r % 2), 2 * t + 8 * (r // 2)
                                    a[row, col], a[row, col + 1] = lo, hi
                        d[wg] += a @ b.T
            acc = {}                                                       # (wg, tw) -> the thread's accumulators
            for wg in (0, 1):
                for warp in range(4):
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        acc[wg, warp * 32 + lane] = [
                            d[wg, 16 * warp + g + 8 * (i // 2 % 2), 8 * (i // 4) + 2 * t + i % 2].item()
                            for i in range(nt // 2)]
            for wg in ((0,) if w13 else (0, 1)):                           # the epilogue
                stg = torch.full((ch, 64), float("nan"), dtype=torch.bfloat16)
                for tw in range(128):
                    warp, lane = tw // 32, tw % 32
                    g, t = lane // 4, lane % 4
                    for i in range(nt // 2):
                        n, f = 8 * (i // 4) + 2 * t + i % 2, 16 * warp + g + 8 * (i // 2 % 2)
                        if w13:
                            gte, up = acc[0, tw][i], acc[1, tw][i]
                            stg[n, f] = gte / (1 + torch.tensor(-gte).exp().item()) * up
                        elif n < rows:
                            stg[n, f] = acc[wg, tw][i] * float(topk_w[int(sorted_ids[blk * ch + n])])
                for n in range(rows):
                    if w13:
                        out[blk * ch + n, c * 64:c * 64 + 64] = stg[n]
                    else:
                        out[int(sorted_ids[blk * ch + n]), c * 128 + wg * 64:c * 128 + wg * 64 + 64] = stg[n]


@pytest.mark.parametrize("group", [32, 64])
def test_emulated_kernel_matches_reference(group):
    """Tokens 0-24 route to experts (0, 1), 25-39 to (0, 2): blocks of 40, 25 and 15 rows, so N =
    48, 32 and 16 with sizes (16, 32, 48)."""
    from ddbench.kernels import moe_marlin

    w = random_marlin_moe(3, 128, 128, group, top_k=2, seed=group)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(group)).bfloat16()
    ids = torch.tensor([[0, 1]] * 25 + [[0, 2]] * 15, dtype=torch.int32)
    tw = torch.rand(40, 2, generator=torch.Generator().manual_seed(1))
    tw = tw / tw.sum(1, keepdim=True)
    sizes = (16, 32, 48)
    sorted_ids, block_expert, block_rows, n_blocks = moe_marlin.plan_ref(ids, 3, sizes[-1])
    rows_of = block_rows[:int(n_blocks)].tolist()
    assert sorted(rows_of) == [15, 25, 40]
    act = torch.zeros(sorted_ids.numel(), 128, dtype=torch.bfloat16)
    _emulate_gemm(x, w.w13, w.w13_scale, rows_of, True, w, sizes, 2, sorted_ids, block_expert, None, act)
    ypart = torch.zeros(80, 128, dtype=torch.bfloat16)
    _emulate_gemm(act, w.w2, w.w2_scale, rows_of, False, w, sizes, 2, sorted_ids, block_expert, tw.reshape(-1), ypart)
    y = ypart.float().reshape(40, 2, 128).sum(1).bfloat16()                 # moe_ksum: slot order
    want = fused_moe_ref(x.float(), ids, tw, w).float()
    assert _err(y, want) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [mg.SIZES, (16, 32, 48)])
def test_wgmma_each_gemm_against_its_reference(k26, sizes):
    """w13's act rows against fp32 (a failure names the first wrong sorted row and feature), then w2
    and the k sum on those rows: which GEMM is off, where the whole-layer test only says the output is."""
    from ddbench.kernels import marlin, moe_marlin

    x, ids, tw = _case("skewed", 300, k26, seed=7)
    h, i = k26.hidden, k26.inter
    sorted_ids, block_expert, block_rows, n_blocks = routing = moe_marlin.plan(ids, k26.n_experts, sizes[-1])
    act = mg.wg_w13(x, routing, 8, k26, mg.STAGES, sizes)
    y = mg.wg_w2(act, routing, tw, k26, mg.STAGES, sizes)               # w2 and the k sum
    torch.cuda.synchronize()
    act_want = torch.zeros_like(act, dtype=torch.float32)
    rows = []
    for blk in range(int(n_blocks)):
        e, n = int(block_expert[blk]), int(block_rows[blk])
        r = torch.arange(blk * sizes[-1], blk * sizes[-1] + n, device=x.device)
        w13 = marlin.dequantize(k26.w13[e], k26.w13_scale[e], h, 2 * i, k26.group_size)
        gu = x[sorted_ids[r].long() // 8].float() @ w13
        act_want[r] = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        rows.append(r)
    rows = torch.cat(rows)
    err = (act[rows].float() - act_want[rows]).abs()
    bad = (err > 2e-2 * act_want[rows].abs().max()).nonzero()
    assert bad.numel() == 0, (f"w13: {bad.shape[0]} wrong values, first at (sorted row {int(rows[bad[0, 0]])}, "
                              f"feature {int(bad[0, 1])})")
    want = fused_moe_ref(x.float(), ids, tw, k26).float()
    assert _err(y, want) <= 1e-2, "w2 or the k sum (w13's act checked above)"
