"""Multi-turn conversations on a kept cache: each reply equals a fresh run over the whole rendered
conversation, only the new tokens are forwarded, and speculation arms from the second turn."""

from __future__ import annotations

import json

import pytest

from tiny import write_tiny_model
from tsspec.spec.plan import SpecPlan
from tsspec.conversation import Conversation
from tsspec.models.cache import common_prefix
from tsspec.errors import BadInput
from tsspec.generate import Engine
from tsspec.models import load_model
from tsspec.sampling import Sampler, SamplingParams
from tsspec.spec.loop import decode
from tsspec.spec.ngram import NGramSpeculator
from tsspec.tokenizer import Tokenizer

USER = ["Say the word apple three times: apple apple apple", "Now say banana", "And the first word again"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("conv") / "m.gguf", "qwen2", seed=3, vocab_size=400, ctx=1024)
    return load_model(path), Tokenizer.from_gguf(path)


def kept(conv):
    """(tokens, cache) of the conversation's one kept cache."""
    (tokens, cache), = conv.prefix.entries.values()
    return tokens, cache


def _engine(model, tok, spec=None):
    return Engine(model, tok, SpecPlan(spec, window=4))


@pytest.mark.parametrize("sampler", [Sampler(), Sampler(SamplingParams(temperature=0.8, top_k=40, seed=5))],
                         ids=["greedy", "seeded"])
def test_each_reply_equals_a_fresh_run_and_only_new_tokens_are_forwarded(tiny, sampler):
    model, tok = tiny
    conv = Conversation(_engine(model, tok), system="You are terse.")
    for i, user in enumerate(USER):
        turn = conv.reply(user, sampler=sampler, max_tokens=12)
        prompt = conv.render(conv.all_messages()[:-1])  # the conversation as this turn saw it
        assert turn.prompt_tokens == len(prompt)
        fresh = decode(model, sampler, prompt, 12)
        got = turn.token_ids + ([] if turn.stop_reason != "eos" else [tok.eos_id])
        assert got == fresh[: len(got)], f"turn {i}"
        if i == 0:
            assert turn.reused == 0 and turn.prefilled == len(prompt)
        else:
            assert turn.reused > 0 and turn.prefilled == len(prompt) - turn.reused
            assert turn.reused >= len(conv.render(conv.all_messages()[:-3])) - 1  # at least the earlier turns
        tokens, cache = kept(conv)
        assert cache.length == len(tokens) and tokens == (prompt + turn.token_ids)[: len(tokens)]


def test_speculation_arms_from_the_second_turn_and_stays_exact(tiny):
    model, tok = tiny
    spec = NGramSpeculator(max_draft_tokens=4)
    conv = Conversation(_engine(model, tok, spec))
    plain = Conversation(_engine(model, tok))
    for user in USER:
        a = conv.reply(user, sampler=Sampler(), max_tokens=16)
        b = plain.reply(user, sampler=Sampler(), max_tokens=16)
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.stats.speculator == "ngram"  # armed on every turn, reused prefix or not
    assert sum(t.stats.verify_calls for t in conv.turns) > 0


def test_a_speculator_that_cannot_arm_after_reuse_sits_out_those_turns(tiny):
    model, tok = tiny

    class NoReuse(NGramSpeculator):
        can_arm_after_prefix_reuse = False

    conv = Conversation(_engine(model, tok, NoReuse(max_draft_tokens=4)))
    first = conv.reply(USER[0], sampler=Sampler(), max_tokens=8)
    second = conv.reply(USER[1], sampler=Sampler(), max_tokens=8)
    assert first.stats.speculator == "ngram" and first.reused == 0
    assert second.reused > 0 and second.stats.speculator is None


def test_reset_system_change_and_cache_trim(tiny):
    model, tok = tiny
    conv = Conversation(_engine(model, tok), system="one")
    conv.reply(USER[0], sampler=Sampler(), max_tokens=6)
    held = kept(conv)[1].length
    conv.set_system("two")  # the first tokens differ now: the cache keeps only the common prefix
    turn = conv.reply(USER[1], sampler=Sampler(), max_tokens=6)
    assert turn.reused < held
    prompt = conv.render(conv.all_messages()[:-1])
    assert turn.token_ids == decode(model, Sampler(), prompt, 6)[: len(turn.token_ids)]
    conv.reset()
    assert conv.messages == [] and not conv.prefix.entries and conv.system == "two"
    assert conv.reply(USER[0], sampler=Sampler(), max_tokens=4).reused == 0


def test_interrupted_reply_keeps_the_conversation(tiny):
    model, tok = tiny
    conv = Conversation(_engine(model, tok))
    n = {"tokens": 0}

    def on_step(stats):
        n["tokens"] = stats.generated

    turn = conv.reply(USER[0], sampler=Sampler(), max_tokens=40, on_step=on_step,
                      interrupted=lambda: n["tokens"] >= 3)
    assert turn.stop_reason == "interrupted" and 3 <= len(turn.token_ids) < 40
    assert conv.messages[-1] == {"role": "assistant", "content": turn.text}
    nxt = conv.reply(USER[1], sampler=Sampler(), max_tokens=6)  # the kept cache is consistent
    prompt = conv.render(conv.all_messages()[:-1])
    assert nxt.token_ids == decode(model, Sampler(), prompt, 6)[: len(nxt.token_ids)]


