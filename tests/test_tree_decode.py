"""Token trees in the loop: the acceptance walk, n-gram trees, and exactness against plain decoding.

* ``tree.walk`` on a chain accepts exactly what ``verify_match`` accepts (greedy and seeded), and on
  a tree follows the trunk's draws into whichever branch holds them;
* ``NGramIndex.lookup_tree``'s first path is the chain lookup's draft, the rest a trie under the
  node budget;
* n-gram trees decode token for token as plain decoding, greedy and seeded, on tiny llama, qwen2
  and gemma3 trunks (branching trees actually verified, more accepted than the chains), and a
  hybrid trunk refuses a tree.
"""

from __future__ import annotations

import random

import pytest
import torch

from test_loop import GREEDY, PROMPTS, models, plain, sampled  # noqa: F401 (fixtures)
from tsspec.spec.plan import SpecPlan
from tsspec.spec import tree
from tsspec.spec.loop import decode
from tsspec.spec.ngram import NGramIndex, NGramSpeculator
from tsspec.spec.stats import SpecStats
from tsspec.spec.verify import verify_match

N_NEW = 48


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


def test_walk_on_a_chain_is_verify_match():
    rng = torch.Generator().manual_seed(0)
    for trial in range(40):
        k = 1 + trial % 6
        logits = torch.randn(k + 1, 50, generator=rng)
        draws = logits.argmax(-1).tolist()
        draft = [draws[i] if (trial >> i) & 1 else (draws[i] + 1) % 50 for i in range(k)]
        for sampler in (GREEDY, sampled(trial)):
            v = verify_match(logits, draft, sampler, 10, [1, 2, 3])
            path, tok = tree.walk(logits, draft, list(range(-1, k - 1)), sampler, 10, [1, 2, 3])
            assert (len(path), tok) == (v.accepted, v.token) and path == list(range(v.accepted))


def test_walk_follows_the_branch_holding_the_draw():
    logits = torch.full((5, 10), -5.0)
    logits[0, 7] = 5  # after the last token the trunk says 7
    logits[2, 3] = 5  # after 7 (token 1's row) it says 3
    logits[4, 9] = 5  # after 7, 3 it says 9
    tokens, parents = [4, 7, 2, 3], [-1, -1, 1, 1]  # 4 | 7 -> (2 | 3)
    path, tok = tree.walk(logits, tokens, parents, GREEDY, 0, [0])
    assert path == [1, 3] and tok == 9


def test_check_and_prune():
    tree.check([1, 2, 3], [-1, 0, 0])
    with pytest.raises(ValueError, match="does not come before"):
        tree.check([1, 2], [0, -1])
    with pytest.raises(ValueError, match="sibling already holds"):
        tree.check([1, 2, 2], [-1, 0, 0])
    toks, pars = tree.prune([1, 2, 3, 4, 5], [-1, 0, 1, -1, 3], max_nodes=4, max_depth=2)
    assert (toks, pars) == ([1, 2, 4, 5], [-1, 0, -1, 2])
    assert tree.depths(pars) == [1, 2, 1, 2]
    # an id without a token (at or past drawable) goes with everything under it
    assert tree.prune([1, 9, 3, 4], [-1, 0, 1, 0], 10, 5, drawable=8) == ([1, 4], [-1, 0])


def test_lookup_tree_starts_with_the_chain_and_keeps_the_budget():
    rng = random.Random(1)
    for _ in range(200):
        hist = [rng.randrange(6) for _ in range(rng.randrange(5, 60))]
        idx = NGramIndex(1, 4)
        idx.extend(hist)
        order, chain = idx.lookup_order(5)
        n, toks, pars = idx.lookup_tree(5, 12)
        assert n == order
        if not chain:
            assert toks == []
            continue
        tree.check(toks, pars)
        assert len(toks) <= 12 and max(tree.depths(pars)) <= 5
        assert toks[: len(chain)] == chain and pars[: len(chain)] == list(range(-1, len(chain) - 1))


@pytest.mark.parametrize("arch", ("llama", "qwen2", "gemma3"))
def test_ngram_trees_equal_plain(models, arch):
    m = models[arch]
    branched = tree_acc = chain_acc = 0
    for name, prompt in PROMPTS.items():
        for sampler in (GREEDY, sampled(3)):
            want = plain(m, prompt, sampler)
            stats = SpecStats()
            spec = NGramSpeculator(max_draft_tokens=8, min_order=1, tree=16)
            seen = []
            orig = spec.propose

            def propose(ctx, orig=orig, seen=seen):
                d = orig(ctx)
                seen.append(d)
                return d

            spec.propose = propose
            got = decode(m, sampler, prompt, N_NEW, SpecPlan(spec, window=8), stats=stats)
            assert got == want, (name, sampler.greedy)
            branched += sum(1 for d in seen if d.parents and len(set(d.parents)) < len(d.parents))
            tree_acc += stats.accepted
            cstats = SpecStats()
            decode(m, sampler, prompt, N_NEW, SpecPlan(NGramSpeculator(max_draft_tokens=8, min_order=1), window=8), stats=cstats)
            chain_acc += cstats.accepted
    assert branched > 0  # trees with more than one child somewhere were verified
    assert tree_acc >= chain_acc  # a tree holds its chain, so it accepts at least as much


