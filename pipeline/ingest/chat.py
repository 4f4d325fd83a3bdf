"""Instruction and chat rows -> text segments, each trained on or not (the loss mask's source).

A row is one JSON object (a JSONL line or a Parquet row) in one of two shapes:

* ``messages``: a list of ``{"role", "content"}`` (roles ``system``, ``user``, ``assistant``,
  ``tool``), rendered by a chat template;
* ``prompt`` + ``completion``: two strings, concatenated as they are (no template).

`render` returns the row's text as consecutive `Segment`s; `prepare` tokenizes each segment on
its own and marks its tokens trained or not. Which spans are trained (``--train-on``):

* ``assistant``: every assistant message, with the template's end-of-turn text after it;
* ``completion``: the completion, or for ``messages`` only the last assistant message;
* ``all``: every token.

Chat templates are Jinja, as in Hugging Face's ``tokenizer_config.json``. The spans of an
assistant message are found by rendering prefixes of the conversation: the text of messages
``[:i]`` with the generation prompt, then messages ``[:i + 1]``; what the second adds is the
message's trained span. A template whose renderings are not prefixes of each other cannot be
split this way and is refused for that row. `BUILTIN_TEMPLATE` is the template used with
tokenizers that carry none (the ``bytes`` tokenizer)::

    <|system|>
    You are terse.
    <|user|>
    What is 2 + 2?
    <|assistant|>
    4<|end|>

A bad row raises `BadRow` with the reason; the caller adds the file and line.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.errors import PrepareError
from pipeline.extras import require

__all__ = [
    "BUILTIN_TEMPLATE",
    "ROLES",
    "ROW_FORMATS",
    "TRAIN_ON",
    "BadRow",
    "ChatTemplate",
    "RowFields",
    "Segment",
    "load_template",
    "render",
]

ROW_FORMATS = ("text", "messages", "prompt-completion")
TRAIN_ON = ("assistant", "completion", "all")
ROLES = frozenset({"system", "user", "assistant", "tool"})

BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message.role }}|>\n{{ message.content }}"
    "{% if message.role == 'assistant' %}<|end|>{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}"
)
"""The builtin chat template (Jinja): a role line per message, ``<|end|>`` after assistant turns."""


class BadRow(Exception):
    """A row that cannot become a document; `prepare` names its file and line, or skips it."""


@dataclass(frozen=True)
class Segment:
    text: str
    trained: bool


@dataclass(frozen=True)
class RowFields:
    """How rows are read: the shape (`ROW_FORMATS`) and the names of its fields."""

    format: str = "text"
    text: str = "text"
    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"

    def __post_init__(self) -> None:
        if self.format not in ROW_FORMATS:
            raise PrepareError(f"--format {self.format!r}: valid formats: {', '.join(ROW_FORMATS)}")

    @property
    def columns(self) -> tuple[str, ...]:
        """The fields a row of this format must have."""
        if self.format == "messages":
            return (self.messages,)
        if self.format == "prompt-completion":
            return (self.prompt, self.completion)
        return (self.text,)


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special-token strings it may use."""

    source: str
    name: str
    special_tokens: tuple[tuple[str, str], ...] = ()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]

    def renderer(self) -> Callable[..., str]:
        """The compiled template, sandboxed like Hugging Face's (no attribute escapes)."""
        require("jinja2.sandbox", "chat", f"chat template {self.name}")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
        try:
            template = env.from_string(self.source)
        except TemplateError as error:
            raise PrepareError(f"chat template {self.name}: does not compile: {error}") from None
        specials = dict(self.special_tokens)

        def render_messages(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **specials
            )

        return render_messages


def load_template(choice: str, tokenizer_spec: str) -> ChatTemplate:
    """`--chat-template`: ``auto`` (the `hf:` tokenizer's, else builtin), ``builtin``, or a
    file: a ``tokenizer_config.json`` (its ``chat_template``) or a Jinja text file."""
    if choice == "builtin":
        return ChatTemplate(BUILTIN_TEMPLATE, "builtin")
    if choice == "auto":
        kind, _, path = tokenizer_spec.partition(":")
        config = os.path.join(os.path.dirname(os.path.expanduser(path)), "tokenizer_config.json")
        if kind == "hf" and os.path.isfile(config):
            return _from_file(config)
        return ChatTemplate(BUILTIN_TEMPLATE, "builtin")
    return _from_file(os.path.expanduser(choice))


