"""Bench workloads: the same prompt token ids for the engine and the peer.

Every workload is built once, before any timing, as token ids; both sides receive exactly these ids,
so tokenization and chat templating are outside the measurement and cannot differ between them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchgen.engine.text.token_prefix import num_shared_prefix

# overhead: bench/overhead.py (null model); serve: random prompts through `batchgen serve`; copy:
# bench/copy_bench.py (speculative decoding on prompts whose answers copy them); score:
# bench/score_bench.py (continuations scored after shared contexts); moe-layer: bench/moe_layer.py (one
# MoE block's forward against transformers' block and a per-expert loop); reward: bench/reward_bench.py
# ((prompt, completion) pairs scored by a reward model, 4 completions per prompt); moe: the random
# workload on a small random-weight Qwen3-MoE (bench/moe_model.py), with the MoE layers' share of the run;
# lora: bench/lora_bench.py (4 LoRA adapters mixed, and one merged at load, against the base model)
WORKLOADS = ("random", "chat", "shared-prefix", "overhead", "serve", "copy", "score", "moe-layer", "reward", "moe",
             "lora")
CHAT_PROMPTS_FILE = "chat_prompts.parquet"


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class Workload:
    """Requests plus how they were made (`params`, recorded in the results)."""

    name: str
    requests: list[BenchRequest]
    params: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(r.prompt_token_ids) for r in self.requests]

    @property
    def output_lens(self) -> list[int]:
        return [r.output_len for r in self.requests]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> dict:
        lens = self.prompt_lens
        return {"name": self.name, "num_requests": self.num_requests, "num_prompt_tokens": self.num_prompt_tokens,
                "num_completion_tokens": self.num_completion_tokens,
                "prompt_len_min": min(lens), "prompt_len_max": max(lens), **self.params}


def special_token_ids(hf_tokenizer) -> set[int]:
    """Ids a random prompt must not contain: the tokenizer's special and added-special tokens."""
    ids = set(hf_tokenizer.all_special_ids)
    ids.update(i for i, tok in getattr(hf_tokenizer, "added_tokens_decoder", {}).items() if tok.special)
    return ids


# ---- random ---------------------------------------------------------------------------------------
def random_workload(num_requests: int, input_len_min: int, input_len_max: int, output_len: int, seed: int,
                    vocab_size: int, excluded_token_ids: set[int] = frozenset()) -> Workload:
    """vLLM-style random prompts: lengths uniform in [min, max], token ids uniform over the vocab
    minus the excluded (special) ids; a seed gives the same prompts on every machine."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not 1 <= input_len_min <= input_len_max:
        raise ValueError(f"need 1 <= input_len_min <= input_len_max, got {input_len_min}, {input_len_max}")
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(excluded_token_ids, dtype=np.int64))
    rng = np.random.default_rng(seed)
    lens = rng.integers(input_len_min, input_len_max + 1, size=num_requests)
    requests = [BenchRequest(f"random-{i}", rng.choice(allowed, size=int(n)).tolist(), output_len)
                for i, n in enumerate(lens)]
    return Workload("random", requests, {"input_len_min": input_len_min, "input_len_max": input_len_max,
                                         "output_len": output_len, "seed": seed})


# ---- chat -----------------------------------------------------------------------------------------
def default_chat_prompts_path() -> Path:
    """The committed prompt set: jobs/data/ beside the source tree (editable install), else under cwd."""
    # src/batchgen/bench/ -> the checkout
    repo_file = Path(__file__).resolve().parents[3] / "jobs" / "data" / CHAT_PROMPTS_FILE
    return repo_file if repo_file.exists() else Path("jobs") / "data" / CHAT_PROMPTS_FILE


def read_chat_prompts(path: Path) -> list[tuple[str, list[dict]]]:
    """(id, messages) rows from a Parquet file with an `id` column and `messages` or `prompt`."""
    import pyarrow.parquet as pq

    if not Path(path).exists():
        raise FileNotFoundError(f"chat prompt set {path} not found; give one with --prompts FILE")
    table = pq.read_table(path)
    columns = set(table.column_names)
    if "messages" in columns:
        conversations = table.column("messages").to_pylist()
    elif "prompt" in columns:
        conversations = [[{"role": "user", "content": p}] for p in table.column("prompt").to_pylist()]
    else:
        raise ValueError(f"{path}: needs a `messages` or a `prompt` column; it has {sorted(columns)}")
    ids = table.column("id").to_pylist() if "id" in columns else list(range(table.num_rows))
    return [(str(i), [{"role": m["role"], "content": m["content"]} for m in conv])
            for i, conv in zip(ids, conversations)]


def chat_workload(tokenizer, output_len: int, path: Path | None = None, num_requests: int | None = None) -> Workload:
    """The committed chat prompts through the model's chat template (engine Tokenizer), first N rows."""
    path = Path(path) if path else default_chat_prompts_path()
    rows = read_chat_prompts(path)
    if num_requests is not None:
        rows = rows[:num_requests]
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    requests = [BenchRequest(f"chat-{i}", tokenizer.encode_messages(messages), output_len) for i, messages in rows]
    return Workload("chat", requests, {"prompts": str(path), "output_len": output_len})


