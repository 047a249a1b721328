"""Chat templates (tgis/router/intake/chat_template.py) against transformers' rendering.

The oracle is ``apply_chat_template(messages, tokenize=False, ...)`` of a transformers
tokenizer built from the embedded model's tokenizer.json with the same template and special
tokens; ours loads the template from a model directory written in tmp_path. The three
real-world templates (Qwen2's ChatML, Llama 3 Instruct, IBM Granite 3.1 Instruct) are in
tests/data/chat_templates/, as published in their models' tokenizer_config.json.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tgis.embedded_model import MODEL_DIR
from tgis.router.intake.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateNotFound,
    load_chat_template,
)

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "chat_templates"
TOKENIZER_JSON = MODEL_DIR / "tokenizer.json"

# template file, and the special tokens of the model's tokenizer_config.json (None: null there)
MODELS: dict[str, tuple[str, dict[str, str | None]]] = {
    "chatml": ("chatml_qwen2.jinja", {"bos_token": None, "eos_token": "<|im_end|>"}),
    "llama3": (
        "llama3_instruct.jinja",
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    ),
    "granite3": (
        "granite3_instruct.jinja",
        {"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>"},
    ),
}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "system_user": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "  What is 2+2?  \n"},
    ],
    "non_ascii": [
        {"role": "system", "content": "Réponds en français — s'il te plaît."},
        {"role": "user", "content": "Café, naïve, 日本語, 😀🎉 and 👨‍👩‍👧?"},
        {"role": "assistant", "content": "D'accord : ça marche ✓"},
        {"role": "user", "content": "Merci 🙏"},
    ],
    "json_content": [
        {"role": "user", "content": 'Parse {"a": [1, 2], "b": {"c": null}} please'},
        {"role": "assistant", "content": '{"a": [1, 2], "b": {"c": null}}\n'},
        {"role": "user", "content": "Now with {{ braces }} and {% tags %}: <tag>&amp;</tag>"},
    ],
}


@cache
def _template_source(model: str) -> str:
    return (TEMPLATES / MODELS[model][0]).read_text(encoding="utf-8")


@cache
def _oracle(template: str, **tokens: str) -> PreTrainedTokenizerFast:
    assert TOKENIZER_JSON.is_file(), TOKENIZER_JSON
    return PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_JSON), chat_template=template, **tokens
    )


def _expected(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    tokens = kwargs.pop("tokens", {})
    rendered = _oracle(template, **tokens).apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(rendered, str)
    return rendered


def _model_dir(root: Path, config: dict[str, Any], jinja: str | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if jinja is not None:
        (root / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return root


def _inline(template: str, **tokens: str) -> ChatTemplate:
    return ChatTemplate(source=template, origin="test", **tokens)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ChatTemplate]:
    """Each real-world template, loaded from a model dir's tokenizer_config.json."""
    result = {}
    for model, (_, tokens) in MODELS.items():
        config = {"chat_template": _template_source(model), **tokens}
        template = load_chat_template(None, _model_dir(tmp_path_factory.mktemp(model), config))
        assert template is not None
        result[model] = template
    return result


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_real_templates_render_as_transformers(
    loaded: dict[str, ChatTemplate], model: str, conversation: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[conversation]
    tokens = {k: v for k, v in MODELS[model][1].items() if v is not None}
    expected = _expected(
        _template_source(model),
        messages,
        add_generation_prompt=add_generation_prompt,
        tokens=tokens,
    )
    got = loaded[model].render(messages, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert messages[-1]["content"].strip() in got  # the template did render the conversation


def test_known_renders() -> None:
    # Not only equal to transformers: the exact published formats.
    llama3 = _inline(_template_source("llama3"), bos_token="<|begin_of_text|>")
    assert llama3.render([{"role": "user", "content": " hi \n"}]) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    chatml = _inline(_template_source("chatml"))
    assert chatml.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_granite_tools_documents_and_controls_as_transformers(
    loaded: dict[str, ChatTemplate],
) -> None:
    # No system message: Granite writes its own, with today's date (strftime_now) and, with
    # tools, the tools as tojson(indent=4), non-ASCII kept.
    messages = [{"role": "user", "content": "Quel temps fait-il à Zürich ?"}]
    extra: dict[str, Any] = {
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Météo d'une ville — °C",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
        "documents": [{"text": "Zürich: 21 °C, ensoleillé."}, {"text": "Genève: pluie."}],
        "controls": {"citations": True, "hallucinations": True},
    }
    source, tokens = _template_source("granite3"), {"eos_token": "<|end_of_text|>"}
    expected = _expected(source, messages, add_generation_prompt=True, tokens=tokens, **extra)
    got = loaded["granite3"].render(messages, **extra)
    assert got == expected
    assert '"description": "Météo d\'une ville — °C"' in got
    assert "Document 1\nGenève: pluie." in got
    assert got.endswith(
        '<|start_of_role|>assistant {"citations": true, "hallucinations": true}<|end_of_role|>'
    )


def test_lookup_order(tmp_path: Path) -> None:
    flag_file = tmp_path / "flag.jinja"
    flag_file.write_text("flag-file:{{ messages[0].content }}", encoding="utf-8")
    config: dict[str, Any] = {"chat_template": "config-string:{{ messages[0].content }}"}
    model_dir = _model_dir(tmp_path / "model", config, jinja="jinja-file:{{ messages[0].content }}")
    messages = [{"role": "user", "content": "x"}]

    def render(option: str | None) -> tuple[str, str] | None:
        template = load_chat_template(option, model_dir)
        return None if template is None else (template.render(messages), template.origin)

    assert render(str(flag_file)) == ("flag-file:x", f"--chat-template {flag_file}")
    inline = "inline:{% for m in messages %}{{ m.content }}{% endfor %}"
    assert render(inline) == ("inline:x", "--chat-template (inline text)")
    assert render(None) == ("jinja-file:x", "chat_template.jinja in the model directory")
    assert render("") == ("jinja-file:x", "chat_template.jinja in the model directory")
    (model_dir / "chat_template.jinja").unlink()
    assert render(None) == ("config-string:x", "tokenizer_config.json")
    config["chat_template"] = [
        {"name": "tool_use", "template": "tool-use:{{ messages[0].content }}"},
        {"name": "default", "template": "default:{{ messages[0].content }}"},
    ]
    _model_dir(model_dir, config)
    assert render(None) == ("default:x", 'tokenizer_config.json (the template named "default")')
    config["chat_template"] = config["chat_template"][:1]
    _model_dir(model_dir, config)
    assert render(None) is None
    del config["chat_template"]
    _model_dir(model_dir, config)
    assert render(None) is None
    assert load_chat_template(None, tmp_path / "empty") is None
    assert load_chat_template(None, None) is None
    # an existing file wins even when its name reads as template text
    odd = tmp_path / "{{ odd }}.jinja"
    odd.write_text("odd-file", encoding="utf-8")
    assert render(str(odd)) == ("odd-file", f"--chat-template {odd}")


def test_special_tokens_come_from_tokenizer_config_whatever_the_template_source(
    tmp_path: Path,
) -> None:
    model_dir = _model_dir(tmp_path, {"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    template = load_chat_template(
        "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}", model_dir
    )
    assert template is not None
    assert (template.bos_token, template.eos_token, template.pad_token) == ("<s>", "</s>", "")
    assert template.render([{"role": "user", "content": "x"}]) == "<s>x</s>"
    assert load_chat_template("{{ bos_token }}", None) == ChatTemplate(
        source="{{ bos_token }}", origin="--chat-template (inline text)"
    )


def test_added_token_dicts_and_chat_template_jinja_as_transformers_loads_them(
    tmp_path: Path,
) -> None:
    # transformers' own loading of the same model directory is the oracle here.
    added = {"__type": "AddedToken", "lstrip": False, "normalized": False, "rstrip": False}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {**added, "content": "<|begin_of_text|>", "single_word": False},
        "eos_token": {**added, "content": "<|eot_id|>"},
        "unk_token": None,
        "chat_template": "never used: chat_template.jinja wins",
    }
    jinja = _template_source("llama3") + "{{ '|' ~ (pad_token is defined) ~ '|' ~ eos_token }}\n"
    model_dir = _model_dir(tmp_path, config, jinja=jinja)
    shutil.copy(TOKENIZER_JSON, model_dir / "tokenizer.json")
    template = load_chat_template(None, model_dir)
    assert template is not None
    assert (template.bos_token, template.eos_token, template.unk_token) == (
        "<|begin_of_text|>",
        "<|eot_id|>",
        "",
    )
    messages = CONVERSATIONS["non_ascii"]
    expected = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert template.render(messages) == expected
    assert expected.startswith("<|begin_of_text|><|start_header_id|>system")
    assert expected.endswith("|False|<|eot_id|>")  # pad_token unset: undefined, not ""


def test_missing_chat_template_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "template.jinja"
    with pytest.raises(ChatTemplateNotFound) as raised:
        load_chat_template(str(missing), None)
    assert isinstance(raised.value, ValueError)
    assert str(missing) in str(raised.value)
    assert "no such file" in str(raised.value)


def test_long_inline_template_is_not_taken_for_a_path() -> None:
    source = "{{ messages[0].content }}" + "x" * 5000  # a "file name" too long for the OS
    template = load_chat_template(source, None)
    assert template is not None
    assert template.render([{"role": "user", "content": "a"}]) == "a" + "x" * 5000


def test_syntax_error_at_load_names_the_origin(tmp_path: Path) -> None:
    broken = "{% for m in messages %}{{ m.content }}\n{% if %}"
    with pytest.raises(ChatTemplateError) as raised:
        load_chat_template(None, _model_dir(tmp_path / "a", {"chat_template": broken}))
    assert "tokenizer_config.json" in str(raised.value)
    assert "does not compile" in str(raised.value)
    assert "line 2" in str(raised.value)
    flag_file = tmp_path / "broken.jinja"
    flag_file.write_text("{{ messages[0].content | no_such_filter }}", encoding="utf-8")
    with pytest.raises(ChatTemplateError, match="no_such_filter") as raised:
        load_chat_template(str(flag_file), None)
    assert f"--chat-template {flag_file}" in str(raised.value)


MISTRAL_LIKE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)


def test_raise_exception_becomes_chat_template_error() -> None:
    template = _inline(MISTRAL_LIKE, bos_token="<s>", eos_token="</s>")
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert template.render(ok) == "<s>[INST] hi [/INST]yo</s>"
    bad = [{"role": "system", "content": "be nice"}, *ok]
    with pytest.raises(jinja2.TemplateError, match="Only user and assistant roles are supported!"):
        _expected(MISTRAL_LIKE, bad, tokens={"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(ChatTemplateError) as raised:
        template.render(bad)
    assert str(raised.value) == "chat template error: Only user and assistant roles are supported!"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "{{ messages[0].nope.deeper }}",
            "chat template error: 'dict object' has no attribute 'nope'",
        ),
        ("{{ messages[0].content + 1 }}", "chat template error: TypeError: "),
        ("{{ ''.__class__.__mro__ }}", "chat template error: access to attribute '__class__'"),
        (
            "{% set ns = namespace(_x=1) %}",
            "chat template error: a namespace() refuses the name '_x'",
        ),
        ("{{ messages.append(1) }}", "chat template error: access to attribute 'append'"),
    ],
)
def test_rendering_failures_are_chat_template_errors(source: str, message: str) -> None:
    with pytest.raises(ChatTemplateError) as raised:
        _inline(source).render([{"role": "user", "content": "x"}])
    assert str(raised.value).startswith(message)
    with pytest.raises(Exception):  # noqa: B017 (transformers fails too, with its own type)
        _expected(source, [{"role": "user", "content": "x"}])


