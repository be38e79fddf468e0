"""`python -m batchgen.bench`: the same command as `batchgen bench`."""

from batchgen.bench.cli import main

main()
