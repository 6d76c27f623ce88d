"""The GPU check's measurements (issue 16), run by ``scripts/gpu_check.sh`` on a lent GPU machine.

Real model files cannot travel to that machine, so this writes random-weight GGUF files of the four
known models' exact shapes and quant types (``MODELS``, read from the real files with gguf-py: every
matrix's type, including which layers llama.cpp's mixes give the larger type) and measures, per
model, on the Triton path (``--device cuda``):

* plain decode tok/s (1-row forwards, greedy, host loop; no CUDA graphs yet);
* the verify curve: ms per forward of 1..16 rows (all rows' logits, as a verify needs);
* spec == plain: speculative decoding with a scripted drafter whose acceptance follows
  ``PATTERN`` (0..15 of 15 drafted tokens accepted) emits exactly the plain greedy tokens;
* beside them: the HBM bandwidth limit (the device weight bytes one decode step reads / the
  bandwidth; 4.8 TB/s for an H200) and torch's own bf16 ``F.linear`` over the same shapes (1 and 16
  rows), a dense-weight baseline with every layer's weights distinct (no cache reuse).

``--dry-run`` runs all of it on the CPU (the native/torch path instead of Triton), with two layers
per model and a cut vocabulary, so the argument parsing, the GGUF writing of the shapes, the
measurements and the table are exercised without a GPU (tests/test_gpu_check.py). Its numbers mean
nothing; its table's spec == plain column still does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

H200_BANDWIDTH = 4.8e12  # bytes/s
PATTERN = (0, 3, 15, 1, 8, 2, 15, 5, 0, 11)  # tokens accepted per verify, in turn (15 drafted at most)
MAX_DRAFT = 15  # a full verify is 16 rows
VERIFY_ROWS = tuple(range(1, 17))

# What the four known models' files hold (from their GGUF metadata and tensor table). ``types``: each
# block matrix's type; ``alt``: the type some layers get instead (``alt_layers``), as llama.cpp's
# Q4_K_M-style mixes give attn_v and ffn_down more bits on those layers.
MODELS = {
    "smollm2-135m": dict(
        arch="llama", n_layers=30, d_model=576, n_heads=9, n_kv=3, head_dim=64, ffn=1536, vocab=49152,
        ctx=8192, rope_base=100000.0, eps=1e-5, tied=True, embd="Q8_0", output=None,
        types=dict(attn_q="Q4_1", attn_k="Q4_1", attn_v="Q4_1", attn_output="Q4_1", ffn_gate="Q4_1",
                   ffn_up="Q4_1", ffn_down="Q4_1"),
        alt={}, alt_layers=()),
    "gemma3-270m": dict(
        arch="gemma3", n_layers=18, d_model=640, n_heads=4, n_kv=1, head_dim=256, ffn=2048, vocab=262144,
        ctx=32768, rope_base=1000000.0, eps=1e-6, tied=True, embd="Q8_0", output=None, sliding_window=512,
        types=dict(attn_q="Q5_0", attn_k="Q5_0", attn_v="Q5_0", attn_output="Q4_K", ffn_gate="Q5_0",
                   ffn_up="Q5_0", ffn_down="Q4_K"),
        alt=dict(attn_v="Q8_0", ffn_down="Q6_K"), alt_layers=(0, 1, 4, 7, 10, 13, 15, 16, 17)),
    "qwen2.5-coder-0.5b": dict(
        arch="qwen2", n_layers=24, d_model=896, n_heads=14, n_kv=2, head_dim=64, ffn=4864, vocab=151936,
        ctx=32768, rope_base=1000000.0, eps=1e-6, tied=False, embd="Q5_0", output="Q8_0",
        types=dict(attn_q="Q5_0", attn_k="Q5_0", attn_v="Q5_0", attn_output="Q5_0", ffn_gate="Q5_0",
                   ffn_up="Q5_0", ffn_down="Q4_K"),
        alt=dict(attn_v="Q8_0", ffn_down="Q6_K"), alt_layers=(0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21)),
    "qwen2.5-coder-1.5b": dict(
        arch="qwen2", n_layers=28, d_model=1536, n_heads=12, n_kv=2, head_dim=128, ffn=8960, vocab=151936,
        ctx=32768, rope_base=1000000.0, eps=1e-6, tied=False, embd="Q4_K", output="Q6_K",
        types=dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q4_K", attn_output="Q4_K", ffn_gate="Q4_K",
                   ffn_up="Q4_K", ffn_down="Q4_K"),
        alt=dict(attn_v="Q6_K", ffn_down="Q6_K"), alt_layers=(0, 1, 5, 6, 7, 8, 9, 10, 13, 16, 19, 21, 24, 27)),
}

# the f16 scale fields of one block (byte offsets) and the typical magnitude of (code x sub-scale),
# so that a random block's weights have about the standard deviation asked for
_F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
_CODE_STD = {"Q4_0": 4.6, "Q4_1": 4.6, "Q5_0": 9.2, "Q8_0": 74.0, "Q4_K": 250.0, "Q6_K": 1370.0}


# ----------------------------------------------------------------------------- writing the files


def random_blocks(type_name: str, n: int, k: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF blocks uint8 [n, row_bytes] of ``type_name`` whose weights have about ``std``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    nb = n * k // elems
    blocks = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    d = (std / _CODE_STD[type_name]) * rng.uniform(0.5, 1.5, nb)
    blocks[:, _F16_FIELDS[type_name][0] : _F16_FIELDS[type_name][0] + 2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    if type_name == "Q4_1":  # the min centres the codes 0..15
        blocks[:, 2:4] = (-7.5 * d).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if type_name == "Q4_K":  # dmin about d * 7.5: the sub-block mins offset the codes' mean
        blocks[:, 2:4] = (7.5 * d).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, -1)


def layer_indices(spec: dict, layers: int | None) -> list[int]:
    """The real layers a file of ``layers`` layers stands for: all of them, or every other one from
    0 (so a cut model keeps both a larger-type and a plain layer of a mix)."""
    n = spec["n_layers"]
    if layers is None or layers >= n:
        return list(range(n))
    return [min(2 * i, n - 1) for i in range(layers)]


def write_model(name: str, path: Path, *, layers: int | None = None, vocab: int | None = None,
                seed: int = 0) -> Path:
    """A random-weight GGUF of model ``name``'s shapes and quant types (``layers``/``vocab``: cut
    for a dry run; every matrix shape but the vocabulary's is then still the real one)."""
    import gguf

    spec = MODELS[name]
    arch, d, hd = spec["arch"], spec["d_model"], spec["head_dim"]
    idx = layer_indices(spec, layers)
    v = spec["vocab"] if vocab is None else vocab
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_name(f"random {name} shapes")
    w.add_context_length(spec["ctx"])
    w.add_embedding_length(d)
    w.add_block_count(len(idx))
    w.add_feed_forward_length(spec["ffn"])
    w.add_head_count(spec["n_heads"])
    w.add_head_count_kv(spec["n_kv"])
    w.add_rope_freq_base(spec["rope_base"])
    w.add_layer_norm_rms_eps(spec["eps"])
    w.add_vocab_size(v)
    if arch == "llama":
        w.add_rope_dimension_count(hd)
    if arch == "gemma3":
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_sliding_window(spec["sliding_window"])
    w.add_quantization_version(2)

    def mat(tname: str, type_name: str, n: int, k: int, std: float) -> None:
        raw = random_blocks(type_name, n, k, std, rng)
        w.add_tensor(tname, raw, raw_dtype=gguf.GGMLQuantizationType[type_name])

    def norm(tname: str, n: int) -> None:
        w.add_tensor(tname, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    q_dim, kv_dim = spec["n_heads"] * hd, spec["n_kv"] * hd
    mat("token_embd.weight", spec["embd"], v, d, 0.05)
    shapes = dict(attn_q=(q_dim, d), attn_k=(kv_dim, d), attn_v=(kv_dim, d), attn_output=(d, q_dim),
                  ffn_gate=(spec["ffn"], d), ffn_up=(spec["ffn"], d), ffn_down=(d, spec["ffn"]))
    for li, real in enumerate(idx):
        p = f"blk.{li}."
        norm(p + "attn_norm.weight", d)
        for t, (n, k) in shapes.items():
            ty = spec["alt"].get(t, spec["types"][t]) if real in spec["alt_layers"] else spec["types"][t]
            mat(p + t + ".weight", ty, n, k, 1.0 / np.sqrt(k))
            if arch == "qwen2" and t in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(p + t + ".bias", (0.1 * rng.standard_normal(n)).astype(np.float32))
        if arch == "gemma3":
            norm(p + "attn_q_norm.weight", hd)
            norm(p + "attn_k_norm.weight", hd)
            norm(p + "post_attention_norm.weight", d)
            norm(p + "post_ffw_norm.weight", d)
        norm(p + "ffn_norm.weight", d)
    norm("output_norm.weight", d)
    if not spec["tied"]:
        mat("output.weight", spec["output"], v, d, 1.0 / np.sqrt(d))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ----------------------------------------------------------------------------- measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt(vocab: int, n: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def decode_tok_s(model, steps: int, prompt_len: int = 32) -> float:
    """Plain greedy decoding: 1-row forwards after a prompt, tokens per second."""
    cache = model.make_cache()
    out = model.forward(_prompt(model.vocab_size, prompt_len), cache)
    tok = int(out.logits[-1].argmax())
    model.forward([tok], cache)  # warm
    _sync(model.device)
    t = time.perf_counter()
    for _ in range(steps):
        tok = int(model.forward([tok], cache).logits[-1].argmax())
    _sync(model.device)
    return steps / (time.perf_counter() - t)


def verify_curve(model, reps: int, rows=VERIFY_ROWS, prefix: int = 64) -> dict[int, float]:
    """ms per forward of ``rows`` rows (all logits) after a ``prefix``-token cache, median of ``reps``."""
    cache = model.make_cache()
    model.forward(_prompt(model.vocab_size, prefix), cache)
    toks = _prompt(model.vocab_size, max(rows), seed=2)
    out = {}
    for r in rows:
        model.forward(toks[:r], cache, all_logits=True)  # warm (and compile) this row count
        cache.trim(r)
        times = []
        for _ in range(reps):
            _sync(model.device)
            t = time.perf_counter()
            model.forward(toks[:r], cache, all_logits=True)
            _sync(model.device)
            times.append((time.perf_counter() - t) * 1e3)
            cache.trim(r)
        out[r] = statistics.median(times)
    return out


class ScriptedSpeculator:
    """Drafts the plain output (``truth``), wrong from token ``PATTERN[step]`` of each proposal on,
    so verify ``step`` accepts exactly that many (the ``Speculator`` protocol of tsspec.spec)."""

    name = "scripted"
    default_min_draft_prob = 0.0
    min_draft_prob = 0.0
    needs_hidden_state = False
    can_arm_after_prefix_reuse = True
    default_accept_rule = "match"
    taps = ()

    def __init__(self, truth, vocab: int, pattern=PATTERN, max_draft: int = MAX_DRAFT):
        self.truth, self.vocab, self.pattern, self.max_draft = list(truth), vocab, pattern, max_draft
        self.steps = 0
        self.drafted = 0

    def begin(self, prompt, hidden) -> None:
        pass

    def propose(self, ctx):
        from tsspec.spec.protocols import Draft

        start = len(ctx.history)
        want = self.truth[start : start + min(ctx.max_tokens, self.max_draft)]
        good = self.pattern[self.steps % len(self.pattern)]
        out = [t if i < good else (t + 1) % self.vocab for i, t in enumerate(want)]
        if out:
            self.steps += 1
            self.drafted += len(out)
        return Draft(out)

    def commit(self, tokens, hidden, start_pos) -> None:
        pass

    def reset(self) -> None:
        pass


def spec_equals_plain(model, prompt, n_new: int = 64) -> dict:
    """Greedy plain decoding, then speculative decoding with the scripted acceptance pattern: equal?"""
    from tsspec.sampling import Sampler
    from tsspec.spec.loop import decode
    from tsspec.spec.plan import SpecPlan
    from tsspec.spec.stats import SpecStats

    plain = decode(model, Sampler(), prompt, n_new)
    spec = ScriptedSpeculator(list(prompt) + plain, model.vocab_size)
    stats = SpecStats()
    out = decode(model, Sampler(), prompt, n_new, SpecPlan(spec, window=MAX_DRAFT), stats=stats)
    return dict(equal=out == plain, tokens=len(out), verifies=stats.verify_calls, drafted=stats.drafted,
                accepted=stats.accepted)


def linears(model) -> list:
    """Every weight product of one decode step, in order (blocks, then the head)."""
    out = []
    for b in model.blocks:
        out += [b.qkv, b.o, b.gate_up, b.down]
    return out + [model.lm_head]


def device_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads (every product's weights; the embedding's one row is
    left out)."""
    return sum(lin.nbytes() for lin in linears(model))


def torch_bf16_linear_ms(model, rows: int, reps: int) -> float:
    """torch's bf16 F.linear over the same shapes as one forward's products (dense random weights,
    every layer its own), ms per forward of ``rows`` rows, median of ``reps``."""
    dev = model.device
    ws = [torch.randn(lin.out_features, lin.in_features, device=dev, dtype=torch.bfloat16) * 0.02
          for lin in linears(model)]
    xs = {k: torch.randn(rows, k, device=dev, dtype=torch.bfloat16) for k in {w.shape[1] for w in ws}}
    for w in ws:  # warm
        torch.nn.functional.linear(xs[w.shape[1]], w)
    times = []
    for _ in range(reps):
        _sync(dev)
        t = time.perf_counter()
        for w in ws:
            torch.nn.functional.linear(xs[w.shape[1]], w)
        _sync(dev)
        times.append((time.perf_counter() - t) * 1e3)
    del ws
    return statistics.median(times)


def measure(name: str, path: Path, *, device: str, steps: int, reps: int, bandwidth: float, n_new: int) -> dict:
    from tsspec.models import load_model

    t = time.perf_counter()
    model = load_model(path, device=device)
    load_s = time.perf_counter() - t
    wbytes = device_weight_bytes(model)
    row = dict(model=name, device=device, path_kind="triton" if model.triton else "cpu", load_s=load_s,
               weight_bytes=wbytes, hbm_limit_ms=wbytes / bandwidth * 1e3)
    row["decode_tok_s"] = decode_tok_s(model, steps)
    row["verify_ms"] = verify_curve(model, reps)
    row["spec"] = spec_equals_plain(model, _prompt(model.vocab_size, 24, seed=3), n_new)
    row["torch_bf16_ms"] = {r: torch_bf16_linear_ms(model, r, reps) for r in (1, 16)}
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------- the table


def format_table(rows: list[dict], bandwidth: float) -> str:
    """One table: per model shape, plain decode beside the bandwidth limit and torch's bf16 linears,
    the verify curve, and whether speculative output equals plain output."""
    head = (f"{'model':<20} {'weights':>8} {'HBM limit':>10} {'decode':>9} {'% limit':>7} "
            f"{'verify ms r=1':>13} {'r=16':>7} {'16/1':>5} {'bf16 F.linear r=1/16':>21} {'spec==plain':>12}")
    lines = [f"HBM bandwidth limit: device weight bytes per decode step / {bandwidth / 1e12:.1f} TB/s", head,
             "-" * len(head)]
    for r in rows:
        v = r["verify_ms"]
        limit_tok_s = 1e3 / r["hbm_limit_ms"]
        sp = r["spec"]
        lines.append(
            f"{r['model']:<20} {r['weight_bytes'] / 1e6:>6.0f}MB {limit_tok_s:>6.0f}tok/s {r['decode_tok_s']:>5.0f}tok/s "
            f"{100 * r['decode_tok_s'] / limit_tok_s:>6.1f}% {v[1]:>13.3f} {v[16]:>7.3f} {v[16] / v[1]:>5.2f} "
            f"{r['torch_bf16_ms'][1]:>9.3f}/{r['torch_bf16_ms'][16]:.3f} ms "
            f"{'yes' if sp['equal'] else 'NO':>4} ({sp['accepted']}/{sp['drafted']})")
    lines.append("")
    lines.append("verify curve, ms per forward for rows 1..16:")
    for r in rows:
        lines.append(f"  {r['model']:<20} " + " ".join(f"{r['verify_ms'][k]:.2f}" for k in VERIFY_ROWS))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="on the CPU: 2 layers per model, vocabulary cut to 1024, few steps (no GPU needed)")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--work-dir", type=Path, default=None, help="where the GGUF files are written (default: a temp dir)")
    ap.add_argument("--layers", type=int, default=None, help="layers per model (default: the real count)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary rows (default: the real count)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed (default 128; 4 in a dry run)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per verify row count (default 9; 1 dry)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens in the spec == plain check (default 96)")
    ap.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="HBM bytes/s (default H200's 4.8e12)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    for v, what in ((a.layers, "--layers"), (a.vocab, "--vocab"), (a.steps, "--steps"), (a.reps, "--reps"),
                    (a.new_tokens, "--new-tokens"), (a.bandwidth, "--bandwidth")):
        if v is not None and not v >= 1:
            print(f"error: {what} must be >= 1", file=sys.stderr)
            return 2
    if a.dry_run:
        device = "cpu"
        layers, vocab = a.layers or 2, a.vocab or 1024
        steps, reps, n_new = a.steps or 4, a.reps or 1, a.new_tokens or 24
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA GPU for torch here (use --dry-run to exercise the check on the CPU)", file=sys.stderr)
            return 2
        device = "cuda"
        layers, vocab = a.layers, a.vocab
        steps, reps, n_new = a.steps or 128, a.reps or 9, a.new_tokens or 96
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        work = a.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in a.models:
            t = time.perf_counter()
            path = write_model(name, work / f"{name}.gguf", layers=layers, vocab=vocab)
            print(f"{name}: wrote {path.stat().st_size / 1e6:.0f} MB in {time.perf_counter() - t:.1f}s; measuring",
                  file=sys.stderr, flush=True)
            rows.append(measure(name, path, device=device, steps=steps, reps=reps, bandwidth=a.bandwidth,
                                n_new=n_new))
            if a.work_dir is None:
                path.unlink()
    print(format_table(rows, a.bandwidth))
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["spec"]["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
