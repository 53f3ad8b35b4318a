"""learner.max_tokens_per_microbatch (rlsys/packing.py): rows packed into one sequence without
padding keep their attention inside the row (the packed forward's logprobs, values and
gradients are the per-row and padded forwards'); the micro-batch plan keeps to the token budget
and never cuts a prompt group; micro-batch losses weighted by what the loss averages over
accumulate the whole minibatch's gradient; a learner step in packed micro-batches gives the
weights, loss and gradient norm of the learner without them; and learner.auto_pack packs where
padding to the longest response dominates."""

import pytest
import torch

from actors.modeling import PolicyOnly, PolicyWithValueHead, enable_activation_checkpointing
from rlsys.batch import TrainBatch, collate_ids
from rlsys.logprobs import forward_logprobs
from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir
from rlsys.packing import (
    PACKED_SDPA,
    microbatches,
    pack_rows,
    packed_logprobs,
    plan_microbatches,
    plan_rank_shards,
    prompt_groups,
    row_lengths,
    row_spans,
    unpack,
)
from tests.fakes import assert_same_update, rows_sharing_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
TIGHT = dict(rtol=1e-5, atol=1e-5)  # float32: the same rows through other kernels and shapes


def long_and_short_id_rows(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Four prompt groups of three (prompt, response) rows, responses of 2 to 60 tokens (30x):
    19, 88, 33 and 57 tokens a group."""
    g = torch.Generator().manual_seed(seed)
    groups = [(3, (2, 3, 5)), (5, (60, 4, 9)), (4, (12, 2, 7)), (6, (30, 6, 3))]
    rows = []
    for plen, lengths in groups:
        prompt = torch.randint(3, 64, (plen,), generator=g).tolist()
        rows += [(prompt, torch.randint(3, 64, (n,), generator=g).tolist()) for n in lengths]
    return rows


def long_and_short_rows(seed: int = 0) -> TrainBatch:
    rows = long_and_short_id_rows(seed)
    return collate_ids([p for p, _ in rows], [r for _, r in rows])


def long_and_short_table(seed: int = 0):
    """`long_and_short_id_rows` as an Experience table (groups "0".."3")."""
    from rlsys.experience import make_experience

    rows = long_and_short_id_rows(seed)
    return make_experience(
        [
            dict(uid=str(i), group=str(i // 3), prompt_ids=p, response_ids=r, logprobs=[], reward=0.0, policy_version=0)
            for i, (p, r) in enumerate(rows)
        ]
    )


def test_pack_and_unpack_round_trip():
    """Rows concatenated without padding, positions restarting at 0 per row; unpack puts each
    token back where it was (zeros at padding), whole or cut to a width; left padding is refused."""
    _, batch = rows_sharing_prompts()
    packed = pack_rows(batch.input_ids, batch.attention_mask)
    lengths = row_lengths(batch.attention_mask)
    assert packed.input_ids.shape == packed.position_ids.shape == (1, sum(lengths))
    assert packed.input_ids[0].tolist() == [t for row, n in zip(batch.input_ids.tolist(), lengths) for t in row[:n]]
    assert packed.position_ids[0].tolist() == [p for n in lengths for p in range(n)]
    real = batch.attention_mask.bool()
    assert torch.equal(unpack(packed.input_ids, packed), torch.where(real, batch.input_ids, 0))
    features = torch.randn(1, sum(lengths), 3)
    back = unpack(features, packed, width=batch.input_ids.shape[1] - 1)
    assert back.shape == (len(batch), batch.input_ids.shape[1] - 1, 3)
    assert torch.equal(back[real[:, :-1]], unpack(features, packed)[:, :-1][real[:, :-1]])
    assert torch.equal(back[~real[:, :-1]], torch.zeros_like(back[~real[:, :-1]]))
    with pytest.raises(ValueError, match="right-padded"):
        pack_rows(batch.input_ids, batch.attention_mask.flip(1))


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_attention_stays_inside_each_row(architecture, attention):
    """The packed forward's logits, logprobs and last hidden state equal each row's forward on
    its own (no padding, batch of one), and the padded forward's at every real target: SDPA on
    each row's span (the model switched to PACKED_SDPA), eager with the block-diagonal mask
    transformers builds from the restarting positions. Switched, an SDPA model's other forwards
    are bit for bit what they were, and transformers' own packed SDPA (the [T, T] mask) agrees."""
    _, batch = rows_sharing_prompts()
    model = build_tiny_model(TinyModelSpec(**SPEC, architecture=architecture), seed=3).eval()
    model.set_attn_implementation(attention)
    packed = pack_rows(batch.input_ids, batch.attention_mask)
    with torch.no_grad():
        padded = forward_logprobs(model, batch.input_ids, batch.attention_mask, 0.7)
        masked = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits / 0.7
        logits, logprobs, hidden = packed_logprobs(model, batch.input_ids, batch.attention_mask, 0.7, hidden=True)
        switched = model.config._attn_implementation
        for i, n in enumerate(row_lengths(batch.attention_mask)):
            alone = forward_logprobs(model, batch.input_ids[i : i + 1, :n], batch.attention_mask[i : i + 1, :n], 0.7)
            assert torch.allclose(logits[i, : n - 1], alone[0][0], **TIGHT)
            assert torch.allclose(logprobs[i, : n - 1], alone[1][0], **TIGHT)
            assert torch.allclose(hidden[i, :n], alone[2][0], **TIGHT)
            assert not logprobs[i, n - 1 :].any() and not hidden[i, n:].any()  # padding: zeros
        again = forward_logprobs(model, batch.input_ids, batch.attention_mask, 0.7)
    assert switched == (PACKED_SDPA if attention == "sdpa" else "eager")
    targets = batch.attention_mask[:, 1:].bool()
    assert torch.allclose(logprobs[targets], padded[1][targets], **TIGHT)
    assert all(torch.equal(a, b) for a, b in zip(padded, again))
    assert torch.allclose(unpack(masked, packed)[:, :-1][targets], logits[targets], **TIGHT)
    # as one causal sequence (no restarting positions) the rows attend to those before them: not the same
    with torch.no_grad():
        leaky = unpack(model(input_ids=packed.input_ids, use_cache=False).logits / 0.7, packed)[:, :-1]
    assert not torch.allclose(leaky[1:][targets[1:]], logits[1:][targets[1:]], **TIGHT)


def test_the_packed_forward_under_activation_checkpointing_gives_the_same_gradients():
    """The backward's recompute of a checkpointed layer runs outside `packed_logprobs` (no
    mask was built; the saved positions still say where each row starts): the same gradients."""
    _, batch = rows_sharing_prompts(seed=2)
    plain, checkpointed = (build_tiny_model(TinyModelSpec(**SPEC), seed=3).train() for _ in range(2))
    enable_activation_checkpointing(checkpointed)
    grads = []
    for model in (plain, checkpointed):
        logprobs = packed_logprobs(model, batch.input_ids, batch.attention_mask)[1]
        grads.append(torch.autograd.grad((logprobs * batch.response_mask).sum(), list(model.parameters())))
        assert model.config._attn_implementation == PACKED_SDPA
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_row_spans_read_the_restarts():
    assert row_spans(torch.tensor([0, 1, 2, 0, 0, 1, 0, 1, 2, 3])) == [(0, 3), (3, 4), (4, 6), (6, 10)]
    assert row_spans(torch.tensor([5, 6, 7])) == [(0, 3)]  # one row, wherever it starts


def test_packed_policy_and_value_head_give_the_padded_gradients():
    """PolicyOnly and PolicyWithValueHead with `packed=True`: the logprobs and values at the
    trainable targets, and every parameter's gradient of their sum, are those of the padded
    forward (rows sharing a prompt running it once)."""
    _, batch = rows_sharing_prompts(seed=1)
    trainable = batch.response_mask > 0
    for wrap, output in ((PolicyOnly, 1), (PolicyWithValueHead, 2)):
        module = wrap(build_tiny_model(TinyModelSpec(**SPEC), seed=3).train())
        if output == 2:
            torch.nn.init.normal_(module.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(7))
        results = []
        for packed in (False, True):
            out = module(batch.input_ids, batch.attention_mask, 0.7, batch.response_mask, packed=packed)[output]
            grads = torch.autograd.grad((out * trainable).sum(), list(module.parameters()))
            results.append((out[trainable], grads))
        (want, want_grads), (got, got_grads) = results
        assert torch.allclose(want, got, **TIGHT)
        for a, b in zip(want_grads, got_grads):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_plan_keeps_to_the_budget_and_never_cuts_a_group():
    """First-fit decreasing by group tokens: each micro-batch within the budget unless it is one
    group larger than it (a row longer than the budget goes alone), every row once, rows in batch
    order, micro-batches ordered by their first row."""
    lengths = [5, 7, 3, 40, 12, 12, 2, 9, 30, 1, 1, 1]
    groups = [0, 0, 0, 1, 2, 2, 3, 3, 4, 5, 5, 5]
    for budget in (1, 8, 20, 31, 45, 200):
        plan = plan_microbatches(lengths, groups, budget)
        assert sorted(i for rows in plan for i in rows) == list(range(len(lengths)))
        assert all(rows == sorted(rows) for rows in plan) and [r[0] for r in plan] == sorted(r[0] for r in plan)
        where = {i: k for k, rows in enumerate(plan) for i in rows}
        assert all(
            where[i] == where[j] for i in range(len(groups)) for j in range(len(groups)) if groups[i] == groups[j]
        )
        for rows in plan:
            tokens = sum(lengths[i] for i in rows)
            assert tokens <= budget or len({groups[i] for i in rows}) == 1, (budget, rows)
    assert plan_microbatches(lengths, groups, 200) == [list(range(12))]
    assert plan_microbatches(lengths, groups, 31) == [
        [0, 1, 2, 6, 7],
        [3],
        [4, 5, 9, 10, 11],
        [8],
    ]  # 15+11, 40, 24+3, 30
    assert plan_microbatches([3, 3], [0, 0], 4) == [[0, 1]]  # a pair over the budget stays together
    with pytest.raises(ValueError, match=">= 1"):
        plan_microbatches(lengths, groups, 0)


def test_rank_shards_balance_the_trained_tokens_and_keep_groups_whole():
    """Whole groups, the costliest first to the least-loaded rank: every row once, each shard in
    batch order, its cost within the largest group of the mean; groups of no cost (rows without
    gradient) spread by rows; fewer groups than ranks: contiguous shards, every rank a row."""
    costs = [5, 7, 3, 40, 12, 12, 0, 0, 30, 1, 1, 1]
    groups = [0, 0, 0, 1, 2, 2, 3, 3, 4, 5, 5, 5]
    for ranks in (1, 2, 3, 4):
        plan = plan_rank_shards(costs, groups, ranks)
        assert len(plan) == ranks and all(plan)
        assert sorted(i for rows in plan for i in rows) == list(range(len(costs)))
        assert all(rows == sorted(rows) for rows in plan)
        where = {i: k for k, rows in enumerate(plan) for i in rows}
        assert all(where[i] == where[j] for i in range(12) for j in range(12) if groups[i] == groups[j])
        loads = [sum(costs[i] for i in rows) for rows in plan]
        assert max(loads) - min(loads) <= 40  # LPT: within the largest group
    assert plan_rank_shards(costs, groups, 2) == [[0, 1, 2, 3, 6, 7], [4, 5, 8, 9, 10, 11]]  # 40+15+0 | 30+24+3
    assert plan_rank_shards([0] * 6, [0, 0, 1, 1, 2, 2], 2) == [[0, 1, 4, 5], [2, 3]]  # no cost: by rows
    assert plan_rank_shards([1, 2, 3], [0, 0, 0], 2) == [[0], [1, 2]]  # one group, two ranks: cut
    with pytest.raises(ValueError, match="2 row\\(s\\) for 3 ranks"):
        plan_rank_shards([1, 2], [0, 1], 3)


def test_learner_ranks_get_shards_balanced_by_the_rows_they_train():
    """`rank_shards`: a GRPO batch whose first half holds the groups without gradient (kl_coef 0)
    splits by the tokens of the rows trained (prompt and response), not by halves; every row goes
    to one rank, rows of a group together."""
    from algorithms.grpo import GRPO
    from rlsys.run.actors import rank_shards

    batch = long_and_short_rows()  # four groups of three: 19, 88, 33 and 57 tokens of responses
    batch.advantages = torch.ones_like(batch.response_mask) * batch.response_mask
    batch.advantages[:6] = 0  # groups 0 and 1 carry no gradient
    algo = GRPO(GRPO.Config(group_size=3, kl_coef=0.0))
    shards = rank_shards(batch, 2, algo)
    assert [int(s.advantages.abs().sum(1).gt(0).sum()) for s in shards] == [3, 3]  # one trained group each
    assert [len(s) for s in shards] == [3, 9]  # 75 tokens | 45, and the untrained groups (no cost)
    assert sum(s.num_tokens() for s in shards) == batch.num_tokens()
    contiguous = batch.split(2)
    assert [int(s.advantages.abs().sum(1).gt(0).sum()) for s in contiguous] == [0, 6]
    assert rank_shards(batch, 1, algo)[0] is batch
    assert [len(s) for s in rank_shards(batch, 3, None)] == [3, 3, 6]  # every row trained: 103 | 75 | 45 + 28 tokens


def test_microbatches_of_a_batch_follow_its_prompts():
    """`microbatches` reads the groups from the prompts (the tokens before the first trainable
    target) and trims each micro-batch's padding."""
    prompts, batch = rows_sharing_prompts()
    assert prompt_groups(batch.input_ids, batch.response_mask) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    parts = microbatches(batch, 30)
    assert sum(len(p) for p in parts) == len(batch) and len(parts) > 1
    for part in parts:
        tokens = part.attention_mask.sum()
        assert tokens <= 30 or len(set(prompt_groups(part.input_ids, part.response_mask))) == 1
        assert part.attention_mask[:, -1].any()  # trimmed
    assert microbatches(batch, 10**6) == [batch]


def grpo_fields(batch: TrainBatch, policy, seed: int = 0, zero_group: int | None = None) -> TrainBatch:
    """Old logprobs near the policy's, a per-row advantage on every response token (a zero
    advantage for the rows of `zero_group`, whose loss has no gradient), reference logprobs,
    values and returns."""
    g = torch.Generator().manual_seed(seed)
    mask = batch.response_mask
    with torch.no_grad():
        current = policy(batch.input_ids, batch.attention_mask)[1]
    batch.old_logprobs = (current + 0.1 * torch.randn(mask.shape, generator=g)) * mask
    batch.ref_logprobs = (current + 0.1 * torch.randn(mask.shape, generator=g)) * mask
    advantage = torch.randn(len(batch), generator=g)
    if zero_group is not None:
        advantage[torch.tensor(prompt_groups(batch.input_ids, mask)) == zero_group] = 0.0
    batch.advantages = advantage[:, None] * mask
    batch.old_values = torch.randn(mask.shape, generator=g) * mask
    batch.returns = torch.randn(mask.shape, generator=g) * mask
    return batch


@pytest.mark.parametrize("normalizer", ["token_mean", "constant"])
def test_weighted_micro_batch_losses_accumulate_the_minibatch_gradient(normalizer):
    """GRPO's token-mean loss and Dr.GRPO's (each response's token sum over a constant, averaged
    over the responses): the packed micro-batches' losses, each times its share of what the loss
    averages over (the minibatch's tokens; its responses), sum to the whole minibatch's padded
    loss, and their accumulated gradients are its gradient."""
    from actors.learner import micro_batch_weights
    from algorithms.grpo import GRPO
    from rlsys.contract import ModelOutputs, loss_denominator

    constant = {"max_tokens": 64} if normalizer == "constant" else {}
    algo = GRPO(GRPO.Config(group_size=3, kl_coef=0.0, loss_normalizer=normalizer, **constant))
    policy = PolicyOnly(build_tiny_model(TinyModelSpec(**SPEC), seed=3).train())
    batch = grpo_fields(long_and_short_rows(), policy)
    params = list(policy.parameters())
    logits, logprobs, _ = policy(batch.input_ids, batch.attention_mask, 1.0, batch.response_mask)
    whole = algo.loss(ModelOutputs(logits, logprobs), batch)[0]
    want = torch.autograd.grad(whole, params)
    parts = microbatches(batch, 80)
    assert len(parts) == 3 and max(len(p) for p in parts) == 6  # 88 | 57 + 19 | 33
    weights = micro_batch_weights(parts, lambda b: loss_denominator(algo, b), batch)
    shares = [len(p) / len(batch) if normalizer == "constant" else p.num_tokens() / batch.num_tokens() for p in parts]
    assert weights == pytest.approx(shares)
    total, got = 0.0, [torch.zeros_like(p) for p in params]
    for part, weight in zip(parts, weights):
        logits, logprobs, _ = policy(part.input_ids, part.attention_mask, 1.0, part.response_mask, packed=True)
        loss = algo.loss(ModelOutputs(logits, logprobs), part)[0] * weight
        total += loss.item()
        for acc, grad in zip(got, torch.autograd.grad(loss, params)):
            acc += grad
    assert total == pytest.approx(whole.item(), rel=1e-5)
    for a, b in zip(want, got):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "algorithm, zero_stage, minibatches", [("grpo", 0, 1), ("grpo", 2, 2), ("grpo_tis", 0, 1), ("ppo", 3, 2)]
)  # fmt: skip
def test_a_learner_step_in_packed_micro_batches_gives_the_same_update(tmp_path, algorithm, zero_stage, minibatches):
    """The learner (in process, one rank) with max_tokens_per_microbatch=80 on rows of 5 to 66
    tokens: every forward is a packed sequence (batch of one), several per minibatch, and the
    step's weights, loss, gradient norm and other metrics are those of the learner without it:
    GRPO under ZeRO-0 with a group left out for having no gradient (the learner's rescaling and
    the token weights together), GRPO under ZeRO-2 in two optimizer steps, GRPO with TIS (the
    sampler mismatch measured and the proximal logprobs taken from the packed forwards), PPO (the
    value head) under ZeRO-3."""
    from actors.learner import Learner
    from algorithms.grpo import GRPO
    from algorithms.ppo import PPO
    from rlsys.cluster import free_port
    from rlsys.models import load_model

    model_dir = save_model_dir(build_tiny_model(TinyModelSpec(**SPEC), seed=3), None, tmp_path / "policy")
    policy = PolicyOnly(load_model(model_dir))
    batch = grpo_fields(long_and_short_rows(), policy, zero_group=2 if algorithm.startswith("grpo") else None)
    table = long_and_short_table()  # scored before the steps: the learner's logprobs (values under PPO), packed or not
    make = {
        "grpo": lambda: GRPO(GRPO.Config(group_size=3, kl_coef=0.0)),
        "grpo_tis": lambda: GRPO(GRPO.Config(group_size=3, kl_coef=0.0, off_policy_correction="tis", is_cap=1.05)),
        "ppo": PPO,
    }[algorithm]
    weights, metrics, calls, scored = [], [], [], []
    try:  # the learners in one process group: padded, a budget of 80, and auto_pack (no budget)
        for budget, auto_pack in ((None, False), (80, False), (None, True)):
            learner = Learner(
                str(model_dir),
                make(),
                lr=1e-2,
                minibatches=minibatches,
                zero_stage=zero_stage,
                master_port=free_port(),
                max_tokens_per_microbatch=budget,
                auto_pack=auto_pack,
            )
            scored.append(learner.values(table) if algorithm == "ppo" else learner.logprobs(table))
            shapes = []
            learner.module.policy.register_forward_pre_hook(
                lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
            )
            metrics.append([learner.train_step(batch.select(slice(None))) for _ in range(2)])  # AdamW's moments
            weights.append(learner.weights())  # gathered under ZeRO-3
            calls.append(shapes)
    finally:  # DeepSpeed's: it also drops the groups it cached, so a later learner in this process starts clean
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()
    for plain, packed in [*zip(scored[0], scored[1]), *zip(scored[0], scored[2])]:
        assert len(plain) == len(packed) and torch.allclose(torch.tensor(packed), torch.tensor(plain), **TIGHT)
    assert calls[2] != calls[0] and any(shape[0] == 1 for shape in calls[2])  # auto_pack packed some minibatches
    packed_calls = calls[1]
    assert all(shape[0] == 1 for shape in packed_calls)
    # micro-batches a step: 88 | 57 + 19 (the 33 left out); 88 | 19 and 57; 88 | 19 and 33 | 57
    assert len(packed_calls) == 2 * {1: 2, 2: 3 if algorithm == "grpo" else 4}[minibatches]
    assert max(shape[1] for shape in packed_calls) == 88  # the largest group, alone
    for plain, packed in [*zip(metrics[0], metrics[1]), *zip(metrics[0], metrics[2])]:
        assert plain.keys() == packed.keys() and "grad_norm" in plain
        for key in plain:
            if not key.startswith("time/"):
                assert packed[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
        if algorithm.startswith("grpo"):
            assert plain["rows_without_gradient"] == pytest.approx(0.25)
        if algorithm == "grpo_tis":
            assert plain["mismatch/kl"] > 0 and 0 < plain["is/capped_frac"] < 1
    initial = {name: t.numpy() for name, t in load_model(model_dir).state_dict().items()}
    for other in weights[1:]:
        assert_same_update(weights[0], other, initial, lr=1e-2)


def test_the_reference_scores_in_packed_batches_of_the_budget(tmp_path):
    """A reference (or teacher) worker given max_tokens_per_batch=60 scores the rows in packed
    sequences of at most 60 tokens, a prompt group whole (the 88-token group alone, over the
    budget), each row once: its logprobs and top-k distributions are the padded worker's."""
    from actors.reference import ReferenceWorker

    model_dir = save_model_dir(build_tiny_model(TinyModelSpec(**SPEC), seed=4), None, tmp_path / "reference")
    table = long_and_short_table()
    padded, packed = ReferenceWorker(str(model_dir), 0.8), ReferenceWorker(str(model_dir), 0.8, max_tokens_per_batch=60)
    shapes = []
    record = lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape))  # noqa: E731
    packed.model.register_forward_pre_hook(record, with_kwargs=True)
    got, want = packed.logprobs(table), padded.logprobs(table)
    assert sorted(shape[1] for shape in shapes) == [33 + 19, 57, 88]  # first-fit by size: 88 | 57 | 33 + 19
    assert all(shape[0] == 1 for shape in shapes)
    assert [len(r) for r in got] == [len(r) for r in table.column("response_ids").to_pylist()]
    for a, b in zip(got, want):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), **TIGHT)
    for (ids_a, lp_a), (ids_b, lp_b) in zip(packed.top_logprobs(table, k=4), padded.top_logprobs(table, k=4)):
        assert ids_a == ids_b and torch.allclose(torch.tensor(lp_a), torch.tensor(lp_b), **TIGHT)
    # auto_pack without a budget: the padded batch of 12 rows (744 positions for 197 tokens) runs as one sequence
    auto, shapes[:] = ReferenceWorker(str(model_dir), 0.8, auto_pack=True), []
    auto.model.register_forward_pre_hook(record, with_kwargs=True)
    for a, b in zip(auto.logprobs(table), want):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), **TIGHT)
    assert shapes == [(1, 197)]


