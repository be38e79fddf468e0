"""Gemma's chat template refuses a system role (transformers raises the template's raise_exception): in a job,
that row alone becomes an error row, under its own id, with the template's words; the job goes on and the
other rows are rendered as transformers renders them.

The template is Gemma 2's as published in google/gemma-2-9b-it's tokenizer_config.json (Gemma 1's is the same;
Gemma 3's folds a system message into the first user turn instead).
"""

from __future__ import annotations

from batchgen.pipeline.job import run_job
from tests.pipeline.conftest import make_job, read_output, write_parquet

GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

USER = {"role": "user", "content": "Name a colour."}
MESSAGES = {
    7: [USER],
    8: [{"role": "system", "content": "Be brief."}, USER],
    9: [USER, {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another."}],
}


def test_a_system_message_makes_that_row_an_error_row_naming_the_templates_refusal(tmp_path, engine):
    path = write_parquet(tmp_path / "chat.parquet", {"id": list(MESSAGES), "messages": list(MESSAGES.values())})
    job = make_job(tmp_path, str(path), input={"prompt_column": None, "messages_column": "messages",
                                                "chat_template": GEMMA2_TEMPLATE}, sampling={"max_tokens": 2})
    result = run_job(job, engine=engine, progress=False)
    rows = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert list(rows) == [7, 8, 9] and result.record.num_errors == 1
    refused = rows[8]
    assert refused["finish_reason"] == "error" and "System role not supported" in refused["error"], refused
    assert refused["completion"] is None and refused["completion_tokens"] == 0
    hf = engine.tokenizer.hf
    for row_id in (7, 9):  # rendered as transformers renders them (model turns, <start_of_turn>model)
        assert rows[row_id]["error"] is None and rows[row_id]["finish_reason"] in ("stop", "length")
        expected = hf.apply_chat_template(MESSAGES[row_id], chat_template=GEMMA2_TEMPLATE,
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
        assert rows[row_id]["prompt_tokens"] == len(expected)
