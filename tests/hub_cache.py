"""A Hugging Face cache layout in a test folder holding the bundled model, as `hf download` leaves one.

models--{org}--{name}/refs/{branch or tag} hold commit hashes; snapshots/{commit}/ hold the repo's
files at that commit. A GGUF repository's snapshot holds its .gguf file: the bundled GGUF is linked
there (the cache links snapshot files to blobs/ the same way), so no weights are copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO_ID = "TestOrg/SmolLM2-135M-Instruct-GGUF"
MAIN_COMMIT = "1" * 40
V1_COMMIT = "2" * 40  # the tag v1
MISSING_REPO_ID = "TestOrg/not-downloaded"


@dataclass(frozen=True)
class HubCache:
    root: Path  # what HF_HUB_CACHE names
    repo_id: str

    def snapshot(self, commit: str) -> Path:
        org, name = self.repo_id.split("/")
        return self.root / f"models--{org}--{name}" / "snapshots" / commit

    @property
    def env(self) -> dict[str, str]:
        return {"HF_HUB_CACHE": str(self.root), "HF_HUB_OFFLINE": "1"}


def make_hub_cache(root: Path, gguf: Path, repo_id: str = REPO_ID) -> HubCache:
    """refs/main -> MAIN_COMMIT and refs/v1 -> V1_COMMIT, each snapshot holding the bundled .gguf."""
    org, name = repo_id.split("/")
    repo = root / f"models--{org}--{name}"
    (repo / "refs").mkdir(parents=True)
    (repo / "blobs").mkdir()
    for ref, commit in (("main", MAIN_COMMIT), ("v1", V1_COMMIT)):
        (repo / "refs" / ref).write_text(commit)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (snapshot / gguf.name).symlink_to(gguf)
    return HubCache(root, repo_id)
