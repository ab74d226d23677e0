"""Inputs the GPU tests of the MoE kernels share (tests/test_moe_marlin.py, test_moe_wide.py):
the K2.6 TP-8 rank shard's experts and one call's x and routing."""
import pytest
import torch

from ddbench.kernels.moe import random_marlin_moe, random_router, route, synthetic_routing

K26 = dict(n_experts=384, hidden=7168, inter=256, group_size=32)


@pytest.fixture(scope="module")
def k26():
    """The K2.6 TP-8 shard's experts (E 384, H 7168, I 256, group 32, top-8) on an sm_90 GPU."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs an sm_90 GPU")
    return random_marlin_moe(**K26, top_k=8, device=torch.device("cuda"), seed=5)


def moe_case(routing, tokens, w, seed=0):
    """(x bf16 `[T, H]`, ids, weights) on the GPU: top-8 routing by `synthetic_routing`, or by a
    random router ("router")."""
    dev = torch.device("cuda")
    x = torch.randn(tokens, w.hidden, device=dev, generator=torch.Generator(dev).manual_seed(seed)).bfloat16()
    if routing == "router":
        gw, bias = random_router(w.hidden, w.n_experts, device=dev, seed=seed)
        ids, tw = route(x, gw, bias, 8, 2.5)
    else:
        ids, tw = synthetic_routing(routing, tokens, w.n_experts, 8, device=dev, seed=seed)
    return x, ids, tw
