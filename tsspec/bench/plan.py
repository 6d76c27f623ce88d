"""What a ``tsspec bench`` run will do, checked before anything loads: the configurations and the
baseline, the workloads, the sampler, the output files, and the peer engine's configurations.

Every check here is of the command line and the files it names, so a mistake is one line at once
and not after the trunk has loaded or a long rotation has run (an output path that cannot be
written would lose the run's figures). ``plan_bench`` returns a ``BenchPlan``; the command then
opens the session and runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BadInput, TsspecError
from ..sampling import Sampler, SamplingParams
from . import llama_server
from .configs import BenchConfig, load_config_file, parse_configs
from .workloads import Workload, get_workload, known_workloads, load_workload, workload_names


@dataclass
class BenchPlan:
    configs: list[BenchConfig]
    baseline: str | None  # None: plain
    workloads: list[Workload]
    sampler: Sampler
    template_kwargs: dict = field(default_factory=dict)
    peer_configs: list[BenchConfig] = field(default_factory=list)  # the peer engine's modes (empty: no peer)
    peer_exe: Path | None = None  # its llama-server


def plan_bench(*, config: list[str], config_file: Path | None, baseline: str | None, draft_model: str | None,
               workload: list[str], max_tokens: int, reps: int, warmup: int, temp: float, seed: int,
               chat_template_kwargs: str | None, outputs: dict[str, Path | None], plot: bool,
               peer: str | None, peer_spec: list[str], llama_bin: Path | None) -> BenchPlan:
    """The checked plan, or ``BadInput`` naming the first problem. ``outputs``: flag -> the file it
    names ('-' for stdout is not a file); ``plot``: a plot is asked for (its extra must be installed)."""
    from ..chat import parse_template_kwargs
    from ..hub import check_model_spec
    from ..paths import check_output_file
    from . import report

    if max_tokens < 2:
        raise BadInput("--max-tokens must be >= 2 for a decode speed")
    if reps < 1 or warmup < 0:
        raise BadInput(f"--reps must be >= 1, got {reps}" if reps < 1 else f"--warmup must be >= 0, got {warmup}")
    configs = parse_configs(config)
    base = baseline
    if config_file is not None:
        cf = load_config_file(config_file)
        configs = list(cf.configs) + configs
        base = base or cf.baseline
    if not configs:
        configs = parse_configs(["ngram"])
    for c in configs:  # a drafter file that is not there: said before the trunk loads
        if c.draft_model is not None:
            try:
                check_model_spec(c.draft_model)
            except TsspecError as e:
                raise BadInput(f"config {c.name}: {e}") from None
    if draft_model is not None:
        try:
            check_model_spec(draft_model)
        except TsspecError as e:
            raise BadInput(f"--draft-model: {e}") from None
    for flag, out in outputs.items():
        if out is not None and str(out) != "-":
            check_output_file(out, f"{flag} {out}")
    if plot:
        report.check_plot()
    wls = [get_workload(w) if w.strip().lower() in known_workloads() else load_workload(Path(w))
           for w in workload or workload_names()]
    sampler = Sampler(SamplingParams(temperature=temp, seed=seed))
    kwargs = parse_template_kwargs(chat_template_kwargs) if chat_template_kwargs else {}
    plan = BenchPlan(configs, base, wls, sampler, kwargs)
    if peer is not None:
        if peer.strip().lower() != llama_server.ENGINE:
            raise BadInput(f"--peer {peer!r}: the peer engine is {llama_server.ENGINE}")
        if not sampler.greedy:
            raise BadInput("--peer compares greedy runs only (drop --temp)")
        plan.peer_configs = llama_server.peer_configs(peer_spec or llama_server.DEFAULT_PEER_MODES[1:], draft_model)
        if base in {c.name for c in plan.peer_configs}:  # its drift would be reported as our correctness bug
            raise BadInput(f"--baseline {base}: the baseline is one of tsspec's configurations; "
                           f"{llama_server.ENGINE}'s are judged against {llama_server.ENGINE}/plain")
        plan.peer_exe = llama_server.llama_tool("llama-server", llama_bin)
    elif peer_spec or llama_bin:
        raise BadInput("--peer-spec and --llama-bin go with --peer llama.cpp")
    return plan
