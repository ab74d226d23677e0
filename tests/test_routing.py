"""engine.routing: uniform draws match the formula, overlap:1 reuses the parent's experts,
model keeps the router's choice, keyed draws are a function of the key (the hash of the
token's whole prefix), and the on-device distinct-expert counter agrees with torch.unique."""
import pytest
import torch

from ddbench.engine.config import ConfigError, preset
from ddbench.engine.model import Transformer
from ddbench.engine.routing import PrefixKeys, Routing, install, keyed, parse_routing
from ddbench.engine.weights import init_random
from ddbench.kernels import ddtree
from ddbench.kernels.moe import expected_experts_touched

E, K = 64, 8


def router_ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, E, generator=g).topk(K, -1).indices.int(), torch.rand(n, K, generator=g)


def test_parse():
    assert parse_routing("overlap:0.25") == ("overlap", 0.25) and parse_routing("model") == ("model", 0.0)
    for bad in ("overlap:2", "overlap:x", "router", "uniform:1"):
        with pytest.raises(ConfigError):
            parse_routing(bad)


def test_model_keeps_the_router_choice_and_counts_like_unique():
    r = Routing("model", E, K, "cpu")
    total = 0.0
    for s in range(5):
        ids, w = router_ids(7 + s, s)
        out, w2 = r(ids, w, 1, 7 + s)
        assert torch.equal(out, ids) and torch.equal(w2, w)
        total += torch.unique(ids).numel()
    assert r.mean_touched() == pytest.approx(total / 5)
    assert r.mean_touched(9) == pytest.approx(torch.unique(router_ids(9, 2)[0]).numel())
    assert r.mean_touched(1) is None


@pytest.mark.parametrize("tokens", [3, 20, 90])
def test_uniform_matches_the_formula(tokens):
    torch.manual_seed(0)
    r = Routing("uniform", E, K, "cpu", seed=1)
    ids0, w = router_ids(tokens, 0)
    for _ in range(300):
        out, _ = r(ids0, w, 1, tokens)
        assert out.shape == ids0.shape and out.dtype == torch.int32
        assert all(len(set(row)) == K for row in out.tolist())          # distinct per token
    assert r.mean_touched(tokens) == pytest.approx(expected_experts_touched(tokens, E, K), rel=0.03)


