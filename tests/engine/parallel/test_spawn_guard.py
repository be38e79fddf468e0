"""Tensor parallelism from a plain script: an engine built at the script's unguarded top level is refused
before any worker starts (spawn would build it again in each), naming the line; under the
`if __name__ == "__main__":` guard the check lets it through."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from batchgen.engine.parallel.spawn_guard import is_guarded_line
from tests.conftest import MODEL

SCRIPT = textwrap.dedent("""\
    import sys
    from batchgen.engine import LLM


    def main():
        return LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32", kv_cache_memory="32MiB",
                   max_model_len=256)


    main()
    if __name__ == "__main__":
        main()
""")


def test_the_guard_is_read_from_the_source():
    assert not is_guarded_line(SCRIPT, 10)  # the bare main() call
    assert is_guarded_line(SCRIPT, 12)  # the one under the guard
    reversed_test = SCRIPT.replace('__name__ == "__main__"', '"__main__" == __name__')
    assert is_guarded_line(reversed_test, 12)
    other_test = SCRIPT.replace('__name__ == "__main__"', '__name__ == "x"')
    assert not is_guarded_line(other_test, 12)


@pytest.mark.subprocess
def test_an_unguarded_script_is_refused_before_workers_start(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), MODEL], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "UnguardedMainError" in done.stderr and f"{script}'s top level" in done.stderr, done.stderr[-2000:]
    assert "line 10 builds the engine there" in done.stderr
    assert "WorkerDiedError" not in done.stderr  # no worker ran the script again
