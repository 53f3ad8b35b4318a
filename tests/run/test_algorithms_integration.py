"""Two steps of VinePPO, PILAF (+ online DPO) and AMPO from their configs on a real local Ray cluster."""

import json

import pytest
from fakes import TINY_ONE_WORKER as TINY

from rlsys.config import load_config

pytestmark = pytest.mark.integration

EXPECTED = {
    "vineppo": (
        ["algorithm.group_size=4", "algorithm.mc_rollouts=3"],
        4 * 4,
        ["loss/policy", "kl_ref", "vineppo/steps_mean", "vineppo/value_s0"],
    ),
    "pilaf": ([], 4 * 2, ["loss/dpo", "dpo/decisive_pairs", "pilaf/interpolated_pairs"]),
    "ampo": (["algorithm.num_samples=4", "algorithm.subset_size=3"], 4 * 4, ["loss/ampo", "ampo/groups_with_signal"]),
}


@pytest.mark.parametrize("algorithm", sorted(EXPECTED))
def test_two_steps_on_a_local_cluster(ray_cluster, tmp_path, algorithm):
    from rlsys.run.controller import Controller

    extra, samples, keys = EXPECTED[algorithm]
    cfg = load_config(
        f"configs/{algorithm}.yaml", [*TINY, *extra, f"run.output_dir={tmp_path}", f"run.name={algorithm}"]
    )
    controller = Controller(cfg, tmp_path / algorithm, progress=False)
    summary = controller.run()
    rows = [json.loads(l) for l in (tmp_path / algorithm / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and summary["steps"] == 2
    for row in rows:
        assert row["samples"] == samples
        for key in keys:
            assert key in row, key
        assert all(v == v for v in row.values() if isinstance(v, float))  # no NaN
    assert ray_cluster.get(controller.workers[0].policy_version.remote()) == 2
