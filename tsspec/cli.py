"""The command line: parsing, option resolution and display. No model or loop logic lives here."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .display import error_line
from .env import process_age_s
from .errors import BadInput, TsspecError
from .paths import read_user_file
from .interrupts import StopRequest, exit_for, startup_done

app = typer.Typer(
    name="tsspec",
    help="Speculative decoding for GGUF language models: exact output, measured speed.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
err = Console(stderr=True)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn a TsspecError into one line on stderr and a non-zero exit; never a traceback."""
    try:
        yield
    except TsspecError as e:
        error_line(err, str(e))
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt as e:  # SIGTERM too (interrupts.Terminated): 143
        word, code = exit_for(e)
        err.print(f"[yellow]{word}[/]")
        raise typer.Exit(code) from None
    except MemoryError as e:  # torch's allocations, or the native kernels' scratch (kernels._check_rc)
        detail = f" ({e})" if str(e) else ""
        error_line(err, f"out of memory{detail}; a smaller --ctx-size or model needs less")
        raise typer.Exit(1) from None


def note(msg: str) -> None:
    """One ``note:`` line: text, not markup (a drafter's file name), not wrapped at the console width."""
    err.print(f"[dim]note: {escape(msg)}[/]", highlight=False, soft_wrap=True)


def warn(msg: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(msg)}", highlight=False, soft_wrap=True)


def utf8_text(text: str, what: str) -> str:
    """``text`` if it is valid Unicode; a prompt from argv, stdin or a file with bytes that are not
    UTF-8 (Python keeps them as lone surrogates) is refused here rather than inside the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadInput(f"{what} is not valid UTF-8 text (at character {e.start})") from None
    return text


# ----------------------------------------------------------------------------- loading


def resolve_command(run: "RunFlags"):
    """Flags and environment resolved once into the run's configuration (its warnings printed): the
    start of generate, chat and serve. What runs is published once the model has chosen its window
    (``start_speculation``)."""
    from .settings import resolve_run

    if run.spec is not None and run.mtp_spec is not None and run.spec != run.mtp_spec:
        raise BadInput("--spec and --mtp-spec disagree")
    spec = run.spec if run.spec is not None else run.mtp_spec
    flags = dict(enabled=spec, type=run.spec_type, draft=run.spec_draft, pmin=run.spec_pmin,
                 draft_model=run.spec_draft_model, accept=run.spec_accept, adaptive=run.spec_adaptive,
                 tree=run.spec_tree, block_drafter=run.draft_model)
    config = resolve_run(model=run.model, weights=run.weights, ctx_size=run.ctx_size, threads=run.threads,
                         speculation=flags, device=run.device, draft_weights=run.draft_weights)
    from .errors import ModelFileError
    from .paths import check_input_file, exists, is_file

    for flag, named in (("--spec-draft-model", run.spec_draft_model), ("--draft-model", run.draft_model)):
        # a FIFO, a device or a directory named on the command line is refused even where speculation
        # is off and it goes unused (a missing file is the drafter loader's, exit 3)
        if named is not None and exists(named) and not is_file(named):
            check_input_file(named, flag, error=ModelFileError)
    for w in config.warnings:
        warn(w)
    return config


def start_speculation(session, *, long_lived: bool = False):
    """The session's speculation, its notes said, and its settings as they run (the window after the
    model's preference: a hybrid trunk runs 3, a draft model 4) published under both families for
    child processes. ``long_lived``: a server's (``Session.speculation``)."""
    from .settings import publish_spec

    speculation = session.speculation(long_lived=long_lived)
    for n in speculation.notes:
        note(n)
    publish_spec(speculation.options)
    return speculation


def open_session(config, *, progress: bool = True, lean: bool = False):
    """The run's ``Session`` (the trunk loaded, threads applied), with this command line's spinner,
    download progress and warnings. ``lean``: see ``Session.open``."""
    from .session import Session

    def loading(path: Path):
        return err.status(f"loading {path.name}", spinner="dots") if progress else contextlib.nullcontext()

    session = Session.open(config, console=err, progress=progress, loading=loading, warn=warn, lean=lean)
    if config.device == "cpu":
        _notice_without_kernels(config.weights)
    return session


def _notice_without_kernels(weights: str) -> None:
    """One line when "auto" had to fall back to the slower pure-torch formats."""
    from . import kernels

    if weights == "auto" and not kernels.available():
        why = kernels.unavailable_reason()
        err.print(f"[yellow]note:[/] native kernels unavailable ({why}); using the pure-torch weight formats (slower)")


def prompt_encoder(g, tok, *, chat: bool, system: str | None, kwargs: dict, fits=None):
    """text -> token ids: plain, or rendered through the file's chat template (one BOS at most).

    ``fits`` (optional, ``(max_tokens, max_context)``): a text that cannot fit even at its fewest
    possible tokens is refused before it is tokenized (a 30 MB prompt would take minutes)."""
    from .chat import build_messages, encode_chat, render_chat
    from .generate import check_fits

    if chat and not tok.chat_template:
        raise BadInput(f"{g.path.name} has no chat template ({tok.chat_template_problem or 'tokenizer.chat_template'}); drop --chat")

    def encode(text: str) -> list[int]:
        if chat:
            bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
            eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
            text = render_chat(tok.chat_template, build_messages(text, system), bos_token=bos, eos_token=eos, **kwargs)
        if fits is not None:
            check_fits(tok.min_tokens(text), *fits, at_least=True)
        return encode_chat(tok, text) if chat else tok.encode(text)

    return encode


def startup_figures(load_ms: float, age_s: float | None, result) -> dict:
    """What a scripted run pays before its first token: the model's load, and the time from the
    process's start to this prompt's first token (its age when the prompt went in, plus the
    prefill; None where the process's start cannot be read)."""
    first = None if age_s is None or not result.token_ids else age_s * 1000.0 + result.stats.prefill_ms
    return {"load_ms": round(load_ms, 1), "first_token_ms": None if first is None else round(first, 1)}


def check_texts(system: str | None, stop: list[str]) -> None:
    """--system and every --stop are text; a --stop is not empty (it would match before any token)."""
    if system is not None:
        utf8_text(system, "--system")
    for x in stop:
        if not x:
            raise BadInput("--stop cannot be empty: it would end the reply before its first token")
        utf8_text(x, "--stop")