# ---- shared prefix --------------------------------------------------------------------------------
# A long house-style system prompt, as synthesis jobs repeat on every request.
SHARED_SYSTEM_PROMPT = (
    "You are a careful writing assistant that produces training data for a customer-support model. Every "
    "answer you write will be read by a reviewer who checks it against the following house rules, so read"
    " them closely before you answer and follow all of them in every reply. First, answer the question "
    "that was asked, directly, in the first sentence; do not restate the question, do not thank the user "
    "for asking, and do not open with a greeting or with filler such as 'Great question'. Second, keep "
    "the answer short: three to six sentences in plain prose, unless the user explicitly asks for a list,"
    " a table, a step-by-step procedure or code, in which case use that form and nothing else. Third, be "
    "concrete. Prefer numbers, names of settings, menu paths and exact error messages over general "
    "advice. When you give a number, give its unit. When a step can fail, say what the user will see if "
    "it does and what to try next. Never invent a product feature, a price, a phone number or a policy; "
    "if you do not know, say so in one sentence and point the user to the help centre. Fourth, write for "
    "a reader who is busy and possibly upset: use a calm, friendly and neutral tone, avoid jargon, "
    "explain any technical term the first time you use it, and never blame the user for the problem. "
    "Fifth, respect privacy: never ask for a full card number, a password or a one-time code, and remind "
    "the user not to share them if they offer. Sixth, do not make promises about refunds, delivery dates "
    "or compensation; describe the process and the usual time it takes instead. Seventh, if the request "
    "is unsafe, illegal or outside customer support, decline politely in one sentence and offer help with"
    " something related. Finally, end with one short sentence that tells the user what to do next, and do"
    " not sign the message."
)
_TOPICS = ["a late parcel", "a double charge on a card", "resetting a password", "changing a delivery address",
           "a broken item on arrival", "cancelling a subscription", "an expired voucher", "two-factor login",
           "exporting account data", "a missing invoice", "upgrading a plan", "a slow mobile app"]
_ASKS = ["What should I do about {topic}?", "Can you explain how to handle {topic}?",
         "I am having trouble with {topic}; what are my options?", "Write a short reply to a customer about {topic}.",
         "My manager asked me to sort out {topic} today. Where do I start?"]


def shared_prefix_workload(tokenizer, num_requests: int, output_len: int, seed: int,
                           min_prefix_tokens: int = 300) -> Workload:
    """N chats sharing SHARED_SYSTEM_PROMPT (300+ tokens), each with its own seeded user message."""
    num_system_tokens = len(tokenizer.encode(SHARED_SYSTEM_PROMPT, add_special_tokens=False))
    if num_system_tokens < min_prefix_tokens:
        raise ValueError(f"the shared system prompt has {num_system_tokens} tokens, fewer than {min_prefix_tokens}")
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        user = f"[ticket {i}] " + rng.choice(_ASKS).format(topic=rng.choice(_TOPICS))
        messages = [{"role": "system", "content": SHARED_SYSTEM_PROMPT}, {"role": "user", "content": user}]
        requests.append(BenchRequest(f"shared-{i}", tokenizer.encode_messages(messages), output_len))
    return Workload("shared-prefix", requests, {"output_len": output_len, "seed": seed,
                                                "shared_prefix_tokens": common_prefix_len(requests)})


def common_prefix_len(requests: list[BenchRequest]) -> int:
    """Tokens every prompt starts with."""
    first = requests[0].prompt_token_ids
    n = len(first)
    for r in requests[1:]:
        n = num_shared_prefix(first, r.prompt_token_ids, cap=n)
    return n
