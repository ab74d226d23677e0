"""The DFlash-style drafter: shapes, non-causal block, context conditioning and its cache,
GQA, TP sharding (shapes and a 2-rank equivalence), the K2.5 preset's size."""
import pytest
import torch
from torch import nn

from ddbench.engine.config import ConfigError, preset
from ddbench.engine.drafter import Drafter, DrafterConfig, DrafterLayer, drafter_config
from ddbench.engine.model import Transformer
from ddbench.engine.parallel import Comm, LocalComm, SimComm
from ddbench.engine.weights import init_random


@pytest.fixture(scope="module")
def target():
    cfg = preset("tiny")
    m = Transformer(cfg, dtype=torch.float32)
    init_random(m, 1)
    return m


def make(target, seed=0, n=2, max_len=40, comm=None, **over):
    dc = drafter_config(target.cfg, **over)
    d = Drafter(dc, target, comm or target.comm, dtype=torch.float32)
    d.init_random(seed)
    d.alloc(n, max_len)
    return d


def test_block_logits_shape_and_sanity(target):
    d = make(target)
    hid = torch.randn(2, 10, len(d.target_layers), target.cfg.hidden)
    d.update(hid, torch.zeros(2, dtype=torch.long))
    logits = d(torch.tensor([5, 7]), torch.tensor([10, 6]))
    assert logits.shape == (2, d.block - 1, target.cfg.vocab) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    p = logits.softmax(-1)
    assert (p.max(-1).values < 0.99).all()        # random weights: no collapsed distribution
    assert not torch.allclose(logits[:, 0], logits[:, 1])