def read_prompt(prompt: str | None, file: Path | None) -> str:
    if prompt is not None and file is not None:
        raise BadInput("give the prompt with -p or -f, not both")
    if prompt is not None:
        return utf8_text(prompt, "the -p prompt")
    if file is not None:  # a BOM (Windows editors) is no prompt text: utf-8-sig drops it
        return read_user_file(file, "prompt file -f")
    if sys.stdin is not None and not sys.stdin.isatty():
        raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8", "surrogateescape")
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise BadInput(f"the prompt on stdin is not UTF-8 text (byte {e.start})") from None
        if text:
            return text
    raise BadInput("no prompt: give -p TEXT, -f FILE, --prompts FILE.jsonl, or pipe text on stdin")


def read_prompt_set(path: Path) -> list[tuple[str, str]]:
    lines = read_user_file(path, "--prompts file").splitlines()
    out = []
    seen: dict[str, int] = {}  # id -> its line: the results are keyed by id, as bench's prompts are
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"{path}:{i}: not JSON ({e.msg})") from None
        except RecursionError:
            raise BadInput(f"{path}:{i}: JSON nested too deeply") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise BadInput(f'{path}:{i}: expected an object with a "text" string')
        if not obj["text"]:  # refused here, before the lines above it are generated, and by its line
            raise BadInput(f"{path}:{i}: the text is empty")
        pid = obj.get("id")
        pid = i if pid is None else pid  # "id": null is no id (it was the id "None")
        # JSON escapes can spell lone surrogates ("\ud800"), which no tokenizer can encode
        pid = utf8_text(str(pid), f"{path}:{i}: the id")
        if pid in seen:
            raise BadInput(f"{path}:{i}: the id {pid!r} is line {seen[pid]}'s too (each result is keyed by its id)")
        seen[pid] = i
        out.append((pid, utf8_text(obj["text"], f"{path}:{i}: the text")))
    if not out:
        raise BadInput(f"{path}: no prompts")
    return out


# ----------------------------------------------------------------------------- commands

# options of every command that loads a model and may speculate (generate, chat, serve)
MODEL_OPTION = typer.Option(None, "-m", "--model", help="GGUF path or known model name (see `tsspec models`). Default: smollm2-135m, pulled on first use.")
TEMP_OPTION = typer.Option(0.0, "--temp", help="Temperature; 0 is greedy.")
TOP_K_OPTION = typer.Option(0, "--top-k", help="Keep the k most likely tokens; 0 is off.")
TOP_P_OPTION = typer.Option(1.0, "--top-p", help="Nucleus sampling mass; 1 is off.")
MIN_P_OPTION = typer.Option(0.0, "--min-p", help="Drop tokens below min-p x the top probability; 0 is off.")
REPEAT_PENALTY_OPTION = typer.Option(1.0, "--repeat-penalty", help="Penalty for recent tokens; 1 is off.")
TEMPLATE_KWARGS_OPTION = typer.Option(None, "--chat-template-kwargs", help='JSON object passed to the chat template, e.g. \'{"enable_thinking": false}\'.')
CTX_OPTION = typer.Option(None, "-c", "--ctx-size", help="Context length (default 4096, capped at the model's).")
THREADS_OPTION = typer.Option(None, "-t", "--threads", help="CPU threads (default: torch's choice, all cores).")
WEIGHTS_OPTION = typer.Option(None, "--weights", help="In-memory weight format: auto (default: the file's own GGUF blocks on the native kernels; pure torch without a C compiler), bf16, f32 (plain reference) or int4 (lossy for non-Q4 tensors). Env: TSSPEC_WEIGHTS.")
DRAFT_WEIGHTS_OPTION = typer.Option(None, "--draft-weights", help="In-memory format of every drafter's own matrices (a draft model, a draft head, a block drafter; what a head borrows from the trunk stays the trunk's): auto, bf16, f32 or int4 (lossy requantization, smaller). Default: the trunk's format. Env: TSSPEC_DRAFT_WEIGHTS.")
DEVICE_OPTION = typer.Option(None, "--device", help="auto (default: cuda when torch sees a GPU and triton is installed, else cpu), cpu, or cuda (the Triton kernels over the file's own GGUF blocks; needs --weights auto). Env: TSSPEC_DEVICE.")
SPEC_OPTION = typer.Option(None, "--spec/--no-spec", help="Enable/disable speculative decoding (default off; env TS_SPEC_SPEC / TS_MTP_SPEC).")
MTP_SPEC_OPTION = typer.Option(None, "--mtp-spec/--no-mtp-spec", help="Legacy spelling of --spec/--no-spec.")
SPEC_TYPE_OPTION = typer.Option(None, "--spec-type", help="auto (default) | draft-head | block | ngram | draft-model | suffix | cascade. suffix: n-gram over this sequence and the engine's earlier ones (a chat, a prompts file, a server's lifetime). cascade: n-gram first, the model drafter where n-gram has nothing; a comma list (ngram,draft-model) is a cascade of those, asked in that order. Env TS_SPEC_TYPE.")
SPEC_TREE_OPTION = typer.Option(None, "--spec-tree", "--mtp-tree", help="Token trees: verify up to N drafted nodes per step as one tree (several guesses at once, output unchanged), 0-64, default 0 (chains). n-gram builds them from its continuations; a draft model, head or block drafter adds its second guesses beside its chain; a recurrent (hybrid) trunk keeps chains. Env TS_SPEC_TREE / TS_MTP_TREE.")
SPEC_DRAFT_OPTION = typer.Option(None, "--spec-draft", "--mtp-draft", help="Max tokens drafted per step, 1-64 (default 8; a model may prefer fewer). Env TS_SPEC_DRAFT / TS_MTP_DRAFT.")
SPEC_PMIN_OPTION = typer.Option(None, "--spec-pmin", "--mtp-pmin", help="Confidence gate in [0,1] (default per algorithm: 0.75 draft head, 0.35 block, 0 n-gram). Env TS_SPEC_PMIN.")
SPEC_DRAFT_MODEL_OPTION = typer.Option(None, "--spec-draft-model", "--mtp-draft-model", help="Separate drafter GGUF (draft head or language model). Env TS_SPEC_DRAFT_MODEL.")
DRAFT_MODEL_OPTION = typer.Option(None, "--draft-model", help="Drafter GGUF or known model name (a language model, or a dflash block drafter); implies --spec.")
SPEC_ACCEPT_OPTION = typer.Option(None, "--spec-accept", help="Verification rule: auto (speculator's default) | match (identical to plain) | residual (lossless in distribution). Env TS_SPEC_ACCEPT.")
SPEC_ADAPTIVE_OPTION = typer.Option(None, "--spec-adaptive/--no-spec-adaptive", help="Cost governor that parks drafting while it loses (default on; env TS_SPEC_ADAPTIVE=0 turns it off).")


