"""Code shipped in a model folder is never run: the tokenizer loads with trust_remote_code=False.

Before, transformers asked "Do you wish to run the custom code? [y/N]" on a terminal and ran it on "y".
"""

from __future__ import annotations

import ast
import builtins
import json
from pathlib import Path

import pytest

import batchgen.engine
import batchgen.pipeline
from batchgen.engine.loader.source import ModelSource
from batchgen.engine.text.tokenizer import Tokenizer


@pytest.fixture
def folder_with_custom_code(llm, tmp_path):
    """The bundled tokenizer saved as files, whose tokenizer_config maps AutoTokenizer to a planted module."""
    folder = tmp_path / "model"
    llm.engine.tokenizer.hf.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)  # no built-in class to fall back on: transformers must decide
    config["auto_map"] = {"AutoTokenizer": ["planted.Planted", "planted.Planted"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    marker = tmp_path / "planted-code-ran"
    (folder / "planted.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                       "from transformers import PreTrainedTokenizerFast as Planted\n")
    return folder, marker


def test_planted_tokenizer_code_is_refused_not_run(folder_with_custom_code, monkeypatch):
    folder, marker = folder_with_custom_code
    asked = []
    monkeypatch.setattr(builtins, "input", lambda *args: asked.append(args) or "y")  # a user who says yes
    with pytest.raises(ValueError, match="custom code"):
        Tokenizer(ModelSource(folder))
    assert not marker.exists() and asked == []


def test_every_from_pretrained_call_pins_trust_remote_code_false():
    """Any `*.from_pretrained(...)` in the engine or pipeline source passes trust_remote_code=False."""
    calls = []
    for package in (batchgen.engine, batchgen.pipeline):
        for path in Path(package.__file__).resolve().parent.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained":
                    pinned = [k for k in node.keywords if k.arg == "trust_remote_code"]
                    is_false = len(pinned) == 1 and isinstance(pinned[0].value, ast.Constant) \
                        and pinned[0].value.value is False
                    calls.append((f"{path.name}:{node.lineno}", is_false))
    assert any(name.startswith("tokenizer.py") for name, _ in calls)
    assert [name for name, is_false in calls if not is_false] == []
