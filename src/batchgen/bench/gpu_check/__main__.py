"""`python -m batchgen.bench.gpu_check`."""

import sys

from batchgen.bench.gpu_check.command import main

sys.exit(main())
