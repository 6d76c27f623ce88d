"""One statistics record per run: the display, the governor's report and ``bench`` all read it."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

PHASES = ("draft", "verify", "accept", "rollback", "commit", "plain")


class _Phase:
    """``with stats.phase(name):`` adds the block's wall time to ``phase_ms[name]``."""

    __slots__ = ("stats", "name", "t0")

    def __init__(self, stats: "SpecStats", name: str):
        self.stats, self.name = stats, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.stats.add_phase(self.name, (time.perf_counter() - self.t0) * 1000.0)


def member_line(c: dict[str, int]) -> str:
    """One member's counts (``SpecStats.members``' entry, a cascade's ``member_stats``) as the summary and the live table print them. Pure."""
    return (f"won {c['won']} of {c['proposals']} asked, accepted {c['accepted']} of {c['drafted']} drafted"
            + (f", benched {c['benched']}" if c.get("benched") else "")
            + (f", gave way {c['deferred']}" if c.get("deferred") else ""))


@dataclass
class SpecStats:
    speculator: str | None = None
    window: int = 0
    prompt_tokens: int = 0
    generated: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    phase_ms: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    phase_calls: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PHASES})
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of those, accepted
    verify_calls: int = 0
    tree_verifies: int = 0  # of those, token trees (their drafted count is nodes, accepted the path's depth)
    tree_nodes: int = 0
    tree_depth: int = 0
    verify_emitted: int = 0  # tokens emitted by verify steps (accepted + corrected/bonus)
    plain_steps: int = 0
    accept_hist: list[int] = field(default_factory=list)  # index = accepted length of a verify
    # a cascade's members (``CascadeSpeculator.member_stats``): per member, proposals asked, steps
    # won, tokens drafted in them and accepted of those; empty for a single speculator
    members: dict[str, dict[str, int]] = field(default_factory=dict)
    governor_parks: int = 0
    governor_state: str = "off"
    rollback_bytes: int = 0  # what undoing a verify holds per sequence (a hybrid trunk's state copies)

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name)

    def add_phase(self, phase: str, ms: float) -> None:
        self.phase_ms[phase] += ms
        self.phase_calls[phase] += 1

    def record_verify(self, drafted: int, accepted: int) -> None:
        self.verify_calls += 1
        self.drafted += drafted
        self.accepted += accepted
        self.verify_emitted += accepted + 1
        if len(self.accept_hist) <= accepted:
            self.accept_hist.extend([0] * (accepted + 1 - len(self.accept_hist)))
        self.accept_hist[accepted] += 1

    def record_tree(self, nodes: int, depth: int) -> None:
        """A token tree's verify (after ``record_verify``): its nodes and the accepted path's depth."""
        self.tree_verifies += 1
        self.tree_nodes += nodes
        self.tree_depth += depth

    @property
    def nodes_per_tree(self) -> float | None:
        return self.tree_nodes / self.tree_verifies if self.tree_verifies else None

    @property
    def accepted_depth(self) -> float | None:
        """Mean accepted path depth per tree verify."""
        return self.tree_depth / self.tree_verifies if self.tree_verifies else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_verify(self) -> float | None:
        return self.verify_emitted / self.verify_calls if self.verify_calls else None

    @property
    def decode_tok_s(self) -> float:
        # the first token comes from the prefill forward; decode covers the rest
        n = max(self.generated - 1, 0)
        return n / (self.decode_ms / 1000) if self.decode_ms > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / (self.prefill_ms / 1000) if self.prefill_ms > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            tokens_per_verify=self.tokens_per_verify,
            nodes_per_tree=self.nodes_per_tree,
            accepted_depth=self.accepted_depth,
            decode_tok_s=self.decode_tok_s,
            prefill_tok_s=self.prefill_tok_s,
        )
        return d
