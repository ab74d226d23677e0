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

    row = dict(decoder="ddtree", concurrency=10, acceptance="rank:x", step_total_us=10000.0)
    rows = [dict(decoder="ar", concurrency=10, steady_tok_per_s=700.0),
            {**row, "budget": 8, "steady_tok_per_s": 1000.0, "predicted_tok_per_s": 1050.0,
             "predicted_step_us": 10300.0, "predicted_accepted": 5.0, "steady_accepted": 4.9, "steady_accepted_se": 0.1},
            {**row, "budget": 32, "steady_tok_per_s": 800.0, "predicted_tok_per_s": 960.0,
             "predicted_step_us": 9800.0, "predicted_accepted": 6.0, "steady_accepted": 5.0, "steady_accepted_se": 0.4},
            {**row, "budget": 16, "budget_auto": True, "steady_tok_per_s": 950.0, "predicted_tok_per_s": 1100.0},
            {**row, "budget": 128, "steady_tok_per_s": None, "predicted_tok_per_s": 500.0}]   # no steady window
    lines = model_check(rows)
    assert lines[0] == ("cost model, c=10: tok/s vs steady worst +20.0% (rank:x budget 32), 1 of 3 rows within 10%; "
                        "step time worst +3.0%")
    assert lines[1] == "  rows off by more than 10%: drawn acceptance 2.5 to 2.5 standard errors below its expectation (1 of 1 beyond 2)"
    assert lines[2] == "budget auto, c=10 rank:x: budget 16 950 tok/s, best measured budget 8 1000 (-5.0%)"


def test_experts_follow_the_concurrency_and_acceptance_of_the_point():
    """One stream's tree and ten streams' trees of similar size touch different numbers of
    experts: a prediction at c=10 interpolates c=10's points, not c=1's."""
    base = {p + "_us": 100.0 for p in PHASES}
    rows = [{**base, "concurrency": 10, "budget": 8, "context": 100, "experts": 260, "acceptance": "a"},
            {**base, "concurrency": 10, "budget": 16, "context": 100, "experts": 300, "acceptance": "a"},
            {**base, "concurrency": 10, "budget": 16, "context": 100, "experts": 200, "acceptance": "b"},
            {**base, "concurrency": 1, "budget": 128, "context": 100, "experts": 150, "acceptance": "a"}]
    m = CostModel.fit(rows)
    assert 260 < m.experts_at(10, 11, "a") < 300                 # n = 120 lies between c=10's 90 and 170
    assert m.experts_at(10, 16, "b") == 200 and m.experts_at(10, 16, "zz") == 250   # unknown label: c=10's mean
    assert 260 < m.experts_at(8, 16, "a") < 300                  # no c=8 points: c=10's curve at n = 136
    assert m.experts_at(1, 128, "a") == 150
