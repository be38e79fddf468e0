"""The documented lm-evaluation-harness command lines, run as a user runs them: through the shell, with
lm-eval's own CLI, against a `batchgen serve` this module starts.

The lines are read from the guide (docs/guides/evaluation.md, the bash block of "lm-evaluation-harness
against `batchgen serve`": the one source of truth). The test changes only what a user's machine would:
the server's address (a free port), the benchmark (a local stand-in of the same kind, as lm-eval cannot
download here) and, appended, `--include_path`, `--limit` and `--output_path`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.metrics.lm_eval_tasks import GEN_TASK, MC_TASK, write_tasks
from tests.serve.server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.subprocess]

GUIDE = Path(__file__).parents[2] / "docs" / "guides" / "evaluation.md"
SECTION = "## lm-evaluation-harness against `batchgen serve`"
DOCUMENTED_ADDRESS = "http://127.0.0.1:8000"
# The documented benchmark -> (a local task of the same output type, the metric its results must hold,
# and the metric's filter: "none", or the generate task's strict-match regex filter).
STAND_INS = {"hellaswag": (MC_TASK, "acc", "none"), "gsm8k": (GEN_TASK, "exact_match", "strict-match")}
LIMIT = 4
CLI_TIMEOUT_S = 300


def documented_lines() -> list[str]:
    """The section's bash block as shell lines (backslash continuations joined)."""
    section = GUIDE.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"{GUIDE}: no bash block under {SECTION!r}"
    return [line.strip() for line in block.group(1).replace("\\\n", " ").splitlines() if line.strip()]


def lm_eval_lines() -> list[str]:
    lines = [line for line in documented_lines() if line.startswith(("lm_eval ", "lm-eval "))]
    assert len(lines) == 2, lines  # a completions and a chat-completions example
    return lines


def model_args(line: str) -> dict[str, str]:
    args = shlex.split(line)
    return dict(pair.split("=", 1) for pair in args[args.index("--model_args") + 1].split(","))


def test_the_documented_server_and_lm_eval_lines_name_the_same_model_and_address():
    serve = shlex.split(next(line for line in documented_lines() if line.startswith("batchgen serve ")))
    for line in lm_eval_lines():
        args = model_args(line)
        assert args["model"] == serve[2], line
        assert args["base_url"].startswith(f"http://127.0.0.1:{serve[serve.index('--port') + 1]}/v1/"), line


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("serve") / "server.log")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def runnable(line: str, base_url: str, tasks: Path, output: Path) -> tuple[str, tuple[str, str, str]]:
    """(the shell command, its stand-in: task, metric, filter)."""
    benchmark = shlex.split(line)[shlex.split(line).index("--tasks") + 1]
    assert benchmark in STAND_INS, f"the guide's task {benchmark!r} has no local stand-in in STAND_INS"
    task = STAND_INS[benchmark][0]
    assert DOCUMENTED_ADDRESS in line, line
    command = line.replace(DOCUMENTED_ADDRESS, base_url).replace(f"--tasks {benchmark}", f"--tasks {task}")
    command += (f" --include_path {shlex.quote(str(tasks))} --limit {LIMIT}"
                f" --output_path {shlex.quote(str(output))}")
    return command, STAND_INS[benchmark]


def test_the_documented_lm_eval_lines_run_through_the_shell(server, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    write_tasks(tasks)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    runs = []
    for i, line in enumerate(lm_eval_lines()):  # both at once: most of each is lm-eval importing itself
        command, stand_in = runnable(line, server.base_url, tasks, tmp_path / f"results{i}")
        proc = subprocess.Popen(command, shell=True, env=env, cwd=tmp_path, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        runs.append((command, stand_in, tmp_path / f"results{i}", proc))
    for command, (task, metric, filter_name), output, proc in runs:
        try:
            printed, _ = proc.communicate(timeout=CLI_TIMEOUT_S)
        finally:
            proc.kill()
        assert proc.returncode == 0, f"{command}\nexited {proc.returncode}:\n{printed[-4000:]}"
        # lm-eval's result table, and its results file, hold the task's metric over LIMIT items.
        header = re.search(r"^\|\s*Tasks\s*\|.*\|\s*Metric\s*\|", printed, re.M)
        assert header, printed[-4000:]
        table = printed[header.start():]
        assert re.search(rf"^\|\s*{task}\s*\|", table, re.M), printed[-4000:]
        assert re.search(rf"^\|.*\|\s*{filter_name}\s*\|.*\|\s*{metric}\s*\|", table, re.M), printed[-4000:]
        (results_file,) = output.rglob("results_*.json")
        results = json.loads(results_file.read_text())
        assert 0.0 <= results["results"][task][f"{metric},{filter_name}"] <= 1.0
        assert results["n-samples"][task]["effective"] == LIMIT
