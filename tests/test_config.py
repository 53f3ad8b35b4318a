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


@pytest.mark.parametrize("override, message", [
    ("trainer.stepz=3", "unknown key 'trainer.stepz'"),
    ("trainer.steps=many", "trainer.steps = 'many'"),
    ("learner.lr=-1", "learner.lr = -1"),
    ("rollout.backend=tpu", "rollout.backend = 'tpu'"),
    ("nosuch.key=1", "unknown key 'nosuch'"),
    ("trainer.steps", "not of the form key=value"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(QUICKSTART, [override])


@pytest.mark.parametrize("override, message", [
    ("algorithm.kl_coeff=0.1", "unknown key 'algorithm.kl_coeff'"),
    ("algorithm.group_size=1", "algorithm.group_size = 1"),
    ("algorithm.name=dqn", "unknown algorithm 'dqn'"),
])
def test_algorithm_keys_are_validated_by_the_algorithm(override, message):
    cfg = load_config(QUICKSTART, [override])
    with pytest.raises(ConfigError, match=message):
        build_algorithm(cfg)


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  steps: [1\n")
    for args in ([str(bad)], [QUICKSTART, "algorithm.clip_eps=5"], [QUICKSTART, "trainer.steps=-3"]):
        p = subprocess.run([sys.executable, "-m", "rlsys.cli", "run", *args], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        lines = [l for l in p.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("config error:"), p.stderr
        assert "Traceback" not in p.stderr


@pytest.mark.parametrize("extra, message", [
    (["algorithm.name=ppo", "buffer.max_staleness=1"], "algorithm 'ppo' needs its rollout on the current policy"),
    ([], "set buffer.max_staleness >= 1"),
])
def test_overlapped_rollout_needs_an_algorithm_and_buffer_that_allow_it(extra, message):
    with pytest.raises(ConfigError, match=message):
        build_algorithm(load_config(QUICKSTART, ["trainer.overlap_rollout=true", *extra]))
    assert build_algorithm(load_config(QUICKSTART, ["trainer.overlap_rollout=true", "buffer.max_staleness=1"]))
