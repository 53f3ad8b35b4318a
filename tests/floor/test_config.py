import subprocess
import sys

import pytest

from algorithms.base import build_algorithm
from rlsys.config import ConfigError, load_config

QUICKSTART = "configs/quickstart.yaml"


def test_quickstart_and_overrides():
    cfg = load_config(QUICKSTART, ["algorithm.kl_coef=0.02", "trainer.steps=5", "task.operations=['+','-']"])
    assert cfg.trainer.steps == 5 and cfg.algorithm_params()["kl_coef"] == 0.02
    assert cfg.task.operations == ["+", "-"]
    alg = build_algorithm(cfg)
    assert alg.config.kl_coef == 0.02 and alg.name == "grpo"


def test_naming_another_algorithm_leaves_out_the_files_keys_it_lacks(capsys):
    """`algorithm.name=X` over a file written for another algorithm: the file's keys X has no field
    for are left out and named when X is built (X's defaults serve, the saved config holds X's keys
    only), the keys X shares are kept; a key given on the command line that X lacks still fails,
    and the file's own algorithm keeps every key."""
    from rlsys.config import dump_config

    cfg = load_config("configs/reasoning.yaml", ["algorithm.name=opd"])  # the file: grpo, group_size 8, kl_coef 0.01
    assert build_algorithm(cfg).config.group_size == 8
    assert cfg.algorithm_params() == {"group_size": 8} and "kl_coef" not in dump_config(cfg)
    assert "algorithm.name=opd leaves out the file's algorithm keys that opd does not have: kl_coef" in (
        capsys.readouterr().err
    )
    rloo = load_config("configs/reasoning.yaml", ["algorithm.name=rloo"])
    assert build_algorithm(rloo).config.kl_coef == 0.01 and rloo.algorithm_params() == {
        "group_size": 8,
        "kl_coef": 0.01,
    }
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match="algorithm.kl_coef"):
        build_algorithm(load_config("configs/reasoning.yaml", ["algorithm.name=opd", "algorithm.kl_coef=0.1"]))
    grpo = load_config("configs/reasoning.yaml", ["algorithm.name=grpo"])  # the file's own: nothing left out
    assert build_algorithm(grpo).config.kl_coef == 0.01 and grpo.algorithm.written_for_another() == set()


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.stepz=3", "unknown key 'trainer.stepz'"),
        ("trainer.steps=many", "trainer.steps = 'many'"),
        ("learner.lr=-1", "learner.lr = -1"),
        ("rollout.backend=tpu", "rollout.backend = 'tpu'"),
        ("nosuch.key=1", "unknown key 'nosuch'"),
        ("trainer.steps", "not of the form key=value"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(QUICKSTART, [override])


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.kl_coeff=0.1", "unknown key 'algorithm.kl_coeff'"),
        ("algorithm.group_size=1", "algorithm.group_size = 1"),
        ("algorithm.name=dqn", "unknown algorithm 'dqn'"),
    ],
)
def test_algorithm_keys_are_validated_by_the_algorithm(override, message):
    cfg = load_config(QUICKSTART, [override])
    with pytest.raises(ConfigError, match=message):
        build_algorithm(cfg)


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  steps: [1\n")
    for args in ([str(bad)], [QUICKSTART, "algorithm.clip_eps=5"], [QUICKSTART, "trainer.steps=-3"]):
        p = subprocess.run(
            [sys.executable, "-m", "rlsys.run.cli", "run", *args], capture_output=True, text=True, timeout=120
        )
        assert p.returncode == 2, p.stderr
        lines = [l for l in p.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("config error:"), p.stderr
        assert "Traceback" not in p.stderr


def test_packed_micro_batches_are_refused_for_a_loss_they_cannot_weigh_exactly():
    """RLEF adds a token mean and a mean over turns: learner.max_tokens_per_microbatch is refused
    in one line; an algorithm whose loss has one denominator takes it."""
    with pytest.raises(ConfigError) as e:
        build_algorithm(load_config("configs/rlef.yaml", ["learner.max_tokens_per_microbatch=4096"]))
    assert str(e.value) == (
        "config error: 'learner.max_tokens_per_microbatch'=4096: algorithm 'rlef' adds loss means over different "
        "units, which packed micro-batches cannot weigh exactly (allowed: null)"
    )
    for name in ("grpo", "gspo", "rloo"):
        build_algorithm(load_config(QUICKSTART, [f"algorithm.name={name}", "learner.max_tokens_per_microbatch=4096"]))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["algorithm.name=ppo", "buffer.max_staleness=1"], "algorithm 'ppo' needs its rollout on the current policy"),
        ([], "set buffer.max_staleness >= 1"),
    ],
)
def test_overlapped_rollout_needs_an_algorithm_and_buffer_that_allow_it(extra, message):
    with pytest.raises(ConfigError, match=message):
        build_algorithm(load_config(QUICKSTART, ["trainer.mode=overlap", *extra]))
    assert build_algorithm(load_config(QUICKSTART, ["trainer.mode=overlap", "buffer.max_staleness=1"]))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["algorithm.name=rloo", "buffer.max_staleness=2"], r"'trainer.mode'=async: algorithm 'rloo' needs its"),
        ([], "set buffer.max_staleness >= 1"),
        (["buffer.max_staleness=2", "trainer.weight_sync=broadcast"], r"'trainer.weight_sync'=broadcast: trainer"),
        (["buffer.max_staleness=2", "trainer.weight_sync=shared_memory"], r"\(allowed: auto, object_store\)$"),
        (
            ["buffer.max_staleness=2", "trainer.deterministic=true", "trainer.staleness_policy=drop"],
            "it takes trainer.staleness_policy=wait, not drop",
        ),
        (
            ["buffer.max_staleness=2", "learner.lora.rank=4", "learner.zero_stage=3"],
            "with learner.lora under learner.zero_stage=3",
        ),
        (
            ["buffer.max_staleness=2", "rollout.inflight_update=continue", "rollout.decode=generate"],
            r"continue loads weights between the lean decoder's steps: it needs rollout.decode=lean",
        ),
        (
            ["buffer.max_staleness=2", "rollout.inflight_update=continue", "trainer.deterministic=true"],
            r"continue: the decode step that new weights reach depends on timing",
        ),
    ],
)
def test_async_mode_needs_stale_rows_a_bound_and_a_sync_that_does_not_wait_on_the_workers(extra, message):
    with pytest.raises(ConfigError, match=message):
        build_algorithm(load_config(QUICKSTART, ["trainer.mode=async", *extra]))
    assert build_algorithm(load_config(QUICKSTART, ["trainer.mode=async", "buffer.max_staleness=2"]))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["trainer.deterministic=true"], r"^config error: 'trainer.deterministic' applies to trainer.mode=async only"),
        (["trainer.staleness_policy=drop"], r"'trainer.staleness_policy' applies to trainer.mode=async only"),
        (["rollout.inflight_update=resume"], r"'rollout.inflight_update'=resume: weights change during a generation"),
        (["rollout.inflight_update=continue"], r"'rollout.inflight_update'=continue: weights change during a"),
    ],
)
def test_the_async_keys_are_refused_outside_async(extra, message):
    with pytest.raises(ConfigError, match=message):
        build_algorithm(load_config(QUICKSTART, extra))


