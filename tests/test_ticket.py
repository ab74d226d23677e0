"""kernels.ticket.counters: one zeroed buffer per (device, key), grown without freeing the old one."""
import torch

from ddbench.kernels import ticket


def test_counters_share_a_buffer_per_key_and_grow_without_freeing():
    def grow(n, device="cpu"):
        return ticket.counters(device, "test-grow", n, size=8)

    a = grow(5)
    assert a.dtype == torch.int32 and a.shape == (5,) and not a.any()
    assert grow(8, torch.device("cpu")).data_ptr() == a.data_ptr()  # same buffer while n fits
    assert ticket.counters("cpu", "test-other", 4).data_ptr() != a.data_ptr()  # keys never share

    a[:3] = 7  # a kernel would leave them zero; marks which buffer is which here
    big = grow(9)
    assert big.shape == (9,) and not big.any() and big.data_ptr() != a.data_ptr()
    held = ticket._BUFFERS[("cpu", "test-grow")]
    assert [t.numel() for t in held] == [8, 16]          # doubled; the old buffer still allocated
    assert held[0].data_ptr() == a.data_ptr() and held[0][:3].tolist() == [7, 7, 7]
    assert grow(16).data_ptr() == big.data_ptr()
    assert grow(40).numel() == 40 and held[-1].numel() == 40  # n past twice the size: n