def test_empty_conversation_is_refused() -> None:
    with pytest.raises(ChatTemplateError, match="no messages"):
        _inline("{{ messages }}").render([])


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages[0].content | tojson }}",
        "{{ messages | tojson(indent=2) }}",
        "{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true) }}",
        "{{ messages[0].content | tojson(ensure_ascii=true) }}",
    ],
)
def test_tojson_as_transformers(source: str) -> None:
    messages = [{"role": "user", "content": '日本語 "q" <b>&</b> 😀'}]
    got = _inline(source).render(messages)
    assert got == _expected(source, messages)
    if "ensure_ascii" not in source:
        assert "日本語" in got and "<b>&</b>" in got and "😀" in got
    assert _inline("{{ messages[0].content | tojson }}").render(messages) == (
        '"日本語 \\"q\\" <b>&</b> 😀"'
    )


def test_strftime_now() -> None:
    before = datetime.now().strftime("%Y-%m-%d")
    got = _inline("{{ strftime_now('%Y-%m-%d') }}").render([{"role": "user", "content": "x"}])
    assert got in {before, datetime.now().strftime("%Y-%m-%d")}


@pytest.mark.parametrize(
    "source",
    [
        # None-valued keys are dropped, reasoning is aliased (in transformers' key order)
        "{% for m in messages %}{{ m | tojson }}|{{ m.content is defined }}\n{% endfor %}",
        # unset special tokens are undefined, not ""
        "{{ bos_token is defined }}{{ pad_token is defined }}{{ tools }}{{ documents }}",
        # {% generation %} (transformers' assistant-mask tag) renders its body
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}{{ m.role }}{% endif %}\n{% endfor %}",
        # namespace(), loop controls, trim_blocks and lstrip_blocks
        "{% set ns = namespace(n=0) %}\n  {% for m in messages %}\n"
        "    {% if loop.first %}{% continue %}{% endif %}\n"
        "    {% set ns.n = ns.n + 1 %}\n  {% endfor %}\n{{ ns.n }}\n",
        # extras (transformers' **kwargs) reach the template, and override special tokens
        "{{ custom }}|{{ bos_token }}|{{ add_generation_prompt }}",
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_environment_as_transformers(source: str, add_generation_prompt: bool) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "reasoning": "hmm", "tool_calls": None},
        {"role": "assistant", "content": "a", "reasoning_content": "r", "thinking": "t"},
    ]
    extra = {"custom": {"k": ["v"]}, "bos_token": "<override>"} if "custom" in source else {}
    expected = _expected(
        source,
        messages,
        add_generation_prompt=add_generation_prompt,
        tokens={"bos_token": "<s>"},
        **extra,
    )
    template = _inline(source, bos_token="<s>")
    assert (
        template.render(messages, add_generation_prompt=add_generation_prompt, **extra) == expected
    )


def test_template_is_frozen_and_compares_by_value() -> None:
    template = _inline("{{ messages[0].content }}", eos_token="</s>")
    assert template == _inline("{{ messages[0].content }}", eos_token="</s>")
    assert template != _inline("{{ messages[0].content }}", eos_token="<eos>")
    with pytest.raises(dataclasses.FrozenInstanceError):
        template.source = "{{ 1 }}"  # type: ignore[misc]
