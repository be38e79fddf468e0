"""Run a bench workload through vLLM and write timings and output token ids as JSON.

Executed as a script by the vLLM environment's Python (bench/peers/vllm_cpu.py starts it): it imports
vLLM and the standard library only, never batchgen.

    python vllm_driver.py --request request.json --result result.json

request.json: {"model_dir", "dtype", "seed", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
"num_reps", "requests": [{"request_id", "prompt_token_ids", "output_len"}, ...]}.
result.json: {"load_seconds", "warmup_seconds", "reps": [{"seconds", "num_prompt_tokens",
"num_completion_tokens"}], "output_token_ids": {request_id: [...]}, "versions", "dtype", "settings"}.

The clock covers `LLM.generate` over the whole workload only (token ids in: no tokenizing); loading,
compiling and a warm-up on other prompts come first and are reported apart. Greedy, ignore_eos and
min_tokens = max_tokens: every request yields exactly its output length. The prefix cache is reset
before each repetition, so a repetition never reuses the one before it.
"""

from __future__ import annotations

import argparse
import json
import time


def _params(SamplingParams, output_len: int, seed: int):
    return SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True,
                          seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--request", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    with open(args.request) as f:
        request = json.load(f)

    start = time.perf_counter()
    import torch
    import transformers
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["model_dir"], dtype=request["dtype"], seed=request["seed"],
              max_model_len=request["max_model_len"], max_num_seqs=request["max_num_seqs"],
              max_num_batched_tokens=request["max_num_batched_tokens"], skip_tokenizer_init=False)
    load_seconds = time.perf_counter() - start

    requests = request["requests"]
    # Warm-up: a few prompts that share no prefix with the workload (token ids from its far end).
    start = time.perf_counter()
    warm_prompts = [{"prompt_token_ids": list(range(1000 + 50 * i, 1000 + 50 * i + 16 + 8 * i))} for i in range(4)]
    llm.generate(warm_prompts, [_params(SamplingParams, 4, request["seed"])] * len(warm_prompts), use_tqdm=False)
    warmup_seconds = time.perf_counter() - start

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [_params(SamplingParams, r["output_len"], request["seed"]) for r in requests]
    reps, outputs = [], {}
    for _ in range(request["num_reps"]):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        outputs = {r["request_id"]: list(out.outputs[0].token_ids) for r, out in zip(requests, results)}
        reps.append({"seconds": seconds,
                     "num_prompt_tokens": sum(len(out.prompt_token_ids) for out in results),
                     "num_completion_tokens": sum(len(t) for t in outputs.values())})

    config = llm.llm_engine.vllm_config
    result = {
        "load_seconds": load_seconds, "warmup_seconds": warmup_seconds, "reps": reps,
        "output_token_ids": outputs, "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "settings": {"max_num_seqs": config.scheduler_config.max_num_seqs,
                     "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                     "max_model_len": config.model_config.max_model_len,
                     "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
                     "torch_threads": torch.get_num_threads()},
    }
    with open(args.result, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
