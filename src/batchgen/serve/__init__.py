"""`batchgen serve`: an OpenAI-compatible HTTP server on the engine (needs the `serve` extra)."""
