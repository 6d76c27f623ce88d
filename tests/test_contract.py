"""The operator contract the design document states, item by item (issue 37, section 4).

* a speculator that does not say whether it arms after a reused prefix is taken to say no;
* heads and block drafters load in the drafter format (``--draft-weights``, ``TSSPEC_DRAFT_WEIGHTS``);
* the window published as ``TS_SPEC_DRAFT``/``TS_MTP_DRAFT`` is the one that runs;
* the legacy spellings on every command that takes the speculation flags;
* what ``bench`` and ``info`` read of the two families;
* a hybrid trunk's rollback memory in ``info``, ``--json`` and the live display;
* ``TS_QWEN35_DFLASH`` attaches a drafter.
"""

from __future__ import annotations

import pytest

from scripted import ScriptedSpeculator
from tiny import write_tiny_model
from tsspec.models import load_model
from tsspec.sampling import Sampler
from tsspec.spec.loop import decode
from tsspec.spec.stats import SpecStats

GREEDY = Sampler()
PROMPT = [(7 * i + 40) % 250 for i in range(20)]
MORE = [100, 101, 102, 103, 104, 50, 100, 101, 102]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_model(write_tiny_model(tmp_path_factory.mktemp("contract") / "llama.gguf", "llama", seed=7, ctx=512))


# ----------------------------------------------------------------------------- speculator defaults


class Silent:
    """A speculator that never mentions ``can_arm_after_prefix_reuse`` (everything else delegated)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "can_arm_after_prefix_reuse":
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_arming_after_prefix_reuse_defaults_to_false(llama):
    """The design's default: a speculator without ``can_arm_after_prefix_reuse`` is left out of a
    sequence that begins from a reused prefix (no AttributeError in ``Sequence.begin``), and drafts
    as usual on a fresh cache."""
    m = llama
    turn2 = PROMPT + decode(m, GREEDY, PROMPT, 8) + MORE
    want = decode(m, GREEDY, turn2, 24)
    cache = m.make_cache()
    decode(m, GREEDY, PROMPT, 8, cache=cache)
    spec = Silent(ScriptedSpeculator(turn2 + want, lambda s, i: False, m.vocab_size))
    assert not hasattr(spec, "can_arm_after_prefix_reuse")
    stats = SpecStats()
    assert decode(m, GREEDY, turn2, 24, cache=cache, speculator=spec, stats=stats) == want
    assert stats.speculator is None and spec.drafts == []
    fresh = Silent(ScriptedSpeculator(turn2 + want, lambda s, i: False, m.vocab_size))
    assert decode(m, GREEDY, turn2, 24, speculator=fresh) == want
    assert fresh.drafts  # no reused prefix: it drafts