def test_layer_is_not_causal_within_the_block(target):
    """Every block position sees every other: perturbing the last one moves the first."""
    dc = drafter_config(target.cfg)
    layer = DrafterLayer(dc, LocalComm(), dtype=torch.float32)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.05)
    n, b, s = 1, dc.block, 4
    freqs = torch.ones(dc.head_dim // 2) * 0.1
    pos = torch.arange(b).view(1, b)
    ck = torch.randn(n, s, dc.n_kv_heads, dc.head_dim)
    cv = torch.randn(n, s, dc.n_kv_heads, dc.head_dim)
    mask = torch.ones(n, s, dtype=torch.bool)
    x = torch.randn(n, b, dc.hidden)
    y0 = layer(x, pos, freqs, ck, cv, mask)
    x2 = x.clone()
    x2[:, -1] += 1.0
    y1 = layer(x2, pos, freqs, ck, cv, mask)
    assert (y1[:, 0] - y0[:, 0]).abs().max() > 1e-4


def test_gqa_matches_repeated_heads(target):
    """Grouped queries over n_kv heads equal plain attention with each KV head repeated."""
    dc = drafter_config(target.cfg)
    layer = DrafterLayer(dc, LocalComm(), dtype=torch.float32)
    for p in layer.parameters():
        nn.init.normal_(p, std=0.1)
    n, b, s, hd = 2, dc.block, 5, dc.head_dim
    g = dc.n_heads // dc.n_kv_heads
    freqs = torch.rand(hd // 2)
    pos = torch.arange(b).view(1, b).expand(n, b) + 3
    ck, cv = torch.randn(n, s, dc.n_kv_heads, hd), torch.randn(n, s, dc.n_kv_heads, hd)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    x = torch.randn(n, b, dc.hidden)
    got = layer(x, pos, freqs, ck, cv, mask)
    # reference: explicit per-head softmax over [valid context, block]
    from ddbench.engine.drafter import rope
    xn = layer.attn_norm(x)
    q = rope(layer.q_norm(layer.wq(xn).view(n, b, -1, hd)), pos, freqs)
    kb, vb = layer.kv(xn, pos, freqs)
    outs = []
    for i in range(n):
        k = torch.cat([ck[i][mask[i]], kb[i]]).repeat_interleave(g, dim=1)      # [S'+B, H, hd]
        v = torch.cat([cv[i][mask[i]], vb[i]]).repeat_interleave(g, dim=1)
        att = torch.einsum("bhd,shd->hbs", q[i], k) / hd ** 0.5
        outs.append(torch.einsum("hbs,shd->bhd", att.softmax(-1), v).reshape(b, -1))
    o = torch.stack(outs)
    h = x + layer.wo(o)
    gate, up = layer.w13(layer.mlp_norm(h)).chunk(2, dim=-1)
    want = h + layer.w2(torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_context_conditions_and_is_masked_by_length(target):
    d = make(target, n=1)
    nl, h = len(d.target_layers), target.cfg.hidden
    hid = torch.randn(1, 12, nl, h)
    d.update(hid, torch.zeros(1, dtype=torch.long))
    a = d(torch.tensor([3]), torch.tensor([12]))
    # rows past the context length are scratch: overwriting them changes nothing
    d.update(torch.randn(1, 5, nl, h) * 3, torch.tensor([12]))
    torch.testing.assert_close(d(torch.tensor([3]), torch.tensor([12])), a)
    # a different context changes the draft
    d.update(torch.randn(1, 12, nl, h), torch.zeros(1, dtype=torch.long))
    assert not torch.allclose(d(torch.tensor([3]), torch.tensor([12])), a)


def test_incremental_context_equals_one_shot(target):
    """Extending the context step by step (as the loop does) equals writing it at once."""
    nl, h = 3, target.cfg.hidden
    hid = torch.randn(2, 15, nl, h)
    one = make(target, seed=5)
    one.update(hid, torch.zeros(2, dtype=torch.long))
    inc = make(target, seed=5)
    inc.update(hid[:, :6], torch.zeros(2, dtype=torch.long))
    inc.update(hid[:, 6:10], torch.full((2,), 6))
    inc.update(hid[:, 10:], torch.full((2,), 10))
    start = torch.tensor([15, 15])
    torch.testing.assert_close(inc(torch.tensor([1, 2]), start), one(torch.tensor([1, 2]), start))


class RankComm(Comm):
    """Rank r of 2 with the all-reduce left to the test (which sums the ranks' partials)."""

    def __init__(self, rank):
        self.tp, self.rank = 2, rank

    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=-1):
        return x


def test_tp2_shards_sum_to_the_full_layer(target):
    """Heads (q and KV) and the MLP dim split over 2 ranks: the ranks' partial attention
    and MLP outputs sum to the TP=1 layer's."""
    dc1 = drafter_config(target.cfg)
    full = DrafterLayer(dc1, LocalComm(), dtype=torch.float32)
    for p in full.parameters():
        nn.init.normal_(p, std=0.1)
    dc2 = DrafterConfig(**{**vars(dc1), "tp": 2})
    ranks = [DrafterLayer(dc2, RankComm(r), dtype=torch.float32) for r in range(2)]
    for r, lay in enumerate(ranks):
        sd = {}
        for name, w in full.state_dict().items():
            if name.startswith(("wq", "wk", "wv")):
                w = w.chunk(2, 0)[r]                                   # heads
            elif name == "w13.weight":
                gate, up = w.chunk(2, 0)
                w = torch.cat([gate.chunk(2, 0)[r], up.chunk(2, 0)[r]])  # gate | up, each split
            elif name.startswith(("wo", "w2")):
                w = w.chunk(2, 1)[r]                                   # row parallel
            sd[name] = w
        lay.load_state_dict(sd)
        assert lay.wq.weight.shape[0] == dc1.n_heads * dc1.head_dim // 2
    n, b, s, hd = 2, dc1.block, 3, dc1.head_dim
    freqs = torch.rand(hd // 2)
    pos = torch.arange(b).view(1, b).expand(n, b)
    ck, cv = torch.randn(n, s, dc1.n_kv_heads, hd), torch.randn(n, s, dc1.n_kv_heads, hd)
    mask = torch.ones(n, s, dtype=torch.bool)
    x = torch.randn(n, b, dc1.hidden)
    o_tp = sum(lay.attn(x, pos, freqs, ck.chunk(2, 2)[r], cv.chunk(2, 2)[r], mask) for r, lay in enumerate(ranks))
    torch.testing.assert_close(o_tp, full.attn(x, pos, freqs, ck, cv, mask), rtol=1e-4, atol=1e-4)
    h = x + o_tp
    torch.testing.assert_close(sum(lay.mlp(h) for lay in ranks), full.mlp(h), rtol=1e-4, atol=1e-4)


def test_k25_preset_size_and_tp8_shard():
    """K2.5 drafter: 6 layers, 64 q / 8 KV heads x 128, inter 18432, block 16; its TP-8 rank
    holds 1/8 of every split weight (built on the meta device: no memory)."""
    cfg = preset("k2.6", tp=8, rank=0)
    dc = drafter_config(cfg)
    assert (dc.n_layers, dc.n_heads, dc.n_kv_heads, dc.head_dim, dc.inter, dc.block) == (6, 64, 8, 128, 18432, 16)
    assert dc.target_layers == (1, 12, 24, 35, 47, 58)
    assert (dc.n_local_heads, dc.n_local_kv_heads) == (8, 1)
    d = Drafter(dc, None, SimComm(8, 0, lambda nbytes: 1.0), device="meta")
    h, hd = 7168, 128
    per_layer = (h * 64 * hd + 2 * h * 8 * hd + 64 * hd * h + 3 * h * 18432) // 8 + 2 * h + 2 * hd
    want = 6 * per_layer + 6 * h * h // 8 + 2 * h
    assert sum(p.numel() for p in d.parameters()) == want
    full = Drafter(drafter_config(preset("k2.6")), None, LocalComm(), device="meta")
    assert sum(p.numel() for p in full.parameters()) * 2 / 1e9 == pytest.approx(6.96, abs=0.05)   # GB bf16


def test_config_errors():
    cfg = preset("tiny")
    with pytest.raises(ConfigError):
        drafter_config(cfg, target_layers=(0, 7))          # tiny has 3 layers
    with pytest.raises(ConfigError):
        drafter_config(cfg, n_heads=6, n_kv_heads=4)
    with pytest.raises(ConfigError):
        drafter_config(preset("tiny", tp=8))               # 4 KV heads do not split 8 ways
    with pytest.raises(ConfigError):
        drafter_config(cfg, name="nope")
