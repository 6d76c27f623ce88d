"""Chat prompts: rendering a model's Jinja chat template and encoding the result.

Contract:

* ``render_chat(template, messages, ...)`` renders a HuggingFace-style chat template in a sandbox
  (jinja2's ``ImmutableSandboxedEnvironment``, ``trim_blocks``/``lstrip_blocks`` and the
  ``raise_exception``/``strftime_now``/``tojson`` helpers, as transformers sets them up), so the
  text matches what transformers' ``apply_chat_template`` would produce. Any failure to parse or
  render becomes ``BadInput`` with one line naming the problem.
* ``build_messages(prompt, system)`` is the message list for a single user turn.
* Rendering runs under a budget (``TEMPLATE_SECONDS`` of wall clock, ``TEMPLATE_OUTPUT_CHARS`` of
  text beyond the messages' own): ``range`` loops, calls and every output chunk check the clock,
  ``*``/``**`` and calls refuse results past the size budget before computing them, and a
  watchdog stops loops that do none of those, on whatever thread renders. Compiling is budgeted
  too. Going over is one ``BadInput`` naming
  the budget.
* ``parse_template_kwargs(text)`` reads ``--chat-template-kwargs`` (a JSON object) into a dict;
  the variables tsspec sets itself (``RESERVED_VARIABLES``) are refused.
* ``encode_chat(tokenizer, text)`` encodes rendered chat text with special tokens parsed, adding
  BOS only when the tokenizer wants one and the template has not already written it.
"""

from __future__ import annotations

import contextvars
import ctypes
import json
import math
import threading
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

from .errors import BadInput
from .tokenizer import Tokenizer

TEMPLATE_SECONDS = 5.0
TEMPLATE_OUTPUT_CHARS = 1_000_000  # text a template may add beyond the messages it is given
RESERVED_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token")


class _TemplateError(Exception):
    """A template rejected its input via ``raise_exception``."""


class _OverBudget(BaseException):
    """A rendering ran past its time or size budget (a BaseException: templates cannot catch it,
    and no ``except Exception`` on the way mistakes it for an ordinary failure)."""


class _Budget:
    def __init__(self, seconds: float, chars: int):
        self.seconds, self.chars = seconds, chars
        self.deadline = time.monotonic() + seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _OverBudget(f"ran past its time budget of {self.seconds:g} s")

    def size(self, n: int) -> None:
        if n > self.chars:
            raise _OverBudget(f"would make more than its output budget of {self.chars} characters")


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("template_budget", default=None)


def _tick() -> None:
    b = _budget.get()
    if b is not None:
        b.tick()


class _BudgetedRange:
    """``range`` for templates: jinja's size cap, and the clock checked on every step."""

    def __init__(self, *args: int):
        from jinja2.sandbox import safe_range

        self._r = safe_range(*args)  # refuses more than jinja's MAX_RANGE items

    def __len__(self) -> int:
        return len(self._r)

    def __getitem__(self, i):
        return self._r[i]

    def __contains__(self, x) -> bool:
        return x in self._r

    def __iter__(self):
        for i in self._r:
            _tick()
            yield i

    def __reversed__(self):
        for i in reversed(self._r):
            _tick()
            yield i


