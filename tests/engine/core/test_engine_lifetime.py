"""An engine dropped by its caller is freed at once, with its KV pool: nothing inside it points back at
it, so it does not wait for the cycle collector (benchmarks and tests build engine after engine over
one set of weights; seven 4 GiB pools waiting for a collection were killed for memory)."""

from __future__ import annotations

import gc
import weakref

from batchgen.engine import LLMEngine, SamplingParams


def test_a_dropped_engine_is_freed_without_the_cycle_collector(llm):
    base = llm.engine
    gc.disable()  # a collection in between would hide a cycle
    try:
        engine = LLMEngine(base.config.replace(num_kv_blocks=64, max_model_len=512), weights_from=base)
        engine.add_request("r", "Hello", SamplingParams(temperature=0, max_tokens=3))
        while engine.has_unfinished():
            engine.step()
        kv_caches = [weakref.ref(t) for t in engine.runner.kv_caches[:1]]
        engine_ref = weakref.ref(engine)
        del engine
        assert engine_ref() is None
        assert all(ref() is None for ref in kv_caches)
    finally:
        gc.enable()