def _from_file(path: str) -> ChatTemplate:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as error:
        raise PrepareError(f"chat template {path}: cannot read it ({error})") from None
    if not path.endswith(".json"):
        return ChatTemplate(text, os.path.basename(path))
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise PrepareError(f"{path}: not JSON ({error.msg} at line {error.lineno})") from None
    source = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(source, list):  # several named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        raise PrepareError(
            f"{path}: has no chat_template string; pass --chat-template builtin or a Jinja file"
        )
    specials = []
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            specials.append((key, value))
    return ChatTemplate(source, os.path.basename(path), tuple(specials))


def json_kind(value: Any) -> str:
    """What a row's value is, in the words of the JSON (or Parquet) the user wrote: "a number",
    "null", "a list", "bytes" (a Parquet binary column; a Sequence, not a list); a Python type
    name ("a int", "a NoneType") reads as our bug, not theirs."""
    if value is None:
        return "null"
    kinds = ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"),
             (bytes, "bytes"), (Mapping, "an object"), (Sequence, "a list"))  # fmt: skip
    for types, kind in kinds:
        if isinstance(value, types):
            return kind
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def render(
    row: Mapping[str, Any],
    fields: RowFields,
    train_on: str,
    template: Callable[..., str] | None,
) -> list[Segment]:
    """The row's text as segments; raises `BadRow` for a row that cannot be trained on."""
    if not isinstance(row, Mapping):
        raise BadRow(f"is {json_kind(row)}, not an object")
    if fields.format == "prompt-completion":
        prompt = _string(row, fields.prompt)
        completion = _string(row, fields.completion)
        if not completion:
            raise BadRow(f"field {fields.completion!r} is empty: nothing to train on")
        return _merge([Segment(prompt, train_on == "all"), Segment(completion, True)])
    if template is None:
        raise ValueError("messages rows need a chat template")
    messages = _messages(row, fields.messages)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "completion":
        if messages[-1]["role"] != "assistant":
            raise BadRow("the last message is not the assistant's: no completion to train on")
        assistant = assistant[-1:]
    if not assistant and train_on != "all":
        raise BadRow("no assistant message: nothing to train on")
    full = _render(template, messages, False)
    if train_on == "all":
        return [Segment(full, True)]
    segments, done = [], 0
    for i in assistant:
        start = len(_prefix(template, full, messages[:i], True))
        stop = len(_prefix(template, full, messages[: i + 1], False))
        if start < done or stop <= start:
            raise BadRow(f"the template renders message {i + 1} as nothing: nothing to train on")
        segments += [Segment(full[done:start], False), Segment(full[start:stop], True)]
        done = stop
    segments.append(Segment(full[done:], False))
    return _merge(segments)


def _prefix(template: Callable[..., str], full: str, messages: list, generation: bool) -> str:
    text = _render(template, messages, generation)
    if not full.startswith(text):
        raise BadRow(
            "the chat template does not render the conversation's first messages as a prefix "
            "of the whole, so the assistant's spans cannot be located"
        )
    return text


def _render(template: Callable[..., str], messages: list, generation: bool) -> str:
    from jinja2 import TemplateError

    try:
        return template(messages, generation)
    except TemplateError as error:
        raise BadRow(f"the chat template fails to render it: {error}") from None


def _string(row: Mapping[str, Any], field: str) -> str:
    if field not in row or row[field] is None:
        raise BadRow(f"has no field {field!r} (fields: {', '.join(sorted(row)) or 'none'})")
    value = row[field]
    if not isinstance(value, str):
        raise BadRow(f"field {field!r} is {json_kind(value)}, not a string")
    return value


def _messages(row: Mapping[str, Any], field: str) -> list[dict[str, str]]:
    if field not in row or row[field] is None:
        raise BadRow(f"has no field {field!r} (fields: {', '.join(sorted(row)) or 'none'})")
    value = row[field]
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise BadRow(f"field {field!r} is {json_kind(value)}, not a list of messages")
    if not value:
        raise BadRow(f"field {field!r} is an empty conversation")
    messages = []
    for i, message in enumerate(value, 1):  # numbered from 1, as lines are
        if not isinstance(message, Mapping) or not {"role", "content"} <= set(message):
            raise BadRow(f"message {i} is not an object with 'role' and 'content'")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise BadRow(
                f"message {i} has unknown role {role!r} (roles: {', '.join(sorted(ROLES))})"
            )
        if not isinstance(content, str):
            raise BadRow(f"message {i}: content is {json_kind(content)}, not a string")
        messages.append({"role": role, "content": content})
    return messages


def _merge(segments: list[Segment]) -> list[Segment]:
    """Drop empty segments and join neighbours with the same flag."""
    merged: list[Segment] = []
    for segment in segments:
        if not segment.text:
            continue
        if merged and merged[-1].trained == segment.trained:
            merged[-1] = Segment(merged[-1].text + segment.text, segment.trained)
        else:
            merged.append(segment)
    return merged
