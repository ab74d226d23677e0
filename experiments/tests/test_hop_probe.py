"""experiments.hop_probe (a token passed between two SMs): every hop happens, in every flag kind,
idle and under a stream; its arguments are checked before anything runs."""
import pytest
import torch

from experiments import hop_probe


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="mode"):
        hop_probe.hop_ns("fence")
    with pytest.raises(ValueError, match="rounds"):
        hop_probe.hop_ns("relaxed", rounds=hop_probe.WARM)
    with pytest.raises(ValueError, match="x_bytes"):
        hop_probe.hop_ns("counter + x", x_bytes=100)
    with pytest.raises(ValueError, match="multiplies"):
        hop_probe.hop_ns("x to a warp", x_bytes=512)
    for mode in hop_probe.FANS:
        with pytest.raises(ValueError, match="stream"):
            hop_probe.hop_ns(mode, stream=torch.zeros(16, dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [m for m in hop_probe.MODES if m not in hop_probe.FANS])
@pytest.mark.parametrize("streaming", [False, True])
def test_gpu_every_hop_happens(mode, streaming):
    buf = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device="cuda") if streaming else None
    ns, token, gave_up, error = hop_probe.hop_ns(mode, rounds=300, stream=buf)
    assert token == 600 and not gave_up
    assert 50 < ns < 100_000                       # a hop is more than an SM's own clock and far less than 0.1 ms
    if mode in hop_probe.CONSUMER:                 # the consumer multiplied the x it was handed
        assert abs(error) < 1e-3
    else:
        assert error is None


@pytest.mark.gpu
@pytest.mark.parametrize("fan", [1, 7, 131])
def test_gpu_all_to_one_every_answer_counted(fan):
    ns, token, gave_up, _ = hop_probe.hop_ns("all to one", rounds=300, fan=fan)
    assert token == fan * 300 and not gave_up and 50 < ns < 100_000


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [m for m in hop_probe.FANS if m != "all to one"])
@pytest.mark.parametrize("fan", [1, 7, 131])
def test_gpu_all_to_all_every_post_counted_and_multiplied(mode, fan):
    ns, token, gave_up, error = hop_probe.hop_ns(mode, rounds=300, fan=fan)
    assert token == (fan + 1) * 300 and not gave_up and 50 < ns < 100_000
    assert error is None if mode not in hop_probe.CONSUMER else abs(error) < 1e-3
