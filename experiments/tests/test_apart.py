"""The product does not depend on the experiments: nothing under ddbench/, engine/ or kernels/
imports `experiments`, and no product CUDA source includes the probes' header."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_product_module_imports_experiments():
    bad = [f"{p.relative_to(ROOT)}:{i}" for d in ("ddbench", "engine", "kernels") for p in (ROOT / d).glob("*.py")
           for i, line in enumerate(p.read_text().splitlines(), 1)
           if re.match(r"\s*(from|import)\s+experiments\b", line)]
    assert not bad, bad


def test_no_product_kernel_includes_the_probe_header():
    bad = [p.name for p in (ROOT / "kernels").glob("*.cu*") if "PROBE_COMMON" in p.read_text()
           or "probe_common" in p.read_text()]
    assert not bad, bad
