"""INT4 quantization, compressed-tensors and Marlin layout (DESIGN §3, §4)."""
import pytest
import torch

from ddbench.kernels import ctensors, marlin, quant


def _nibble(word: int, i: int) -> int:
    return (word & 0xFFFFFFFF) >> (4 * i) & 0xF


def test_marlin_words_follow_the_design_formula():
    g = torch.Generator().manual_seed(1)
    k, n = 48, 192
    q = torch.randint(0, 16, (2, k, n), dtype=torch.uint8, generator=g)
    packed = marlin.pack(q)
    assert packed.shape == (2, k // 16, 2 * n) and packed.dtype == torch.int32
    for e in range(2):
        for kt in range(k // 16):
            for nb in range(n // 64):
                for lane in range(32):
                    t, gg = lane % 4, lane // 4
                    offsets = [(2 * t, gg), (2 * t + 8, gg), (2 * t, gg + 8), (2 * t + 8, gg + 8),
                               (2 * t + 1, gg), (2 * t + 9, gg), (2 * t + 1, gg + 8), (2 * t + 9, gg + 8)]
                    for tile in range(4):
                        word = int(packed[e, kt, nb * 128 + lane * 4 + tile])
                        k0, n0 = 16 * kt, 64 * nb + 16 * tile
                        got = [_nibble(word, i) for i in range(8)]
                        want = [int(q[e, k0 + dk, n0 + dn]) for dk, dn in offsets]
                        assert got == want, (e, kt, nb, lane, tile)


def test_marlin_round_trip_and_rules():
    q = torch.randint(0, 16, (3, 64, 256), dtype=torch.uint8)
    assert torch.equal(marlin.unpack(marlin.pack(q), 64, 256), q)
    with pytest.raises(ValueError, match="multiple of 16"):
        marlin.pack(torch.zeros(40, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 64"):
        marlin.pack(torch.zeros(32, 96, dtype=torch.uint8))
    with pytest.raises(ValueError, match="does not divide"):
        marlin.check_shape(64, 64, group_size=48)


def test_grouped_scale_permutation_is_an_8x8_transpose_per_64_columns():
    s = torch.randn(4, 192)
    p = marlin.permute_scales(s, 32)
    for run in range(3):
        for i in range(8):
            for j in range(8):
                assert p[:, run * 64 + 8 * i + j].equal(s[:, run * 64 + i + 8 * j])
    assert torch.equal(marlin.unpermute_scales(p, 32), s)


def test_per_channel_scale_permutation():
    s = torch.randn(1, 96)
    p = marlin.permute_scales(s, -1)
    order = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    for run in range(3):
        assert p[0, run * 32:(run + 1) * 32].equal(s[0, run * 32 + torch.tensor(order)])
    assert torch.equal(marlin.unpermute_scales(p, -1), s)


def test_compressed_tensors_round_trip_and_bit_layout():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    s = torch.rand(5, 2).to(torch.bfloat16)
    t = ctensors.to_checkpoint(q, s)
    assert t["weight_packed"].shape == (5, 8) and t["weight_packed"].dtype == torch.int32
    assert t["weight_shape"].tolist() == [5, 64]
    word = int(t["weight_packed"][2, 3])
    assert [_nibble(word, j) for j in range(8)] == q[2, 24:32].tolist()  # value j at bits 4j
    q2, s2 = ctensors.from_checkpoint(t)
    assert torch.equal(q2, q) and torch.equal(s2, s)


def test_quantization_error_is_within_half_a_step():
    w = torch.randn(16, 256) * 0.02
    q, s = quant.quantize(w, 32)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    err = (quant.dequantize(q, s) - w).abs().reshape(16, 8, 32)
    step = s.float().unsqueeze(-1)
    # half a step of rounding, plus bf16 rounding of the scale (relative 2^-8, up to 8 steps)
    assert bool((err <= step * (0.5 + 8 * 2**-8) + 1e-7).all())
    with pytest.raises(ValueError):
        quant.quantize(w, 48)


def test_random_int4_gives_unit_gain_linear():
    q, s = quant.random_int4((512, 1024), 32, generator=torch.Generator().manual_seed(0))
    w = quant.dequantize(q, s)
    x = torch.randn(64, 1024)
    ratio = (x @ w.t()).std() / x.std()
    assert 0.85 < float(ratio) < 1.15


def _experts(e, inter, hidden, g=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in [("gate", (e, inter, hidden)), ("up", (e, inter, hidden)), ("down", (e, hidden, inter))]:
        q, s = quant.random_int4(shape, g, generator=gen)
        out[name] = (q, s, {"weight_packed": ctensors.pack_nibbles(q), "weight_scale": s})
    return out


@pytest.mark.parametrize("tp,shapes", [
    (1, {"w13": (2, 448, 8192), "w13_scale": (2, 224, 4096), "w2": (2, 128, 14336), "w2_scale": (2, 64, 7168)}),
    (8, {"w13": (2, 448, 1024), "w13_scale": (2, 224, 512), "w2": (2, 16, 14336), "w2_scale": (2, 8, 7168)}),
])
def test_moe_repack_shapes_at_k26_dims(tp, shapes):
    ex = _experts(2, 2048, 7168)
    got = marlin.repack_moe(ex["gate"][2], ex["up"][2], ex["down"][2], tp=tp, rank=tp - 1)
    assert {k: tuple(v.shape) for k, v in got.items()} == shapes


def test_moe_repack_values_per_rank():
    e, inter, hidden, tp = 3, 128, 64, 2
    ex = _experts(e, inter, hidden)
    (qg, sg, cg), (qu, su, cu), (qd, sd, cd) = ex["gate"], ex["up"], ex["down"]
    for rank in range(tp):
        r = slice(rank * 64, rank * 64 + 64)
        got = marlin.repack_moe(cg, cu, cd, tp=tp, rank=rank)
        assert torch.equal(marlin.unpack(got["w13"], hidden, 128), torch.cat([qg[:, r], qu[:, r]], 1).transpose(1, 2))
        assert torch.equal(marlin.unpack(got["w2"], 64, hidden), qd[:, :, r].transpose(1, 2))
        # dequantized Marlin == dequantized checkpoint
        want = quant.dequantize(qd[:, :, r], sd[:, :, rank * 2:rank * 2 + 2]).transpose(1, 2)
        assert torch.equal(marlin.dequantize(got["w2"], got["w2_scale"], 64, hidden, 32), want)
