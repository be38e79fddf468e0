"""batchgen.pipeline: jobs (config, read, order, feed the engine, write, resume, report, CLI)."""
