"""Chat templates for ``/v1/chat/completions``: found and compiled once at startup, rendered.

``load_chat_template`` takes the first of: (1) ``--chat-template``: the file it names, else
the option itself if it reads as template text (has ``{{`` or ``{%``), else an error (an empty
option counts as not given); (2) ``chat_template.jinja`` in the model directory; (3)
``tokenizer_config.json``'s ``chat_template``: a string, or a list of ``{"name", "template"}``
whose ``default`` is taken. None found: ``None``. The special tokens always come from the
model directory's ``tokenizer_config.json``. A template that does not compile fails the load.

Rendering mirrors transformers' ``apply_chat_template(..., tokenize=False)``
(``transformers/utils/chat_template_utils.py``) without importing transformers: its sandboxed
jinja2 environment, filters, globals and ``{% generation %}`` tag, and the variables it passes:
``messages`` (None-valued keys dropped, reasoning also as ``thinking`` and
``reasoning_content``), ``tools`` and ``documents`` (None unless given),
``add_generation_prompt``, the special tokens that are set (an unset one is undefined) and the
caller's extras. Every failure is a ``ChatTemplateError``, whose message fits a 400 body.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
# The names a message's reasoning goes by; transformers fills the first two from the first set.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
Messages = Sequence[Mapping[str, Any]]  # the conversation: OpenAI-style {"role", "content", ...}


class ChatTemplateError(ValueError):
    """A chat template that cannot be found, compiled or rendered; ``str()`` fits a 400 body."""


class ChatTemplateNotFound(ChatTemplateError):
    """``--chat-template`` names no existing file and is not template text either."""


def _raise_exception(message: object) -> NoReturn:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; transformers' is json.dumps with these options
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a namespace() refuses the name {name!r}")


class _Namespace(Namespace):
    """jinja's ``namespace()``, refusing underscore-prefixed attributes as transformers does."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        attrs = dict(*args[1:], **kwargs)  # args[0] is self (jinja's signature: self=... works)
        for name in attrs:
            _check_name(name)
        Namespace.__init__(args[0], attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        super().__setitem__(name, value)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant mask): its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's Extension declares it a plain class attribute)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals.update(
    raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace
)


def _plain(value: Any) -> Any:
    """A copy built of dicts, lists and tuples, so the template sees plain data."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items = [_plain(item) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to a template."""
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"chat template: a message must be an object, not {message!r}")
    plain = {key: _plain(value) for key, value in message.items() if value is not None}
    reasoning = next((plain[key] for key in _REASONING_FIELDS if key in plain), None)
    if reasoning is None:
        return plain
    return {"thinking": reasoning, **plain, "reasoning_content": reasoning}


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template, compiled, with the special tokens it may use."""

    source: str
    origin: str  # where it came from, e.g. "--chat-template /path" or "tokenizer_config.json"
    bos_token: str = ""
    eos_token: str = ""
    unk_token: str = ""
    pad_token: str = ""
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            compiled = _ENV.from_string(self.source)
        except jinja2.TemplateError as e:
            line = f"line {e.lineno}: " if isinstance(e, jinja2.TemplateSyntaxError) else ""
            raise ChatTemplateError(
                f"the chat template from {self.origin} does not compile: {line}{e.message}"
            ) from e
        object.__setattr__(self, "_compiled", compiled)

    def special_tokens(self) -> dict[str, str]:
        """The special tokens that are set (non-empty), by their template variable name."""
        tokens = {name: getattr(self, name) for name in SPECIAL_TOKENS}
        return {name: text for name, text in tokens.items() if text}

    def render(
        self, messages: Messages, *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt, as ``apply_chat_template(messages, tokenize=False, ...)`` renders it;
        ``extra`` are more template variables (``tools``, ``documents``, ...)."""
        if not messages:
            raise ChatTemplateError("chat template: the conversation has no messages")
        variables: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens()}
        variables.update(_plain(extra))
        variables["messages"] = [_template_message(message) for message in messages]
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return self._compiled.render(variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except Exception as e:
            raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from e


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"cannot read the chat template {path}: {e}") from e


def _from_option(option: str) -> tuple[str, str]:
    try:
        is_file = Path(option).is_file()
    except (OSError, ValueError):  # a name too long, or with a NUL: not a path
        is_file = False
    if is_file:
        return _read_text(Path(option)), f"--chat-template {option}"
    if "{{" in option or "{%" in option:
        return option, "--chat-template (inline text)"
    raise ChatTemplateNotFound(
        f"--chat-template {option}: no such file (nor template text, which has {{{{ or {{%)"
    )


def _read_tokenizer_config(model_dir: Path | None) -> dict[str, Any]:
    if model_dir is None or not (path := model_dir / TOKENIZER_CONFIG).is_file():
        return {}
    try:
        config = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{path} is not a JSON object")
    return config


def _from_config(value: Any) -> tuple[str, str] | None:
    origin = TOKENIZER_CONFIG
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]: the one named default
        named = {
            entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)
        }
        value, origin = named.get("default"), f'{TOKENIZER_CONFIG} (the template named "default")'
    if value is None or isinstance(value, str):
        return None if value is None else (value, origin)
    raise ChatTemplateError(f"{TOKENIZER_CONFIG}: chat_template is neither a string nor a list")


def _token_text(value: Any) -> str:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def load_chat_template(option: str | None, model_dir: Path | None) -> ChatTemplate | None:
    """The chat template to serve (see the module docstring for the order), or None."""
    config = _read_tokenizer_config(model_dir)
    found: tuple[str, str] | None
    if option:
        found = _from_option(option)
    elif model_dir is not None and (model_dir / TEMPLATE_FILE).is_file():
        found = _read_text(model_dir / TEMPLATE_FILE), f"{TEMPLATE_FILE} in the model directory"
    else:
        found = _from_config(config.get("chat_template"))
    if found is None:
        return None
    tokens = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
    return ChatTemplate(source=found[0], origin=found[1], **tokens)
