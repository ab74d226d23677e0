"""Engine core on the tiny preset: model, KV cache, TP, weights, checkpoints (CPU)."""
from __future__ import annotations

import pytest
import torch

from engine.config import preset
from engine.kv_cache import KVCache
from engine.model import Transformer, causal_visible
from engine.parallel import SimComm
from engine.weights import init_random


def tiny_model(tp=1, rank=0, comm=None, seed=0, **over):
    cfg = preset("tiny", tp=tp, rank=rank, **over)
    m = Transformer(cfg, comm, dtype=torch.float32)
    init_random(m, seed, mode="exact")
    return m


def run(model, tokens, max_len=32):
    b, t = tokens.shape
    cache = model.new_cache(b, max_len)
    pos = torch.arange(t).expand(b, t)
    with torch.no_grad():
        return model(tokens, pos, cache, torch.zeros(b, dtype=torch.int32), causal_visible(b, t))[0]


def test_one_by_one_equals_causal_forward():
    m = tiny_model()
    b, t = 2, 6
    tok = torch.randint(0, m.cfg.vocab, (b, t), generator=torch.Generator().manual_seed(1))
    full = run(m, tok)
    cache = m.new_cache(b, 16)
    plen = torch.zeros(b, dtype=torch.int32)
    steps = []
    with torch.no_grad():
        for j in range(t):
            lg, _ = m(tok[:, j:j + 1], plen.long().view(b, 1), cache, plen, torch.ones(b, 1, 1, dtype=torch.bool))
            steps.append(lg)
            plen += 1
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    assert full.isfinite().all() and 0.3 < full.std() < 3


def test_hidden_layers_are_block_outputs():
    m = tiny_model()
    tok = torch.randint(0, m.cfg.vocab, (1, 4))
    cache = m.new_cache(1, 8)
    vis = causal_visible(1, 4)
    pos = torch.arange(4).view(1, 4)
    with torch.no_grad():
        lg, hid = m(tok, pos, cache, torch.zeros(1, dtype=torch.int32), vis, hidden_layers=(2, 0))
        assert hid.shape == (1, 4, 2, m.cfg.hidden)
        # the last block's output through the head gives the logits
        torch.testing.assert_close(m.logits(hid[:, :, 0]), lg)


def test_deep_random_model_stays_sane():
    """61 layers of random weights: finite logits of unit-ish size (weights docstring)."""
    m = tiny_model(n_layers=61)
    lg = run(m, torch.randint(0, m.cfg.vocab, (1, 3)))
    assert lg.isfinite().all() and 0.3 < lg.std() < 3


def test_kv_commit_moves_accepted_nodes_in_every_layer():
    cfg = preset("tiny")
    c = KVCache(cfg, 2, 12, dtype=torch.float32)
    c.ckv.normal_()
    c.kpe.normal_()
    ckv0, kpe0 = c.ckv.clone(), c.kpe.clone()
    plen = torch.tensor([3, 5])
    acc = torch.tensor([[0, 2, 5], [0, 1, -1]])
    c.commit(plen, acc)
    for layer in range(cfg.n_layers):
        for b, (p, nodes) in enumerate(zip(plen.tolist(), acc.tolist())):
            for i, j in enumerate(nodes):
                src = j if j >= 0 else i  # padded entries keep their old value
                torch.testing.assert_close(c.ckv[layer, b, p + i], ckv0[layer, b, p + src])
                torch.testing.assert_close(c.kpe[layer, b, p + i], kpe0[layer, b, p + src])
            torch.testing.assert_close(c.ckv[layer, b, :p], ckv0[layer, b, :p])


def test_simulated_rank_runs_and_models_comm():
    calls = []
    comm = SimComm(2, 0, lambda n: calls.append(n) or 5.0)
    m = tiny_model(tp=2, rank=0, comm=comm)
    lg = run(m, torch.randint(0, 1024, (2, 3)))
    assert lg.shape == (2, 3, 1024) and lg.isfinite().all()
    # embedding + 2 per layer + logits gather
    assert comm.calls == 2 + 2 * m.cfg.n_layers
    assert comm.modelled_us == pytest.approx(5.0 * (comm.calls - 1) + 2.5)
