"""Token-in/token-out (TITO) conversations: the token row of a multi-turn episode, built by appending.

A `Conversation` holds the episode's token ids, a loss mask that is 1 exactly on the tokens the
policy sampled, and the policy's logprobs at those tokens (0 elsewhere). It grows by appending:

    prompt        the chat template applied to the first messages (with `tools=` schemas when
                  given), the generation prompt added
    policy turn   the sampled ids exactly as sampled, never decoded and re-encoded (a sampled
                  tokenisation the tokenizer would not produce itself stays as it is)
    observation   tool results (the template's `tool` role) or a user message, encoded once as
                  the template's tokens for those messages plus the next generation prompt

An observation's tokens come from rendering a fixed dummy dialog, [user, assistant, *messages]
with the generation prompt, and taking what follows the dummy assistant's end-of-turn token
(`end_of_turn_id`: the token the sampler stops on, `<|im_end|>` for ChatML): the template's close
of the assistant turn (ChatML's newline), the messages, the next generation prompt. That needs
the template to render the generation prompt as the start of an assistant turn and to end the
assistant's turn with that token; a template that does not gets a `TemplateMismatch` naming why.
A policy turn that does not end with the end-of-turn token (cut at its token budget) is closed
with it, as an environment token, before the observation.

Where the policy's ids are the tokenizer's own tokenisation of its messages, the row equals the
template's rendering of the whole message list tokenized at once (tests/envs/test_conversation.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

DUMMY_CONTEXT = ({"role": "user", "content": "hi"},)
DUMMY_ASSISTANT = {"role": "assistant", "content": "ok"}
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")  # ChatML, Llama 3, Gemma, Phi-3


def end_of_turn_id(tokenizer) -> int:
    """The token that ends an assistant turn in the tokenizer's chat template, which a multi-turn
    sampler stops on besides eos: the first of END_OF_TURN_TOKENS the template writes (ChatML's
    `<|im_end|>`, ...) that the vocabulary holds as one token, else eos. ValueError without either."""
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = tokenizer.get_vocab()
    for token in END_OF_TURN_TOKENS:
        if token in template and token in vocab:
            return vocab[token]
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer's chat template ends turns with no known token and it has no eos token")
    return tokenizer.eos_token_id


class TemplateMismatch(ValueError):
    """The chat template cannot be appended to token by token (see the module's docstring)."""


@dataclass(frozen=True)
class ChatEncoder:
    """A tokenizer's chat template as token ids: a conversation's prompt, and the tokens of the
    messages that follow a policy turn. `end_of_turn_id`: the token that ends an assistant turn
    in the template and stops the sampler (None: the tokenizer's eos); `template_kwargs`: extra
    variables of the template (e.g. enable_thinking)."""

    tokenizer: Any
    end_of_turn_id: int | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    closes_turns = True  # a policy turn cut short is closed with the end-of-turn token before an observation

    def __post_init__(self):
        if self.end_of_turn_id is None:
            if self.tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no eos token: give ChatEncoder an end_of_turn_id")
            object.__setattr__(self, "end_of_turn_id", self.tokenizer.eos_token_id)

    def render_ids(
        self, messages: Sequence[Mapping], tools: Sequence[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        """The template's rendering of `messages`, tokenized at once without added special tokens
        (as `apply_chat_template(..., tokenize=True)` does)."""
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def observation_ids(self, messages: Sequence[Mapping], tools: Sequence[dict] | None = None) -> list[int]:
        """The tokens that follow a policy turn's end-of-turn token: the template's close of the
        assistant turn, `messages` and the next generation prompt. TemplateMismatch when the
        template does not line up with a policy turn (see the module's docstring)."""
        if not messages:
            raise ValueError("an observation needs at least one message")
        opened = self.render_ids(DUMMY_CONTEXT, tools)
        full = self.render_ids([*DUMMY_CONTEXT, DUMMY_ASSISTANT, *messages], tools)
        if full[: len(opened)] != opened:
            raise TemplateMismatch(
                "the chat template does not render an assistant turn as its generation prompt followed by "
                "the reply (or renders earlier messages differently once more follow): the policy's turns "
                "cannot be kept token for token"
            )
        turn = full[len(opened) :]
        if self.end_of_turn_id not in turn:
            token = self.tokenizer.convert_ids_to_tokens(self.end_of_turn_id)
            raise TemplateMismatch(
                f"the chat template does not end an assistant turn with {token!r} (id {self.end_of_turn_id}): "
                "give ChatEncoder the end_of_turn_id its sampler stops on"
            )
        return turn[turn.index(self.end_of_turn_id) + 1 :]


@dataclass(frozen=True)
class PlainEncoder:
    """A dialog without a chat template: the prompt and every observation are their messages'
    contents tokenized as they are (no special tokens), appended right after the policy's turn,
    which eos ends (a turn cut short stays as it is). RLEF's code dialogs: problem, answer,
    feedback, answer, ..."""

    tokenizer: Any
    closes_turns = False

    @property
    def end_of_turn_id(self) -> int:
        return self.tokenizer.eos_token_id

    def render_ids(self, messages: Sequence[Mapping], tools: Sequence[dict] | None = None) -> list[int]:
        text = "".join(m["content"] for m in messages)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def observation_ids(self, messages: Sequence[Mapping], tools: Sequence[dict] | None = None) -> list[int]:
        if not messages:
            raise ValueError("an observation needs at least one message")
        return self.render_ids(messages)


@dataclass
class Conversation:
    """One episode's token row. Start it with `Conversation.start(encoder, messages, tools)`, then
    alternate `add_policy(ids, logprobs)` and `add_messages(messages)`; the row's `ids`, `loss_mask`
    (1 exactly on sampled tokens) and `logprobs` (the sampler's there, 0 elsewhere) stay aligned.
    `policy_turns` holds each policy turn's [start, end) in `ids`."""

    encoder: ChatEncoder | PlainEncoder
    ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_length: int
    tools: list[dict] | None = None
    policy_turns: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def start(
        cls, encoder: ChatEncoder | PlainEncoder, messages: Sequence[Mapping], tools: Sequence[dict] | None = None
    ) -> "Conversation":
        """The prompt: `messages` through the chat template (`tools`: the function schemas the
        template lists), ending with the generation prompt."""
        if not messages:
            raise ValueError("a conversation starts with at least one message")
        tools = list(tools) if tools else None
        ids = encoder.render_ids(messages, tools)
        return cls(encoder, ids, [0] * len(ids), [0.0] * len(ids), len(ids), tools)

    @property
    def num_tokens(self) -> int:
        """Tokens so far, prompt included: what an env compares with its `max_tokens`."""
        return len(self.ids)

    @property
    def awaiting_policy(self) -> bool:
        """Whether the next piece is a policy turn (the row ends with a generation prompt)."""
        last_turn_end = self.policy_turns[-1][1] if self.policy_turns else -1
        return last_turn_end != len(self.ids)

    def _append(self, ids: Sequence[int], logprobs: Sequence[float], sampled: bool) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.loss_mask += [int(sampled)] * len(ids)

    def add_policy(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """The policy's turn: its sampled ids and their logprobs, appended as they are."""
        if not self.awaiting_policy:
            raise ValueError("a policy turn follows the prompt or an observation, not another policy turn")
        if len(ids) != len(logprobs):
            raise ValueError(f"a policy turn of {len(ids)} ids has {len(logprobs)} logprobs")
        start = len(self.ids)
        self._append(list(ids), [float(x) for x in logprobs], sampled=True)
        self.policy_turns.append((start, len(self.ids)))

    def add_messages(self, messages: Sequence[Mapping], budget: int | None = None) -> list[int] | None:
        """An observation after a policy turn: tool results (`{"role": "tool", "content": ...}`, all
        of one turn at once: templates group them) or a user message, and the next generation
        prompt; the policy's turn is closed with the end-of-turn token first if it was cut short.
        Returns the ids appended; with `budget`, an observation that would take the row past
        `budget` tokens is not appended (None)."""
        if self.awaiting_policy:
            raise ValueError("an observation follows a policy turn")
        eot = self.encoder.end_of_turn_id
        close = [] if self.ids[-1:] == [eot] or not self.encoder.closes_turns else [eot]
        ids = close + self.encoder.observation_ids(messages, self.tools)
        if budget is not None and len(self.ids) + len(ids) > budget:
            return None
        self._append(ids, [0.0] * len(ids), sampled=False)
        return ids

    def add_tool_results(self, contents: Sequence[str]) -> list[int]:
        """Tool results, in call order, as the template's `tool` messages."""
        return self.add_messages([{"role": "tool", "content": c} for c in contents])

    def add_user(self, content: str) -> list[int]:
        """A user message (feedback, the next question)."""
        return self.add_messages([{"role": "user", "content": content}])

    # ---- the Experience row's token columns ---------------------------------------------------

    @property
    def prompt_ids(self) -> list[int]:
        return self.ids[: self.prompt_length]

    @property
    def response_ids(self) -> list[int]:
        """Everything after the prompt: policy turns and observations."""
        return self.ids[self.prompt_length :]

    def experience_fields(self) -> dict[str, list]:
        """prompt_ids, response_ids, logprobs and loss_mask of an Experience row (rlsys/experience.py)."""
        return {
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "logprobs": self.logprobs[self.prompt_length :],
            "loss_mask": self.loss_mask[self.prompt_length :],
        }
