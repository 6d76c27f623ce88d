"""The trunk's own answers as training data.

A head drafts inside the trunk's replies, so the text it should learn is what the trunk writes, in
its chat template. Prompts are built from the training corpus (explain, continue, summarise a
snippet; never from the benchmark workloads), the trunk answers each greedily, and the rendered
conversations (prompt and reply) are packed into chunks like any other text. Answers are cached
as they are made, so an interrupted run keeps them.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Callable, Sequence

from ..chat import chat_prompt_ids

CODE_ASKS = (
    "Explain what this Python code does:\n\n```python\n{s}\n```",
    "Here is part of a Python module:\n\n```python\n{s}\n```\n\nWrite one more function that fits it.",
    "Add docstrings to this code and show the result:\n\n```python\n{s}\n```",
    "Write a unit test for this code:\n\n```python\n{s}\n```",
    "Rewrite this code to be shorter and clearer:\n\n```python\n{s}\n```",
)
PROSE_ASKS = (
    "Summarize this text:\n\n{s}",
    "Rewrite this in simpler words:\n\n{s}",
    "Continue this text:\n\n{s}",
    "What are the main points of the following?\n\n{s}",
    "Answer briefly: what is this text about?\n\n{s}",
)


def make_prompts(texts: Sequence[tuple[str, str]], n: int, seed: int) -> list[str]:
    """``n`` requests over snippets of (kind, text) pairs, in a seeded order."""
    rng = random.Random(f"{seed}:prompts")
    usable = [(k, t) for k, t in texts if len(t.strip()) >= 300]
    if not usable:
        return []
    out = []
    for i in range(n):
        kind, text = usable[rng.randrange(len(usable))]
        size = rng.randrange(300, 1200)
        start = rng.randrange(max(1, len(text) - size))
        snippet = text[start : start + size].strip()
        asks = CODE_ASKS if kind == "code" else PROSE_ASKS
        out.append(asks[rng.randrange(len(asks))].format(s=snippet))
    return out


def _cache_path(root: Path, model_id: str, prompts: Sequence[str], max_new: int) -> Path:
    h = hashlib.sha256(f"{model_id}|{max_new}".encode())
    for p in prompts[:8]:  # prompts come in a seeded order: a longer list extends a shorter one
        h.update(p.encode("utf-8", "replace"))
        h.update(b"\0")
    return root / f"answers-{h.hexdigest()[:20]}.json"


def answer(model, tok, prompts: Sequence[str], max_new: int, budget: int, cache_root: Path, model_id: str,
           progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy replies of the trunk to ``prompts`` until ``budget`` reply tokens: each conversation's
    ids (rendered prompt + reply). Cached (and resumed) under ``cache_root``."""
    from ..sampling import Sampler
    from ..spec.loop import decode

    path = _cache_path(cache_root, model_id, prompts, max_new)
    done: list[list[int]] = []
    made = 0
    saved = _load(path, model.vocab_size)
    if saved is not None:
        done, made = saved
        if progress:
            progress(min(made, budget))
    eos = set(tok.eos_ids)
    cache = model.make_cache()  # one for every reply (a new one per reply costs its allocation each time)
    for prompt in prompts[len(done):]:
        if made >= budget:
            break
        ids = chat_prompt_ids(tok, [{"role": "user", "content": prompt}])
        if len(ids) + max_new > model.max_context:
            ids = ids[-(model.max_context - max_new):]
        reply: list[int] = []

        def on_token(t: int) -> bool:
            reply.append(t)
            if progress:
                progress(1)
            return t in eos

        cache.reset()
        decode(model, Sampler(), ids, min(max_new, budget - made), cache=cache, on_token=on_token,
               drawable=tok.vocab_size)
        done.append(ids + reply)
        made += len(reply)
        if len(done) % 8 == 0:
            _save(path, done, made)
    _save(path, done, made)
    return done


def _load(path: Path, vocab: int) -> tuple[list[list[int]], int] | None:
    """The cached replies at ``path``, or None when there are none or the file is damaged (then
    they are made again, not a traceback)."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        done, made = saved["conversations"], saved["reply_tokens"]
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return None
    ok = isinstance(made, int) and made >= 0 and isinstance(done, list) and all(
        isinstance(c, list) and all(isinstance(t, int) and 0 <= t < vocab for t in c) for c in done)
    return (done, made) if ok else None


def _save(path: Path, conversations: list[list[int]], made: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps({"reply_tokens": made, "conversations": conversations}))
    tmp.replace(path)


def pack(conversations: Sequence[Sequence[int]]) -> list[int]:
    """Conversations end to end, one token stream (chunks may span two of them)."""
    out: list[int] = []
    for c in conversations:
        out.extend(c)
    return out
