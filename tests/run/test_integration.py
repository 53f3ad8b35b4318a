"""A tiny job on a real local Ray cluster: 2 rollout workers, a 2-rank DeepSpeed learner."""

import json

import pytest
from fakes import TINY_JOB

from rlsys.config import load_config

pytestmark = pytest.mark.integration

TINY = [
    *TINY_JOB,
    "trainer.eval_every=2",
    "rollout.max_new_tokens=4",
    "rollout.num_workers=2",
]


def run_job(tmp_path, algorithm, extra=()):
    from rlsys.run.controller import Controller

    cfg = load_config(
        "configs/quickstart.yaml",
        [*TINY, f"run.output_dir={tmp_path}", f"run.name={algorithm}", f"algorithm.name={algorithm}", *extra],
    )
    controller = Controller(cfg, tmp_path / algorithm, progress=False)
    return controller, controller.run()


def test_grpo_two_rank_learner_two_workers(ray_cluster, tmp_path):
    from actors.learner import lr_multiplier

    controller, summary = run_job(
        tmp_path,
        "grpo",
        [
            "trainer.steps=3",
            "learner.num_ranks=2",
            "learner.zero_stage=2",
            "learner.lr_schedule=linear",
            "learner.warmup_steps=1",
            "learner.min_lr_ratio=0.2",
            "run.loggers=[jsonl, tensorboard, wandb, mlflow]",
            "rollout.dtype=bfloat16",  # the workers decode in bf16, the learner in fp32
        ],
    )
    run_dir = tmp_path / "grpo"
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    samples = [json.loads(l) for l in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4 + [3] * 4  # trainer.log_samples=4 a step
    tok = controller.tokenizer
    prompts = {tok.decode(p.prompt_ids, skip_special_tokens=False) for p in controller.stream.prompts}
    assert all(s["prompt"] in prompts for s in samples)  # exactly as the model saw them
    assert {"prompt", "response", "reward"} <= set(samples[0]) and isinstance(samples[0]["reward"], float)
    lr = controller.cfg.learner.lr  # the schedule is stepped by the DeepSpeed engine on both ranks
    assert [r["lr"] for r in rows] == pytest.approx([lr * lr_multiplier(s, 3, 1, "linear", 0.2) for s in range(3)])
    assert rows[2]["lr"] == pytest.approx(0.6 * lr)
    for key in (
        "reward/mean",
        "accuracy/train",
        "kl_ref",
        "loss",
        "time/generate",
        "time/train",
        "time/sync",
        "perf/tokens_per_s",
    ):
        assert key in rows[0], key
    assert rows[0]["samples"] == 4 * 8  # prompts_per_step x the quickstart group_size
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent), size_guidance={"histograms": 0})  # 0: every one, not the last
    acc.Reload()
    assert len(acc.Scalars("reward/mean")) == 3
    assert "eval/heldout/accuracy" in acc.Tags()["scalars"]
    assert len(acc.Histograms("staleness")) == 3  # each step's tokens, policy versions behind
    assert rows[0]["staleness/max"] == 0 and rows[0]["mismatch/kl"] >= 0
    assert rows[0]["mismatch/logprob_abs"] > 5e-5  # bf16 sampling against the fp32 learner (4e-4; fp32: 6e-8)
    from mlflow import MlflowClient  # and mlflow the same metrics (wandb's run: tests/floor/test_loggers.py)

    mlflow_run = (run_dir / "mlflow_run_id").read_text()
    history = MlflowClient((tmp_path / "mlruns").as_uri()).get_metric_history(mlflow_run, "reward.mean")
    assert sorted((m.step, m.value) for m in history) == [(r["step"], r["reward/mean"]) for r in rows]
    assert len(list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))) == 1
    # every rollout worker holds the newest policy version, and it equals the learner's
    versions = ray_cluster.get([w.policy_version.remote() for w in controller.workers])
    assert versions == [3, 3]
    evals = [json.loads(l) for l in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert [e["policy_version"] for e in evals] == [0, 2, 3]
    assert (run_dir / "config.yaml").exists() and (run_dir / "policy_init" / "model.safetensors").exists()
    # the weights the workers serve are the learner's
    import numpy as np

    learner_weights = ray_cluster.get(controller.learners[0].weights.remote())
    worker_stats = ray_cluster.get(controller.workers[1].stats.remote())
    assert worker_stats["version"] == 3 and worker_stats["tokens"] > 0
    assert all(np.isfinite(v).all() for v in learner_weights.values())


@pytest.mark.parametrize("algorithm", ["ppo", "rloo"])
def test_ppo_and_rloo_run(ray_cluster, tmp_path, algorithm):
    import gc
    import weakref

    controller, summary = run_job(tmp_path, algorithm, ["trainer.steps=2", "rollout.num_workers=1"])
    rows = [json.loads(l) for l in (tmp_path / algorithm / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and summary["steps"] == 2
    if algorithm == "ppo":
        assert "loss/value" in rows[0]
    # no reference cycle keeps a finished run (and so its actors, on a shared cluster) alive
    gc.disable()
    try:
        ref = weakref.ref(controller)
        del controller
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "weight_sync",
    ["auto", "object_store", "async"],  # auto: shared memory on this one node; async: the object store, unsettled
)
def test_killed_rollout_worker_is_restarted_and_every_prompt_counted_once(ray_cluster, tmp_path, weight_sync):
    import os
    import signal

    from rlsys.generation import GenerationRequest
    from rlsys.run.controller import Controller

    cfg = load_config(
        "configs/quickstart.yaml",
        [*TINY, f"run.output_dir={tmp_path}", "run.name=faults"]
        + (
            ["trainer.mode=async", "buffer.max_staleness=1"]
            if weight_sync == "async"
            else [f"trainer.weight_sync={weight_sync}"]
        ),
    )
    c = Controller(cfg, tmp_path / "faults", progress=False)
    c.start_actors(c.prepare_policy())
    c.sync_weights(1)  # the workers now hold version 1; a restarted one would come back at 0
    worker = c.workers[0]
    requests = [GenerationRequest(p.prompt_ids, c.ctx.sampling(n=3, seed=5)) for p in c.stream.next(8)]
    pid = ray_cluster.get(worker.pid.remote())
    os.kill(pid, signal.SIGKILL)  # dies before/while serving its share of the next call
    gens = c.ctx.generate(requests)
    assert sorted(g.request_index for g in gens) == sorted(list(range(8)) * 3)
    assert {g.policy_version for g in gens} == {1}
    assert c.ctx.restarted_workers == 1
    assert ray_cluster.get(worker.pid.remote()) != pid


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_object_store_sync_in_buckets_gives_every_worker_the_learners_weights(ray_cluster, tmp_path, mode):
    """trainer.sync_bucket_mb below the policy's size: the sync goes bucket by bucket (awaited,
    not sent with the step; under async, all buckets in one unawaited call per worker), the workers
    end with the learner's bytes, and a worker restarted afterwards catches up from the kept buckets
    one at a time."""
    import os
    import signal

    import torch

    from actors.modeling import state_dict_numpy
    from rlsys.generation import GenerationRequest
    from rlsys.run.controller import Controller
    from rlsys.weight_digest import digest

    cfg = load_config(
        "configs/quickstart.yaml",
        [*TINY, f"run.output_dir={tmp_path}", "run.name=buckets"]
        + ["trainer.weight_sync=object_store", "trainer.sync_bucket_mb=0.02", f"trainer.mode={mode}"]
        + (["buffer.max_staleness=1"] if mode == "async" else []),
    )
    c = Controller(cfg, tmp_path / "buckets", progress=False)
    c.start_actors(c.prepare_policy())
    p, get = c.policies[c.ctx.main_policy], ray_cluster.get
    assert len(p.buckets) >= 3 and not c.weights.sends_with_step
    assert sorted(n for b in p.buckets for n in b) == sorted(get(c.learners[0].weights.remote()))

    def perturb(learner):  # the learner's weights move away from the workers' initial ones
        g = torch.Generator().manual_seed(0)
        for param in learner.module.policy.parameters():
            param.data.add_(torch.randn(param.shape, generator=g) * 0.01)

    get(c.learners[0].__ray_call__.remote(perturb))
    learner_digest = get(c.learners[0].weights_and_digest.options(num_returns=2).remote()[1])
    worker_digest = lambda w: get(w.__ray_call__.remote(lambda self: digest(state_dict_numpy(self.backend.model))))  # noqa: E731
    assert worker_digest(c.workers[0]) != learner_digest
    c.sync_weights(1)
    c.ctx.settle_sync()  # under async the send did not wait
    assert isinstance(p.weights_ref, list) and len(p.weights_ref) == len(p.buckets)
    assert all(worker_digest(w) == learner_digest for w in c.workers)
    assert get([w.policy_version.remote() for w in c.workers]) == [1, 1]

    pid = get(c.workers[1].pid.remote())
    os.kill(pid, signal.SIGKILL)
    requests = [GenerationRequest(q.prompt_ids, c.ctx.sampling(n=2, seed=5)) for q in c.stream.next(4)]
    gens = c.ctx.generate(requests)
    assert {g.policy_version for g in gens} == {1} and c.ctx.restarted_workers == 1
    assert worker_digest(c.workers[1]) == learner_digest
    c.shutdown()


def test_weight_sync_is_sent_unawaited_and_its_failure_surfaces_at_the_next_generate(ray_cluster, tmp_path):
    import time

    from rlsys.generation import GenerationRequest
    from rlsys.placement import WeightSyncTimeout
    from rlsys.run.controller import Controller

    cfg = load_config(
        "configs/quickstart.yaml",
        [*TINY, f"run.output_dir={tmp_path}", "run.name=unawaited", "trainer.sync_timeout_s=1"],
    )
    c = Controller(cfg, tmp_path / "unawaited", progress=False)
    c.start_actors(c.prepare_policy())
    requests = [GenerationRequest(p.prompt_ids, c.ctx.sampling(n=2, seed=5)) for p in c.stream.next(4)]
    busy = c.workers[1].__ray_call__.remote(lambda self: time.sleep(4))  # cannot load weights for 4 s
    c.sync_weights(1)  # returns although worker 1 cannot acknowledge within sync_timeout_s
    assert c.ctx.policy_version == 1
    with pytest.raises(WeightSyncTimeout, match="policy version 1 did not complete within 1 s \\(1 of 2 rollout"):
        c.ctx.generate(requests)
    ray_cluster.get(busy)
    c.sync_weights(2)
    gens = c.ctx.generate(requests)  # each worker loaded version 2 before generating: no restart, no stale row
    assert {g.policy_version for g in gens} == {2} and c.ctx.restarted_workers == 0
    assert sorted(g.request_index for g in gens) == sorted(list(range(4)) * 2)
    c.shutdown()


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "rloo", "gspo"])
def test_learner_leaving_out_rows_without_gradient_takes_the_full_batch_step(ray_cluster, tmp_path, algorithm):
    """Groups with equal rewards (no KL term) are left out of the learner's forward and backward,
    and each group's prompt runs once; the others' loss is rescaled by their share of what the loss
    averages over (GRPO's tokens; Dr.GRPO's responses x a constant, RLOO's and GSPO's responses).
    Its loss, gradient norm, clipping and AdamW steps are those of plain torch on every row."""
    import numpy as np
    import torch

    from actors.learner import Learner
    from actors.modeling import PolicyOnly
    from algorithms.grpo import GRPO
    from algorithms.gspo import GSPO
    from algorithms.rloo import RLOO
    from rlsys.batch import collate
    from rlsys.cluster import free_port
    from rlsys.contract import ModelOutputs
    from rlsys.experience import make_experience
    from rlsys.models import TinyModelSpec, build_tiny_model, load_model, save_model_dir, train_tokenizer

    tok = train_tokenizer([f"{a}+{b}={a + b}" for a in range(30) for b in range(30)], vocab_size=64)
    model_dir = save_model_dir(
        build_tiny_model(
            TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=64), tok, seed=4
        ),
        tok,
        tmp_path / "policy",
    )
    policy = PolicyOnly(load_model(str(model_dir)))
    rng = np.random.default_rng(0)

    def batch(rewards):  # groups of 4 sharing a prompt, responses of 1-6 tokens, old logprobs of the current weights
        prompts = [rng.integers(3, 64, rng.integers(2, 8)).tolist() for _ in range(len(rewards) // 4)]
        rows = [
            dict(
                uid=f"{i}",
                group=str(i // 4),
                prompt_ids=prompts[i // 4],
                response_ids=rng.integers(3, 64, rng.integers(1, 7)).tolist(),
                logprobs=[],
                reward=float(r),
                policy_version=0,
                meta={},
            )
            for i, r in enumerate(rewards)
        ]
        with torch.no_grad():
            b = collate(make_experience(rows))
            old = policy(b.input_ids, b.attention_mask)[1]
        for row, lp, m in zip(rows, old, b.response_mask):
            row["logprobs"] = lp[m > 0].tolist()
        return algo.prepare(make_experience(rows))

    algo = {
        "grpo": lambda: GRPO(GRPO.Config(group_size=4, kl_coef=0.0)),
        "dr_grpo": lambda: GRPO(
            GRPO.Config(group_size=4, kl_coef=0.0, std_normalize=False, loss_normalizer="constant", max_tokens=6)
        ),
        "rloo": lambda: RLOO(RLOO.Config(group_size=4, kl_coef=0.0)),
        "gspo": lambda: GSPO(GSPO.Config(group_size=4)),
    }[algorithm]()
    steps = [
        batch([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1]),  # two groups of equal rewards
        batch([0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]),  # three
        batch([1, 1, 1, 1] * 4),
    ]  # every group: the step's gradient is zero
    # unclipped, and clipped at every step (the norms here are ~0.1-1)
    for grad_clip in (0.0, 0.05) if algorithm == "grpo" else (0.05,):
        policy = PolicyOnly(load_model(str(model_dir)))
        learner = ray_cluster.remote(Learner).remote(
            str(model_dir), algo, lr=1e-2, grad_clip=grad_clip, master_port=free_port()
        )
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.0)
        for b, left_out in zip(steps, [0.5, 0.75, 1.0]):
            metrics = ray_cluster.get(learner.train_step.remote(b))
            logits, logprobs, _ = policy(b.input_ids, b.attention_mask)
            loss = algo.loss(ModelOutputs(logits, logprobs), b)[0]  # every row
            opt.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip or float("inf"))
            opt.step()
            assert metrics["rows_without_gradient"] == left_out
            assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-7)
            assert metrics["grad_norm"] == pytest.approx(norm.item(), rel=1e-4, abs=1e-7)
            assert grad_clip == 0 or left_out == 1.0 or norm > grad_clip  # the clip acted
        theirs = ray_cluster.get(learner.weights.remote())
        for name, p in policy.policy.state_dict().items():
            np.testing.assert_allclose(theirs[name], p.detach().numpy(), atol=1e-4, err_msg=name)
        ray_cluster.kill(learner)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("minibatches", [1, 2])
def test_learner_measures_the_sampler_mismatch_and_corrects_it_with_the_policy_before_the_update(
    ray_cluster, tmp_path, minibatches, bf16
):
    """Rows whose sampler logprobs are the learner's plus known noise: the learner reports the
    mismatch of the noise, and GRPO with TIS trains as plain torch does with the proximal
    logprobs of the weights before the step (from the loss's own forward in a one-update step,
    from a forward without gradient first when the step is two updates). Under learner.bf16 on
    a CPU every forward runs under torch's bf16 autocast, the one without gradient included: the
    mismatch is to the autocast logprobs, which differ from fp32's."""
    import numpy as np
    import torch

    from actors.learner import Learner
    from actors.modeling import PolicyOnly
    from algorithms.grpo import GRPO
    from rlsys.batch import collate
    from rlsys.cluster import free_port
    from rlsys.contract import ModelOutputs
    from rlsys.experience import make_experience
    from rlsys.logprobs import mismatch_metrics
    from rlsys.models import TinyModelSpec, build_tiny_model, load_model, save_model_dir, train_tokenizer

    tok = train_tokenizer([f"{a}+{b}={a + b}" for a in range(30) for b in range(30)], vocab_size=64)
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=64)
    model_dir = save_model_dir(build_tiny_model(spec, tok, seed=4), tok, tmp_path / "policy")
    policy = PolicyOnly(load_model(str(model_dir)))
    precision = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)  # noqa: E731
    rng = np.random.default_rng(1)
    rows = [
        dict(
            uid=f"{i}",
            group=str(i // 4),
            prompt_ids=rng.integers(3, 64, 4).tolist(),
            response_ids=rng.integers(3, 64, rng.integers(2, 7)).tolist(),
            logprobs=[],
            reward=float(i % 2),  # every group has signal
            policy_version=0,
        )
        for i in range(8)
    ]
    with torch.no_grad():
        b = collate(make_experience(rows))
        with precision():
            learner_logprobs = policy(b.input_ids, b.attention_mask)[1]
        fp32_logprobs = policy(b.input_ids, b.attention_mask)[1]
    assert bf16 == (not torch.equal(learner_logprobs, fp32_logprobs))
    noise = torch.from_numpy(rng.normal(0.0, 0.5, learner_logprobs.shape)).float()
    for row, lp, m in zip(rows, learner_logprobs + noise, b.response_mask):
        row["logprobs"] = lp[m > 0].tolist()
    algo = GRPO(GRPO.Config(kl_coef=0.0, off_policy_correction="tis", is_cap=1.5))
    batch = algo.prepare(make_experience(rows))
    learner = ray_cluster.remote(Learner).remote(
        str(model_dir), algo, lr=1e-2, minibatches=minibatches, master_port=free_port(), bf16=bf16
    )
    metrics = ray_cluster.get(learner.train_step.remote(batch))

    expected = mismatch_metrics(learner_logprobs, batch.old_logprobs, batch.response_mask)  # every row's tokens
    other = mismatch_metrics(fp32_logprobs if bf16 else learner_logprobs, batch.old_logprobs, batch.response_mask)
    for key in ("mismatch/logprob_abs", "mismatch/kl"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-4)
        assert not bf16 or metrics[key] != pytest.approx(other[key], rel=1e-4)
    assert 0 < metrics["is/capped_frac"] < 1  # the noise puts some rho past the cap
    initial = {name: p.detach().numpy().copy() for name, p in policy.policy.state_dict().items()}
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.0)
    batch.proximal_logprobs = learner_logprobs.clone()  # the policy before the step, for every minibatch
    for mb in batch.split(minibatches):
        mb = mb.trim()
        with precision():
            logits, logprobs, _ = policy(mb.input_ids, mb.attention_mask)
        loss = algo.loss(ModelOutputs(logits, logprobs), mb)[0]
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
    theirs = ray_cluster.get(learner.weights.remote())
    trained = policy.policy.state_dict()
    if bf16:  # the two sides' roundings may differ where a gradient is near zero, and Adam's first
        # steps move such an entry by ~lr whatever its sign: the whole updates agree, not every entry
        ours = np.concatenate([(theirs[k] - initial[k]).ravel() for k in trained])
        plain = np.concatenate([(p.detach().numpy() - initial[k]).ravel() for k, p in trained.items()])
        cosine = float((ours * plain).sum() / (np.linalg.norm(ours) * np.linalg.norm(plain)))
        off = float(np.mean(np.abs(ours - plain) > 1e-4))  # 1.4% of the embedding in one CI run
        assert cosine > 0.95 and off < 0.05, (cosine, off)
    else:
        for name, p in trained.items():
            np.testing.assert_allclose(theirs[name], p.detach().numpy(), atol=1e-4, err_msg=name)
    ray_cluster.kill(learner)


