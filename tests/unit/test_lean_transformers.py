"""models/load.py lean_transformers: where scikit-learn and SciPy are installed, loading a model and its tokenizer the
way shardwise does imports neither (transformers would import them with its generation and loss modules, for code
a causal LM's training never runs: 2 s before the first step on the H200 machine). A fresh interpreter, with
stand-in packages of those names on its path that leave a mark when imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import importlib.util, json, sys
import torch
from shardwise.models.load import load_model, load_tokenizer
tok = load_tokenizer(sys.argv[1])
model = load_model(sys.argv[1], torch.float32)
logits = model(input_ids=torch.tensor([tok("hello world")["input_ids"]])).logits
from transformers.utils import import_utils
print(json.dumps({
    "findable": [importlib.util.find_spec(p) is not None for p in ("sklearn", "scipy")],
    "transformers_would_say": [import_utils._is_package_available(p)[0] for p in ("sklearn", "scipy")],
    "transformers_says": [import_utils.is_sklearn_available(), import_utils.is_scipy_available()],
    "imported": sorted(m for m in ("sklearn", "scipy") if m in sys.modules),
    "logits_finite": bool(torch.isfinite(logits).all()),
    "generation_imported": "transformers.generation.utils" in sys.modules,
}))
"""


def _stand_in(root, name: str, sub: str, body: str) -> None:
    """A package `name` whose import writes a mark file, with a submodule `sub` defining `body`."""
    pkg = root / name
    (pkg / sub).mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"open({str(root / (name + '.imported'))!r}, 'w').close()\n")
    (pkg / sub / "__init__.py").write_text(body)


def test_loading_a_model_imports_neither_scikit_learn_nor_scipy(tmp_path, tiny_dir):
    _stand_in(tmp_path, "sklearn", "metrics", "def roc_curve(*a, **k):\n    raise RuntimeError\n")
    _stand_in(tmp_path, "scipy", "optimize", "def linear_sum_assignment(*a, **k):\n    raise RuntimeError\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.run([sys.executable, "-c", SCRIPT, tiny_dir], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    # the stand-ins were there to be found, and transformers' own check would have reported both installed
    assert r["findable"] == [True, True] and r["transformers_would_say"] == [True, True]
    # the model and tokenizer loaded (generation module included) and ran; neither package was imported
    assert r["generation_imported"] and r["logits_finite"]
    assert r["imported"] == [] and not list(tmp_path.glob("*.imported"))
    assert r["transformers_says"] == [False, False]
