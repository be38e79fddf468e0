"""Local lm-evaluation-harness tasks written by the tests (no download): 40 multiple-choice questions
and a 3-shot arithmetic generate_until task with lm-eval's regex filters, as JSONL files and task YAMLs
in a folder that lm-eval's TaskManager includes.

The multiple-choice answers' lengths vary within an item (a one-word answer beside a sentence), so that
acc (raw log-likelihood) and acc_norm (per character) pick differently on some items. Each item's right
answer is written first and the choices are shuffled with a fixed seed, so the gold index varies; every
fifth item gives its label as the right answer's text (lm-eval's `choices.index(gold)` path), the others
as its index.
"""

from __future__ import annotations

import json
import operator
import random
from pathlib import Path

MC_TASK, GEN_TASK = "batchgen_metrics_mc", "batchgen_metrics_gen"
MC_PROMPT = "Question: {question}\nAnswer:"  # lm-eval adds its target_delimiter " " before each choice

# (question, [the right answer, then three wrong ones]).
_MC_QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Lyon", "Marseille, on the southern coast", "Nice"]),
    ("Which animal is known as man's best friend?",
     ["the dog", "a small grey elephant", "cat", "the goldfish"]),
    ("What color is fresh grass?", ["green", "bright purple with yellow dots", "red", "blue"]),
    ("How many legs does a spider have?", ["eight", "six", "four legs and a long tail", "two"]),
    ("What do bees make?", ["honey", "milk from flowers and leaves", "silk", "bread"]),
    ("Which planet is closest to the Sun?", ["Mercury", "Jupiter, the largest gas giant", "Mars", "Neptune"]),
    ("What is frozen water called?", ["ice", "steam rising from a kettle", "sand", "fog"]),
    ("Which is the largest ocean on Earth?", ["the Pacific Ocean", "the Arctic", "a small lake", "Indian"]),
    ("What gas do plants take in from the air?",
     ["carbon dioxide", "helium", "pure oxygen from the sea", "neon"]),
    ("Who wrote Romeo and Juliet?", ["William Shakespeare", "Charles Dickens", "Mark Twain", "Jane Austen"]),
    ("How many days are in a week?", ["seven", "ten", "five", "twelve days and twelve nights"]),
    ("What is the opposite of up?", ["down", "the left side of the road", "over", "in"]),
    ("Which fruit is yellow and curved?", ["banana", "a round red apple", "grape", "plum"]),
    ("At what temperature in Celsius does water boil at sea level?",
     ["100", "50", "a thousand degrees", "0"]),
    ("What do cows drink?", ["water", "milk", "orange juice with ice cubes", "tea"]),
    ("Which instrument has black and white keys?", ["piano", "drum", "a violin with four strings", "flute"]),
    ("What is the color of the sky on a clear day?",
     ["blue", "green", "a deep orange like a sunset", "black"]),
    ("What is two plus two?", ["four", "five", "twenty-two", "three"]),
    ("Which month comes after January?", ["February", "March", "December of the year before", "June"]),
    ("Where do fish live?", ["in water", "in trees", "in the dunes of a sandy desert", "in clouds"]),
    ("What is the tallest animal?", ["the giraffe", "a small brown field mouse", "cat", "horse"]),
    ("What shape has three sides?", ["a triangle", "circle", "a square with four equal sides", "line"]),
    ("What do we call a baby cat?", ["a kitten", "a puppy", "a calf that lives on a dairy farm", "foal"]),
    ("Which sense do we use our ears for?", ["hearing", "sight", "the sense of smell and of taste", "touch"]),
    ("What is the main language spoken in Spain?",
     ["Spanish", "German", "Japanese as spoken in Tokyo", "Thai"]),
    ("How many hours are in a day?", ["twenty-four", "ten", "one hundred", "sixty"]),
    ("What falls from clouds when it rains?",
     ["water", "small stones", "leaves from the tallest trees", "ash"]),
    ("Which organ pumps blood through the body?",
     ["the heart", "the lungs", "the skin on the hands", "liver"]),
    ("Which season is the coldest?", ["winter", "summer", "the warm days of late spring", "autumn"]),
    ("What do you use to write on a blackboard?",
     ["chalk", "a spoon", "a wet paintbrush full of glue", "soap"]),
    ("Which star is at the center of our solar system?",
     ["the Sun", "the Moon", "Sirius, the dog star", "Vega"]),
    ("What is the largest land animal?", ["the African elephant", "mouse", "a tiny ant", "the rabbit"]),
    ("What do caterpillars turn into?", ["butterflies", "frogs", "large snakes of the rainforest", "birds"]),
    ("Which metal is liquid at room temperature?", ["mercury", "iron", "gold coins from a treasure", "tin"]),
    ("What is the freezing point of water in Celsius?",
     ["zero", "fifty", "minus one hundred degrees", "ten"]),
    ("Which bird cannot fly and lives in Antarctica?", ["the penguin", "eagle", "a small sparrow", "crow"]),
    ("What is the primary ingredient of bread?", ["flour", "sugar", "melted chocolate and cream", "salt"]),
    ("How many continents are there?", ["seven", "three", "twenty of them in total", "one"]),
    ("What do you call a house made of ice?",
     ["an igloo", "a castle", "a wooden cabin in the forest", "tent"]),
    ("Which vehicle travels on rails?", ["a train", "a boat", "a bicycle with two wheels", "a plane"]),
]
# Items 0, 5, 10, ...: the label is the right answer's text (never digits: lm-eval reads "2" as an index).
TEXT_LABEL_EVERY = 5


