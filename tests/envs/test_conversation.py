"""envs/conversation.py: token-in/token-out rows against the template's rendering of the whole
dialog, sampled ids kept as sampled, the loss mask on exactly the policy's tokens, and templates
that cannot be appended to token by token."""

import pytest

from envs.conversation import ChatEncoder, Conversation, PlainEncoder, TemplateMismatch
from envs.tools import calculator, tool_from_function, tool_schemas
from rlsys.models import train_tokenizer

# Qwen2.5's chat template (tools listed in the system turn, <tool_call> in assistant turns, tool
# results grouped in a user turn as <tool_response>), its default system prompt shortened
QWEN_TOOLS_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501 - the template as Qwen ships it

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
DIALOG = [
    {"role": "system", "content": "You are a careful assistant. Use tools for arithmetic."},
    {"role": "user", "content": "What is 2**70 plus 3**40, and then that times 7?"},
    {"role": "assistant", "content": CALL % "2**70" + "\n" + CALL % "3**40"},
    {"role": "tool", "content": "1180591620717411303424"},
    {"role": "tool", "content": "12157665459056928801"},
    {"role": "assistant", "content": "Now the sum times 7.\n" + CALL % "(2**70 + 3**40) * 7"},
    {"role": "tool", "content": "8349245003235277625575"},
    {"role": "assistant", "content": "The answer is 8349245003235277625575."},
    {"role": "user", "content": "Thank you! And what is 1/3?"},
]
CORPUS = [m["content"] for m in DIALOG] * 20 + ["hello world, hello there, hello again"] * 40


@pytest.fixture(scope="module")
def tokenizer():
    tok = train_tokenizer(CORPUS, vocab_size=400)
    tok.chat_template = QWEN_TOOLS_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return ChatEncoder(tokenizer, end_of_turn_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))


@pytest.fixture(scope="module")
def schemas():
    return tool_schemas([tool_from_function(calculator)])


def sampled(encoder, text: str) -> list[int]:
    """A policy turn as a sampler that followed the tokenizer would give it: the text's own
    tokenisation, then the end-of-turn token."""
    return encoder.tokenizer(text, add_special_tokens=False)["input_ids"] + [encoder.end_of_turn_id]


def play(encoder, dialog, tools, turns):
    """The conversation of `dialog` (its first messages the prompt) with each assistant message
    replaced by `turns[k]`: (ids, logprobs) of the k-th policy turn."""
    first = next(i for i, m in enumerate(dialog) if m["role"] == "assistant")
    conv = Conversation.start(encoder, dialog[:first], tools)
    pending, k = [], 0
    for m in dialog[first:]:
        if m["role"] == "assistant":
            if pending:
                conv.add_messages(pending)
                pending = []
            conv.add_policy(*turns[k])
            k += 1
        else:
            pending.append(m)
    if pending:
        conv.add_messages(pending)
    return conv


def canonical_turns(encoder, dialog):
    turns = []
    for k, m in enumerate(m for m in dialog if m["role"] == "assistant"):
        ids = sampled(encoder, m["content"])
        turns.append((ids, [-0.5 - 0.01 * (k * 100 + j) for j in range(len(ids))]))
    return turns


