"""The GPU check, one command: `python -m batchgen.bench.gpu_check` (what it runs, in what time: command.py).

command.py (the arguments, the parts in order, the JSON file rewritten after each), models.py (shapes,
seeded weights, engine configs, greedy runs), correctness.py (part 1), speed.py (parts 2 and 3: speed
configurations, kernels alone, the HF peer), tensor_parallel.py (part 4), table.py (the closing table).
"""

from batchgen.bench.gpu_check.command import main, parse_args, run
from batchgen.bench.gpu_check.table import format_table

__all__ = ["format_table", "main", "parse_args", "run"]