def test_packing_pays_where_padding_to_the_longest_response_dominates():
    """Padded positions: each group's prompt once to the longest prompt, then every row to the
    longest response; every row to the longest row when no prompt repeats."""
    from rlsys.packing import packing_pays, padded_positions

    spread = long_and_short_rows()  # 4 groups, prompts of 3-6 tokens, responses of 2-60: 197 real tokens
    assert padded_positions(spread) == 4 * 6 + 12 * 60 and packing_pays(spread)
    even = collate_ids([[5, 6, 7, 8]] * 2 + [[9, 10, 11, 12]] * 2, [[3, 4, 5]] * 4)  # 28 real tokens
    assert padded_positions(even) == 2 * 4 + 4 * 3 and not packing_pays(even)
    distinct = collate_ids([[5, 6], [7, 8], [9, 10]], [[3, 4, 5], [3, 4, 5], [3] * 8])  # 20 real tokens
    assert padded_positions(distinct) == 3 * 10 and not packing_pays(distinct)  # 30 is not above 1.5 x 20
    assert packing_pays(collate_ids([[5, 6], [7, 8], [9, 10]], [[3], [3], [3] * 9]))  # 30 above 1.5 x 15


def test_the_config_keys_reach_the_learner():
    import inspect

    from actors.learner import Learner
    from rlsys.config import load_config
    from rlsys.run import actors

    assert load_config().learner.max_tokens_per_microbatch is None
    cfg = load_config(overrides=["learner.max_tokens_per_microbatch=4096"])
    assert cfg.learner.max_tokens_per_microbatch == 4096
    assert inspect.signature(Learner).parameters["max_tokens_per_microbatch"].default is None
    assert "max_tokens_per_microbatch=l.max_tokens_per_microbatch" in inspect.getsource(actors.start_actors)
    assert "max_tokens_per_batch=l.max_tokens_per_microbatch" in inspect.getsource(actors.start_actors)  # the reference
    assert load_config().learner.auto_pack is True and "auto_pack=l.auto_pack" in inspect.getsource(actors.start_actors)
