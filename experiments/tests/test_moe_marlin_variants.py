"""experiments.scripts.moe_marlin_variants: each variant changes today's kernels/moe_marlin.cu and
keeps its kernels (the compile is checked in test_compile.py)."""
import pytest

from experiments.scripts import moe_marlin_variants as mv


@pytest.mark.parametrize("variant", sorted(mv.VARIANTS))
def test_variant_changes_the_source(variant):
    src = mv.SRC.read_text()
    text = mv.VARIANTS[variant][0](src)
    assert text != src
    for name in ("moe_plan(", "moe_w13(", "moe_w2(", "void stream("):
        assert text.count(name) == src.count(name) == 1


def test_replace_stream_swaps_only_the_stream_function():
    src = mv.SRC.read_text()
    text = mv.replace_stream(src, "// stream\n")
    assert "void stream(" not in text and "// stream\n" in text
    assert len(src) - len(text) < 6000                      # the function, not the rest of the file
    assert text.startswith(src[:src.index(mv.STREAM_HEAD)])
