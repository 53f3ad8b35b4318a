"""learner.offload: DeepSpeed's ZeRO-Offload sections for a CUDA learner (the config builder is
tested in test_vllm_backend.py); on a CPU learner it changes nothing and says so once; a stage
that cannot offload is a one-line config error."""

import pytest

from rlsys.config import ConfigError, load_config
from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread", "in_process_learners")


def test_offload_needs_zero_and_a_cpu_learner_says_it_changes_nothing(tmp_path, capfd):
    with pytest.raises(ConfigError, match="offload 'optimizer' needs zero_stage 1, 2 or 3"):
        load_config("configs/quickstart.yaml", ["learner.offload=optimizer"])
    with pytest.raises(ConfigError, match="offload 'params' needs zero_stage 3, not 2"):
        load_config("configs/quickstart.yaml", ["learner.offload=params", "learner.zero_stage=2"])
    assert load_config("configs/quickstart.yaml", ["learner.offload=params", "learner.zero_stage=3"])

    import torch

    from actors.learner import Learner
    from algorithms.grpo import GRPO
    from rlsys.cluster import free_port

    if torch.cuda.is_available():
        pytest.skip("a CUDA learner offloads for real")
    spec = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    model_dir = save_model_dir(build_tiny_model(TinyModelSpec(**spec)), None, tmp_path / "policy")
    learner = Learner(str(model_dir), GRPO(), zero_stage=3, offload="params", master_port=free_port())
    assert learner.offload == "none" and "offload_param" not in learner.engine.config["zero_optimization"]
    assert "learner.offload=params on a CPU learner changes nothing" in capfd.readouterr().err