def test_dead_learner_rank_stops_the_run_in_one_line_naming_the_checkpoint(ray_cluster, tmp_path):
    import os
    import signal

    from rlsys import checkpoint
    from rlsys.run.controller import Controller, LearnerFailed

    cfg = load_config(
        "configs/quickstart.yaml",
        [*TINY, f"run.output_dir={tmp_path}", "run.name=learner_dies", "rollout.num_workers=1"],
    )
    c = Controller(cfg, tmp_path / "learner_dies", progress=False)
    c.start_actors(c.prepare_policy())
    c.train_step()
    # held-out pass@k on 4 samples per prompt, before the learner dies
    held_out = c.evaluate(greedy=False, samples=4)
    assert held_out["n"] == 4 * len(c.task.rows("eval"))
    assert held_out["accuracy"] <= held_out["pass@2"] <= held_out["pass@4"] <= 1.0
    saved = c.save_checkpoint()
    pid = ray_cluster.get(c.learners[0].__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(LearnerFailed) as err:
        c.train_step()
    message = str(err.value)
    assert "\n" not in message and "learner rank 0 of 1 died during step 2" in message
    assert f"resume from {saved.name}" in message and "rlsys resume" in message
    assert checkpoint.verify(saved)["step"] == 1  # what was saved is intact and resumable


def test_overlapped_rollout_trains_on_rows_one_version_old_and_checkpoints_them(ray_cluster, tmp_path):
    """trainer.mode=overlap: the next step's rows are generated while the learner trains, by
    the policy a version behind; the prefetched rows are in the checkpointed buffer, and the last
    step prefetches nothing."""
    import pyarrow.parquet as pq

    controller, summary = run_job(
        tmp_path,
        "grpo",
        ["trainer.steps=3", "trainer.mode=overlap", "buffer.max_staleness=1", "trainer.checkpoint_every=2"],
    )
    rows = [json.loads(l) for l in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_lag"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["samples"] for r in rows] == [32, 32, 32] and summary["steps"] == 3
    saved = pq.read_table(tmp_path / "grpo" / "checkpoints" / "step_2" / "buffer.parquet")
    assert saved.num_rows == 32 and set(saved.column("policy_version").to_pylist()) == {1}
    stats = ray_cluster.get(controller.buffer.stats.remote())
    assert stats["size"] == 0 and stats["dropped_stale"] == 0


def test_zero3_learner_syncs_its_gathered_weights(ray_cluster, tmp_path):
    """Under ZeRO-3 the weights are gathered from both ranks and copied out before the gathered
    buffers are released: the workers serve exactly the learner's trained weights, and so does the
    checkpoint's HF export. PPO on a model whose projections are above DeepSpeed's persistence
    threshold (each forward gathers them): every rank joins the value head's scoring forwards."""
    import numpy as np

    from actors.modeling import state_dict_numpy
    from rlsys.checkpoint import candidates
    from rlsys.models import load_model

    # the length-shaped reward varies within a group, so the advantages (and the update) are not zero
    controller, _ = run_job(
        tmp_path,
        "ppo",
        [
            "trainer.steps=2",
            "trainer.checkpoint_every=2",
            "learner.num_ranks=2",
            "learner.zero_stage=3",
            "rollout.num_workers=1",
            "model.hidden_size=320",  # 320 x 320 projections: 102400 parameters, above the threshold of 1e5
            "task.shaping=[{cosine_length: {max_length: 24}}]",
        ],
    )
    served = ray_cluster.get(controller.workers[0].__ray_call__.remote(lambda w: state_dict_numpy(w.backend.model)))
    refs = [l.weights.remote() for l in controller.learners]  # every rank joins the gather
    learner = ray_cluster.get(refs)[0]
    initial = state_dict_numpy(load_model(tmp_path / "ppo" / "policy_init"))
    exported = state_dict_numpy(load_model(candidates(tmp_path / "ppo" / "checkpoints")[0] / "hf"))
    assert set(served) == set(learner) == set(exported)
    assert all(np.array_equal(served[k], learner[k]) and np.array_equal(exported[k], learner[k]) for k in learner)
    assert any(not np.array_equal(initial[k], learner[k]) for k in learner)


def test_learner_ranks_whose_shards_plan_different_forwards_agree_on_them(ray_cluster, tmp_path):
    """Two ranks whose shards plan different forwards: rank 0's two minibatches share prompts
    and spread 2-60-token responses, rank 1's are short, its second with distinct prompts; in a
    second step rank 1 has one row (one minibatch for both, one update: the sampler mismatch and
    the proximal logprobs from the loss's own forwards, copies at weight 0 among them). Under
    ZeRO-2/3 ranks meet in every backward (ZeRO-3 also in every forward, gathering the embedding,
    which is above DeepSpeed's persistence threshold), so they agree on their plans: ZeRO-3 padded
    runs prompts once only where both ranks can; ZeRO-2 under a budget of 80 tokens runs rank 1's
    minibatches in as many micro-batches as rank 0's (copies at weight 0); ZeRO-3 with auto_pack
    packs rank 1 where rank 0 packs. Unagreed, the ranks crash or hang in their collectives; agreed,
    each step is ZeRO-0's (whose ranks meet at each minibatch's end only): the same update, loss and
    sampler mismatch. Under ZeRO-3 every rank joins the HF export and the scoring forwards: the
    export holds the trained weights and the scores are theirs."""
    import numpy as np
    import torch

    from actors.learner import Learner
    from actors.modeling import PolicyOnly
    from algorithms.grpo import GRPO
    from rlsys.batch import collate, collate_ids
    from rlsys.cluster import free_port
    from rlsys.experience import make_experience
    from rlsys.models import TinyModelSpec, build_tiny_model, load_model, save_model_dir
    from tests.actors.test_packing import grpo_fields, long_and_short_rows
    from tests.fakes import assert_same_update

    spec = TinyModelSpec(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    model_dir = save_model_dir(build_tiny_model(spec, seed=3), None, tmp_path / "policy")
    policy = PolicyOnly(load_model(model_dir))
    short = [([5, 6, 7], [8, 9, 10]), ([5, 6, 7], [11, 12, 13, 14]), ([20, 21], [22, 23, 24]), ([30, 31], [32, 33])]
    shards = [
        grpo_fields(long_and_short_rows(), policy),
        grpo_fields(collate_ids([p for p, _ in short], [r for _, r in short]), policy, seed=1),
    ]
    table = make_experience(
        [
            dict(uid=str(i), group=str(i), prompt_ids=p, response_ids=r, logprobs=[], reward=0.0, policy_version=0)
            for i, (p, r) in enumerate(short)
        ]
    )
    weights, metrics = [], []
    for zero_stage, budget, auto_pack in [(0, None, False), (3, None, False), (2, 80, False), (3, None, True)]:
        algo = GRPO(GRPO.Config(group_size=3, kl_coef=0.0, off_policy_correction="tis", is_cap=1.05))
        port = free_port()
        ranks = [
            ray_cluster.remote(Learner)
            .options(num_cpus=0.5)
            .remote(
                str(model_dir),
                algo,
                lr=1e-2,
                minibatches=2,
                zero_stage=zero_stage,
                rank=rank,
                world_size=2,
                master_port=port,
                max_tokens_per_microbatch=budget,
                auto_pack=auto_pack,
            )
            for rank in range(2)
        ]
        try:
            steps = ray_cluster.get([l.train_step.remote(s) for l, s in zip(ranks, shards)], timeout=180)
            one_row = [shards[0], shards[1].select(slice(0, 1))]
            steps += ray_cluster.get([l.train_step.remote(s) for l, s in zip(ranks, one_row)], timeout=180)
            metrics.append(steps)
            weights.append(ray_cluster.get([l.weights.remote() for l in ranks], timeout=60)[0])
            if zero_stage == 3 and not auto_pack:
                out = tmp_path / "hf"
                ray_cluster.get([l.export_hf.remote(str(out)) for l in ranks], timeout=60)
                exported = load_model(out)
                for name, tensor in exported.state_dict().items():
                    assert np.array_equal(tensor.numpy(), weights[-1][name]), name
                scored = ray_cluster.get([l.logprobs.remote(table) for l in ranks], timeout=60)
                assert scored[0] == scored[1]
                with torch.no_grad():
                    b = collate(table)
                    want = PolicyOnly(exported)(b.input_ids, b.attention_mask)[1]
                for row, mask, got in zip(want, b.response_mask, scored[0]):
                    assert torch.allclose(row[mask > 0], torch.tensor(got), rtol=1e-5, atol=1e-5)
        finally:
            for l in ranks:
                ray_cluster.kill(l)
    initial = {name: t.numpy() for name, t in load_model(model_dir).state_dict().items()}
    for other, steps in zip(weights[1:], metrics[1:]):
        assert_same_update(weights[0], other, initial, lr=1e-2)
        for plain, agreed in zip(metrics[0], steps):  # each rank's, each step's
            for key in ("loss", "mismatch/kl", "mismatch/logprob_abs", "is/capped_frac"):
                assert agreed[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key


def test_a_step_with_fewer_rows_than_learner_ranks_fails_in_one_line(tmp_path):
    """A rank given no rows would leave the others waiting in their first collective: the step
    stops before any rank is called."""
    from types import SimpleNamespace

    from rlsys.errors import RunFailed
    from rlsys.run.actors import Learners
    from rlsys.run.context import PolicyActors
    from tests.actors.test_packing import long_and_short_rows

    ranks = Learners({"policy": PolicyActors(workers=[], learners=["rank 0", "rank 1", "rank 2"])}, tmp_path)
    no_slot = SimpleNamespace(train_slot=lambda name, version: None)
    with pytest.raises(RunFailed, match="^step 7: 2 row\\(s\\) to train for 3 learner ranks$"):
        ranks.train({"policy": long_and_short_rows().select(slice(0, 2))}, 6, no_slot, step=7)


@pytest.mark.parametrize("room", [0.5, 1.1])  # 1.1: the learner and the worker (0.5 each) fit, not all services
def test_actors_the_cluster_cannot_place_fail_in_one_line(ray_cluster, tmp_path, room):
    """A cluster whose CPUs another job holds: the run stops with one line saying so, instead of
    its actors (a service included) pending forever; `shutdown()` after it has nothing left to do."""
    from rlsys.errors import RunFailed
    from rlsys.run.controller import Controller

    hog = ray_cluster.remote(num_cpus=ray_cluster.cluster_resources()["CPU"] - room)(
        type("Hog", (), {"ok": lambda self: 1})
    )
    hog = hog.remote()
    ray_cluster.get(hog.ok.remote())
    try:
        cfg = load_config(
            "configs/quickstart.yaml",
            [*TINY, f"run.output_dir={tmp_path}", "run.name=grpo", "trainer.steps=1", "trainer.start_timeout_s=5"]
            + ["rollout.num_workers=1"],
        )
        controller = Controller(cfg, tmp_path / "grpo", progress=False)
        with pytest.raises(RunFailed, match=r"did not start within 5 s .* logical CPUs free") as e:
            controller.run()
        assert "\n" not in str(e.value)
        controller.shutdown()
    finally:
        ray_cluster.kill(hog)
    import time

    deadline = time.time() + 30  # nothing of the failed run stays queued: all CPUs come back
    while (
        ray_cluster.available_resources().get("CPU", 0) < ray_cluster.cluster_resources()["CPU"]
        and time.time() < deadline
    ):
        time.sleep(0.5)
    assert ray_cluster.available_resources().get("CPU", 0) == ray_cluster.cluster_resources()["CPU"]


def test_a_local_qwen3_model_dir_trains_through_every_actor(ray_cluster, tmp_path):
    """`model.path`: a Qwen3 directory made here (an RMSNorm on every query and key head, tied
    embeddings) loaded with `from_pretrained`; GRPO steps through the warm-up, the DeepSpeed
    learner, the reference, the lean-decode rollout and the shared-memory weight sync. After
    training, the worker's greedy answers are what transformers' `generate` gives with the
    learner's weights."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from actors.rollout import HFBackend
    from rlsys.generation import GenerationRequest, SamplingParams
    from rlsys.models import save_model_dir, train_tokenizer

    tok = train_tokenizer([f"{a}+{b}={a + b}" for a in range(10) for b in range(10)], 128)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    model_dir = save_model_dir(Qwen3ForCausalLM(config), tok, tmp_path / "qwen3")
    controller, summary = run_job(
        tmp_path, "grpo", [f"model.path={model_dir}", "trainer.steps=2", "rollout.num_workers=1"]
    )
    rows = [json.loads(l) for l in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 2 and [r["step"] for r in rows] == [1, 2] and rows[0]["samples"] == 4 * 8
    assert json.loads((tmp_path / "grpo" / "policy_init" / "config.json").read_text())["model_type"] == "qwen3"

    weights = ray_cluster.get(controller.learners[0].weights.remote())
    plain = HFBackend("unused", model=Qwen3ForCausalLM(config).eval(), decode="generate")
    plain.load_weights(weights)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    requests = [
        GenerationRequest(tok(p, add_special_tokens=False)["input_ids"], greedy) for p in ("3+4=", "12+9=", "5+5=")
    ]
    served = ray_cluster.get(controller.workers[0].generate.remote(requests))
    stats = ray_cluster.get(controller.workers[0].stats.remote())
    assert stats["version"] == 2 and stats["lean_decode"]
    assert [g.response_ids for g in served] == [g.response_ids for g in plain.generate(requests)]


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_learner_ranks_take_the_one_rank_update_of_the_whole_batch(ray_cluster, tmp_path, algorithm):
    """A batch split over two ranks whose shards differ in size (GRPO: 107 and 90 response tokens;
    RLOO, a mean over responses: 6 and 5 rows) takes one rank's update on the whole batch: the
    same gradient (its norm), loss and weights. DeepSpeed averages the ranks' gradients, so each
    rank's mean loss is weighted by its share of what the loss averages over; unweighted, the
    shorter shard's tokens (rows) count more per token (row) than the longer's."""
    from actors.learner import Learner
    from actors.modeling import PolicyOnly
    from algorithms.grpo import GRPO
    from algorithms.rloo import RLOO
    from rlsys.cluster import free_port
    from rlsys.models import TinyModelSpec, build_tiny_model, load_model, save_model_dir
    from rlsys.run.actors import rank_means
    from tests.actors.test_packing import grpo_fields, long_and_short_rows
    from tests.fakes import assert_same_update

    spec = TinyModelSpec(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    model_dir = save_model_dir(build_tiny_model(spec, seed=3), None, tmp_path / "policy")
    batch = grpo_fields(long_and_short_rows(), PolicyOnly(load_model(model_dir)))
    if algorithm == "grpo":
        algo = GRPO(GRPO.Config(group_size=3, kl_coef=0.0))
    else:
        algo, batch = RLOO(RLOO.Config(group_size=3, kl_coef=0.0)), batch.select(slice(0, 11))
    runs = []
    for world_size in (1, 2):
        port = free_port()
        ranks = [
            ray_cluster.remote(Learner)
            .options(num_cpus=0.5)
            .remote(str(model_dir), algo, lr=1e-2, rank=rank, world_size=world_size, master_port=port)
            for rank in range(world_size)
        ]
        try:
            steps = [  # two steps: AdamW's first moves each weight by ~lr whatever its gradient's size
                rank_means(ray_cluster.get([l.train_step.remote(s) for l, s in zip(ranks, shards)], timeout=120))
                for shards in [batch.split(world_size)] * 2
            ]
            runs.append((steps, ray_cluster.get(ranks[0].weights.remote(), timeout=60)))
        finally:
            for l in ranks:
                ray_cluster.kill(l)
    (one, one_weights), (two, two_weights) = runs
    for one_step, two_step in zip(one, two):
        for key in ("grad_norm", "loss"):
            assert two_step[key] == pytest.approx(one_step[key], rel=1e-4), key
    initial = {name: t.numpy() for name, t in load_model(model_dir).state_dict().items()}
    assert_same_update(one_weights, two_weights, initial, lr=1e-2)
