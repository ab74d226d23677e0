"""engine.cost_model: the least-squares fit recovers known per-phase costs, and the best
budget is the argmax of the predicted tok/s."""
import pytest

from ddbench.engine.cost_model import PHASES, CostModel


def truth(c, b, x, e):
    n = c * (b + 1)
    return {"draft": 50 + 3 * c, "tree": 20 + c + 0.05 * c * b, "verify_attention": 30 + 0.2 * n + 0.001 * n * x,
            "verify_moe": 100 + 2.0 * e + 0.1 * n, "verify_other": 40 + 0.3 * n, "accept": 10 + 0.5 * c,
            "comm": 25 + 0.02 * n, "host": 15}


def experts(n):
    return 64 * (1 - (1 - 8 / 64) ** n)


def rows():
    out = []
    for c in (1, 4, 10):
        for b in (4, 16, 64, 128):
            for x in (100, 160):
                e = experts(c * (b + 1))
                out.append({"concurrency": c, "budget": b, "context": x, "experts": e,
                            **{f"{p}_us": v for p, v in truth(c, b, x, e).items()}})
    return out


def test_fit_recovers_the_phases():
    m = CostModel.fit(rows())
    for c, b in ((1, 16), (4, 64), (10, 128)):
        got = m.phases_us(c, b, context=100, experts=experts(c * (b + 1)))
        want = truth(c, b, 100, experts(c * (b + 1)))
        for p in PHASES:
            assert got[p] == pytest.approx(want[p], rel=1e-6, abs=1e-6)
    assert m.experts_at(4, 16) == pytest.approx(experts(68), rel=1e-9)     # a measured point


def test_best_budget_is_the_argmax():
    m = CostModel.fit(rows())
    curve = [1 + 4 * (1 - 0.97 ** b) for b in range(129)]                  # saturating acceptance
    b, pred = m.best_budget(10, curve, 4, 128)
    all_pred = {bb: m.tok_per_s(10, bb, curve[bb]) for bb in range(4, 129)}
    assert pred == max(all_pred.values()) and all_pred[b] == pred
    assert 4 < b < 128                                                     # an interior optimum here


def test_model_check_names_the_worst_row_and_the_auto_gap():
    from ddbench.e2e import model_check

    row = dict(decoder="ddtree", concurrency=10, acceptance="rank:x")
    rows = [dict(decoder="ar", concurrency=10, steady_tok_per_s=700.0),
            {**row, "budget": 8, "steady_tok_per_s": 1000.0, "predicted_tok_per_s": 1050.0},
            {**row, "budget": 32, "steady_tok_per_s": 800.0, "predicted_tok_per_s": 960.0},
            {**row, "budget": 16, "budget_auto": True, "steady_tok_per_s": 950.0, "predicted_tok_per_s": 1100.0},
            {**row, "budget": 128, "steady_tok_per_s": None, "predicted_tok_per_s": 500.0}]   # no steady window
    lines = model_check(rows)
    assert lines[0].startswith("cost model vs steady tok/s, c=10: worst +20.0% (rank:x budget 32") and "3 rows" in lines[0]
    assert lines[1] == ("budget auto, c=10 rank:x: budget 16 950 tok/s, best measured budget 8 1000 (-5.0%)")
