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


def test_replace_between_replaces_one_span():
    assert mv.replace_between("a [x] b [y] c", "[", "]", "Z") == "a Z b [y] c"
    with pytest.raises(ValueError):
        mv.replace_between("a b", "[", "]", "Z")


def test_replace_all_needs_each_old_text_once():
    assert mv.replace_all("ab", [("a", "x"), ("b", "y")]) == "xy"
    with pytest.raises(ValueError):
        mv.replace_all("aa", [("a", "x")])


def test_addr_patches_only_the_stage_loop():
    src = mv.SRC.read_text()
    text = mv.VARIANTS["addr"][0](src)
    head = src.index(mv.STREAM_HEAD)
    assert text.startswith(src[:head]) and "lds128(slot" in text and "issue(st0 + i)" not in text
    tail = "// stream over the item's ngv valid groups"            # the code after `stream`
    assert text[text.index(tail):] == src[src.index(tail):]
