"""scripts/ab_kernels.py: two builds of the native kernels timed in one process."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_kernels import tiles_as_loaded
from tiny import write_tiny_model
from tsspec import kernels

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import ab_kernels  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels: {kernels.unavailable_reason()}")


def test_same_source_twice_is_identical_and_timed(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", quant="Q4_0", d_model=64, ffn_dim=128, vocab_size=320)
    src = ab_kernels.source_at(None)
    libs = [ab_kernels.build(src), ab_kernels.build(src)]
    for rows in (1, 3):
        res = ab_kernels.compare(str(path), rows, libs, rounds=4, steps=2, head=True, threads=2, allow_different=False)
        assert res["identical"] and res["rows"] == rows
        assert res["base_ms"] > 0 and res["new_ms"] > 0
        assert res["ratio_q1"] <= res["ratio"] <= res["ratio_q3"]


def test_unknown_revision_is_one_clear_error():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ab_kernels.py"), "--base", "no-such-rev-xyz"],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "no kernel sources (tsspec/kernels/*.c) at 'no-such-rev-xyz'" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("quant,d_model", [("Q4_0", 64), ("Q6_K", 256)])
def test_gfni_nibbles_give_the_shift_and_mask_bits(tmp_path, quant, d_model):
    """nibbles512 (Q4_0 here) and q6k_codes512 (Q6_K: the 512-bit products of 2 rows and more) take
    their code bits with gf2p8affineqb where the compiler targets GFNI; the same source built without
    it (the shifts and masks, what an AVX-512 CPU without GFNI compiles) gives every logit the same
    bits. (Every type's SIMD product is also held to the plain C reference in test_kernels.)"""
    path = write_tiny_model(tmp_path / "m.gguf", "llama", quant=quant, d_model=d_model, ffn_dim=2 * d_model,
                            vocab_size=320)
    src = ab_kernels.source_at(None)
    assert b"#ifdef __GFNI__" in src["products.c"]
    libs = [ab_kernels.build({**src, "products.c": b"#undef __GFNI__\n" + src["products.c"]}), ab_kernels.build(src)]
    for rows in (1, 2, 5):
        res = ab_kernels.compare(str(path), rows, libs, rounds=2, steps=1, head=True, threads=2, allow_different=True)
        assert res["identical"], (quant, rows)


def test_an_older_build_gets_every_function_it_has_declared():
    """A library without a later function (tsq_forward_tree sits before tsq_output in the table)
    still gets tsq_output typed, and the missing one is named."""
    class Fn:
        restype = argtypes = None

    class Old:
        pass

    old = Old()
    for name in kernels.SIGNATURES:
        if name != "tsq_forward_tree":
            setattr(old, name, Fn())
    import pytest as _pytest

    with _pytest.raises(AttributeError, match="lacks tsq_forward_tree"):
        kernels._declare(old)
    assert old.tsq_output.argtypes == kernels.SIGNATURES["tsq_output"][1]
    assert old.tsq_eagle_step.restype is kernels.SIGNATURES["tsq_eagle_step"][0]


def test_base_and_amx_are_one_or_the_other():
    for args in ([], ["--base", "HEAD", "--amx"]):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ab_kernels.py"), *args], capture_output=True,
                           text=True)
        assert r.returncode != 0, args
        assert "give --base REV, or --amx" in r.stderr and "Traceback" not in r.stderr


def test_tile_modes_pair_in_one_build(tmp_path):
    """compare's ``modes`` (what --amx pairs: VNNI against the hardware tiles) run here with the
    emulated tiles (mode 2), so the switching and the identity check run on every CPU."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama", quant="Q4_0", d_model=64, ffn_dim=128, vocab_size=320)
    lib = ab_kernels.build(ab_kernels.source_at(None))
    try:
        res = ab_kernels.compare(str(path), 3, [lib, lib], rounds=4, steps=1, head=True, threads=2,
                                 allow_different=False, modes=(0, 2))
    finally:
        tiles_as_loaded()
    assert res["identical"] and res["base_ms"] > 0 and res["new_ms"] > 0


def test_prompt_rows_take_the_route_in_both_builds(tmp_path):
    """--prompt: the rows go as prompt rows with the prompt routes on in both builds (their bits then
    differ from the shared arithmetic's), and the routes are off again after; where the tiles cannot
    run, one clear error"""
    path = write_tiny_model(tmp_path / "m.gguf", "qwen2", quant="Q4_K", d_model=256, ffn_dim=512, vocab_size=320)
    src = ab_kernels.source_at(None)
    libs = [ab_kernels.build(src), ab_kernels.build(src)]
    if not (kernels.amx_usable() and kernels.sb_tiles_built()):
        with pytest.raises(ab_kernels.ScriptError, match="--prompt needs"):
            ab_kernels.compare(str(path), 20, libs, rounds=4, steps=1, head=False, threads=2, allow_different=False,
                               prompt=True)
        return
    st = ab_kernels.Stepper(str(path), 20, False, 2, 1, 8)
    plain = st.step(libs[0], st.context)
    res = ab_kernels.compare(str(path), 20, libs, rounds=4, steps=1, head=False, threads=2, allow_different=False,
                             prompt=True)
    assert res["identical"] and res["prompt"]
    assert not any(lib.tsq_sb_in_use() for lib in libs)
    libs[0].tsq_sb_use(1)
    st.prompt = True
    try:
        assert not torch.equal(st.step(libs[0], st.context), plain)  # the route ran
    finally:
        libs[0].tsq_sb_use(0)
