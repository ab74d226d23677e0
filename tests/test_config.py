import pytest

from ddbench.engine.config import ConfigError, parse_overrides, preset


def test_k26_facts_and_tp8_rank_shapes():
    c = preset("k2.6")
    assert (c.hidden, c.n_layers, c.n_experts, c.top_k, c.moe_inter, c.vocab) == (7168, 61, 384, 8, 2048, 163840)
    r = preset("k2.6", tp=8, rank=3)
    assert (r.n_local_heads, r.moe_inter_local, r.vocab_local) == (8, 256, 20480)
    assert preset("k2.6-tp8-rank").moe_inter_local == 256
    r.check_marlin()


def test_dense_shapes_are_the_models_weights():
    """config.dense_shapes names the [N, K] of the bf16 GEMM weights the model builds (tiny,
    rank 1 of 2), and the K2.6 TP-8 decode shapes the GPU benchmarks time."""
    from ddbench.engine.model import Transformer
    from ddbench.engine.parallel import SimComm
    cfg = preset("tiny", tp=2, rank=1)
    m = Transformer(cfg, SimComm(2, 1, lambda n: 0.0), device="meta")
    dense, moe = m.layers[0], m.layers[1]
    got = {"wqkv_a": moe.attn.wqkv_a.weight, "wq_b": moe.attn.wq_b.weight, "wo": moe.attn.wo.weight,
           "router": moe.ffn.gate, "shared_w13": moe.ffn.shared.w13.weight, "shared_w2": moe.ffn.shared.w2.weight,
           "dense_w13": dense.ffn.w13.weight, "dense_w2": dense.ffn.w2.weight}
    assert cfg.dense_shapes() == {k: tuple(w.shape) for k, w in got.items()}
    assert preset("k2.6", tp=8).dense_shapes() == {
        "wqkv_a": (2112, 7168), "wq_b": (1536, 1536), "wo": (7168, 1024), "router": (384, 7168),
        "shared_w13": (512, 7168), "shared_w2": (7168, 256), "dense_w13": (4608, 7168), "dense_w2": (7168, 2304)}


def test_yarn_softmax_scale():
    import math
    c = preset("k2.6")
    m = 0.1 * math.log(64) + 1
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * m * m)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tiny_keeps_marlin_rules_at_every_tp(tp):
    for rank in range(tp):
        preset("tiny", tp=tp, rank=rank).check_marlin()


def test_bad_configs():
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("k3")
    with pytest.raises(ConfigError, match="multiple of 16"):
        preset("tiny", hidden=200).check_marlin()
    with pytest.raises(ConfigError, match="multiple of 64"):
        preset("tiny", moe_inter=80, tp=1).check_marlin()
    with pytest.raises(ConfigError, match="does not divide"):
        preset("tiny", group_size=48).check_marlin()
    with pytest.raises(ConfigError, match="rank"):
        preset("tiny", tp=2, rank=2)
    with pytest.raises(ConfigError):
        parse_overrides(["hidden"])
    assert parse_overrides(["hidden=512", "norm_eps=1e-6"]) == {"hidden": 512, "norm_eps": 1e-6}


def test_unsupported_routing_and_rope_fields_are_refused():
    with pytest.raises(ConfigError, match="grouped routing"):
        preset("tiny", n_group=8, topk_group=4)
    with pytest.raises(ConfigError, match="mscale"):
        preset("tiny", rope_mscale=0.707)
