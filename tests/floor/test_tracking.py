"""Run logs a person reads: samples.jsonl and TensorBoard's text tab."""

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlsys.experience import make_experience
from rlsys.models import train_tokenizer
from rlsys.tracking import Tracker, read_jsonl, rollout_samples


def _table(tok, n=3):
    rows = []
    for i in range(n):
        prompt, response = tok(f"{i}+1=")["input_ids"], tok(f"{i + 1}")["input_ids"]
        rows.append(
            dict(
                uid=str(i),
                group="g",
                prompt_ids=prompt,
                response_ids=response,
                logprobs=[0.0] * len(response),
                reward=float(i),
                policy_version=0,
                meta={"answer": i + 1, "reward/format": 0.5},
            )
        )
    return make_experience(rows)


def test_samples_reach_the_jsonl_and_tensorboard_and_resume_drops_later_ones(tmp_path):
    tok = train_tokenizer([f"{a}+{b}={a + b}" for a in range(10) for b in range(10)], vocab_size=64)
    table = _table(tok)
    samples = rollout_samples(table.slice(0, 2), tok)
    assert [s["prompt"] for s in samples] == ["0+1=", "1+1="]
    assert [s["response"] for s in samples] == ["1", "2"]
    assert [s["reward"] for s in samples] == [0.0, 1.0] and samples[0]["reward/format"] == 0.5
    assert "answer" not in samples[0]  # the row's other meta stays out of the log
    extra = {table.column("uid")[1].as_py(): {"reward/steps_shown": 3.0}}  # a reward function's, per row
    assert [s.get("reward/steps_shown") for s in rollout_samples(table.slice(0, 2), tok, extra)] == [None, 3.0]

    tracker = Tracker(tmp_path)
    tracker.log_samples(1, samples)
    tracker.log_samples(2, samples[:1])
    tracker.close()
    logged = read_jsonl(tmp_path / "samples.jsonl")
    assert [(r["step"], r["prompt"]) for r in logged] == [(1, "0+1="), (1, "1+1="), (2, "0+1=")]

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [1, 2]
    first = texts[0].tensor_proto.string_val[0].decode()
    assert "| prompt | response | reward | reward/format |" in first and "| 1+1= | 2 | 1.0 | 0.5 |" in first

    Tracker(tmp_path).truncate_after(1)  # a resumed run logs step 2 again
    assert [r["step"] for r in read_jsonl(tmp_path / "samples.jsonl")] == [1, 1]
    assert json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])["reward"] == 0.0