def test_keyed_draws_depend_only_on_the_key_and_layer():
    r = Routing("uniform", E, K, "cpu", seed=1)
    keys = torch.randint(0, PrefixKeys.M, (2, 5))
    ids, w = router_ids(10, 3)
    r.key = keys
    a, _ = r(ids, w, 2, 5, layer=1)
    b, _ = r(ids.flip(0), w, 2, 5, layer=1)
    c, _ = r(ids, w, 2, 5, layer=2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    r.key = keys[:1, 2:3]                                                    # same key alone: same experts
    d, _ = r(ids[:1], w[:1], 1, 1, layer=1)
    assert torch.equal(d[0], a[2])


def test_keyed_names_the_tokens_for_the_body_only():
    r = Routing("uniform", E, K, "cpu", seed=1)
    keys, tree = torch.randint(0, PrefixKeys.M, (2, 5)), (torch.zeros(2, 5), torch.zeros(2, 5), 1)
    ids, w = router_ids(10, 3)
    with keyed(r, keys, tree):
        assert r.key is keys and r.tree is tree
        inside, _ = r(ids, w, 2, 5, layer=1)
    assert r.key is None and r.tree is None
    r.key = keys
    again, _ = r(ids, w, 2, 5, layer=1)
    assert torch.equal(inside, again)                                       # the body's draws were keyed
    r.key = None
    with pytest.raises(RuntimeError), keyed(r, keys):
        raise RuntimeError("a forward that fails")
    assert r.key is None and r.tree is None                                  # cleared on the way out
    with keyed(None, keys):                                                  # no hook: nothing to name
        pass


def prefix_hash(tokens: list[int]) -> int:
    """The reference: sum over positions p of token_p * B^p mod M."""
    return sum(t * pow(PrefixKeys.B, p, PrefixKeys.M) for p, t in enumerate(tokens)) % PrefixKeys.M


def test_prefix_keys_name_the_whole_prefix():
    """A key hashes its token's whole prefix: prompts (ragged), a tree's nodes (two nodes
    with one token at one depth under different parents apart), commits and a one-token step."""
    pk = PrefixKeys(2, 32, "cpu")
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 1000, (2, 7), generator=g)
    pos = torch.arange(7).expand(2, 7)
    lens = torch.tensor([7, 4])
    keys = pk.prompt(prompt, pos, pos < lens.view(2, 1))
    for b in range(2):
        for j in range(int(lens[b])):
            assert int(keys[b, j]) == prefix_hash(prompt[b, :j + 1].tolist())
        assert int(pk.prefix[b]) == prefix_hash(prompt[b, :int(lens[b])].tolist())
    # root r, children a and b, then c under a and c under b: [r, a, b, c, c]
    parent = torch.tensor([[-1, 0, 0, 1, 2]] * 2)
    depth = torch.tensor([[0, 1, 1, 2, 2]] * 2)
    tok = torch.tensor([[11, 12, 13, 14, 14], [21, 22, 23, 24, 24]])
    vis = ddtree._visible_ref(parent, depth)
    tk = pk.tree(tok, lens.view(2, 1) + depth, vis)
    for b in range(2):
        pre = prompt[b, :int(lens[b])].tolist()
        for i in range(5):
            path = [int(tok[b, j]) for j in range(5) if vis[b, i, j]]
            assert int(tk[b, i]) == prefix_hash(pre + path)
        assert int(tk[b, 3]) != int(tk[b, 4])
    pk.commit(tk, torch.tensor([4, 3]), torch.tensor([True, False]))
    assert int(pk.prefix[0]) == int(tk[0, 4]) and int(pk.prefix[1]) == prefix_hash(prompt[1, :4].tolist())
    one = pk.tree(torch.tensor([[7], [8]]), torch.tensor([[10], [4]]), torch.ones(2, 1, 1, dtype=torch.bool))
    assert int(one[0]) == prefix_hash(prompt[0].tolist() + [11, 13, 14, 7])
    assert int(one[1]) == prefix_hash(prompt[1, :4].tolist() + [8])


def tree(n, t, depth, seed):
    """Random trees: parent < child, depth = parent's depth + 1."""
    g = torch.Generator().manual_seed(seed)
    parent = torch.full((n, t), -1, dtype=torch.long)
    dep = torch.zeros(n, t, dtype=torch.long)
    for b in range(n):
        for j in range(1, t):
            cands = [i for i in range(j) if dep[b, i] < depth]
            p = cands[int(torch.randint(len(cands), (1,), generator=g))]
            parent[b, j], dep[b, j] = p, dep[b, p] + 1
    return parent, dep


@pytest.mark.parametrize("f", [1.0, 0.5, 0.0])
def test_overlap_keeps_parent_experts(f):
    torch.manual_seed(1)
    n, t, depth = 3, 40, 5
    parent, dep = tree(n, t, depth, 0)
    r = Routing(f"overlap:{f}", E, K, "cpu", seed=2)
    r.tree = (parent, dep, depth)
    ids, w = router_ids(n * t, 4)
    out, _ = r(ids, w, n, t)
    out = out.view(n, t, K)
    shared = []
    for b in range(n):
        for j in range(1, t):
            mine, theirs = set(out[b, j].tolist()), set(out[b, parent[b, j]].tolist())
            assert len(mine) == K
            shared.append(len(mine & theirs) / K)
    mean = sum(shared) / len(shared)
    if f == 1.0:
        assert mean == 1.0
    else:   # kept with prob F, plus replacements that hit the parent's dropped experts by chance
        assert abs(mean - (f + (1 - f) * (1 - f) * K / E)) < 0.06
    r.tree = None                                      # not a tree verify: plain uniform draws
    assert r(ids, w, n, t)[0].shape == (n * t, K)


