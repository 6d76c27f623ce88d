"""Chat prompts: rendering a model's Jinja chat template and encoding the result.

Contract:

* ``render_chat(template, messages, ...)`` renders a HuggingFace-style chat template in a sandbox
  (jinja2's ``ImmutableSandboxedEnvironment``, ``trim_blocks``/``lstrip_blocks`` and the
  ``raise_exception``/``strftime_now``/``tojson`` helpers, as transformers sets them up), so the
  text matches what transformers' ``apply_chat_template`` would produce. Any failure to parse or
  render becomes ``BadInput`` with one line naming the problem.
* ``build_messages(prompt, system)`` is the message list for a single user turn.
* ``parse_template_kwargs(text)`` reads ``--chat-template-kwargs`` (a JSON object) into a dict.
* ``encode_chat(tokenizer, text)`` encodes rendered chat text with special tokens parsed, adding
  BOS only when the tokenizer wants one and the template has not already written it.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from .errors import BadInput
from .tokenizer import Tokenizer


class _TemplateError(Exception):
    """A template rejected its input via ``raise_exception``."""


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation (e.g. roles out of order).
    raise _TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<', '>', '&' and "'"; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise BadInput(f"chat template does not parse: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def render_chat(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **kwargs: Any,
) -> str:
    """The prompt text the template makes of ``messages``; extra ``kwargs`` (e.g.
    ``enable_thinking``) are passed to the template as variables."""
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **kwargs,
        )
    except _TemplateError as e:
        raise BadInput(f"chat template rejected the conversation: {_one_line(e)}") from None
    except Exception as e:  # jinja2 errors, and Python errors raised from inside the template
        raise BadInput(f"chat template failed to render: {type(e).__name__}: {_one_line(e)}") from None


def build_messages(prompt: str, system: str | None = None) -> list[dict]:
    """``[{"role": "system", ...}, {"role": "user", ...}]``; the system turn only if given."""
    messages: list[dict] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    return messages


def parse_template_kwargs(text: str) -> dict[str, Any]:
    """The ``--chat-template-kwargs`` value: a JSON object such as ``{"enable_thinking": false}``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"--chat-template-kwargs: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise BadInput(f"--chat-template-kwargs: expected a JSON object, got {type(value).__name__}")
    return value


def encode_chat(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of rendered chat text, with exactly one BOS where the tokenizer wants one.

    Many templates write ``{{ bos_token }}`` themselves; adding the tokenizer's BOS on top would
    give the model two, which it never saw in training. No EOS is appended even if the file asks
    for one: the prompt ends where the model is to continue.
    """
    ids = tokenizer.encode(text, add_special=False, parse_special=True)
    if tokenizer.add_bos and tokenizer.bos_id is not None and (not ids or ids[0] != tokenizer.bos_id):
        ids.insert(0, tokenizer.bos_id)
    return ids