@pytest.mark.parametrize("with_tools", [True, False])
def test_tito_row_equals_the_template_rendering_of_the_whole_dialog(tokenizer, encoder, schemas, with_tools):
    tools = schemas if with_tools else None
    conv = play(encoder, DIALOG, tools, canonical_turns(encoder, DIALOG))
    whole = tokenizer.apply_chat_template(
        DIALOG, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert conv.ids == list(whole)
    assert conv.num_tokens == len(whole)
    assert ("# Tools" in tokenizer.decode(conv.prompt_ids)) == with_tools
    assert tokenizer.decode(conv.ids).endswith("Thank you! And what is 1/3?<|im_end|>\n<|im_start|>assistant\n")


def test_tito_row_equals_the_rendering_with_the_repos_chatml_template():
    tok = train_tokenizer(CORPUS, vocab_size=400)  # rlsys.models.CHAT_TEMPLATE: every role as ChatML
    encoder = ChatEncoder(tok, end_of_turn_id=tok.convert_tokens_to_ids("<|im_end|>"))
    conv = play(encoder, DIALOG, None, canonical_turns(encoder, DIALOG))
    whole = tok.apply_chat_template(DIALOG, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert conv.ids == list(whole["input_ids"])
    assert "<|im_start|>tool\n1180591620717411303424<|im_end|>" in tok.decode(conv.ids)


def test_tool_results_of_one_turn_share_one_user_turn(tokenizer, encoder):
    conv = Conversation.start(encoder, DIALOG[:2])
    conv.add_policy(*canonical_turns(encoder, DIALOG)[0])
    added = tokenizer.decode(conv.add_tool_results(["1", "2"]))
    assert added == (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_sampled_ids_stay_as_sampled_where_decoding_and_re_encoding_would_change_them(tokenizer, encoder):
    text = "hello world, hello there"
    canonical = tokenizer(text, add_special_tokens=False)["input_ids"]
    # the sampler spelled it byte by byte: the same text, a tokenisation the tokenizer never makes
    bytewise = tokenizer.convert_tokens_to_ids([c if c != " " else "Ġ" for c in text])
    assert tokenizer.decode(bytewise) == text and len(bytewise) > len(canonical)
    ids = bytewise + [encoder.end_of_turn_id]
    logprobs = [-(j + 1) / 7 for j in range(len(ids))]
    conv = Conversation.start(encoder, DIALOG[:2])
    conv.add_policy(ids, logprobs)
    conv.add_user("hello again")
    conv.add_policy([tokenizer.convert_tokens_to_ids("h"), encoder.end_of_turn_id], [-0.25, -0.125])

    (a, b), (c, d) = conv.policy_turns
    assert conv.ids[a:b] == ids and conv.logprobs[a:b] == pytest.approx(logprobs)
    assert conv.ids[c:d] == [tokenizer.convert_tokens_to_ids("h"), encoder.end_of_turn_id]
    # decode -> re-encode (what a text-level rollout does) would have trained on other tokens
    assert tokenizer(tokenizer.decode(conv.ids), add_special_tokens=False)["input_ids"] != conv.ids
    rendered_turn = tokenizer(tokenizer.decode(conv.ids[a:b]), add_special_tokens=False)["input_ids"]
    assert rendered_turn != ids


def test_loss_mask_covers_exactly_the_policy_tokens_over_three_turns(encoder, schemas):
    turns = canonical_turns(encoder, DIALOG)
    assert len(turns) == 3
    conv = play(encoder, DIALOG, schemas, turns)
    fields = conv.experience_fields()
    assert len(fields["response_ids"]) == len(fields["logprobs"]) == len(fields["loss_mask"])
    assert fields["prompt_ids"] + fields["response_ids"] == conv.ids
    expected_mask = [0] * len(conv.ids)
    for (a, b), (ids, logprobs) in zip(conv.policy_turns, turns):
        assert conv.ids[a:b] == ids and conv.logprobs[a:b] == pytest.approx(logprobs)
        expected_mask[a:b] = [1] * (b - a)
    assert conv.loss_mask == expected_mask
    assert sum(conv.loss_mask) == sum(len(ids) for ids, _ in turns)
    assert all(lp == 0.0 for lp, m in zip(conv.logprobs, conv.loss_mask) if not m)
    assert conv.loss_mask[: conv.prompt_length] == [0] * conv.prompt_length


def test_a_turn_cut_short_is_closed_with_the_end_of_turn_token_outside_the_mask(tokenizer, encoder):
    conv = Conversation.start(encoder, DIALOG[:2])
    cut = tokenizer('<tool_call>\n{"name"', add_special_tokens=False)["input_ids"]  # no end-of-turn token
    conv.add_policy(cut, [-1.0] * len(cut))
    added = conv.add_user("Your answer was cut off.")
    assert added[0] == encoder.end_of_turn_id
    a, b = conv.policy_turns[0]
    assert conv.loss_mask[b] == 0 and conv.ids[a:b] == cut
    assert tokenizer.decode(conv.ids[a:]).startswith('<tool_call>\n{"name"<|im_end|>\n<|im_start|>user\n')


def test_a_plain_dialog_appends_the_texts_as_they_tokenize_and_closes_no_turn(tokenizer):
    """PlainEncoder (RLEF's code dialogs): no template; the prompt and each observation are their
    text's tokens, appended right after the policy's ids, a turn cut short left as it is."""
    encoder = PlainEncoder(tokenizer)
    problem, feedback = "What is 2 + 2?", "\n# Feedback: wrong.\n"
    conv = Conversation.start(encoder, [{"role": "user", "content": problem}])
    assert conv.ids == tokenizer(problem, add_special_tokens=False)["input_ids"]
    cut = tokenizer(" 5", add_special_tokens=False)["input_ids"]  # no eos: cut at its budget
    conv.add_policy(cut, [-0.5] * len(cut))
    added = conv.add_user(feedback)
    assert added == tokenizer(feedback, add_special_tokens=False)["input_ids"]  # nothing closes the turn
    answer = [*tokenizer(" 4", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    conv.add_policy(answer, [-0.25] * len(answer))
    assert conv.response_ids == [*cut, *added, *answer]
    assert conv.experience_fields()["loss_mask"] == [1] * len(cut) + [0] * len(added) + [1] * len(answer)
    assert encoder.end_of_turn_id == tokenizer.eos_token_id


def test_turns_must_alternate(encoder):
    conv = Conversation.start(encoder, DIALOG[:2])
    with pytest.raises(ValueError, match="observation follows a policy turn"):
        conv.add_user("too early")
    conv.add_policy([5, encoder.end_of_turn_id], [-1.0, -1.0])
    with pytest.raises(ValueError, match="not another policy turn"):
        conv.add_policy([5], [-1.0])
    with pytest.raises(ValueError, match="2 ids has 1 logprobs"):
        Conversation.start(encoder, DIALOG[:2]).add_policy([5, 6], [-1.0])


def test_a_template_that_does_not_open_assistant_turns_as_its_generation_prompt_is_refused(tokenizer):
    tok = train_tokenizer(CORPUS, vocab_size=400)
    tok.chat_template = (  # past turns are rendered as "model", the generation prompt says "assistant"
        "{%- for m in messages %}{{ '<|im_start|>' + ('model' if m.role == 'assistant' else m.role) + '\\n'"
        " + m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    encoder = ChatEncoder(tok, end_of_turn_id=tok.convert_tokens_to_ids("<|im_end|>"))
    conv = Conversation.start(encoder, DIALOG[:2])
    conv.add_policy([5, encoder.end_of_turn_id], [-1.0, -1.0])
    with pytest.raises(TemplateMismatch, match="generation prompt"):
        conv.add_user("next")


def test_an_end_of_turn_token_the_template_does_not_use_is_refused(tokenizer):
    encoder = ChatEncoder(tokenizer)  # the trained tokenizer's eos is <eos>; the template ends turns with <|im_end|>
    conv = Conversation.start(encoder, DIALOG[:2])
    conv.add_policy([5, encoder.end_of_turn_id], [-1.0, -1.0])
    with pytest.raises(TemplateMismatch, match="'<eos>'.*end_of_turn_id"):
        conv.add_user("next")
