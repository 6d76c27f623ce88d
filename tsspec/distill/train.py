"""``tsspec distill``: teach a drafter the trunk's own behaviour, on this machine.

One run: read a corpus, run the frozen trunk over it teacher-forced (``features``), pick the draft
vocabulary, train the head (``head``), measure held-out acceptance as it goes, write the GGUF the
registry loads. The work is resumable: the trunk's features are cached by content, and a
checkpoint beside the output (``OUT.ckpt``) holds the head, the optimiser and the step; running
the same command again continues from it. Every batch is drawn from a generator seeded by
(seed, step), so a resumed run takes the same batches an uninterrupted one would.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..errors import BadInput
from . import corpus as corpus_mod
from .features import Features, collect, features_key
from .head import HeadModule, anchors, choose_draft_vocab, coverage, evaluate, export_gguf, loss_fn, make_batch

KINDS = ("head", "block")
PRECISIONS = ("auto", "f32", "bf16")
CHARS_PER_TOKEN = 3.0  # a generous guess: text read per wanted token (chunks are then cut to the budget)


@dataclass(frozen=True)
class DistillConfig:
    model: str
    out: str
    kind: str = "head"
    corpus: tuple[str, ...] = ()
    tokens: int = 200_000  # training tokens of corpus text the trunk is run over
    answers: int = 0  # reply tokens the trunk writes to prompts made from the corpus (added to the training set)
    answer_length: int = 192
    heldout_tokens: int = 16_384
    steps: int = 6000
    batch: int = 128
    lr: float = 2e-3
    unroll: int = 3
    chunk: int = 256
    top_k: int = 8
    draft_vocab: int = 8192
    ffn: int = 0  # 0: twice the hidden size
    block_size: int = 5  # --kind block: the anchor and block_size - 1 drafts per forward
    layers: int = 1  # --kind block: the drafter's transformer layers
    taps: int = 4  # --kind block: trunk layers whose entering residual it reads
    seed: int = 0
    device: str = "cpu"
    precision: str = "auto"  # the training forward's matrix products: f32, bf16 (autocast), auto (bf16 where native)
    weights: str = "q8_0"
    eval_every: int = 200

    def check(self) -> None:
        if self.kind not in KINDS:
            raise BadInput(f"--kind {self.kind!r}: choose head or block")
        if self.answers < 0:
            raise BadInput(f"--answers must be >= 0, got {self.answers}")
        for name, lo in (("tokens", 1024), ("answer_length", 8), ("steps", 1), ("batch", 1), ("unroll", 1), ("chunk", 16), ("top_k", 1),
                         ("draft_vocab", 16), ("heldout_tokens", 256), ("eval_every", 1)):
            if getattr(self, name) < lo:
                raise BadInput(f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(self, name)}")
        for name, lo, hi in (("block_size", 2, 32), ("layers", 1, 16), ("taps", 1, 16)):
            if not lo <= getattr(self, name) <= hi:
                raise BadInput(f"--{name.replace('_', '-')} must be in [{lo}, {hi}], got {getattr(self, name)}")
        if self.kind == "block" and self.block_size + 2 > self.chunk:
            raise BadInput(f"--block-size {self.block_size} needs chunks of at least {self.block_size + 2} tokens")
        if self.unroll >= self.chunk:
            raise BadInput(f"--unroll {self.unroll} must be smaller than --chunk {self.chunk}")
        if not (0 < self.lr < 1):
            raise BadInput(f"--lr must be in (0, 1), got {self.lr}")
        if self.weights not in ("q8_0", "f32"):
            raise BadInput(f"--weights {self.weights!r}: choose q8_0 or f32")
        if self.device not in ("cpu", "cuda"):
            raise BadInput(f"--device {self.device!r}: choose cpu or cuda")
        if self.precision not in PRECISIONS:
            raise BadInput(f"--precision {self.precision!r}: choose auto, f32 or bf16")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise BadInput("--device cuda: torch sees no CUDA device on this machine")
        self.check_out()

    def check_out(self) -> None:
        """The drafter (and its checkpoint ``OUT.ckpt``) must not be written over a model: ``-o`` naming
        the trunk replaced it with a 3 MB head after the whole run (the model cache lost its file)."""
        from ..errors import TsspecError
        from ..gguf_file import read_metadata
        from ..models import ARCHITECTURES

        check_output_files(self.out)
        for target in (Path(self.out), Path(f"{self.out}.ckpt")):
            if target.exists() and Path(self.model).exists() and os.path.samefile(target, self.model):
                raise BadInput(f"-o {self.out}: {target} is the trunk's own file; the drafter needs a file of its own")
        out = Path(self.out)
        if out.is_file():
            try:
                arch = read_metadata(out).get("general.architecture")
            except TsspecError:
                return  # not a readable GGUF: not a model this would destroy
            if arch in ARCHITECTURES:
                raise BadInput(f"-o {self.out}: is a {arch} model, not a drafter; writing the drafter there would "
                               f"replace it (give another file name)")

    def resumable_with(self, other: "DistillConfig") -> bool:
        """A checkpoint continues under a config that differs only in how long or how visibly it runs
        (``out`` is where the checkpoint was found, however it was spelled; the model path is
        compared resolved)."""
        skip = {"steps", "eval_every", "device", "out"}
        a, b = asdict(self), asdict(other)
        a["model"], b["model"] = (str(Path(x["model"]).resolve()) for x in (a, b))
        return all(a[k] == b[k] for k in a if k not in skip)


def output_files(out: str | Path) -> tuple[Path, ...]:
    """Every file a run writes: the drafter, its checkpoint ``OUT.ckpt``, and their partial files."""
    o = Path(out)
    return o, o.with_name(o.name + ".part"), Path(f"{o}.ckpt"), Path(f"{o}.ckpt.part")


def check_output_files(out: str | Path) -> None:
    """Refuse, before any work, an ``-o`` where one of the run's files could not be written or would
    replace something that is not a file (``-o /dev/full`` replaced the device, as root)."""
    from ..paths import check_output_file

    for p in output_files(out):
        check_output_file(p, f"-o {out}" if p == Path(out) else f"-o {out}: its file {p}")


@dataclass
class DistillResult:
    out: Path
    steps: int
    train_tokens: int
    heldout_tokens: int
    draft_vocab: int
    coverage: float
    heldout: dict
    curve: list = field(default_factory=list)  # (step, anchors seen, held-out first-token acceptance, tokens/verify)
    seconds: float = 0.0
    precision: str = "f32"


Events = Callable[..., None]  # events(kind, **data): "phase" (name, total), "advance" (n), "metrics" (...)


def _noop(kind: str, **data) -> None:
    pass


def native_bf16(device: str, cpu_flags: str | None = None) -> bool:
    """Whether ``device`` multiplies bfloat16 natively: a CUDA device that supports it, or a CPU
    with AVX512_BF16 (``cpu_flags``: /proc/cpuinfo's flags line, read when not given)."""
    if device == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if cpu_flags is None:
        from ..kernels import cpu_flags as read_flags

        cpu_flags = read_flags()
    return "avx512_bf16" in cpu_flags.split()


def resolve_precision(precision: str, device: str, cpu_flags: str | None = None) -> str:
    """``auto`` -> ``bf16`` where the device multiplies it natively, else ``f32``."""
    if precision != "auto":
        return precision
    return "bf16" if native_bf16(device, cpu_flags) else "f32"


def lr_at(step: int, steps: int, base: float, warmup: int = 100) -> float:
    """Linear warmup, then cosine down to a tenth."""
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def features_dir() -> Path:
    from ..hub import cache_dir

    return cache_dir().parent / "distill"


def _texts_to_chunks(tok, texts: Sequence[tuple[str, str]], chunk: int, budget: int) -> list[list[int]]:
    ids = [tok.encode(t, add_special=False, parse_special=False) for _, t in texts]
    chunks = corpus_mod.chunk_ids(ids, chunk)
    return chunks[: max(1, budget // chunk)]


def _features(model, chunks: list[list[int]], cfg: DistillConfig, model_id: str, label: str, events: Events,
              taps: tuple[int, ...] | None) -> Features:
    """The trunk's features over ``chunks``, from the content-keyed cache when it has them."""
    path = features_dir() / f"{features_key(model_id, chunks, cfg.top_k, taps)}.pt"
    feats = Features.load(path) if path.exists() else None  # None too for a damaged file: computed again
    width = model.hidden_size * (1 if taps is None else len(taps))
    if feats is not None and tuple(feats.tokens.shape) == (len(chunks), len(chunks[0])) \
            and feats.hidden.shape[-1] == width and feats.top_ids.shape[-1] == feats.top_p.shape[-1] == cfg.top_k:
        events("phase", name=f"trunk features ({label}, cached)", total=len(chunks) * cfg.chunk)
        events("advance", n=feats.n_tokens)
        return feats
    events("phase", name=f"trunk features ({label})", total=len(chunks) * cfg.chunk)
    feats = collect(model, chunks, cfg.top_k, progress=lambda n: events("advance", n=n), taps=taps)
    feats.save(path)
    return feats


def prepare_features(cfg: DistillConfig, model, tok, model_id: str, events: Events,
                     taps: tuple[int, ...] | None = None) -> tuple[Features, Features]:
    sources = corpus_mod.user_sources(cfg.corpus) if cfg.corpus else corpus_mod.default_sources()
    train_src, held_src = corpus_mod.split_sources(sources, 0.1)
    if not held_src:
        raise BadInput("the corpus has a single file; give at least two so one can be held out")
    out = []
    for name, src, budget in (("train", train_src, cfg.tokens), ("held-out", held_src, cfg.heldout_tokens)):
        texts = corpus_mod.sample_texts(src, int(budget * CHARS_PER_TOKEN), cfg.seed)
        chunks = _texts_to_chunks(tok, texts, cfg.chunk, budget)
        if not chunks:
            raise BadInput(f"the {name} corpus holds fewer than {cfg.chunk} tokens; give more text or a smaller --chunk")
        feats = [_features(model, chunks, cfg, model_id, name, events, taps)]
        want = cfg.answers if name == "train" else cfg.answers // 10
        if want:
            if not tok.chat_template:
                raise BadInput("--answers needs a model with a chat template (tokenizer.chat_template)")
            from .selfgen import answer, make_prompts, pack

            prompts = make_prompts(texts, 4 * want // 32 + 8, cfg.seed + (0 if name == "train" else 1))
            events("phase", name=f"trunk answers ({name})", total=want)
            convs = answer(model, tok, prompts, cfg.answer_length, want, features_dir(), model_id,
                           progress=lambda n: events("advance", n=n))
            answer_chunks = corpus_mod.chunk_ids([pack(convs)], cfg.chunk)
            if answer_chunks:
                feats.append(_features(model, answer_chunks, cfg, model_id, f"{name} answers", events, taps))
        out.append(Features.concat(feats))
    return out[0], out[1]


class _HeadTask:
    """--kind head: a per-token head (``tsspec-eagle``) chained ``unroll`` steps in training."""

    def __init__(self, cfg: DistillConfig, model, train: Features, held: Features, shared: dict):
        self.cfg, self.train, self.held, self.s = cfg, train, held, shared
        d = model.hidden_size
        self.module = HeadModule(d, cfg.ffn or 2 * d, float(model.cfg.rms_eps), model.out_norm, cfg.seed).to(shared["dev"])
        self.pool = anchors(train, cfg.unroll)

    def loss(self, gen: torch.Generator):
        idx = self.pool[torch.randint(len(self.pool), (self.cfg.batch,), generator=gen)]
        batch = make_batch(self.train, idx.to(self.s["dev"]), self.cfg.unroll)
        return loss_fn(self.module, self.s["embed"], self.s["lm_rows"], self.s["t2d"], batch)

    def evaluate(self) -> dict:
        return evaluate(self.module, self.s["embed"], self.s["lm_rows"], self.s["d2t"], self.held, steps=4, seed=self.cfg.seed)

    def export(self, g, trunk: dict, training: dict) -> None:
        export_gguf(Path(self.cfg.out), self.module, self.s["d2t_np"], trunk, {**training, "unroll": self.cfg.unroll},
                    weights=self.cfg.weights)


class _BlockTask:
    """--kind block: a DFlash-style block drafter over the trunk's tapped residuals."""

    def __init__(self, cfg: DistillConfig, model, train: Features, held: Features, shared: dict, taps: tuple[int, ...]):
        from .block import BlockModule, BlockShape, choose_mask_token

        self.cfg, self.train, self.held, self.s, self.taps = cfg, train, held, shared, taps
        d = model.hidden_size
        rope_base = float(model.cfg.layers[0].rope_base) if getattr(model.cfg, "layers", None) else 10000.0
        shape = BlockShape.for_trunk(d, len(taps), cfg.layers, cfg.ffn or 2 * d, cfg.block_size,
                                     float(model.cfg.rms_eps), rope_base)
        self.mask_token = choose_mask_token(train, shared["embed"])
        self.train_ctx = int(model.cfg.train_ctx)  # llama.cpp wants the drafter's context length
        self.module = BlockModule(shape, model.out_norm, cfg.seed).to(shared["dev"])

    def loss(self, gen: torch.Generator):
        from .block import block_loss, sample_block_batch

        batch = sample_block_batch(self.train, self.cfg.batch, self.cfg.block_size, gen)
        return block_loss(self.module, self.s["embed"], self.s["lm_rows"], self.s["t2d"], self.mask_token, batch)

    def evaluate(self) -> dict:
        from .block import evaluate_block

        return evaluate_block(self.module, self.s["embed"], self.s["lm_rows"], self.s["d2t"], self.mask_token, self.held,
                              seed=self.cfg.seed)

    def export(self, g, trunk: dict, training: dict) -> None:
        from ..drafters.eagle import stored_head_rows
        from .block import export_block_gguf

        export_block_gguf(Path(self.cfg.out), self.module, self.taps, self.mask_token, stored_head_rows(g, self.s["d2t_np"]),
                          self.s["d2t_np"], trunk, training,
                          trunk_file=g, context_length=self.train_ctx, weights=self.cfg.weights)


def distill(cfg: DistillConfig, events: Events = _noop) -> DistillResult:
    """Train a drafter for ``cfg.model`` and write it to ``cfg.out``."""
    from ..drafters.eagle import trunk_identity
    from ..gguf_file import GGUFFile
    from ..models import load_model
    from ..tokenizer import Tokenizer
    from .block import choose_taps

    cfg.check()
    ckpt = Path(str(cfg.out) + ".ckpt")
    state = read_checkpoint(ckpt, cfg)  # before the trunk's feature pass, not minutes after it
    precision = resolve_precision(cfg.precision, cfg.device)
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    g = GGUFFile(cfg.model)
    model = load_model(g)
    tok = Tokenizer.from_gguf(cfg.model)
    st = Path(cfg.model).stat()
    model_id = f"{Path(cfg.model).resolve()}|{st.st_size}|{int(st.st_mtime)}"
    taps = choose_taps(model.n_layers, cfg.taps) if cfg.kind == "block" else None
    train, held = prepare_features(cfg, model, tok, model_id, events, taps)

    d2t = choose_draft_vocab(train, cfg.draft_vocab, model.vocab_size)
    dev = torch.device(cfg.device)
    shared = _shared(g, model, d2t, dev)
    train_dev, held_dev = _to(train, dev), _to(held, dev)  # moved once, not per measurement
    task = (_BlockTask(cfg, model, train_dev, held_dev, shared, taps) if cfg.kind == "block"
            else _HeadTask(cfg, model, train_dev, held_dev, shared))
    module = task.module
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step, curve = _resume(module, opt, state, ckpt, events)

    def save_checkpoint() -> None:
        tmp = ckpt.with_name(ckpt.name + ".part")
        torch.save({"config": asdict(cfg), "head": module.state_dict(), "opt": opt.state_dict(), "step": step,
                    "curve": curve}, tmp)
        tmp.replace(ckpt)

    if step == 0:  # the untrained drafter: where the curve starts
        m = task.evaluate()
        curve.append((0, 0, m["first"], m["tokens_per_verify"]))
        events("metrics", step=0, **m)
    events("phase", name="training", total=cfg.steps, completed=step)
    bf16 = precision == "bf16"  # the training forward only: parameters, optimiser and held-out checks stay f32
    try:
        while step < cfg.steps:
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg.steps, cfg.lr)
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16):
                loss, parts = task.loss(gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            opt.step()
            step += 1
            events("advance", n=1, loss=float(loss.detach()), **parts)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                m = task.evaluate()
                curve.append((step, step * cfg.batch, m["first"], m["tokens_per_verify"]))
                events("metrics", step=step, **m)
                save_checkpoint()
    except KeyboardInterrupt:
        save_checkpoint()
        raise
    final = task.evaluate()
    cov = coverage(held, d2t)
    trunk = trunk_identity(g, model)
    trunk["name"] = str(g.get("general.name") or Path(cfg.model).stem)
    task.export(g, trunk, {
        "steps": step, "tokens": train.n_tokens, "seed": cfg.seed,
        "heldout_accept": float(final["first"]), "heldout_tokens_per_verify": float(final["tokens_per_verify"]),
        "corpus": "user" if cfg.corpus else "default", "precision": precision,
    })
    return DistillResult(Path(cfg.out), step, train.n_tokens, held.n_tokens, len(d2t), cov, final, curve,
                         time.perf_counter() - t_start, precision)


def _shared(g, model, d2t, dev: torch.device) -> dict:
    """What every drafter kind trains against, on ``dev``: the draft vocabulary both ways, the
    trunk's output rows for it and its token embedding (dense, read 8192 rows at a time)."""
    from ..drafters.eagle import dense_head_rows

    t2d = torch.full((model.vocab_size,), -1, dtype=torch.long)
    t2d[torch.as_tensor(d2t)] = torch.arange(len(d2t))
    return {
        "dev": dev, "d2t_np": d2t, "d2t": torch.as_tensor(d2t).to(dev), "t2d": t2d.to(dev),
        "lm_rows": dense_head_rows(g, d2t).to(dev),
        "embed": torch.cat([model.embed[list(range(i, min(i + 8192, model.vocab_size)))].float()
                            for i in range(0, model.vocab_size, 8192)]).to(dev),
    }


def _resume(module, opt, state: dict | None, ckpt: Path, events: Events) -> tuple[int, list]:
    """(step, curve) to continue from: the checkpoint's, loaded into ``module`` and ``opt``, or a start."""
    if state is None:
        return 0, []
    try:
        module.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise BadInput(f"{ckpt}: its weights do not fit this run ({str(e).splitlines()[0][:200]}); "
                       "delete it to start over") from None
    events("resumed", step=state["step"])
    return state["step"], state["curve"]


def read_checkpoint(ckpt: Path, cfg: DistillConfig) -> dict | None:
    """The checkpoint at ``ckpt`` if there is one and it continues ``cfg``; one line otherwise.

    Read with ``weights_only=True``: the file holds tensors and plain values only, so one planted
    beside the output cannot run code when it is unpickled, and a damaged one is refused, not a
    traceback."""
    if not ckpt.exists():
        return None
    try:
        with warnings.catch_warnings():  # torch's notes on a foreign pickle: the line below says it
            warnings.simplefilter("ignore")
            state = torch.load(ckpt, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ... on a bad file
        raise BadInput(f"{ckpt}: not a tsspec distill checkpoint ({type(e).__name__}); delete it to start over") from None
    try:
        if not (isinstance(state, dict) and isinstance(state.get("config"), dict)):
            raise TypeError("not a dict with a config")
        saved = DistillConfig(**state["config"])
        step, curve = state["step"], state["curve"]
        if not (isinstance(step, int) and 0 <= step and isinstance(curve, list)
                and isinstance(state.get("head"), dict) and isinstance(state.get("opt"), dict)):
            raise TypeError("step, curve, head or opt")
        same = saved.resumable_with(cfg)
    except (TypeError, KeyError, ValueError):
        raise BadInput(f"{ckpt}: not a tsspec distill checkpoint (its contents are not a run's); "
                       "delete it to start over") from None
    if not same:
        raise BadInput(f"{ckpt} holds a run with other settings; delete it to start over, or rerun with the same options")
    return state


def _to(f: Features, dev: torch.device) -> Features:
    if dev.type == "cpu":
        return f
    return Features(f.tokens.to(dev), f.hidden.to(dev), f.top_ids.to(dev), f.top_p.to(dev))
