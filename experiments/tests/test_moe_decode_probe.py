"""experiments.scripts.moe_decode_probe: every variant's patches find their text in today's
kernels/moe_decode.cu and change it (the compile is checked in test_compile.py)."""
import pytest

from experiments.scripts import moe_decode_probe


@pytest.mark.parametrize("variant", sorted(moe_decode_probe.PATCHES))
def test_variant_patches_apply(variant):
    text = moe_decode_probe.patched(variant)
    assert text != moe_decode_probe.SRC.read_text()
    for _, new in moe_decode_probe.PATCHES[variant]:
        assert new in text