def test_the_governor_hears_a_trees_depth(models):
    """A tree's reach is its depth: the governor sizes depths and reads acceptance along them, so
    it is told the depth, not the node count (a 16-node tree of depth 3 that accepts 3 is a full
    draft, not 13 rejected tokens)."""
    from tsspec.spec.governor import SpeculationCostGovernor
    from tsspec.spec.protocols import Draft

    assert Draft([1, 2, 3, 4], parents=[-1, 0, 0, 2]).depth == 3 and Draft([1, 2]).depth == 2
    assert Draft().depth == 0
    heard, depths = [], []

    class Ear(SpeculationCostGovernor):
        def record(self, speculative, ms, tokens, drafted=None, setup_ms=0.0, shared=1):
            heard.append(drafted)
            super().record(speculative, ms, tokens, drafted, setup_ms)

    spec = NGramSpeculator(max_draft_tokens=8, min_order=1, tree=16)
    orig = spec.propose
    spec.propose = lambda ctx: (lambda d: (depths.append((d.depth, len(d.tokens))), d)[1])(orig(ctx))
    gov = Ear(enabled=False)
    prompt = PROMPTS["repeat"] if "repeat" in PROMPTS else next(iter(PROMPTS.values()))
    decode(models["llama"], GREEDY, prompt, N_NEW, SpecPlan(spec, window=8, governor=gov))
    assert any(0 < d < n for d, n in depths)  # trees wider than a chain were drafted
    assert [h for h in heard if h] == [d for d, _ in depths if d]


def test_a_hybrid_trunk_refuses_a_tree(tmp_path):
    from tiny_hybrid import write_hybrid
    from tsspec.models import load_model
    from tsspec.models.protocols import ForwardItem

    m = load_model(write_hybrid(tmp_path / "h.gguf")[0])
    c = m.make_cache()
    m.forward([1, 2, 3], c)
    with pytest.raises(ValueError, match="token trees need a trunk that shares one forward"):
        m.forward_batch([ForwardItem([4, 5], c, True, None, [-1, -1])])
    assert c.length == 3


# ----------------------------------------------------------------------------- the operator surface

CLI_PROMPT = "the cat sat on the mat. the cat sat on the dog. the cat sat on the"


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory):
    from tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tree_cli") / "tiny.gguf", arch="llama", seed=3))


def _json(result) -> dict:
    import json

    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("how", ["flag", "TS_SPEC_TREE", "TS_MTP_TREE", "--mtp-tree"])
def test_spec_tree_from_the_cli_equals_plain(cli_model, how):
    from clirun import run

    base = ("generate", "-m", cli_model, "-p", CLI_PROMPT, "-n", "24", "--json", "--ignore-eos")
    plain_ids = _json(run(*base))["token_ids"]
    spec = ("--spec", "--spec-type", "ngram", "--no-spec-adaptive")
    if how in ("flag", "--mtp-tree"):
        out = _json(run(*base, *spec, "--spec-tree" if how == "flag" else "--mtp-tree", "12"))
    else:
        out = _json(run(*base, *spec, env={how: "12"}))
    assert out["token_ids"] == plain_ids
    assert out["spec"]["tree_verifies"] > 0 and out["spec"]["nodes_per_tree"] <= 12


def test_a_draft_models_grown_tree_from_the_cli(cli_model):
    """``--draft-model`` with ``--spec-tree``: greedy, the grown tree's output is plain's; seeded
    under ``--spec-accept residual`` its trees are verified by the recursive rule (a seeded residual
    run is the trunk's distribution, not plain's text, so only that it ran on trees is checked)."""
    from clirun import run

    base = ("generate", "-m", cli_model, "-p", CLI_PROMPT, "-n", "24", "--json", "--ignore-eos")
    spec = ("--spec", "--spec-type", "draft-model", "--draft-model", cli_model, "--no-spec-adaptive",
            "--spec-tree", "10")
    plain_ids = _json(run(*base))["token_ids"]
    out = _json(run(*base, *spec))
    assert out["token_ids"] == plain_ids and out["spec"]["tree_verifies"] > 0
    res = _json(run(*base, *spec, "--temp", "0.8", "--seed", "3", "--spec-accept", "residual"))
    assert len(res["token_ids"]) == 24 and res["spec"]["tree_verifies"] > 0


def test_spec_tree_out_of_range_is_one_line(cli_model):
    from clirun import entry

    for args, env in ((("--spec-tree", "65"), None), (("--spec-tree", "x"), None), ((), {"TS_SPEC_TREE": "-1"})):
        code, out, err = entry("generate", "-m", cli_model, "-p", "hi", "-n", "2", "--spec", *args, env=env)
        assert code == 2, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
        assert "--spec-tree" in err or "TS_SPEC_TREE" in err


def test_published_tree_and_bench_config():
    from tsspec.bench.configs import parse_config
    from tsspec.options import SpecOptions, publish

    env: dict = {}
    publish(SpecOptions(enabled=True, tree=16), env)
    assert env["TS_SPEC_TREE"] == env["TS_MTP_TREE"] == "16"
    c = parse_config("ngt=ngram:tree=16,draft=6")
    assert (c.name, c.algo, c.tree, c.draft) == ("ngt", "ngram", 16, 6)
    assert parse_config(c.spec()) == type(c)(**{**c.__dict__, "name": c.spec()})
    from tsspec.errors import BadInput

    with pytest.raises(BadInput, match="tree must be a node count 0-64"):
        parse_config("ngram:tree=100")
