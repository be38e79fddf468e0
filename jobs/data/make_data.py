"""Writes the tiny prompt sets the example jobs read. Rerun after editing: python jobs/data/make_data.py"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# (category, messages): short and long, single and multi-turn, some sharing a system prompt.
TUTOR = "You are a patient tutor. Explain step by step and keep answers short."
CHAT = [
    ("greeting", user("Hi! How are you today?")),
    ("greeting", user("Good morning. Can you introduce yourself in one sentence?")),
    ("facts", user("What is the capital of France?")),
    ("facts", user("How many planets are in the solar system?")),
    ("facts", user("Who wrote the play Romeo and Juliet?")),
    ("facts", user("What is the boiling point of water at sea level in Celsius?")),
    ("facts", user("Which ocean is the largest?")),
    ("facts", user("What gas do plants absorb from the air?")),
    ("math", user("What is 12 times 7?")),
    ("math", user("Is 91 a prime number? Explain briefly.")),
    ("math", user("Convert 3.5 hours into minutes.")),
    ("math", user("A shirt costs 20 dollars and is 15 percent off. What is the sale price?")),
    ("math", [{"role": "system", "content": TUTOR}, {"role": "user", "content": "How do I add fractions?"}]),
    ("math", [{"role": "system", "content": TUTOR}, {"role": "user", "content": "What is a derivative?"}]),
    ("math", [{"role": "system", "content": TUTOR}, {"role": "user", "content": "Why is dividing by zero undefined?"}]),
    ("math", [{"role": "system", "content": TUTOR}, {"role": "user", "content": "What is the Pythagorean theorem?"}]),
    ("coding", user("Write a Python function that reverses a string.")),
    ("coding", user("What does the HTTP status code 404 mean?")),
    ("coding", user("Explain the difference between a list and a tuple in Python.")),
    ("coding", user("Write a SQL query that counts the rows of a table named users.")),
    ("coding", user("What is a race condition? Give a short example.")),
    ("coding", user("How do I read a CSV file with pandas?")),
    ("coding", user("Write a bash one-liner that counts the lines of every .txt file in a folder.")),
    ("writing", user("Write a haiku about autumn leaves.")),
    ("writing", user("Write a two-sentence horror story.")),
    ("writing", user("Suggest three names for a coffee shop near a library.")),
    ("writing", user("Write a short thank-you note to a colleague who helped me move.")),
    ("writing", user("Rewrite this sentence to be more formal: gonna be late, traffic is nuts.")),
    ("writing", user("Write a product description for a reusable water bottle in under 50 words.")),
    ("advice", user("How can I sleep better?")),
    ("advice", user("Give me three tips for a job interview.")),
    ("advice", user("What should I pack for a weekend hiking trip?")),
    ("advice", user("How do I start learning to play the guitar?")),
    ("explain", user("Explain photosynthesis to a ten-year-old.")),
    ("explain", user("Why is the sky blue?")),
    ("explain", user("What causes the seasons on Earth?")),
    ("explain", user("How does a vaccine work?")),
    ("explain", user("What is inflation, in simple terms?")),
    ("explain", user("Explain what a black hole is in two sentences.")),
    ("summarize", user("Summarize in one sentence: The meeting covered the quarterly budget, the new hiring "
                       "plan for the support team, and a proposal to move the office to a larger building "
                       "next spring. No decision was made on the move.")),
    ("summarize", user("Summarize in one sentence: Bees pollinate many crops. Their numbers have fallen in "
                       "several regions because of habitat loss, pesticides and disease, which worries "
                       "farmers and scientists alike.")),
    ("multi-turn", [
        {"role": "user", "content": "I am planning a trip to Japan."},
        {"role": "assistant", "content": "That sounds exciting! When are you planning to go?"},
        {"role": "user", "content": "In April. What should I see?"}]),
    ("multi-turn", [
        {"role": "user", "content": "Can you help me with a recipe?"},
        {"role": "assistant", "content": "Of course. What would you like to cook?"},
        {"role": "user", "content": "Something quick with eggs and spinach."}]),
    ("multi-turn", [
        {"role": "user", "content": "What is 5 plus 3?"},
        {"role": "assistant", "content": "5 plus 3 is 8."},
        {"role": "user", "content": "And if I multiply that by 2?"}]),
    ("multi-turn", [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "What is your favourite colour?"}]),
    ("classify", user("Is this review positive or negative? 'The battery died after two days.'")),
    ("classify", user("Is this review positive or negative? 'Fast shipping and it works perfectly.'")),
    ("classify", user("Which language is this: 'Guten Tag, wie geht es Ihnen?'")),
]

QUICKSTART = [
    "What is the capital of Italy?",
    "Write a haiku about the sea.",
    "Give me one tip for learning to code.",
    "What is 7 plus 6?",
    "Name three fruits that are red.",
    "Why do cats purr?",
]

SFT_TOPICS = [
    ("cooking", "Explain how to boil an egg."),
    ("travel", "Describe a good day trip from a big city."),
    ("fitness", "Suggest a five-minute morning stretch."),
]

DPO_PROMPTS = [
    "Explain recursion to a beginner.",
    "What is a good way to save money each month?",
    "Describe the water cycle.",
]

EVAL = [  # (question, reference answer, max_tokens for this row)
    ("What is the capital of Germany?", "Berlin", 12),
    ("What is 9 times 8?", "72", 12),
    ("What color do you get by mixing blue and yellow?", "green", 12),
    ("How many days are in a leap year?", "366", 12),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci", 16),
]

MULTIPLE_CHOICE = [  # (question, choices, the right choice's index)
    ("Question: What is the capital of France?\nAnswer:", [" Paris", " Berlin", " Madrid", " Rome"], 0),
    ("Question: How many legs does a spider have?\nAnswer:", [" six", " eight", " ten", " four"], 1),
    ("Question: Which planet is closest to the sun?\nAnswer:", [" Venus", " Earth", " Mercury", " Mars"], 2),
    ("Question: What do bees make?\nAnswer:", [" milk", " silk", " wax only", " honey"], 3),
    ("Question: What is frozen water called?\nAnswer:", [" ice", " steam", " sand", " glass"], 0),
    ("Question: Which animal barks?\nAnswer:", [" a cat", " a dog", " a fish", " a bird"], 1),
    ("Question: What colour is the sky on a clear day?\nAnswer:", [" green", " red", " blue", " black"], 2),
    ("Question: How many days are in a week?\nAnswer:", [" five", " ten", " three", " seven"], 3),
    ("Question: What is 2 plus 2?\nAnswer:", [" 4", " 22", " 5", " 0"], 0),
    ("Question: Which season comes after winter?\nAnswer:", [" autumn", " spring", " summer", " night"], 1),
    ("Question: What do cows drink?\nAnswer:", [" milk", " oil", " water", " juice"], 2),
    ("Question: Which is the largest ocean on Earth?\nAnswer:", [" Atlantic", " Indian", " Arctic", " Pacific"], 3),
]


def chat_line(custom_id: str, messages: list[dict], **fields) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": messages, **fields}}


def completion_line(custom_id: str, prompt: str, **fields) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "gpt-3.5-turbo-instruct", "prompt": prompt, **fields}}


# An OpenAI Batch API input file, as OpenAI's docs write them (the `model` names are ignored: the job's
# model runs every line). JSON mode is constrained decoding; the last line forces a call of its tool
# (tool_choice names it): its message carries tool_calls whose arguments match the tool's parameters.
BATCH = [
    chat_line("capital", user("What is the capital of France?"), max_tokens=24),
    chat_line("tutor", [{"role": "system", "content": TUTOR}, {"role": "user", "content": "What is a prime number?"}],
              max_tokens=40),
    chat_line("slogans", user("Write a slogan for a bakery."), temperature=0.8, n=2, seed=7, max_tokens=24),
    chat_line("with-logprobs", user("Name a primary color."), max_tokens=8, logprobs=True, top_logprobs=2),
    completion_line("story", "Once upon a time, a small robot", max_tokens=24, stop=["\n"]),
    completion_line("list", "Three fruits that are red:", max_tokens=16, temperature=0.5, seed=1),
    chat_line("json-mode", user("List two colors as JSON."), response_format={"type": "json_object"}),
    chat_line("tool-call", user("What is the weather in Paris?"),
              tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {
                  "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}],
              tool_choice={"type": "function", "function": {"name": "get_weather"}}),
]


def write_batch_file() -> None:
    text = "".join(json.dumps(line) + "\n" for line in BATCH)
    (HERE / "batch_requests.jsonl").write_text(text)


def main() -> None:
    chat = pa.table({
        "id": pa.array(range(len(CHAT)), pa.int64()),
        "messages": pa.array([m for _, m in CHAT], pa.list_(MESSAGE)),
        "category": pa.array([c for c, _ in CHAT], pa.string()),
    })
    pq.write_table(chat, HERE / "chat_prompts.parquet")
    pq.write_table(pa.table({"id": pa.array(range(len(QUICKSTART)), pa.int64()), "prompt": QUICKSTART}),
                   HERE / "quickstart.parquet")
    pq.write_table(pa.table({"id": [f"sft-{i}" for i in range(len(SFT_TOPICS))],
                             "topic": [t for t, _ in SFT_TOPICS], "prompt": [p for _, p in SFT_TOPICS]}),
                   HERE / "sft_seed_prompts.parquet")
    # Written by polars on purpose: large_string / large_list, as many users' files are.
    pl.DataFrame({"id": list(range(len(DPO_PROMPTS))),
                  "messages": [user(p) for p in DPO_PROMPTS]}).write_parquet(HERE / "dpo_prompts.parquet")
    pq.write_table(pa.table({"id": pa.array(range(len(EVAL)), pa.int32()), "question": [q for q, _, _ in EVAL],
                             "answer": [a for _, a, _ in EVAL],
                             "max_tokens": pa.array([m for _, _, m in EVAL], pa.int32())}),
                   HERE / "eval_questions.parquet")
    pq.write_table(pa.table({"id": pa.array(range(len(MULTIPLE_CHOICE)), pa.int32()),
                             "question": [q for q, _, _ in MULTIPLE_CHOICE],
                             "choices": [c for _, c, _ in MULTIPLE_CHOICE],
                             "label": pa.array([g for _, _, g in MULTIPLE_CHOICE], pa.int32())}),
                   HERE / "multiple_choice.parquet")
    write_batch_file()


if __name__ == "__main__":
    main()