@dataclass(frozen=True)
class RunFlags:
    """The model and speculation options that generate, chat and serve share, as given (None: not
    given; the environment and defaults are ``settings.resolve_run``'s). Declared once, here and in
    ``RUN_FLAG_OPTIONS``; ``run_flags`` puts them on a command."""

    model: Optional[str] = None
    ctx_size: Optional[int] = None
    threads: Optional[int] = None
    weights: Optional[str] = None
    draft_weights: Optional[str] = None
    device: Optional[str] = None
    spec: Optional[bool] = None
    mtp_spec: Optional[bool] = None
    spec_type: Optional[str] = None
    spec_draft: Optional[int] = None
    spec_tree: Optional[int] = None
    spec_pmin: Optional[float] = None
    spec_draft_model: Optional[str] = None
    draft_model: Optional[str] = None
    spec_accept: Optional[str] = None
    spec_adaptive: Optional[bool] = None


# RunFlags' field -> (its type, its typer option), in the order --help lists them
RUN_FLAG_OPTIONS = {
    "model": (Optional[str], MODEL_OPTION), "ctx_size": (Optional[int], CTX_OPTION),
    "threads": (Optional[int], THREADS_OPTION), "weights": (Optional[str], WEIGHTS_OPTION),
    "draft_weights": (Optional[str], DRAFT_WEIGHTS_OPTION), "device": (Optional[str], DEVICE_OPTION),
    "spec": (Optional[bool], SPEC_OPTION), "mtp_spec": (Optional[bool], MTP_SPEC_OPTION),
    "spec_type": (Optional[str], SPEC_TYPE_OPTION), "spec_draft": (Optional[int], SPEC_DRAFT_OPTION),
    "spec_tree": (Optional[int], SPEC_TREE_OPTION), "spec_pmin": (Optional[float], SPEC_PMIN_OPTION),
    "spec_draft_model": (Optional[str], SPEC_DRAFT_MODEL_OPTION), "draft_model": (Optional[str], DRAFT_MODEL_OPTION),
    "spec_accept": (Optional[str], SPEC_ACCEPT_OPTION), "spec_adaptive": (Optional[bool], SPEC_ADAPTIVE_OPTION),
}
RUN_FLAGS = RunFlags()  # the ``common`` parameter's placeholder default; run_flags replaces it


def run_flags(fn):
    """A command whose ``common: RunFlags`` parameter stands for ``RUN_FLAG_OPTIONS``: typer sees
    those options in its place (the signature is rewritten), and the command gets them as one
    RunFlags."""
    sig = inspect.signature(fn)
    params = []
    for p in sig.parameters.values():
        if p.name != "common":
            params.append(p)
            continue
        params += [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=opt, annotation=ann)
                   for name, (ann, opt) in RUN_FLAG_OPTIONS.items()]

    @functools.wraps(fn)
    def command(*args, **kwargs):
        common = RunFlags(**{name: kwargs.pop(name) for name in RUN_FLAG_OPTIONS})
        return fn(*args, common=common, **kwargs)

    command.__signature__ = sig.replace(parameters=params)
    command.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k != "common"}
    return command



@app.command()
@run_flags
def generate(
    common: RunFlags = RUN_FLAGS,  # -m/--model and the speculation options (run_flags)
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Prompt text."),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="Read the prompt from a file."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help='JSONL file, one {"id", "text"} per line: many prompts, model loaded once.'),
    max_tokens: int = typer.Option(128, "-n", "--max-tokens", help="Tokens to generate at most."),
    temp: float = TEMP_OPTION,
    top_k: int = TOP_K_OPTION,
    top_p: float = TOP_P_OPTION,
    min_p: float = MIN_P_OPTION,
    repeat_penalty: float = REPEAT_PENALTY_OPTION,
    repeat_last_n: int = typer.Option(64, "--repeat-last-n", help="How many recent tokens the penalties look at."),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help="Subtracted once from any recent token's logit."),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help="Subtracted per occurrence of a recent token."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed; each position's draw depends only on (seed, position, logits)."),
    stop: List[str] = typer.Option([], "--stop", help="Stop when this text appears (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep going past end-of-sequence tokens."),
    chat: bool = typer.Option(False, "--chat", help="Render the prompt with the model's chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System message for --chat."),
    chat_template_kwargs: Optional[str] = TEMPLATE_KWARGS_OPTION,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (text, ids, counters, timings) at the end instead of streaming."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Plain text only: no live panel, no summary."),
):
    """Generate text from a prompt, optionally with speculative decoding."""
    from .chat import parse_template_kwargs
    from .display import LiveSink, TextSink, summary_line
    from .models.lean import declines
    from .sampling_params import SamplingParams
    with user_errors():
        if max_tokens < 1:
            raise BadInput("--max-tokens must be >= 1")
        params = SamplingParams(
            temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repeat_last_n=repeat_last_n, seed=seed,
        ).validate()
        config = resolve_command(common)
        kwargs = parse_template_kwargs(chat_template_kwargs) if chat_template_kwargs else {}
        if (system or kwargs) and not chat:
            warn("--system and --chat-template-kwargs only apply with --chat")
        if prompts is not None and (prompt is not None or file is not None):
            raise BadInput(f"give the prompts with --prompts or {'-p' if prompt is not None else '-f'}, not both")
        items = read_prompt_set(prompts) if prompts is not None else [(None, read_prompt(prompt, file))]
        check_texts(system, stop)
        t_load = time.perf_counter()
        # a plain greedy run loads a llama-family trunk without torch where it can (models.lean)
        session = open_session(config, progress=not (json_out or quiet), lean=declines(config, params) is None)
        load_ms = (time.perf_counter() - t_load) * 1000.0
        sampler = session.sampler(params)
        speculation = start_speculation(session)
        engine = session.engine(speculation)
        speculator, governor = speculation.plan.speculator, speculation.plan.governor

        encode = prompt_encoder(session.gguf, session.tokenizer, chat=chat, system=system, kwargs=kwargs,
                                fits=(max_tokens, session.target.max_context))

        interactive = sys.stdout.isatty() and not quiet and not json_out
        startup_done()  # from here a Ctrl-C stops the run and keeps what it printed (user_errors)
        for pid, text in items:
            ids = encode(text)
            age = process_age_s()  # when this prompt went in: its first token comes one prefill later
            if json_out:  # a first SIGINT/SIGTERM ends the run at the next token: its object is still printed
                with StopRequest() as halt:
                    result = engine.generate(ids, sampler=sampler, max_tokens=max_tokens, stop=stop,
                                             ignore_eos=ignore_eos, interrupted=halt.is_set)
                obj = {**result.to_dict(), **startup_figures(load_ms, age, result)}
                if pid is not None:
                    obj = {"id": pid, **obj}
                print(json.dumps(obj), flush=True)
                halt.raise_if_requested()
                continue
            if pid is not None and not quiet:
                print(f"### {pid}", flush=True)
            sink = LiveSink(Console(), governor, title=speculator.name if speculator else "plain") if interactive else TextSink()
            with sink:
                result = engine.generate(ids, sampler=sampler, max_tokens=max_tokens, stop=stop,
                                         ignore_eos=ignore_eos, on_text=sink.text, on_step=sink.step)
                sink.finish()
            if not quiet:
                err.print(summary_line(result, **startup_figures(load_ms, age, result)), highlight=False)