def _environment_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, with sizes checked before ``*``/``**`` and calls make something huge."""

        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            b = _budget.get()
            if b is not None:
                if operator == "*":
                    for seq, n in ((left, right), (right, left)):
                        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                            b.size(len(seq) * n)
                elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                    b.size(int(right * math.log2(abs(left)) / 8))  # bytes of the result
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            b = _budget.get()
            if b is not None:
                b.tick()
                for a in (*args, *kwargs.values()):  # "x".ljust(10**9), "x"|center(10**9)
                    if isinstance(a, int) and not isinstance(a, bool):
                        b.size(abs(a))
            return super().call(__context, __obj, *args, **kwargs)

    return BudgetedEnvironment


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


def _compile(template: str, seconds: float = TEMPLATE_SECONDS):
    """The compiled template, under the time budget: compiling is as hostile as rendering (5,000
    nested parentheses or 20,000 chained filters overflow the parser's recursion, 25 nested
    ``for`` blocks Python's compiler). A failure is cached too: each turn does not pay it again."""
    compiled, error = _compile_cached(template, seconds)
    if error is not None:
        raise BadInput(error)
    return compiled


@lru_cache(maxsize=8)
def _compile_cached(template: str, seconds: float):
    from jinja2.ext import loopcontrols

    env = _environment_class()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters = {name: _budgeted_filter(f) for name, f in env.filters.items()}
    env.filters["tojson"] = _budgeted_filter(_tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _BudgetedRange
    try:
        with _watchdog(seconds):
            return env.from_string(template), None
    except _OverBudget:
        return None, f"chat template does not parse within its time budget of {seconds:g} s"
    except (Exception, RecursionError, MemoryError) as e:  # TemplateSyntaxError, and Python's own limits
        return None, f"chat template does not parse: {type(e).__name__}: {_one_line(e)}"


def _budgeted_filter(f):
    """A filter whose integer arguments (widths, counts) are held to the size budget and which
    checks the clock: filters are called directly, not through the sandbox's ``call``."""
    import functools

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        b = _budget.get()
        if b is not None:
            b.tick()
            for a in (*args[1:], *kwargs.values()):
                if isinstance(a, int) and not isinstance(a, bool):
                    b.size(abs(a))
        return f(*args, **kwargs)

    return wrapped


class _Watchdog:
    """Raises ``_OverBudget`` in the thread that made it once ``seconds`` pass, unless stopped
    first: a loop that never ticks (``for c in s`` nested, ``lipsum(n=999999)``) is stopped on any
    thread, serve's request threads included, not on the main thread alone as SIGALRM could."""

    def __init__(self, seconds: float):
        self._tid = threading.get_ident()
        self._lock = threading.Lock()
        self._armed, self._fired = True, False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        with self._lock:
            if self._armed:
                self._fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), ctypes.py_object(_OverBudget))

    def __enter__(self) -> "_Watchdog":
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()
        with self._lock:
            self._armed = False
            if self._fired:  # raised but not yet delivered: it must not land in the caller's code
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), None)


def _watchdog(seconds: float) -> _Watchdog:
    return _Watchdog(seconds + 0.5)  # the ticks normally fire first


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
    seconds: float = TEMPLATE_SECONDS,
    max_chars: int | None = None,
    **kwargs: Any,
) -> str:
    """The prompt text the template makes of ``messages``; extra ``kwargs`` (e.g.
    ``enable_thinking``) are passed to the template as variables. ``seconds`` and ``max_chars``
    (default: ``TEMPLATE_OUTPUT_CHARS`` plus twice the messages' text) bound the rendering."""
    compiled = _compile(template, seconds)
    own = sum(len(str(m.get("content", ""))) for m in messages) + len(bos_token) + len(eos_token)
    budget = _Budget(seconds, TEMPLATE_OUTPUT_CHARS + 2 * own if max_chars is None else max_chars)
    token = _budget.set(budget)
    try:
        with _watchdog(seconds):
            parts, n = [], 0
            for chunk in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                           bos_token=bos_token, eos_token=eos_token, **kwargs):
                n += len(chunk)
                budget.size(n)
                budget.tick()
                parts.append(chunk)
            return "".join(parts)
    except _OverBudget as e:  # the watchdog's carries no text: it is the clock
        raise BadInput(f"chat template {str(e) or f'ran past its time budget of {seconds:g} s'} (the template or --chat-template-kwargs loops or "
                       f"grows without bound)") from None
    except _TemplateError as e:
        raise BadInput(f"chat template rejected the conversation: {_one_line(e)}") from None
    except Exception as e:  # jinja2 errors, Python errors raised inside the template, MemoryError
        raise BadInput(f"chat template failed to render: {type(e).__name__}: {_one_line(e)}") from None
    finally:
        _budget.reset(token)


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
    except RecursionError:
        raise BadInput("--chat-template-kwargs: JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise BadInput(f"--chat-template-kwargs: expected a JSON object, got {type(value).__name__}")
    reserved = [k for k in RESERVED_VARIABLES if k in value]
    if reserved:
        raise BadInput(f"--chat-template-kwargs: {', '.join(reserved)} cannot be set here (tsspec sets "
                       f"{', '.join(RESERVED_VARIABLES)} from the prompt, --system and the model file)")
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # "\ud800" escapes: lone surrogates no tokenizer encodes
    except UnicodeEncodeError:
        raise BadInput("--chat-template-kwargs: a string in it is not valid UTF-8 text") from None
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


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], **kwargs: Any) -> list[int]:
    """Token ids of ``messages`` rendered through the tokenizer's chat template, ending where the
    assistant's reply begins (the template's generation prompt)."""
    if not tokenizer.chat_template:
        raise BadInput(f"the model has no chat template ({getattr(tokenizer, 'chat_template_problem', None) or 'tokenizer.chat_template'})")
    bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    return encode_chat(tokenizer, render_chat(tokenizer.chat_template, messages, bos_token=bos, eos_token=eos,
                                              **kwargs))
