"""Import names: the repo's `kernels/` and `engine/` are `ddbench.kernels` / `ddbench.engine`
only, so Hugging Face's `kernels` package (which transformers imports at start-up) is never
shadowed: once it was, and `from transformers import ...` failed with "cannot import name
'CUDAProperties' from 'kernels'"."""
import json
import subprocess
import sys
from importlib.metadata import packages_distributions
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def repo_folder(origin: str, name: str) -> bool:
    """Is `origin` (a module's __file__) the repo's own top-level folder `name`?"""
    return Path(origin).resolve().parent == (ROOT / name).resolve()


def test_distribution_exposes_only_ddbench():
    ours = sorted(top for top, dists in packages_distributions().items() if "ddbench" in dists)
    assert ours == ["ddbench"]


def test_subpackages_resolve_from_anywhere(tmp_path):
    # from a folder outside the repo: ddbench.kernels / ddbench.engine are the repo's folders,
    # and a bare `kernels` / `engine` is never the repo's (absent, or another distribution's)
    code = ("import json, importlib.util as u\n"
            "spec = lambda n: (lambda s: s and s.origin)(u.find_spec(n))\n"
            "print(json.dumps({n: spec(n) for n in ('ddbench.kernels.moe', 'ddbench.engine.model', 'kernels', 'engine')}))")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    # the repo's own code (its top-level folders hold no __init__.py: namespace packages, which
    # never shadow a regular package of the same name elsewhere on sys.path)
    for mod, name, file in (("ddbench.kernels.moe", "kernels", "moe.py"), ("ddbench.engine.model", "engine", "model.py")):
        rel = Path(got[mod]).resolve().relative_to(ROOT.resolve())
        assert rel.parts == (name, file), rel
    for name in ("kernels", "engine"):
        assert got[name] is None or not repo_folder(got[name], name), got


@pytest.mark.skipif(find_spec("transformers") is None, reason="needs transformers (the test extra)")
def test_transformers_model_classes_work_from_the_repo_root():
    # started from the repo root, as `python -m pytest` and `python -m ddbench` are: the
    # working directory is on sys.path. A tiny Llama from a config, fresh random weights and
    # ids: its forward runs, and its greedy first token is the forward's last-position argmax.
    code = r'''
import os, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import ddbench.kernels, ddbench.engine  # the repo's own names import beside transformers'
torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
model = LlamaForCausalLM(cfg).eval()
ids = torch.randint(1, 97, (2, 9))
with torch.no_grad():
    logits = model(ids).logits
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
assert logits.shape == (2, 9, 97) and torch.isfinite(logits).all() and logits.abs().sum() > 0
assert torch.equal(gen[:, -1], logits[:, -1].argmax(-1)), (gen, logits[:, -1].argmax(-1))
hf = sys.modules.get("kernels")
print("ok", getattr(hf, "__file__", None))
'''
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    status, hf_kernels = p.stdout.split()
    assert status == "ok"
    assert hf_kernels == "None" or not repo_folder(hf_kernels, "kernels")