@app.command()
@run_flags
def chat(
    common: RunFlags = RUN_FLAGS,  # -m/--model and the speculation options (run_flags)
    system: Optional[str] = typer.Option(None, "--system", help="System message (change it later with /system)."),
    max_tokens: int = typer.Option(512, "-n", "--max-tokens", help="Tokens per reply at most."),
    temp: float = TEMP_OPTION,
    top_k: int = TOP_K_OPTION,
    top_p: float = TOP_P_OPTION,
    min_p: float = MIN_P_OPTION,
    repeat_penalty: float = REPEAT_PENALTY_OPTION,
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    stop: List[str] = typer.Option([], "--stop", help="End a reply when this text appears (repeatable)."),
    chat_template_kwargs: Optional[str] = TEMPLATE_KWARGS_OPTION,
):
    """Talk to a model, keeping its cache from turn to turn.

    Each turn renders the conversation with the model's chat template and forwards only the tokens
    the kept cache does not hold; speculation arms from the second turn where the speculator can
    (n-gram, block drafters, a draft model). Lines starting with / are commands (/help)."""
    from .chat import parse_template_kwargs
    from .conversation import Conversation
    from .repl import run
    from .sampling import Sampler, SamplingParams
    with user_errors():
        if max_tokens < 1:
            raise BadInput("--max-tokens must be >= 1")
        sampler = Sampler(SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                         repeat_penalty=repeat_penalty, seed=seed))
        config = resolve_command(common)
        kwargs = parse_template_kwargs(chat_template_kwargs) if chat_template_kwargs else {}
        check_texts(system, stop)
        interactive = sys.stdin.isatty() and sys.stdout.isatty()
        session = open_session(config, progress=interactive)
        speculation = start_speculation(session)
        conv = Conversation(session.engine(speculation), system=system, template_kwargs=kwargs)
        startup_done()  # from here Ctrl-C stops a reply (repl) or, at the prompt, leaves with 130
        code = run(conv, sampler=sampler, max_tokens=max_tokens, stop=stop, err=err, interactive=interactive)
    raise typer.Exit(code)


@app.command()
@run_flags
def serve(
    common: RunFlags = RUN_FLAGS,  # -m/--model and the speculation options (run_flags)
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8080, "--port", help="TCP port."),
    slots: int = typer.Option(4, "--slots", help="Kept caches in the prefix cache (memory: one context's KV each)."),
    parallel: int = typer.Option(4, "--parallel", help="Requests decoded together, their rows sharing each forward "
                                 "(memory: one context's KV each)."),
    queue: int = typer.Option(64, "--queue", help="Requests that may wait for a place; beyond this a request is "
                              "answered 503 at once."),
    max_tokens: int = typer.Option(256, "-n", "--max-tokens", help="Default max_tokens of a request that gives none (capped at the room its prompt leaves in the context)."),
    chat_template_kwargs: Optional[str] = TEMPLATE_KWARGS_OPTION,
):
    """An OpenAI-compatible HTTP server over one loaded model, with a prefix cache across requests.

    Endpoints: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics."""
    from .chat import parse_template_kwargs
    from .server import Server, create_app
    with user_errors():
        if not 0 < port < 65536:
            raise BadInput("--port must be in 1..65535")
        if slots < 1:
            raise BadInput("--slots must be >= 1")
        if parallel < 1:
            raise BadInput("--parallel must be >= 1")
        if queue < 0:
            raise BadInput("--queue must be >= 0")
        _check_bind(host, port)  # before minutes of loading, not after
        if max_tokens < 1:
            raise BadInput("--max-tokens must be >= 1")
        config = resolve_command(common)
        kwargs = parse_template_kwargs(chat_template_kwargs) if chat_template_kwargs else {}
        session = open_session(config)
        speculation = start_speculation(session, long_lived=True)
        server = Server(session.engine(speculation), model_id=session.path.stem, slots=slots,
                        default_max_tokens=max_tokens, template_kwargs=kwargs, parallel=parallel, queue=queue)
        err.print(f"serving {session.path.name} on http://{host}:{port}/v1 "
                  f"({speculation.plan.speculator.name if speculation.plan.speculates else 'plain'}; Ctrl-C stops)",
                  markup=False, highlight=False, soft_wrap=True)
        if not _serve_until_stopped(server, create_app(server), host, port):
            raise BadInput(f"cannot listen on {host}:{port} (in use, or not an address of this machine)")


