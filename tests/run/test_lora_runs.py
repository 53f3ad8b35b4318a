"""learner.lora on a local Ray cluster: a GRPO run whose learner trains adapters only, synced to two
rollout workers through each sync mode (object store, shared memory, broadcast). The workers end
serving the learner's merged weights, and the three modes train the same run (the same metrics
rows): each delivered the same adapters."""

import json
import shutil

import numpy as np
import pytest
from fakes import TINY_JOB
from safetensors.numpy import load_file

from rlsys.config import LoraSettings, load_config
from rlsys.tracking import read_jsonl

pytestmark = pytest.mark.integration

LORA = ["learner.lora.rank=4", "learner.lora.alpha=8", "learner.lr=0.01"]
WARM = ["sft.steps=150", "sft.lr=0.005", "trainer.prompts_per_step=8"]  # some rewards 1: the adapters move


def test_every_sync_mode_delivers_the_adapters_the_learner_trains(ray_cluster, tmp_path):
    from actors.modeling import state_dict_numpy
    from rlsys.run.controller import Controller

    rows = {}
    for sync in ("object_store", "shared_memory", "broadcast"):
        cfg = load_config(
            "configs/quickstart.yaml",
            [*TINY_JOB, *LORA, *WARM, "rollout.num_workers=2", "trainer.steps=2", "trainer.eval_every=0"]
            + ["rollout.max_new_tokens=6", "trainer.checkpoint_every=2", f"trainer.weight_sync={sync}"]
            + [f"run.output_dir={tmp_path}", f"run.name={sync}"],
        )
        if rows:  # the first run's warmed-up policy, not warmed up again
            shutil.copytree(tmp_path / "object_store" / "policy_init", tmp_path / sync / "policy_init")
        c = Controller(cfg, tmp_path / sync, progress=False)
        c.run()
        synced = ray_cluster.get(c.learners[0].weights.remote())
        assert "lora.scaling" in synced and all(".lora_" in k for k in synced if k != "lora.scaling")
        merged = load_file(str(tmp_path / sync / "checkpoints" / "step_2" / "hf" / "model.safetensors"))
        initial = load_file(str(tmp_path / sync / "policy_init" / "model.safetensors"))
        for worker in c.workers:
            served = ray_cluster.get(worker.__ray_call__.remote(lambda w: state_dict_numpy(w.backend.model)))
            assert all(np.allclose(served[k], merged[k], atol=1e-6) for k in merged)
            moved = {k.rsplit(".", 2)[-2] for k in merged if not np.array_equal(served[k], initial[k])}
            assert moved == set(LoraSettings().target_modules)  # the adapted layers, and they only
        placement = json.loads((tmp_path / sync / "placement.json").read_text())
        assert "reference" not in placement["services"]  # the learner's base with its adapters off is the reference
        c.shutdown()
        rows[sync] = [
            {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}
            for r in read_jsonl(tmp_path / sync / "metrics.jsonl")
        ]
    assert rows["object_store"] == rows["shared_memory"] == rows["broadcast"]
    assert len(rows["broadcast"]) == 2
    assert rows["broadcast"][0]["kl_ref"] == 0 < rows["broadcast"][1]["kl_ref"]  # B starts at zero, then moves