def mc_items() -> list[dict]:
    """The 40 items: question, choices (shuffled), label (the right one's index, or for every fifth item
    its text) and gold (its index)."""
    shuffle = random.Random(41)
    items = []
    for i, (question, answers) in enumerate(_MC_QUESTIONS):
        choices = answers[:]
        shuffle.shuffle(choices)
        gold = choices.index(answers[0])
        label = answers[0] if i % TEXT_LABEL_EVERY == 0 else gold
        items.append({"question": question, "choices": choices, "label": label, "gold": gold})
    return items


# Arithmetic with a worked answer: the shots teach "... #### <number>"; the questions' answers are
# written the same way, so gold goes through regexes_to_ignore as GSM8K's does.
_SHOTS = [("3+4", "3 plus 4 is 7. #### 7"), ("10-6", "10 minus 6 is 4. #### 4"),
          ("5*3", "5 times 3 is 15. #### 15")]
_QUESTIONS = [(12, "+", 7), (8, "+", 5), (20, "-", 9), (6, "*", 7), (15, "+", 15), (9, "-", 13), (4, "*", 4),
              (30, "-", 12), (7, "+", 8), (11, "*", 3), (100, "-", 1), (25, "+", 17), (3, "*", 9),
              (14, "-", 20), (50, "+", 50), (8, "*", 8), (19, "+", 23), (40, "-", 15), (12, "*", 12),
              (2, "-", 7)]
_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
GEN_REGEXES_TO_IGNORE = [",", "\\$", "(?s).*#### ", "\\.$"]  # lm-eval's gsm8k exact_match options
STRICT_REGEX = "#### (\\-?[0-9\\.\\,]+)"
FLEXIBLE_REGEX = "(-?[$0-9.,]{2,})|(-?[0-9]+)"  # lm-eval's gsm8k flexible-extract
# Digits are single tokens: 14 tokens end " 8 plus 5 is 13. #### 13" but cut " 25 plus 17 is 42. ####"
# before its answer, so strict-match falls back to "[invalid]" where flexible-extract takes "42." (the
# two filters disagree on some items, and the fallback path is exercised).
GEN_MAX_TOKENS = 14


def gen_items() -> list[dict]:
    """The 20 questions with their answers written as "#### <n>"."""
    return [{"question": f"{a}{op}{b}", "answer": f"#### {_OPERATIONS[op](a, b)}"} for a, op, b in _QUESTIONS]


def write_tasks(folder: Path) -> Path:
    """Both tasks' data and YAMLs in `folder` (lm-eval's include_path)."""
    mc, gen, shots = folder / "mc.jsonl", folder / "gen.jsonl", folder / "gen_shots.jsonl"
    # lm-eval's doc_to_target renders the label as text: "2" becomes the index 2, "Paris" is looked up.
    mc.write_text("".join(json.dumps({"question": it["question"], "choices": it["choices"],
                                      "label": str(it["label"])}) + "\n" for it in mc_items()))
    gen.write_text("".join(json.dumps(it) + "\n" for it in gen_items()))
    shots.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in _SHOTS))
    (folder / f"{MC_TASK}.yaml").write_text(f"""task: {MC_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    (folder / f"{GEN_TASK}.yaml").write_text(f"""task: {GEN_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    train: {shots}
    test: {gen}
test_split: test
fewshot_split: train
num_fewshot: 3
fewshot_config:
  sampler: first_n
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}=? A:"
doc_to_target: "{{{{answer}}}}"
fewshot_delimiter: "\\n"
generation_kwargs:
  until: ["\\n", "Q:"]
  max_gen_toks: {GEN_MAX_TOKENS}
  do_sample: false
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: {json.dumps(STRICT_REGEX)}
        group_select: 0
      - function: take_first
  - name: flexible-extract
    filter:
      - function: regex
        regex_pattern: {json.dumps(FLEXIBLE_REGEX)}
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: {json.dumps(GEN_REGEXES_TO_IGNORE)}
""")
    return folder
