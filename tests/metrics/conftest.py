"""lm-evaluation-harness' own `hf` backend (HFLM over HF transformers' float32 SmolLM2, the session's
`hf_model`) on the local tasks of lm_eval_tasks.py: the reference the metrics are checked against."""

from __future__ import annotations

import functools

import pytest

from tests.metrics.lm_eval_tasks import write_tasks


@pytest.fixture(scope="session")
def lm_eval_results(tmp_path_factory, hf_model, hf_tokenizer):
    """results(task) -> lm-eval's results of that task (each task evaluated once per session), with the
    logged samples in doc order under ["samples"][task] (a generate task's once per filter, its
    "filter" key)."""
    folder = write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_DATASETS_OFFLINE", "1")  # the tasks' files are local: nothing is downloaded
        env.setenv("HF_DATASETS_CACHE", str(folder / "datasets"))
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_path=str(folder))
        model = HFLM(pretrained=hf_model, tokenizer=hf_tokenizer, batch_size=20, device="cpu")

        @functools.cache
        def results(task: str) -> dict:
            found = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=manager, log_samples=True)
            found["samples"][task].sort(key=lambda s: (s["filter"], s["doc_id"]))
            return found
        yield results
