"""batchgen.bench: `batchgen bench` and the measurements behind it.

Workloads (workloads.py) run through the engine (engine_side.py) and HF transformers (peer.py),
timed (result.py), against a roofline (roofline.py) from the machine's measured GEMM rate
(gemm_rate.py), on a recorded machine (machine.py); harness.py orchestrates a run (options.py: its
settings), batchgen/cli/bench.py is the command, report.py prints it. quality.py measures FP8 drift
against the unquantized model; gpu_check/ is the one-command check for a GPU (correctness, speed,
peer); overhead.py measures the engine's host time per step with a null model;
batchgen.engine.quant.calibrate.sequence_runner runs a bare model with a private KV cache for both
(and for the calibration pass of `int_calibration: activation_aware`). Depends on batchgen.engine and
batchgen.pipeline; neither imports it (the `batchgen` command line, batchgen/cli/, registers `bench`).
"""
