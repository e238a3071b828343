"""Chat templates rendered by jserve against transformers' apply_chat_template."""

from __future__ import annotations

import pytest

from jserve.loaders.chat_template import (
    ChatTemplateError,
    load_chat_template,
    render_chat_template,
)
from jserve.loaders.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are a pirate. Answer in one line."}
TURNS = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "Four, matey!"},
    {"role": "user", "content": "And in Chinese? 用中文 😀\n\tplease"},
]
CONVERSATIONS = {
    "one-turn": TURNS[:1],
    "multi-turn": TURNS,
    "system+one-turn": [SYSTEM, *TURNS[:1]],
    "system+multi-turn": [SYSTEM, *TURNS],
    "ends-with-assistant": TURNS[:2],
}

# Exercises what transformers' environment adds: trim/lstrip blocks, loop controls, a
# namespace, tojson without HTML escaping and with indent, tools, bos/eos, {% generation %}.
RICH_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(turns=0) %}
{% if tools %}
    Tools: {{ tools | tojson(indent=2) }}
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'tool' %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
    <{{ message['role'] }}>{{ message['content'] | default('(none)') }}
    {% if message['role'] == 'assistant' %}
        {% generation %}{{ message['content'] | default('') | tojson }}{{ eos_token }}
        {% endgeneration %}
    {% endif %}
    {% if loop.index > 5 %}{% break %}{% endif %}
{% endfor %}
turns={{ ns.turns }} documents={{ documents is none }}
{% if add_generation_prompt %}<assistant>{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <b>now</b> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_smollm2_template_matches_transformers(
    name, add_generation_prompt, smollm2_tokenizer, hf_gguf_tokenizer
):
    messages = CONVERSATIONS[name]
    ours = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt)
    theirs = hf_gguf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == theirs
    ids = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt, tokenize=True)
    expected_ids = hf_gguf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ids == expected_ids


@pytest.mark.parametrize("answer", ["Sure, here", "Sure, here ", " a\nb", "Hi"])
def test_continue_final_message_matches_transformers(answer, smollm2_tokenizer, hf_gguf_tokenizer):
    """The prompt ends inside the final (assistant) message, as transformers cuts it: trailing
    spaces kept where the template kept them, the last occurrence of the text taken."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer}]
    ours = smollm2_tokenizer.apply_chat_template(messages, continue_final_message=True)
    theirs = hf_gguf_tokenizer.apply_chat_template(
        messages, continue_final_message=True, add_generation_prompt=False, tokenize=False
    )
    assert ours == theirs and answer.strip() in ours[-len(answer) - 1 :]
    with pytest.raises(ChatTemplateError, match="needs a final message with text"):
        smollm2_tokenizer.apply_chat_template(
            [*messages[:1], {"role": "assistant", "content": " "}], continue_final_message=True
        )


def test_a_given_template_replaces_the_models_as_in_transformers(
    smollm2_tokenizer, hf_gguf_tokenizer
):
    """apply_chat_template(chat_template=...) (a trusted request's own template) renders that
    template with the model's bos/eos and the documents, as transformers does."""
    documents = [{"title": "Notes", "text": "The sky is green."}]
    template = (
        RICH_TEMPLATE + "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
    )
    ours = smollm2_tokenizer.apply_chat_template(TURNS, chat_template=template, documents=documents)
    theirs = hf_gguf_tokenizer.apply_chat_template(
        TURNS, chat_template=template, documents=documents, add_generation_prompt=True,
        tokenize=False,
    )  # fmt: skip
    assert ours == theirs and "[Notes: The sky is green.]" in ours
    assert ours != smollm2_tokenizer.apply_chat_template(TURNS, documents=documents)


def test_smollm2_template_exact_text(smollm2_tokenizer):
    text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_rich_template_matches_transformers(add_generation_prompt, tools, hf_gguf_tokenizer):
    messages = [
        SYSTEM,
        *TURNS,
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": None, "tool_calls": None},  # None keys are dropped
    ]
    theirs = hf_gguf_tokenizer.apply_chat_template(
        messages,
        chat_template=RICH_TEMPLATE,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )
    ours = render_chat_template(
        RICH_TEMPLATE,
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        bos_token=hf_gguf_tokenizer.bos_token,
        eos_token=hf_gguf_tokenizer.eos_token,
    )
    assert ours == theirs
    assert "(none)" in ours and "turns=5 documents=True" in ours
    if tools:  # tojson must not HTML-escape
        assert '"description": "Weather for a city <b>now</b> & later"' in ours


def test_strftime_now_and_raise_exception():
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be "
        "from the user, got ' + messages[0]['role']) }}{% endif %}{{ strftime_now('%Y') }}"
    )
    year = render_chat_template(template, [{"role": "user", "content": "x"}])
    assert year.isdigit() and len(year) == 4
    with pytest.raises(ChatTemplateError, match="first message must be from the user, got bot"):
        render_chat_template(template, [{"role": "bot", "content": "x"}])


def test_errors_inside_template_code_become_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="not JSON serializable"):
        render_chat_template("{{ messages[0].nope | tojson }}", [{"role": "user", "content": "x"}])


def test_template_is_sandboxed():
    attack = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError, match="rejected"):
        render_chat_template(attack, [{"role": "user", "content": "x"}])


def test_bad_templates_and_conversations_raise_clear_errors(smollm2_tokenizer):
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        smollm2_tokenizer.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="message 1 is a str"):
        smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "x"}, "hello"])


def test_model_without_template_says_which_model(smollm2_tokenizer):
    no_template = Tokenizer(
        smollm2_tokenizer.backend,
        bos_token_id=None,
        eos_token_id=2,
        chat_template=None,
        source="/models/base-model",
    )
    with pytest.raises(ChatTemplateError, match="/models/base-model: this model has no chat"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_flag_takes_a_file_or_the_template_itself_as_vllm_does(tmp_path):
    inline = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(inline)
    assert load_chat_template(str(path)) == load_chat_template(inline) == inline
    hi = [{"role": "user", "content": "hi"}]
    assert render_chat_template(load_chat_template(str(path)), hi) == "<user>hi"
    with pytest.raises(ChatTemplateError, match="looks like a file path, but it cannot be read"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_chat_template("{% for m in messages %}")
