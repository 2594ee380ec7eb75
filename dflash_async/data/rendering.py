"""Chat template rendering, exactly as `tokenizer.apply_chat_template(tokenize=False)` renders.

Masking one conversation renders its template about 4 times per assistant turn (chat.py), so
rendering is most of the cost of tokenizing chat data. transformers renders in a jinja sandbox
whose attribute check (`is_safe_attribute`: isinstance tests against a dozen types per lookup)
takes about half the time. That check reads only the object's type and the attribute name, so
`render_chat` renders with a copy of transformers' own environment (same class, options,
extensions, filters and globals, taken from the template transformers compiled) whose check is
memoized per (type, name): the same answers, the same sandbox, computed once. The inputs go
through transformers' own data preparation (plain JSON copies, reasoning-field aliases).

`render_chat_reference` is the plain call of transformers' renderer; a test holds the two equal.
If a transformers release moves the private pieces used here, rendering falls back to it.
transformers is imported on first use (~1 s): tokenizer processes that render everything with
fast_template.py never import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = dict[str, Any]
_PRIVATE = ("_compile_jinja_template", "_plain_template_data", "_alias_reasoning_fields")


@lru_cache(maxsize=1)
def _transformers_rendering() -> tuple[Any, bool]:
    """(transformers' chat_template_utils, whether its private pieces used here exist)."""
    from transformers.utils import chat_template_utils

    return chat_template_utils, all(hasattr(chat_template_utils, name) for name in _PRIVATE)


_DICT_ATTRIBUTES = frozenset(dir(dict))


class MemoizedSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox with `is_safe_attribute` cached per (type(obj), attribute).

    Exact because jinja's check (underscore names, internal attributes of functions, methods,
    types, frames and generators, mutating methods of known mutable types) depends on nothing
    but the object's type and the attribute's name. `message.role` on a plain dict skips the
    AttributeError that jinja's lookup raises and catches before it reads the item: same result.
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._safe: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = self._safe.get(key)
        if safe is None:
            safe = self._safe[key] = super().is_safe_attribute(obj, attr, value)
        return safe


@lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    """The template compiled in a MemoizedSandbox copy of transformers' environment."""
    base = _transformers_rendering()[0]._compile_jinja_template(template).environment
    if type(base) is not ImmutableSandboxedEnvironment:  # another sandbox: do not second-guess
        raise TypeError(f"transformers renders chat templates in a {type(base).__name__}")
    env = MemoizedSandbox(
        trim_blocks=base.trim_blocks,
        lstrip_blocks=base.lstrip_blocks,
        extensions=[type(extension) for extension in base.extensions.values()],
    )
    env.filters = dict(base.filters)
    env.globals = dict(base.globals)
    return env.from_string(template)


def render_chat(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    enable_thinking: bool,
    tools: list[dict] | None = None,
) -> str:
    """Render `messages` exactly as `tokenizer.apply_chat_template(tokenize=False)` would."""
    chat_template_utils, fast = _transformers_rendering()
    if not fast or (tools is not None and not all(isinstance(t, dict) for t in tools)):
        return render_chat_reference(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            tools=tools,
        )
    plain = chat_template_utils._plain_template_data
    chat = chat_template_utils._alias_reasoning_fields(plain(list(messages)))
    return _compiled(template).render(
        messages=chat,
        tools=plain(tools),
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **plain({"enable_thinking": enable_thinking}),
    )


def render_chat_reference(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    enable_thinking: bool,
    tools: list[dict] | None = None,
) -> str:
    """transformers' own rendering (the reference for render_chat)."""
    rendered, _ = _transformers_rendering()[0].render_jinja_template(
        conversations=[list(messages)],
        tools=tools,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )
    return rendered[0]
