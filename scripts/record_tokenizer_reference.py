"""Record reference token ids for ``tests/fixtures/tokenizer/<model>.json``.

The reference is transformers' own GGUF tokenizer (``AutoTokenizer.from_pretrained(dir,
gguf_file=name)``), an implementation independent of ``tsspec.tokenizer``. For every corpus string
the ids it gives (no BOS/EOS, special-token texts parsed) are written to the fixture, which
``tests/test_tokenizer.py`` then holds ``tsspec`` to.

Where ``tsspec`` and transformers disagree the script stops, unless the case is listed in
``KNOWN_DIFFERENCES`` with the reason ``tsspec`` is right (llama.cpp is the authority for GGUF).
Such cases are written with ``tsspec``'s ids *and* transformers' ids and the reason, so a
mismatch is documented in the fixture, never hidden.

Usage: python scripts/record_tokenizer_reference.py [model ...]   (needs the `reference` extra)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing tsspec

MODELS_DIR = Path.home() / ".cache" / "tsspec" / "models"
FIXTURES = ROOT / "tests" / "fixtures" / "tokenizer"
MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]

CORPUS: list[str] = [
    "",
    "Hello world!",
    " Hello",
    "  leading spaces",
    "trailing spaces   ",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, we've done it.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\n}",
    "x = {'a': [1, 2, 3], \"b\": None}  # comment",
    "tabs\tand\t\ttabs\n\nnewlines\r\nwindows\n\n\n\nmany",
    "wide          gap of spaces",
    "3.14159265358979 and 1234567890123 and 42",
    "2024-01-31T12:34:56Z 0x1F $9.99 100%",
    "Café naïve résumé Zürich São Paulo",
    "日本語のテキストと中文文本，还有한국어.",
    "Привет, мир! Ελληνικά. مرحبا بالعالم",
    "emoji 😀🎉👍🏽 and flags 🇫🇷 and family 👨‍👩‍👧",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>not a bos in text",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "a\u00a0b\u2003c\u200bd",
    "....!!!???---___===",
    "   \n   \n",
    "\n",
    " ",
    "ÿþ\x00\x01 control \x7f",
    "Intro:\n\n1. First item",
    "if x:\n" + " " * 32 + ")",
]

# (model, text) -> why tsspec's ids, not transformers', are right.
KNOWN_DIFFERENCES: dict[tuple[str, str], str] = {
    ("smollm2-135m", "Intro:\n\n1. First item"): (
        "tokenizer.ggml.pre=smollm: llama.cpp first isolates every digit (\\p{N}), then applies the "
        "GPT-2 regex to each piece, so ':\\n\\n' ends its piece and '\\s+(?!\\S)' keeps '\\n\\n' "
        "whole (one token, as SmolLM2's own tokenizer.json with its Digits pre-tokenizer does). "
        "transformers has no mapping for 'smollm' and runs the plain GPT-2 regex over ':\\n\\n1', "
        "which splits the newlines into two tokens."
    ),
    ("gemma3-270m", "if x:\n" + " " * 32 + ")"): (
        "Gemma's space-run tokens (2..31 spaces) are USER_DEFINED; llama.cpp matches them as raw "
        "text before SentencePiece, longest first, so 32 spaces become the 31-space token and the "
        "last space joins ')' as '▁)'. transformers respells them as '▁' runs and merges them "
        "as ordinary BPE (16+16 spaces, then ')')."
    ),
}


def reference_ids(hf_tok, text: str) -> list[int]:
    return list(hf_tok(text, add_special_tokens=False)["input_ids"])


def record(model: str) -> dict:
    from transformers import AutoTokenizer

    from tsspec.tokenizer import Tokenizer

    path = MODELS_DIR / f"{model}.gguf"
    hf_tok = AutoTokenizer.from_pretrained(str(MODELS_DIR), gguf_file=path.name)
    ours = Tokenizer.from_gguf(path)
    cases, unexplained = [], []
    for text in CORPUS:
        ref = reference_ids(hf_tok, text)
        got = ours.encode(text, add_special=False)
        case: dict = {"text": text, "ids": got}
        if got != ref:
            reason = KNOWN_DIFFERENCES.get((model, text))
            if reason is None:
                unexplained.append((text, ref, got))
            case.update(transformers_ids=ref, reason=reason)
        cases.append(case)
    if unexplained:
        for text, ref, got in unexplained:
            print(f"{model}: MISMATCH {text!r}\n  transformers {ref}\n  tsspec       {got}", file=sys.stderr)
        raise SystemExit(f"{model}: {len(unexplained)} unexplained mismatches; fixture not written")
    return {
        "model": model,
        "reference": "transformers AutoTokenizer(gguf_file=...), add_special_tokens=False",
        # What the reference puts around text when asked to: the BOS/EOS convention.
        "empty_with_special": list(hf_tok("", add_special_tokens=True)["input_ids"]),
        "cases": cases,
    }


def main(argv: list[str]) -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for model in argv or MODELS:
        data = record(model)
        out = FIXTURES / f"{model}.json"
        out.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {out} ({out.stat().st_size} bytes, {len(data['cases'])} cases)")


if __name__ == "__main__":
    main(sys.argv[1:])