@pytest.mark.parametrize(
    "extra",
    [["rollout.decode=generate"], ["rollout.kv_cache=specache"], ["rollout.backend=vllm", "rollout.dtype=bfloat16"]],
)
def test_a_bfloat16_rollout_is_the_lean_decoders(extra):
    overrides = extra if "rollout.dtype=bfloat16" in extra else [*extra, "rollout.dtype=bfloat16"]
    with pytest.raises(
        ConfigError,
        match=r"rollout.dtype = 'bfloat16': Value error, bfloat16 is the lean decoder's \(rollout.backend hf",
    ):
        load_config(QUICKSTART, overrides)
    assert load_config(QUICKSTART, ["rollout.dtype=bfloat16"]).rollout.dtype == "bfloat16"


def test_a_renamed_key_names_its_successor():
    with pytest.raises(
        ConfigError, match=r"^config error: unknown key 'trainer.overlap_rollout' \(it became trainer.mode: overlap\)$"
    ):
        load_config(QUICKSTART, ["trainer.overlap_rollout=true"])


def test_shaping_a_judge_or_model_score_is_refused_when_the_algorithm_is_built():
    with pytest.raises(
        ConfigError,
        match=r"^config error: 'task.shaping' shapes the task's rule reward, but reward.source "
        r"is 'judge' \(its scores are not shaped\)",
    ):
        build_algorithm(load_config(QUICKSTART, ["task.shaping=[{repetition: {ngram: 2}}]", "reward.source=judge"]))
    assert build_algorithm(load_config(QUICKSTART, ["task.shaping=[{repetition: {ngram: 2}}]"]))


def test_check_job_takes_the_algorithm_it_is_given():
    """The rules across sections look at the built algorithm (its capabilities), not at its name."""
    from rlsys.config import check_job

    cfg = load_config(QUICKSTART, ["trainer.mode=overlap", "buffer.max_staleness=1"])
    check_job(cfg, build_algorithm(cfg))
    with pytest.raises(ConfigError, match="algorithm 'grpo' needs its rollout on the current policy"):
        check_job(cfg, object())  # declares no TrainsOnStaleRows


# ---- the reference: every key described, docs/configuration.md current ---------------------------
def _algorithms() -> dict:
    from algorithms.base import available, get_algorithm

    return {name: get_algorithm(name) for name in available()}


def _fields(model, prefix):
    from pydantic import BaseModel

    for key, field in model.model_fields.items():
        yield f"{prefix}.{key}", field
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _fields(field.annotation, f"{prefix}.{key}")


def test_every_config_key_has_a_description():
    from rlsys.config import JobConfig

    keys = list(_fields(JobConfig, "job")) + [
        kv for name, cls in _algorithms().items() for kv in _fields(cls.Config, f"algorithm({name})")
    ]
    assert len(keys) > 150
    missing = [key for key, field in keys if not (field.description or "").strip()]
    assert not missing, f"config keys without a description: {', '.join(missing)}"
    multiline = [key for key, field in keys if "\n" in field.description]
    assert not multiline, f"descriptions are one line: {', '.join(multiline)}"


def test_docs_configuration_md_is_current():
    from pathlib import Path

    from rlsys.config import config_reference

    expected = config_reference(_algorithms())
    committed = Path("docs/configuration.md")
    assert committed.exists() and committed.read_text() == expected, (
        "docs/configuration.md is not current: run `rlsys config doc --output docs/configuration.md`"
    )


def test_config_doc_command_prints_or_writes_the_reference(tmp_path):
    out = tmp_path / "configuration.md"
    p = subprocess.run(
        [sys.executable, "-m", "rlsys.run.cli", "config", "doc", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    from rlsys.config import config_reference

    assert out.read_text() == config_reference(_algorithms())