def test_hook_in_the_model_counts_every_moe_layer():
    cfg = preset("tiny")
    model = Transformer(cfg, dtype=torch.float32)
    init_random(model, 0)
    r = install(model, "uniform", 0)
    from ddbench.engine.model import causal_visible

    n_tok = 6
    cache = model.new_cache(1, 16)
    tok = torch.randint(0, cfg.vocab, (1, n_tok))
    pos = torch.arange(n_tok).view(1, -1)
    model(tok, pos, cache, torch.zeros(1, dtype=torch.long), causal_visible(1, n_tok))
    assert float(r.calls[n_tok]) == len(model.moe_blocks())
    assert 1 <= r.mean_touched(n_tok) <= min(cfg.n_experts, n_tok * cfg.top_k)


@pytest.mark.parametrize("mode", ["copy", "keyed", "stream"])
def test_route_draw_reference_counts_like_unique(mode):
    """kernels.route_draw's reference (the CPU path): keyed rows are the pool rows of the
    hash, stream rows run on from a hashed offset that advances per call, and the count adds
    torch.unique's distinct experts."""
    from ddbench.kernels import route_draw as rd

    g = torch.Generator().manual_seed(5)
    pool = torch.rand(50, E, generator=g).topk(K, -1).indices.int()
    ids, _ = router_ids(13, 6)
    key = torch.randint(0, 1 << 40, (13,), generator=g)
    state, touched, calls = torch.zeros(1, dtype=torch.long), torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    m = {"copy": rd.COPY, "keyed": rd.KEYED, "stream": rd.STREAM}[mode]
    a = rd.draw_count(pool, ids, key, 3, 7, m, state, touched, calls, 2, E)
    b = rd.draw_count(pool, ids, key, 3, 7, m, state, touched, calls, 2, E)
    for out in (a, b):
        assert out.shape == ids.shape and out.dtype == torch.int32
    if mode == "copy":
        assert torch.equal(a, ids)
    elif mode == "keyed":
        assert torch.equal(a, pool[rd.mix_ref(key, 3, 7) % 50]) and torch.equal(a, b)
        assert (rd.mix_ref(key, 3, 7) >= 0).all()
    else:
        assert int(state) == 2 and not torch.equal(a, b)
        off = rd.mix_ref(torch.zeros(1, dtype=torch.long), 3, 7) % 50
        assert torch.equal(a, pool[(off + torch.arange(13)) % 50])
    assert int(calls[2]) == 2 and int(touched[2]) == torch.unique(a).numel() + torch.unique(b).numel()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["copy", "keyed", "stream"])
@pytest.mark.parametrize("n", [1, 9, 90, 1280, 5000])
def test_route_draw_kernel_matches_reference(mode, n):
    """The one-launch kernel: the reference's ids, state and counters exactly, at K2.6's
    E=384, k=8, on fresh random router ids and keys."""
    from ddbench.kernels import route_draw as rd

    dev, e = "cuda", 384
    g = torch.Generator(device=dev).manual_seed(n)
    pool = torch.rand(16384, e, generator=g, device=dev).topk(K, -1).indices.int()
    ids = torch.rand(n, e, generator=g, device=dev).topk(K, -1).indices.int()
    key = torch.randint(0, 1 << 40, (n,), generator=g, device=dev)
    m = {"copy": rd.COPY, "keyed": rd.KEYED, "stream": rd.STREAM}[mode]
    outs = []
    for fn in (rd.draw_count, rd.draw_count_ref):
        state = torch.full((1,), 11, dtype=torch.long, device=dev)
        touched, calls = torch.zeros(8, dtype=torch.long, device=dev), torch.zeros(8, dtype=torch.long, device=dev)
        got = [fn(pool, ids, key, 5, 3, m, state, touched, calls, 4, e).clone() for _ in range(2)]
        outs.append((got, state.clone(), touched.clone(), calls.clone()))
    (ka, ks, kt, kc), (ra, rs, rt, rc) = outs
    assert all(torch.equal(x, y) for x, y in zip(ka, ra))
    assert torch.equal(ks, rs) and torch.equal(kt, rt) and torch.equal(kc, rc)
