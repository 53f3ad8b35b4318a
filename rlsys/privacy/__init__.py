"""Privacy side module: the vocabulary-matching hidden-state inversion attack and Cascade,
a token-sharded forward pass in which each party holds the rows of one or two shards of
positions, never the whole prompt.

- `decoder`: a Llama-family forward (Llama, Qwen2, Qwen3, Mistral, Phi-3) as pure functions on
  plain tensors, attention as exactly merged partial blocks (log-sum-exp).
- `attack`: views (plain, row/entry-permuted, one party's hidden states or keys/values/queries)
  and the attack on them.
- `cascade`: (c, delta)-sharding and the sharded forward, parties in-process or Ray actors.
- `cli`: `rlsys privacy attack`.
"""

from .attack import AttackConfig, AttackResult, View, permuted_view, plain_view, vocab_matching_attack
from .cascade import CascadeOutput, attention_pairs, attention_party_views, c_delta_shards, cascade_forward
from .decoder import DecoderWeights, hidden_states, plain_logits

__all__ = [
    "AttackConfig",
    "AttackResult",
    "CascadeOutput",
    "DecoderWeights",
    "View",
    "attention_pairs",
    "attention_party_views",
    "c_delta_shards",
    "cascade_forward",
    "hidden_states",
    "permuted_view",
    "plain_logits",
    "plain_view",
    "vocab_matching_attack",
]