def _serve_until_stopped(server, app, host: str, port: int) -> bool:
    """HTTP (uvicorn) in a thread of its own; the scheduler, which runs the model, here on the main
    thread that loaded it (``Scheduler.run`` says why). Ctrl-C or SIGTERM stops both: requests still
    running or waiting are answered 503, then the HTTP side closes. -> False when uvicorn could not
    start (it could not bind)."""
    import signal
    import threading

    import uvicorn

    http = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))

    def serve_http() -> None:
        try:
            http.run()
        except SystemExit:  # uvicorn exits when it cannot bind
            pass
        finally:
            server.scheduler.stop()

    def on_term(signum, frame):
        raise KeyboardInterrupt

    t = threading.Thread(target=serve_http, name="tsspec-http", daemon=True)
    t.start()
    signal.signal(signal.SIGTERM, on_term)
    startup_done()  # Ctrl-C is a KeyboardInterrupt here from now on
    interrupted = False
    try:
        server.scheduler.run()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        server.scheduler.stop()
        http.should_exit = True
        t.join(30)
    return http.started or interrupted


def _check_bind(host: str, port: int) -> None:
    """Refuse an address the server could not listen on, with the reason, before claiming to serve
    (uvicorn would log its own multi-line error and exit)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(infos[0][4])
    except OSError as e:
        raise BadInput(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


@app.command()
def info(
    model: Optional[str] = typer.Argument(None, help="GGUF path or known model name (default smollm2-135m)."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Also show what an attached drafter enables."),
    load: bool = typer.Option(True, "--load/--no-load", help="Load the weights to report what each speculator would do."),
):
    """Describe a model: architecture, sizes, quant types, vocabulary, context, chat template, speculators.

    Of the speculation environment it reads what changes the report: the drafter (TS_SPEC_DRAFT_MODEL,
    TS_MTP_DRAFT_MODEL, TS_QWEN35_DFLASH; --draft-model wins) and the window (TS_SPEC_DRAFT,
    TS_MTP_DRAFT), for the rollback memory a hybrid trunk holds per sequence."""
    from rich.table import Table

    from .gguf_file import GGUFFile
    from .hub import resolve_model
    from .models import arch_module, validate_model
    from .tokenizer import Tokenizer

    out = Console()
    with user_errors():
        path = resolve_model(model, console=err)
        g = GGUFFile(path)
        mod = arch_module(g.arch, path.name)
        validate_model(g)  # a file whose metadata and tensors disagree is refused here, by name
        cfg = mod.config(g)
        tok = Tokenizer.from_metadata(g.metadata)
        t = Table(title=f"{path.name}", show_header=False)
        t.add_column(style="bold cyan")
        t.add_column()
        t.add_row("file", f"{path}  ({path.stat().st_size / 1e6:.1f} MB)")
        t.add_row("name", str(g.get("general.name", "-")))
        t.add_row("architecture", g.arch)
        t.add_row("layers", str(cfg.n_layers))
        t.add_row("hidden size", str(cfg.d_model))
        t.add_row("heads (q / kv)", f"{cfg.n_heads} / {cfg.n_kv_heads}, head dim {cfg.head_dim}")
        t.add_row("feed-forward", str(cfg.ffn_dim))
        t.add_row("vocabulary", f"{cfg.vocab_size} ({g.get('tokenizer.ggml.model')}, pre={g.get('tokenizer.ggml.pre', '-')})")
        t.add_row("context (trained)", str(cfg.train_ctx))
        t.add_row("quant types", ", ".join(f"{k} x{v}" for k, v in sorted(g.quant_types().items())))
        t.add_row("special tokens", f"bos={tok.bos_id} eos={sorted(tok.eos_ids)} add_bos={tok.add_bos}")
        t.add_row("chat template", "yes" if tok.chat_template else "no")
        from . import kernels

        t.add_row("products", escape(kernels.products_line()))
        out.print(t)
        if tok.chat_template_problem:
            warn(f"{tok.chat_template_problem}: it is not used (--chat and chat need a template)")
        if load:
            from .display import human_bytes
            from .options import SETTINGS
            from .session import Session
            from .settings import resolve_run

            flags = {**dict.fromkeys(SETTINGS), "block_drafter": draft_model}
            config = resolve_run(model=model, speculation=flags)
            for w in config.warnings:
                warn(w)
            session = Session.open(config, gguf=g, console=err, warn=warn,
                                   loading=lambda _path: err.status("loading weights", spinner="dots"))
            spec = session.for_this_trunk(config.spec)
            named = spec.draft_model  # --draft-model, else the environment's
            drafter = session.load_drafter(resolve_model(named, console=err)) if named else None
            s = Table(title="speculators", show_header=True)
            s.add_column("name")
            s.add_column("serves")
            s.add_column("why")
            for name, ok, why in session.explain(drafter):
                s.add_row(name, "[green]yes[/]" if ok else "[red]no[/]", why)
            out.print(s)
            out.print(f"auto would use: {' -> '.join(session.auto_order(drafter))} (first that serves)")
            window = session.with_preferred_window(spec).draft
            held = session.rollback_memory(window)
            if held:
                how = ("one copy of the recurrent state, TS_Q35_VERIFY_SNAPSHOTS=0" if not config.verify_snapshots
                       else f"at most: recurrent-state slots for {window + 1} verify rows; a run "
                            "reports what it held")
                out.print(f"rollback memory: {human_bytes(held)} per sequence at window {window} ({how})")


@app.command()
def pull(
    names: List[str] = typer.Argument(None, help="Known model names (see `tsspec models`)."),
    all_: bool = typer.Option(False, "--all", help="Pull every known model."),
    force: bool = typer.Option(False, "--force", help="Download again even if cached."),
):
    """Fetch known real GGUF models into the cache (~/.cache/tsspec/models, or $TSSPEC_CACHE)."""
    from .hub import KNOWN_MODELS, pull as do_pull

    with user_errors():
        startup_done()  # a download cleans up its partial file on Ctrl-C (tsspec.hub)
        todo = list(KNOWN_MODELS) if all_ else list(names or [])
        if not todo:
            raise BadInput("name a model to pull (see `tsspec models`) or pass --all")
        for n in todo:
            p = do_pull(n, force=force, console=err)
            err.print(f"{n}: {escape(str(p))}", soft_wrap=True)  # a path is text, not markup ('[/b]')


@app.command()
def distill(
    model: str = typer.Option("smollm2-135m", "-m", "--model", help="GGUF path or known model name: the trunk to train for."),
    out: Path = typer.Option(..., "-o", "--out", help="Where to write the drafter GGUF (a checkpoint OUT.ckpt sits beside it)."),
    kind: str = typer.Option("head", "--kind", help="head: a per-token draft head (EAGLE-shaped). block: a DFlash-style "
                             "block drafter (drafts --block-size - 1 tokens in one forward)."),
    corpus: Optional[List[Path]] = typer.Option(None, "--corpus", help="Text files or directories to train on "
                                                "(repeatable; default: Python's sources and the docs on this machine)."),
    tokens: int = typer.Option(200_000, "--tokens", help="Training tokens of corpus text the trunk is run over."),
    answers: int = typer.Option(60_000, "--answers", help="Reply tokens the trunk writes to prompts made from the "
                                "corpus, added to the training set (the text a head drafts in; 0: none)."),
    steps: int = typer.Option(6000, "--steps", help="Optimiser steps."),
    batch: int = typer.Option(128, "--batch", help="Positions per step."),
    lr: float = typer.Option(2e-3, "--lr", help="Peak learning rate (warmup, then cosine to a tenth)."),
    unroll: int = typer.Option(3, "--unroll", help="Chained head steps trained per position (as drafting chains them)."),
    draft_vocab: int = typer.Option(8192, "--draft-vocab", help="Tokens the head scores (the trunk's most predicted)."),
    block_size: int = typer.Option(5, "--block-size", help="--kind block: the anchor and this many minus one drafts per forward."),
    layers: int = typer.Option(1, "--layers", help="--kind block: the drafter's transformer layers."),
    taps: int = typer.Option(4, "--taps", help="--kind block: trunk layers whose residual it reads (spread over the trunk)."),
    seed: int = typer.Option(0, "--seed", help="Seed for the corpus order, the initial weights and every batch."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    precision: str = typer.Option("auto", "--precision", help="The training forward's products: f32, bf16, or auto "
                                  "(bf16 where the device has it natively: AVX512_BF16 CPUs, CUDA)."),
    weights: str = typer.Option("q8_0", "--weights", help="Matrix format in the written file: q8_0 or f32."),
    eval_every: int = typer.Option(200, "--eval-every", help="Steps between held-out measurements (and checkpoints)."),
):
    """Train a drafter for a model on this machine, from the model's own predictions.

    The trunk is run over a corpus and the drafter learns to predict its next tokens (its soft
    distribution, so acceptance is what improves): a per-token head from the trunk's last row, or
    (--kind block) a block drafter from the rows entering a few layers. The output loads with
    `tsspec generate -m MODEL --spec --spec-draft-model OUT`. Ctrl-C saves a checkpoint; run the same
    command again to continue."""
    from .distill.train import DistillConfig, check_output_files, distill as run_distill
    from .hub import resolve_model

    with user_errors():
        check_output_files(out)  # before a pull or the trunk's load
        path = resolve_model(model, console=err)
        cfg = DistillConfig(model=str(path), out=str(out), kind=kind, corpus=tuple(str(c) for c in corpus or ()),
                            tokens=tokens, answers=answers, steps=steps, batch=batch, lr=lr, unroll=unroll, draft_vocab=draft_vocab,
                            block_size=block_size, layers=layers, taps=taps, seed=seed, device=device, precision=precision, weights=weights,
                            eval_every=eval_every)
        cfg.check()
        startup_done()  # Ctrl-C from here saves a checkpoint (inside distill) and exits 130
        from .display import DistillProgress

        with DistillProgress(err) as view:
            try:
                result = run_distill(cfg, view.event)
            except KeyboardInterrupt as e:  # SIGTERM too: the checkpoint is saved either way
                view.stop()
                word, code = exit_for(e)
                err.print(f"[yellow]{word}[/]: checkpoint saved to {escape(str(out))}.ckpt; run the same command to continue")
                raise typer.Exit(code) from None
        h = result.heldout
        err.print(f"wrote {escape(str(result.out))}: {result.steps} steps ({result.precision}) on {result.train_tokens} tokens in "
                  f"{result.seconds / 60:.1f} min; "
                  f"draft vocabulary {result.draft_vocab} covers {result.coverage:.1%} of the trunk's held-out greedy tokens")
        n = len(h["accept"])
        err.print(f"held-out acceptance (greedy path, {h['anchors']} positions): first token {h['first']:.1%}, "
                  f"run of 1..{n}: {', '.join(f'{a:.1%}' for a in h['accept'])}; "
                  f"expected tokens per verify with {n} drafts {h['tokens_per_verify']:.2f}")
        err.print(f"use it: tsspec generate -m {escape(str(model))} --spec --spec-draft-model {escape(str(result.out))} -p ...")


@app.command("export-hf")
def export_hf(
    drafter: Path = typer.Argument(..., help="A dflash block drafter GGUF (e.g. from `tsspec distill --kind block`)."),
    out: Path = typer.Option(..., "-o", "--out", help="Directory to write config.json and model.safetensors into."),
    dtype: str = typer.Option("float32", "--dtype", help="Weight type in model.safetensors: float32 (exact) or bfloat16."),
):
    """Write a DFlash block drafter in the Hugging Face layout of the z-lab DFlash reference.

    OUT gets config.json (DFlashDraftModel, dflash_config with target_layer_ids, block_size and
    mask_token_id) and model.safetensors (fc, hidden_norm, layers.N.*, norm), the layout vLLM,
    SGLang and the reference's transformers code load as a DFlash draft model. The drafter borrows
    the target's embedding and LM head there, so the file's draft-vocabulary rows are not written.
    DFlash2 files are refused (that layout has no place for their convolutions and selector)."""
    from .distill.export_hf import export_block_hf

    with user_errors():
        written = export_block_hf(drafter, out, dtype=dtype)
        err.print(f"wrote {escape(str(written / 'config.json'))} and {escape(str(written / 'model.safetensors'))} (DFlash reference layout, {dtype})",
                  highlight=False, soft_wrap=True)


@app.command()
def models():
    """List the known real models and whether each is cached."""
    from rich.table import Table

    from .hub import KNOWN_MODELS, is_cached

    with user_errors():
        t = Table(title="known models")
        for col in ("name", "model", "size", "cached"):
            t.add_column(col)
        for name, m in KNOWN_MODELS.items():
            t.add_row(name, m.description, f"{m.size / 1e6:.0f} MB", "yes" if is_cached(name) else "no")
        Console().print(t)

@app.command()
def bench(
    model: Optional[str] = typer.Option(None, "-m", "--model", help="GGUF path or known model name (default smollm2-135m)."),
    config: List[str] = typer.Option([], "--config", help="NAME=SPEC or SPEC, e.g. ngram, ngram:draft=4, draft-model:path=X.gguf,draft=3,pmin=0.5 (repeatable)."),
    config_file: Optional[Path] = typer.Option(None, "--config-file", help="TOML file with \\[configs.NAME] tables."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="Config name or spec every ratio is taken against (default plain)."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", "--spec-draft-model", "--mtp-draft-model", help="Drafter for configs that need one and name none (also spelled as generate's --spec-draft-model and its legacy --mtp-draft-model)."),
    workload: List[str] = typer.Option([], "-w", "--workload", help="Built-in workload (prose, factual, code, grounded; agent and code-edit only when named: agent's requests run in order, for what a speculator carries between them; code-edit quotes a file and writes new code in it) or a prompts file (text or JSONL); repeatable. Default: the first four."),
    max_tokens: int = typer.Option(64, "-n", "--max-tokens", help="Tokens generated per run (every run generates exactly this many unless --stop-at-eos)."),
    reps: int = typer.Option(5, "--reps", help="Repetitions; configurations alternate inside each, order rotating."),
    warmup: int = typer.Option(1, "--warmup", help="Unrecorded warm-up runs per configuration."),
    stop_at_eos: bool = typer.Option(False, "--stop-at-eos", help="End runs at end-of-sequence (token counts then differ by prompt)."),
    keep_cache: bool = typer.Option(False, "--keep-cache", help="Each configuration keeps its last run's prompt in its cache, and a run forwards only what its prompt does not share with it (an agent workload's instruction once), as a server or a chat does; a prompt run again reuses only what its first run did. Default: every run starts from an empty cache."),
    chat: bool = typer.Option(False, "--chat", help="Render prompts with the model's chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System message for --chat."),
    chat_template_kwargs: Optional[str] = typer.Option(None, "--chat-template-kwargs", help='JSON object for the chat template, e.g. \'{"enable_thinking": false}\'.'),
    temp: float = typer.Option(0.0, "--temp", help="Temperature (0: greedy, and every config's text must equal the baseline's)."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", help="CPU threads."),
    weights: Optional[str] = typer.Option(None, "--weights", help="auto (default), bf16, f32 or int4; see generate --help."),
    draft_weights: Optional[str] = typer.Option(None, "--draft-weights", help="Every drafter's own format (default: the trunk's); see generate --help."),
    device: Optional[str] = typer.Option(None, "--device", help="auto (default), cpu or cuda; see generate --help."),
    ctx_size: Optional[int] = typer.Option(None, "-c", "--ctx-size", help="Context length (default 4096)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the full result as JSON to this file ('-' for stdout)."),
    csv_out: Optional[Path] = typer.Option(None, "--csv", help="Write one row per workload x config to this CSV file."),
    plot_out: Optional[Path] = typer.Option(None, "--plot", help="Draw ratios with their intervals to this PNG (needs tsspec\\[plot])."),
    peer: Optional[str] = typer.Option(None, "--peer", help="Run another engine beside tsspec in the same rotation: llama.cpp (starts llama-server from the peer build, one per --peer-spec mode)."),
    peer_spec: List[str] = typer.Option([], "--peer-spec", help="llama.cpp modes besides its plain decoding: ngram-simple, ngram-mod, ngram-map-k, ngram-cache, draft (-md with --draft-model); repeatable. Default: ngram-simple and ngram-mod."),
    llama_bin: Optional[Path] = typer.Option(None, "--llama-bin", help="Directory with llama-server (default: where ../shared/tools/build_llamacpp.sh puts it, or $LLAMA_CPP_DIR/build/bin)."),
):
    """Paired speed comparison of configurations against a baseline, on this machine.

    Every configuration runs the same prompts and token counts, alternated inside each repetition
    with the order rotating, so slow drifts of a shared machine hit all of them alike; ratios are
    taken pair by pair with a bootstrap confidence interval, and the baseline run against itself
    gives the noise floor, so a verdict says "within noise" unless the interval clears it.
    """
    from .bench import report
    from .bench.plan import plan_bench
    from .settings import resolve_run

    with user_errors():
        if keep_cache and peer:
            raise BadInput("--keep-cache keeps tsspec's caches only: run --peer without it (llama-server's "
                           "prompt cache would reuse a prompt's own earlier run)")
        plan = plan_bench(config=config, config_file=config_file, baseline=baseline, draft_model=draft_model,
                          workload=workload, max_tokens=max_tokens, reps=reps, warmup=warmup, temp=temp, seed=seed,
                          chat_template_kwargs=chat_template_kwargs, plot=plot_out is not None,
                          outputs={"--json": json_out, "--csv": csv_out, "--plot": plot_out},
                          peer=peer, peer_spec=peer_spec, llama_bin=llama_bin)
        config = resolve_run(model=model, weights=weights, ctx_size=ctx_size, threads=threads, device=device,
                             draft_weights=draft_weights)
        from .settings import speculation_variables

        ignored = speculation_variables()
        if ignored:
            warn(f"bench reads no speculation variable (each --config says what it runs): {', '.join(ignored)} ignored")
        t_load = time.perf_counter()
        session = open_session(config)
        load_ms = (time.perf_counter() - t_load) * 1000.0
        g = session.gguf

        encode = prompt_encoder(g, session.tokenizer, chat=chat, system=system, kwargs=plan.template_kwargs)
        _bench_modules()
        startup_done()  # from here a Ctrl-C stops the peer servers on its way out (user_errors)
        with contextlib.ExitStack() as stack:
            peer_run = _start_peer(stack, plan, g.path, draft_model, ctx_size) if plan.peer_configs else None
            result = _run_bench_rows(
                session, plan, max_tokens=max_tokens, encode=encode, draft_model=draft_model,
                stop_at_eos=stop_at_eos, peer=peer_run, reps=reps, warmup=warmup, chat=chat, temp=temp,
                load_ms=load_ms, keep_cache=keep_cache,
            )
        report.render_table(result, Console())
        for name, why in (peer_run.fallback.items() if peer_run is not None else ()):
            err.print(f"note: {name}: {why} (its default crashed; every figure of it is from that server)")
        if json_out is not None and str(json_out) == "-":
            print(json.dumps(report.to_json(result), indent=2))
        report.save_outputs(result, json_path=None if json_out is None or str(json_out) == "-" else json_out.expanduser(),
                            csv_path=csv_out.expanduser() if csv_out else None, plot_path=plot_out.expanduser() if plot_out else None)
        if not result.ok:
            raise TsspecError("speculative output differed from the baseline: a correctness bug, see the table")


def _start_peer(stack: contextlib.ExitStack, plan, model_path: Path, draft_model: str | None, ctx_size: int | None):
    """The peer engine's servers for ``plan``, started; ``stack`` stops them."""
    from .bench import llama_server
    from .hub import resolve_model

    need_draft = any(c.algo == "draft" for c in plan.peer_configs)
    draft_path = resolve_model(draft_model, console=err) if need_draft else None
    with err.status(f"starting {len(plan.peer_configs)} llama-server(s)", spinner="dots"):
        return stack.enter_context(llama_server.Peer(plan.peer_configs, model_path, exe=plan.peer_exe,
                                                     threads=_threads(), ctx=ctx_size or 4096, draft_model=draft_path))


