"""Which engine settings are job keys, and the only places where a job differs from the engine.

The job file's `model`, `engine` and `sampling` sections are EngineConfig's and SamplingParams'
fields: names, types, defaults and checks come from those dataclasses (pipeline/config.py derives
the sections and validates a job by constructing them). This file holds what the dataclasses cannot
say: which EngineConfig field sits under `model:`, the fields that are not job keys and why, the job
defaults that deliberately differ from the engine's and why, and which sampling keys a row may set.
"""

from __future__ import annotations

# EngineConfig fields under `model:` (they say what is loaded); EngineConfig.model is `model.path`.
# Every other EngineConfig field not in ENGINE_ONLY sits under `engine:`.
MODEL_KEYS = ("revision", "dtype", "quantization", "fp8_mode", "quantize_lm_head", "int_calibration", "max_model_len",
              "generation_config", "reasoning_parser", "tool_call_parser")
MODEL_PATH_FIELD = "model"
# `model:` keys that are not EngineConfig fields: model.path (EngineConfig.model), and the LoRA adapters
# (each row's LoRARequest; the engine only needs enable_lora, which they turn on).
MODEL_JOB_KEYS = ("path", "lora_modules")

# `engine:` keys that change outputs, so they join the config hash (when not at their default, so a
# job that leaves them alone keeps its hash): an FP8 KV cache changes the numbers attention reads.
KV_CACHE_HASH_KEYS = ("kv_cache_dtype", "calculate_kv_scales")

# Keys of hashed sections that joined the job file after jobs had been run: hashed only when set to
# something other than their default, so the output folders of jobs that leave them alone keep their
# config hash (and resume).
HASHED_WHEN_SET = {
    "model": ("revision", "generation_config", "reasoning_parser", "tool_call_parser", "lora_modules"),
    "input": ("chat_template", "chat_template_kwargs", "continuations_column", "continuation_column",
              "prompt_template", "tools_column", "tools", "tool_choice", "parallel_tool_calls", "completion_column",
              "lora_column"),
    "sampling": ("include_stop_str_in_output", "beam_width", "length_penalty", "early_stopping",
                 "thinking_token_budget"),
}

# EngineConfig fields that are not job keys, with the reason.
ENGINE_ONLY = {
    "num_kv_blocks": "fixes the KV pool's size by hand (tests, capacity experiments); a job sizes it "
                     "with engine.kv_cache_memory",
    "num_threads": "a process-wide torch setting: the CLI leaves torch's default (OMP_NUM_THREADS); "
                   "the bench and Python callers set it",
    "compile": "torch.compile of the elementwise ops, a Python-API experiment: nothing in the project "
               "sets it, the CPU's C kernels replace those ops and it brought no gain there",
    "seed": "keys requests that carry no seed (LLM calls, a server's requests); every job row is keyed by "
            "sampling.seed and its id",
    "merged_lora": "a job whose model.lora_modules holds one adapter and sets no input.lora_column runs it on "
                   "every row: the job merges it at load itself",
    "runner": "a job's task says what runs: task: reward needs a sequence classifier (auto detects it from "
              "the checkpoint's architecture), the generating tasks a causal LM",
}

# SamplingParams fields that are not job keys, with the reason.
SAMPLING_ONLY = {
    "skip_special_tokens": "the completion column is always the text without special tokens; the "
                           "token ids column keeps every token",
    "guided_decoding": "vLLM's older name of structured_outputs; a job sets the constraint as "
                       "sampling.structured",
    "prompt_logprobs": "a job scores text with task: loglikelihood (each given continuation's "
                       "log-probability after the prompt); the prompt's own log-probabilities are the "
                       "Python API's and the server's (echo)",
    "output_kind": "a job writes each request once, when it finishes (FINAL_ONLY); per-step outputs are "
                   "for streams (the server's, an LLMEngine caller's)",
}

# Job keys that set a SamplingParams field of another name, with why: job key -> (field, reason).
SAMPLING_RENAMED = {
    "structured": ("structured_outputs", "a job's constraint may be a schema file relative to the job file "
                                         "(json_file), which StructuredOutputsParams does not read"),
}

# (section, key): (the job's default, why it differs from the engine's default).
JOB_DEFAULTS = {
    ("model", "max_model_len"): (
        4096, "a bounded context per request (models declare 32k-128k, which sizes KV pools and error "
              "rows for the largest case); null: the model's own"),
    ("model", "generation_config"): (
        "vllm", ("a job's sampling section is its defaults, so a job's rows do not change when a model "
                 "ships a generation_config.json (auto: its values fill the sampling keys the job file does "
                 "not set, recorded in _SUCCESS); the engine and the server keep vLLM's auto: LLM.generate "
                 "and LLM.chat without sampling_params, and a request's unset fields, take the model's "
                 "generation_config.json values")),
    ("sampling", "temperature"): (
        0.0, "greedy: a job's outputs are reproducible and comparable run to run unless it asks for "
             "sampling (the engine keeps vLLM's 1.0)"),
    ("sampling", "max_tokens"): (
        256, "a completion long enough to be a dataset row (the engine keeps vLLM's 16)"),
    ("sampling", "logprobs"): (
        False, "the job file spells it false | true (token_logprobs: the chosen tokens') | N (also "
               "top_logprobs: the N most likely); false is the engine's None, true its 0"),
    ("sampling", "seed"): (
        0, "every job is reproducible: samples are keyed by (seed, request id, sample index), so "
           "resumes, ordering and batching never change a row (the engine's None also means 0)"),
}

# SamplingParams fields a per-row column may override (sampling_columns). n, seed and logprobs
# change the job's shape or its reproducibility contract; stop and stop_token_ids are lists (and
# stop_token_ids are checked against the vocabulary once, before any generation): they stay job-wide.
ROW_OVERRIDABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "max_tokens", "min_tokens", "ignore_eos")

