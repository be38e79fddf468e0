"""A multi-stage job on the Ray backend (one local cluster for the module, 2 CPUs): a generate stage and a
`task: reward` stage, each spread over two replicas, then a select stage on the driver, give the rows a
local run gives (token ids exactly; rewards to float32 rounding, which depends on the batch's shape)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.pipeline.stages import load_any_job
from batchgen.pipeline.stages.run import run_staged_job
from tests.pipeline.conftest import read_output, write_parquet
from tests.pipeline.ray_helpers import local_ray_cluster
from tests.tiny_reward import tiny_reward_model  # noqa: F401  (a fixture)

pytestmark = pytest.mark.ray

NUM_PROMPTS, N = 6, 2


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_cluster() as cluster:
        yield cluster


def _job(tmp_path, tiny_model, reward_model, name: str, cluster: dict | None = None) -> str:
    prompts = tmp_path / "prompts.parquet"
    if not prompts.exists():
        write_parquet(prompts, {"id": [f"p{i}" for i in range(NUM_PROMPTS)],
                                "messages": [[{"role": "user", "content": f"Question {i}?"}] for i in range(NUM_PROMPTS)]})
    job = {"name": "ray-stages", "output": {"path": str(tmp_path / name)},
           "model": {"path": str(tiny_model), "dtype": "float32", "max_model_len": 128},
           "engine": {"device": "cpu", "kv_cache_memory": "8MiB", "max_num_seqs": 2},
           "sampling": {"temperature": 0.9, "seed": 3, "max_tokens": 4, "ignore_eos": True},
           **({"cluster": cluster} if cluster else {}),
           "stages": [
               {"name": "gen", "input": {"path": str(prompts), "messages_column": "messages", "rows_per_unit": 2},
                "sampling": {"n": N}},
               {"name": "score", "task": "reward", "input": {"stage": "gen", "rows_per_unit": 3},
                "model": {"path": str(reward_model)}},
               {"name": "pairs", "task": "select", "input": {"stage": "score"}, "select": {"rule": "dpo_pairs"}}]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def _sorted(folder, columns: list[str]) -> list[dict]:
    return sorted(read_output(folder).select(columns).to_pylist(), key=lambda r: (r["id"], r["sample_index"]))


def test_generate_and_reward_stages_on_ray_give_the_local_rows(tmp_path, ray_cluster, tiny_model,
                                                               tiny_reward_model):  # noqa: F811
    _, reward_model = tiny_reward_model
    local = {r.stage.name: r for r in run_staged_job(
        load_any_job(_job(tmp_path, tiny_model, reward_model, "local")), progress=False)}
    on_ray = {r.stage.name: r for r in run_staged_job(load_any_job(_job(
        tmp_path, tiny_model, reward_model, "ray", {"backend": "ray", "replicas": 2})), progress=False)}

    for stage in ("gen", "score"):  # both model stages ran on two replicas, none failed
        workers = on_ray[stage].record.to_dict()["workers"]
        assert (workers["backend"], workers["num_workers"], workers["replica_failures"]) == ("ray", 2, 0), stage
        assert on_ray[stage].record.num_errors == 0
    assert (local["score"].record.to_dict().get("workers") or {}).get("backend") != "ray"

    columns = ["id", "sample_index", "completion", "completion_token_ids"]
    assert _sorted(tmp_path / "ray" / "gen", columns) == _sorted(tmp_path / "local" / "gen", columns)
    scored = _sorted(tmp_path / "ray" / "score", ["id", "sample_index", "completion", "reward"])
    expected = _sorted(tmp_path / "local" / "score", ["id", "sample_index", "completion", "reward"])
    assert len(scored) == NUM_PROMPTS * N
    assert [(r["id"], r["sample_index"], r["completion"]) for r in scored] == [
        (r["id"], r["sample_index"], r["completion"]) for r in expected]
    assert [r["reward"] for r in scored] == pytest.approx([r["reward"] for r in expected], rel=1e-5, abs=1e-6)

    pairs = pq.read_table(tmp_path / "ray" / "pairs" / "part-00000.parquet").to_pylist()
    want = pq.read_table(tmp_path / "local" / "pairs" / "part-00000.parquet").to_pylist()
    assert [(p["id"], p["chosen"], p["rejected"]) for p in pairs] == [(p["id"], p["chosen"], p["rejected"])
                                                                       for p in want]
    assert pairs  # random rewards of distinct samples: pairs there are
