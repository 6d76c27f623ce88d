"""``tsspec bench``, the engine-independent part: is configuration B faster than A, honestly?

Paired, interleaved, rotated runs (``runner``), a pair-by-pair ratio with a bootstrap CI and a
noise floor from the baseline against itself (``stats``), configuration specs (``configs``),
built-in prompt sets (``workloads``) and tables/JSON/CSV/plots (``report``). The engine enters
only through the caller's ``run_one(config, prompt) -> RunRecord``.
"""

from tsspec.bench.configs import (
    algos,
    BenchConfig,
    ConfigFile,
    load_config_file,
    parse_config,
    parse_configs,
    plain_config,
    resolve_configs,
)
from tsspec.bench.runner import (
    BenchResult,
    ConfigResult,
    Measurement,
    Mismatch,
    RunRecord,
    ScheduleEntry,
    WorkloadResult,
    aggregate_counters,
    rotation,
    run_bench,
)
from tsspec.bench.stats import Comparison, NoiseFloor, RatioSummary, Spread, compare
from tsspec.bench.workloads import (
    WORKLOADS,
    Prompt,
    Workload,
    get_workload,
    load_prompts,
    load_workload,
    workload_names,
)

__all__ = [
    "algos",
    "BenchConfig",
    "BenchResult",
    "Comparison",
    "ConfigFile",
    "ConfigResult",
    "Measurement",
    "Mismatch",
    "NoiseFloor",
    "Prompt",
    "RatioSummary",
    "RunRecord",
    "ScheduleEntry",
    "Spread",
    "WORKLOADS",
    "Workload",
    "WorkloadResult",
    "aggregate_counters",
    "compare",
    "get_workload",
    "load_config_file",
    "load_prompts",
    "load_workload",
    "parse_config",
    "parse_configs",
    "plain_config",
    "resolve_configs",
    "rotation",
    "run_bench",
    "workload_names",
]