def _bench_modules() -> None:
    """Import what the bench's rotation needs while start-up still owns Ctrl-C (tsspec.interrupts)."""
    import rich.progress  # noqa: F401

    from .bench import engine, provenance, runner  # noqa: F401


def _run_bench_rows(session, plan, *, max_tokens, encode, draft_model, stop_at_eos, peer, reps, warmup, chat, temp,
                    load_ms, keep_cache=False):
    """The bench's rotation over every configuration of ``plan`` (a peer's included), with a progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .bench import provenance
    from .bench.engine import make_run_one
    from .bench.runner import file_sha256, run_bench

    sampler = plan.sampler
    run_one = make_run_one(
        session, sampler=sampler, max_tokens=max_tokens, encode=encode,
        default_draft_model=draft_model, ignore_eos=not stop_at_eos, peer=peer, keep_cache=keep_cache,
    )
    g, cfg = session.gguf, session.config
    # the formats from the resolved configuration (flag > environment > default), and what the
    # trunk's products actually run on (``auto`` resolves per tensor)
    extra = {"max_tokens": max_tokens, "threads": _threads(), "weights_requested": cfg.weights,
             "weights": provenance.weight_formats(session.target), "draft_weights": cfg.draft_weights,
             "settings": cfg.provenance(), "chat": chat, "template_kwargs": plan.template_kwargs, "temperature": temp,
             "load_ms": round(load_ms, 1),  # the trunk's load and tokenizer, once for every configuration
             "keep_cache": keep_cache}
    if peer is not None:
        extra["peer"] = peer.provenance()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as prog:
        task = prog.add_task("bench", total=None)

        def progress(done: int, total: int, desc: str) -> None:
            prog.update(task, completed=done, total=total, description=desc)

        return run_bench(
            plan.configs + plan.peer_configs, plan.workloads, run_one=run_one, reps=reps, warmup=warmup,
            progress=progress, baseline=plan.baseline,
            check_identical=sampler.greedy, model_path=g.path, model_sha256=_model_sha(g.path, file_sha256),
            extra_metadata=extra,
        )


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _model_sha(path: Path, fallback) -> str:
    """The cached sidecar hash of a known model, else hash the file."""
    side = Path(str(path) + ".sha256")
    if side.exists():
        return side.read_text().split()[0]
    return fallback(path)


def reflow(doc: str) -> str:
    """A docstring with each paragraph on one line. Typer's rich help keeps a docstring's single line
    breaks, so in an 80-column terminal every source line of a long description wrapped once more
    and the text broke mid-sentence ("predict its next\ntokens (its soft\ndistribution")."""
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n"))


for _info in app.registered_commands:  # every command's help, reflowed to the terminal's width
    if _info.help is None and _info.callback is not None and _info.callback.__doc__:
        _info.help = reflow(_info.callback.__doc__)


def main(args: list[str] | None = None) -> None:
    """The ``tsspec`` command: Ctrl-C owned from the start (``tsspec.interrupts``), then ``sys.exit``
    with the status of :func:`run`."""
    from .interrupts import exiting, guard_startup

    guard_startup()  # the ``tsspec`` script imports this module first; ``python -m tsspec`` guards earlier
    from .display import guard_stdout

    guard_stdout()  # a stdout that refuses writes (/dev/full, a closed pipe, >&-): one error line
    try:
        sys.exit(run(args))
    finally:
        exiting()


def run(args: list[str] | None = None) -> int:
    """Run the command line on ``args`` (default ``sys.argv[1:]``) and return its exit status.

    Usage errors from the parser (an unknown option or command, a missing or badly typed value, an
    extra argument) are one ``error:`` line and exit 2, like every other bad input, instead of
    click's usage box; ``--help`` and a bare ``tsspec`` (the help, exit 2) are unchanged."""
    from .interrupts import EXIT_CODE, MESSAGE

    try:
        rv = app(args=args, standalone_mode=False)
    except Exception as e:  # noqa: BLE001 (only the parser's own exceptions are handled here)
        kinds = {c.__name__ for c in type(e).__mro__}  # click's classes, vendored by typer or not
        if "NoArgsIsHelpError" in kinds:  # the help is already printed
            return 2
        if "ClickException" in kinds:
            return _usage_error(e)
        if "Abort" in kinds:  # end of input, or an interrupt, inside the parser
            err.print(f"[yellow]{MESSAGE}[/]")
            return EXIT_CODE
        from .display import OutputError

        if isinstance(e, OutputError):  # the parser's own output (--help) into a closed pipe or a full disk
            error_line(err, str(e))
            return e.exit_code
        raise
    return rv if isinstance(rv, int) else 0


def _usage_error(e) -> int:
    """One line for a parser error, with where to find the help; its exit status (2 for usage)."""
    msg = " ".join(e.format_message().split())
    ctx = getattr(e, "ctx", None)
    if ctx is not None and "UsageError" in {c.__name__ for c in type(e).__mro__}:
        msg += f" (see '{ctx.command_path} --help')"
    error_line(err, msg)
    return e.exit_code


if __name__ == "__main__":
    main()
