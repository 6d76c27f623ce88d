"""Every environment variable tsspec reads, at every edge value, through the real command line.

One rule (``tsspec.settings``): a variable set to the empty string is unset; any other value must be
valid, blanks around it ignored, or the run stops with one ``error:`` line naming the variable and
exit 2. So each variable below is tried with the empty string, blanks, negative, zero, huge, NaN and
infinite numbers, a word, and bytes that are not UTF-8; the values its kind accepts must run (exit 0),
every other one must be that one line. Nothing is accepted silently: a switch set to ``of`` is a
typo, not "on".
"""

from __future__ import annotations

import pytest
from clirun import entry
from test_kernels import fresh_kernels
from tiny import write_tiny_model
from tsspec import kernels
from tsspec.options import FAMILIES

EDGE_VALUES = ("", " ", "\t", "-1", "0", "1", " 1 ", "99999999999999999999", "1e30", "nan", "inf", "-inf", "x",
               "of", "\udcff")  # "\udcff": the byte 0xff, which is not UTF-8, as Python holds it

BOOL = {"", "0", "1", " 1 "}  # the edge values each kind accepts; all others must be refused
KINDS = {
    "bool": (BOOL, ["off", "YES", "true"]),  # accepted edge values, further values that must run
    "draft": ({"", "1", " 1 "}, ["64", "3"]),
    "pmin": ({"", "0", "1", " 1 "}, ["0.5", "1e-3"]),
    "type": ({""}, ["ngram", "auto"]),
    "accept": ({""}, ["match", "residual"]),
    "draft_model": ({""}, ["MODEL"]),
    "weights": ({""}, ["f32", " BF16 ", "auto"]),
    "device": ({""}, ["cpu", " CPU ", "auto"]),  # cuda: refused where there is no GPU (test_usage_errors)
    "cache": (set(EDGE_VALUES) - {" ", "\t"}, ["CACHE"]),  # any path the system takes is a path
    "tree": ({"", "0", "1", " 1 "}, ["16", "64"]),
    # a count of ids (past the vocabulary: all of it)
    "ids": ({"", "0", "1", " 1 ", "99999999999999999999"}, ["auto", "81920"]),
    # 1 runs only where the AMX tiles do (refused elsewhere, one line: test_amx)
    "amx": ({"", "0"} | ({"1", " 1 "} if kernels.amx_usable() else set()), ["auto", " AUTO ", "off"]),
    # the levels this CPU runs; one it lacks is refused in one line (test_isa)
    "isa": ({""}, ["auto", " AUTO ", "scalar"] + [w for w in ("avx512", "avx2", "neon")
                                                  if any(n in kernels.cpu_levels() for n in kernels.ISA_CHOICES[w])]),
}
SPEC_KINDS = {"SPEC": "bool", "TYPE": "type", "DRAFT": "draft", "PMIN": "pmin", "ACCEPT": "accept",
              "ADAPTIVE": "bool", "DRAFT_MODEL": "draft_model", "TREE": "tree"}
VARIABLES = {fam + suffix: kind for fam in FAMILIES for suffix, kind in SPEC_KINDS.items()} | {
    "TSSPEC_WEIGHTS": "weights", "TSSPEC_DRAFT_WEIGHTS": "weights", "TSSPEC_CACHE": "cache",
    "TSSPEC_KERNELS": "bool", "TS_Q35_VERIFY_SNAPSHOTS": "bool", "TS_DFLASH_CONV": "bool",
    "TS_DFLASH_SELECTOR": "bool", "TSSPEC_DEVICE": "device", "TSSPEC_AMX": "amx",
    "TSSPEC_ISA": "isa", "TSSPEC_DRAFT_VOCAB": "ids",
}
COUNTS = {"ran": 0, "refused": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("env") / "tiny.gguf", arch="llama", seed=3))


@pytest.mark.parametrize("name", list(VARIABLES))
def test_every_edge_value(name, model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative $TSSPEC_CACHE is made here
    accepted, valid = KINDS[VARIABLES[name]]
    valid = [model if v == "MODEL" else str(tmp_path / "cache") if v == "CACHE" else v for v in valid]
    for value in EDGE_VALUES + tuple(valid):
        env = {name: value}
        if name.startswith(FAMILIES) and not name.endswith("_SPEC"):
            env[name[:name.index("_", 3) + 1] + "SPEC"] = "1"  # speculation on, so the setting is live
        if name in ("TSSPEC_KERNELS", "TSSPEC_AMX", "TSSPEC_ISA"):  # read once per process: start each case afresh
            fresh_kernels(monkeypatch)
        args = ("models",) if name == "TSSPEC_CACHE" else ("generate", "-m", model, "-p", "the cat", "-n", "2", "-q")
        code, out, err = entry(*args, env=env)
        what = f"{name}={value!r}: exit {code}, stderr {err[-400:]!r}"
        assert "Traceback" not in out + err, what
        lines = [x for x in err.splitlines() if x.strip()]
        if value in accepted or value in valid:
            assert code == 0 and not any(x.startswith("error:") for x in lines), what
            COUNTS["ran"] += 1
        else:
            assert len(lines) == 1 and lines[0].startswith("error:"), what
            if VARIABLES[name] == "draft_model":  # a path: it names the file it could not open
                assert code in (2, 3) and (name in lines[0] or "not found" in lines[0]), what
            else:
                assert code == 2 and name in lines[0], what
            COUNTS["refused"] += 1


def test_summary():
    """The numbers for the README (runs after the table above, in file order)."""
    total = COUNTS["ran"] + COUNTS["refused"]
    print(f"\nenvironment edges: {len(VARIABLES)} variables, {total} cases, {COUNTS}")
    assert total == 0 or COUNTS["refused"] > COUNTS["ran"] > 0
