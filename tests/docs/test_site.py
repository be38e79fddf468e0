"""The documentation site: `mkdocs build --strict` passes (every link and anchor resolves, every page is in
the nav), the reference pages in it are the ones generated from the code, the module paths the pages
name exist, and the architecture page's layout lists the package's folders as they are."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.cli.reference import render_reference_pages

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "batchgen"


def page_html(site: Path, src_uri: str) -> Path:
    """Where mkdocs writes the page docs/`src_uri` (directory URLs: guides/x.md -> guides/x/index.html)."""
    stem = src_uri.removesuffix(".md")
    return site / (f"{stem.removesuffix('index')}index.html" if stem.endswith("index") else f"{stem}/index.html")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built by `mkdocs build --strict` in a child process (its tests carry the subprocess mark)."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


@pytest.mark.subprocess
def test_the_strict_build_renders_every_page(site):
    pages = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "hooks" not in p.parts]
    assert len(pages) > 20
    for src_uri in [*pages, *render_reference_pages()]:
        assert page_html(site, src_uri).is_file(), src_uri


@pytest.mark.subprocess
def test_the_reference_pages_are_generated_not_written(site):
    generated = render_reference_pages()
    assert set(generated) == {"reference/job-file.md", "reference/engine.md", "reference/server.md",
                              "reference/cli.md"}
    for src_uri in generated:
        assert not (DOCS / src_uri).exists(), f"docs/{src_uri} is generated; a copy on disk would drift"
    # What the code defines is what the built pages show.
    assert "max_num_seqs" in page_html(site, "reference/job-file.md").read_text()
    assert "rows_per_unit" in page_html(site, "reference/job-file.md").read_text()
    assert "max_num_batched_tokens" in page_html(site, "reference/engine.md").read_text()
    assert "--max-request-body-bytes" in page_html(site, "reference/server.md").read_text()
    assert "finalize" in page_html(site, "reference/cli.md").read_text()


def test_the_hook_refuses_a_hand_written_reference_page(tmp_path):
    from mkdocs.config import load_config
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File, Files

    config = load_config(str(ROOT / "mkdocs.yml"))  # registers docs/hooks/reference.py as a plugin
    written = Files([File("reference/job-file.md", str(DOCS), str(tmp_path), True)])
    with pytest.raises(PluginError, match="reference/job-file.md is generated"):
        config.plugins.on_files(written, config=config)
    files = config.plugins.on_files(Files([]), config=config)
    assert sorted(f.src_uri for f in files) == sorted(render_reference_pages())
    assert all(f.generated_by for f in files)


CODE_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w.-]+\.(?:py|c|h|sh|j2))\b")


def test_module_paths_named_in_the_docs_exist():
    """A path like `engine/core/scheduler.py` (relative to src/batchgen/, or to the repository, or a
    package's own path like `peers/vllm_driver.py`) names a file that is there. The history pages are a
    dated log and keep the paths of their day."""
    known = [p.relative_to(ROOT).as_posix() for p in ROOT.glob("*/**/*") if p.is_file() and ".git" not in p.parts]
    missing = []
    for page in DOCS.rglob("*.md"):
        if "history" in page.parts:
            continue
        for path in set(CODE_PATH.findall(page.read_text())):
            if not any(k == path or k.endswith("/" + path) for k in known):
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert missing == []


def test_the_architecture_layout_lists_every_package_folder():
    """The "Layout" tree on the architecture page names each folder under src/batchgen/ (nested by its
    indent, two spaces a level), and only folders that are there."""
    page = (DOCS / "design" / "architecture.md").read_text()
    tree = re.search(r"## Layout\n.*?```\n(src/batchgen/\n.*?)```", page, re.S).group(1)
    listed, parents = set(), []
    for line in tree.splitlines()[1:]:
        entry = re.match(r"( +)([\w.-]+/)", line)
        if entry is None:  # a module (`__init__.py ...`) or a description's continuation line
            continue
        depth = len(entry.group(1)) // 2 - 1
        parents[depth:] = [entry.group(2).rstrip("/")]
        listed.add("/".join(parents))
    folders = {p.relative_to(SRC).as_posix() for p in SRC.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    assert listed == folders
