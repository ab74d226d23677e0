import pytest

from engine.config import ConfigError, parse_overrides, preset


def test_k26_facts_and_tp8_rank_shapes():
    c = preset("k2.6")
    assert (c.hidden, c.n_layers, c.n_experts, c.top_k, c.moe_inter, c.vocab) == (7168, 61, 384, 8, 2048, 163840)
    r = preset("k2.6", tp=8, rank=3)
    assert (r.n_local_heads, r.moe_inter_local, r.vocab_local) == (8, 256, 20480)
    assert preset("k2.6-tp8-rank").moe_inter_local == 256
    r.check_marlin()


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