def test_full_conversation_and_save(tiny, tmp_path):
    model, tok = tiny
    small = load_model(model.path, n_ctx=64)
    conv = Conversation(_engine(small, tok))
    with pytest.raises(BadInput, match="conversation is full"):
        conv.reply("word " * 80, sampler=Sampler(), max_tokens=8)
    conv = Conversation(_engine(model, tok), system="s")
    conv.reply(USER[0], sampler=Sampler(), max_tokens=4)
    out = conv.save(tmp_path / "c.json")
    data = json.loads(out.read_text())
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant"]
    assert data["turns"][0]["prefilled_tokens"] > 0
    with pytest.raises(BadInput, match="cannot save"):
        conv.save(tmp_path / "missing" / "c.json")


def test_a_line_far_past_the_context_is_refused_before_rendering(tiny):
    """A 26 MB line was rendered and tokenized (24 s on smollm2) before "the conversation is full"."""
    import time

    model, tok = tiny
    conv = Conversation(_engine(load_model(model.path, n_ctx=64), tok))
    t = time.perf_counter()
    with pytest.raises(BadInput, match=r"the conversation is full: prompt \(at least \d+ tokens\)"):
        conv.reply("the cat sat. " * 2_000_000, sampler=Sampler(), max_tokens=8)
    assert time.perf_counter() - t < 5
    assert conv.messages == [] and conv.turns == []


def test_save_expands_the_home_directory(tiny, tmp_path, monkeypatch):
    """`/save ~/c.json` at the chat prompt (no shell to expand it) failed: "./~/c.json" has no folder."""
    model, tok = tiny
    monkeypatch.setenv("HOME", str(tmp_path))
    conv = Conversation(_engine(model, tok))
    assert conv.save("~/c.json") == tmp_path / "c.json" and (tmp_path / "c.json").is_file()


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2]) == 2


def test_hybrid_conversation_equals_fresh_runs(tmp_path):
    """A hybrid trunk's recurrent state can only undo its last forward: where the rendering departs
    from the cache further back, the conversation starts the cache over; replies stay exact."""
    tiny_hybrid = pytest.importorskip("tiny_hybrid")
    pytest.importorskip("transformers")
    path, _ = tiny_hybrid.write_hybrid(tmp_path / "h.gguf", "qwen35")
    model, tok = load_model(path), Tokenizer.from_gguf(path)
    conv = Conversation(_engine(model, tok, NGramSpeculator(max_draft_tokens=3)))
    for user in USER[:2]:
        turn = conv.reply(user, sampler=Sampler(), max_tokens=8)
        prompt = conv.render(conv.all_messages()[:-1])
        assert turn.token_ids == decode(model, Sampler(), prompt, 8)[: len(turn.token_ids)]
    conv.set_system("changed")  # the divergence is at the start: the hybrid cache starts over
    turn = conv.reply(USER[2], sampler=Sampler(), max_tokens=8)
    assert turn.reused == 0


# ----------------------------------------------------------------------------- tsspec chat


def test_chat_command_over_piped_input(tiny, tmp_path):
    from clirun import run

    model, _ = tiny
    save = tmp_path / "conv.json"
    lines = [USER[0], "/stats", USER[1], "/system be brief", "/bogus", f"/save {save}", "/reset", USER[2], "/exit",
             "never read"]
    r = run("chat", "-m", str(model.path), "-n", "6", "--spec", "--spec-type", "ngram", input="\n".join(lines) + "\n")
    assert r.exit_code == 0, r.output
    out = r.output
    assert out.count("tokens/s") == 0 and out.count("prefilled") >= 3  # one turn line per reply
    assert "0 reused" in out and "unknown command /bogus" in out and "conversation reset" in out
    assert "turns" in out  # the /stats table
    data = json.loads(save.read_text())
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert data["messages"][0]["content"] == "be brief"
    # a second turn reuses the cache: its line reports reused tokens
    turn_lines = [x for x in out.splitlines() if "prefilled" in x]
    assert " 0 reused" in turn_lines[0] and " 0 reused" not in turn_lines[1]


def test_chat_command_errors_are_one_line(tiny, tmp_path):
    from clirun import run

    model, _ = tiny
    no_template = write_tiny_model(tmp_path / "plain.gguf", "llama", tokenizer=None)
    r = run("chat", "-m", str(no_template), input="hi\n")
    assert r.exit_code != 0 and "error:" in r.output and "Traceback" not in r.output
    r = run("chat", "-m", str(model.path), "-n", "0", input="hi\n")
    assert r.exit_code != 0 and "--max-tokens" in r.output
    r = run("chat", "-m", str(model.path), "-c", "64", "-n", "8", input="word " * 100 + "\n/exit\n")
    # a script whose every turn failed is a failure for the script (issue 40)
    assert r.exit_code == 1 and "conversation is full" in r.output


def test_chat_errors_are_text_on_one_line(tiny, tmp_path):
    """A /save path or /command with rich markup in it ('[/]') raised MarkupError (a traceback); a
    long error (a full conversation) wrapped onto two lines at the console's width."""
    from clirun import run

    model, _ = tiny
    (tmp_path / "[").mkdir()
    odd = tmp_path / "[" / "b]saved.json"  # its path reads ".../[/b]saved.json": a closing tag
    lines = [f"/save {tmp_path}/no/[/]x.json", "/[/]", "hi", f"/save {odd}", "word " * 300, "/exit"]
    r = run("chat", "-m", str(model.path), "-c", "256", "-n", "4", input="\n".join(lines) + "\n")
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output and "MarkupError" not in r.output
    errors = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 3, r.output
    assert errors[0].startswith(f"error: cannot save to {tmp_path}/no/[/]x.json")
    assert errors[1] == "error: unknown command /[/]; /help lists them"
    assert "conversation is full" in errors[2] and errors[2].endswith("/reset starts a new one")
    assert odd.exists() and f"saved to {odd}" in r.output
