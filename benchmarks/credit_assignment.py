"""Credit assignment on a toy with exact values: VinePPO's Monte Carlo values vs a PPO critic
(../shared/papers/vineppo.md, the paper's central finding).

The toy is a random-walk token environment: a response is T tokens from {-1, 0, +1} and the
"policy" has its own random logits at every prefix (like an LM, its behaviour is an
idiosyncratic function of the whole prefix). Two rewards: "walk" = 1 when the walk ends above 0
(smooth in the tokens, a critic can generalise), "labels" = a random 0/1 label per leaf (no
structure to share, like right/wrong answers). The tree has 3^T leaves, so V(s) of every prefix
is exact by backward dynamic programming.

For N sampled trajectories, the value states come from VinePPO's own pure functions
(`cap_steps`, `value_state_prefixes`, deduplicated across the batch), get K continuations each,
and `mc_value_estimates` / `step_advantages` give V_hat and the step advantages. The critic is
an MLP over the prefix tokens (one-hot per position), trained by regression on the returns
(gamma = lambda = 1) of the SAME number of sampled episodes: the N trajectories plus one full
trajectory for every MC continuation (so it sees more tokens than VinePPO did). Both are scored
on the N trajectories' value states: MSE of values and of step advantages against the exact
ones, averaged over seeds (each seed a fresh policy).

    .venv/bin/python benchmarks/credit_assignment.py      # ~1-2 min on one CPU thread
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from algorithms.vineppo import cap_steps, mc_value_estimates, step_advantages, value_state_prefixes  # noqa: E402

A = 3  # tokens: steps -1, 0, +1


# ---- the toy: a tree of prefixes, node (t, i) with i the base-A number of the prefix ----------
def make_policy(T: int, rng: np.random.Generator, temperature: float = 1.5) -> list[np.ndarray]:
    """pi[t][i] = next-token probabilities at prefix i of length t (random logits per prefix)."""
    pis = []
    for t in range(T):
        logits = rng.normal(size=(A**t, A)) * temperature
        p = np.exp(logits - logits.max(1, keepdims=True))
        pis.append(p / p.sum(1, keepdims=True))
    return pis


def leaf_rewards(T: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """R(leaf): "walk" = 1 if the walk ends above 0 (leaf index i in base A, digit a a step a-1), a
    smooth function of the tokens; "labels" = a random 0/1 label per leaf (no shared structure)."""
    if kind == "labels":
        return (rng.random(A**T) < 0.5).astype(np.float64)
    digits = (np.arange(A**T)[:, None] // A ** np.arange(T)[::-1]) % A
    return ((digits - 1).sum(1) > 0).astype(np.float64)


def exact_values(pi: list[np.ndarray], rewards: np.ndarray) -> list[np.ndarray]:
    """V[t][i] by backward DP: V(s) = sum_a pi(a|s) V(s a); V at a leaf is its reward."""
    V = [rewards]
    for p in reversed(pi):
        V.insert(0, (p * V[0].reshape(-1, A)).sum(1))
    return V


def rollout(pi: list[np.ndarray], t0: int, i0: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Sample to the end from nodes (t0, i0[j]); returns the tokens of the full responses (n, T)
    with the prefix digits filled in from i0."""
    T, n = len(pi), len(i0)
    tokens = np.zeros((n, T), dtype=np.int64)
    tokens[:, :t0] = (i0[:, None] // A ** np.arange(t0)[::-1]) % A
    i = i0.copy()
    for t in range(t0, T):
        cdf = pi[t][i].cumsum(1)
        a = (rng.random((n, 1)) > cdf).sum(1).clip(max=A - 1)
        tokens[:, t], i = a, i * A + a
    return tokens


def node_index(tokens: np.ndarray, t: int) -> np.ndarray:
    """Index of the length-t prefix of each response."""
    return tokens[:, :t] @ (A ** np.arange(t)[::-1])


def returns_of(tokens: np.ndarray, rewards: np.ndarray) -> np.ndarray:
    """R of each full response (n, T)."""
    return rewards[node_index(tokens, tokens.shape[1])]


# ---- VinePPO: MC values at the value states of N trajectories --------------------------------
def vineppo_values(pi, rewards, trajs, K, max_steps, rng) -> tuple[list[list[float]], int]:
    """Step values per trajectory from K continuations per deduplicated value state, and the
    number of episodes sampled for them."""
    T = len(pi)
    starts = value_state_prefixes(cap_steps(list(range(1, T + 1)), max_steps))
    states = [[(t, int(node_index(tr[None], t)[0])) for t in starts] for tr in trajs]
    unique = list(dict.fromkeys(s for row in states for s in row))
    returns = {s: returns_of(rollout(pi, s[0], np.full(K, s[1]), rng), rewards) for s in unique}
    values = mc_value_estimates(returns)
    return [[values[s] for s in row] for row in states], len(unique) * K


# ---- the PPO critic: an MLP over prefix tokens, regressed on returns -------------------------
def prefix_features(tokens: np.ndarray, t: int) -> np.ndarray:
    """One-hot token per position (zeros past the prefix) and a one-hot of the prefix length t < T."""
    n, T = tokens.shape
    x = np.zeros((n, T, A + 1), dtype=np.float32)
    x[:, :t, :A] = np.eye(A, dtype=np.float32)[tokens[:, :t]]
    x[:, t, A] = 1.0
    return x.reshape(n, -1)


def train_critic(tokens, rets, starts, steps, seed, hidden=128, batch=512, lr=1e-2) -> torch.nn.Module:
    """Regress V(prefix) on the episode return for every value-state prefix of every episode."""
    torch.manual_seed(seed)
    x = torch.tensor(np.concatenate([prefix_features(tokens, t) for t in starts]))
    y = torch.tensor(np.tile(rets, len(starts)), dtype=torch.float32)
    net = torch.nn.Sequential(
        torch.nn.Linear(x.shape[1], hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 1),
    )
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        j = torch.randint(len(x), (batch,), generator=gen)
        loss = torch.nn.functional.mse_loss(net(x[j]).squeeze(-1), y[j])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return net


def critic_values(net, trajs, starts) -> list[list[float]]:
    with torch.no_grad():
        v = [net(torch.tensor(prefix_features(trajs, t))).squeeze(-1).clamp(0, 1).numpy() for t in starts]
    return np.stack(v, 1).tolist()


# ---- scoring ----------------------------------------------------------------------------------
def errors(step_values, exact, rets) -> tuple[float, float]:
    """MSE of the values and of the step advantages A_i = r_i + V(s_i+1) - V(s_i) vs exact."""
    v, e = np.asarray(step_values), np.asarray(exact)
    adv = np.array([step_advantages(a, r) - step_advantages(b, r) for a, b, r in zip(v, e, rets)])
    return float(((v - e) ** 2).mean()), float((adv**2).mean())


def one_seed(kind, T, N, K, max_steps, critic_steps, seed) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pi, rewards = make_policy(T, rng), leaf_rewards(T, kind, rng)
    V = exact_values(pi, rewards)
    trajs = rollout(pi, 0, np.zeros(N, dtype=np.int64), rng)
    rets = returns_of(trajs, rewards)
    starts = value_state_prefixes(cap_steps(list(range(1, T + 1)), max_steps))
    exact = np.stack([V[t][node_index(trajs, t)] for t in starts], 1)
    mc, mc_episodes = vineppo_values(pi, rewards, trajs, K, max_steps, rng)
    extra = rollout(pi, 0, np.zeros(mc_episodes, dtype=np.int64), rng)  # same episode budget
    tokens = np.concatenate([trajs, extra])
    net = train_critic(tokens, returns_of(tokens, rewards), starts, critic_steps, seed)
    return np.array(
        [N + mc_episodes, *errors(mc, exact, rets), *errors(critic_values(net, trajs, starts), exact, rets)]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=10, help="T tokens per response (3^T leaves)")
    ap.add_argument("--trajectories", type=int, default=64, help="N sampled trajectories")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3, 9, 27], help="K continuations per value state")
    ap.add_argument("--rewards", nargs="+", default=["walk", "labels"], choices=["walk", "labels"])
    ap.add_argument("--max-steps", type=int, default=10, help="at most this many value states per response")
    ap.add_argument("--critic-steps", type=int, default=3000, help="Adam steps for the critic (batch 512)")
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(
        f"random-walk token tree: T={args.depth} (3^{args.depth} leaves), N={args.trajectories} trajectories, "
        f"<= {args.max_steps} value states each, {args.seeds} seeds; "
        "critic / VinePPO > 1 means the MC values are the more accurate\n"
    )
    print(
        "| reward | K | episodes (both) | value MSE VinePPO | value MSE critic | critic / VinePPO "
        "| adv. MSE VinePPO | adv. MSE critic | critic / VinePPO |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind, K in [(kind, K) for kind in args.rewards for K in args.ks]:
        r = np.mean(
            [
                one_seed(kind, args.depth, args.trajectories, K, args.max_steps, args.critic_steps, s)
                for s in range(args.seeds)
            ],
            0,
        )
        print(
            f"| {kind} | {K} | {r[0]:.0f} | {r[1]:.4f} | {r[3]:.4f} | {r[3] / r[1]:.2f} "
            f"| {r[2]:.4f} | {r[4]:.4f} | {r[4] / r[2]:.2f} |"
        )


if __name__ == "__main__":
    main()
