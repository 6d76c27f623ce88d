"""A run's sampling settings (``SamplingParams``), apart from the sampler (``tsspec.sampling``)
because nothing here needs torch: a command checks its flags before it loads anything, and a
greedy plain run (``tsspec.models.lean``) never builds a ``Sampler``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import BadInput


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repeat_penalty: float = 1.0  # 1: off (llama.cpp style: divide positive logits, multiply negative)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64  # penalty window over the most recent tokens
    seed: int = 0

    def validate(self) -> "SamplingParams":
        checks = [
            (0 <= self.temperature < math.inf, "--temp must be a finite number >= 0"),
            (self.top_k >= 0, "--top-k must be >= 0"),
            (0 < self.top_p <= 1, "--top-p must be in (0, 1]"),
            (0 <= self.min_p < 1, "--min-p must be in [0, 1)"),
            (0 < self.repeat_penalty < math.inf, "--repeat-penalty must be a finite number > 0"),
            (-2 <= self.presence_penalty <= 2, "--presence-penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "--frequency-penalty must be in [-2, 2]"),
            (self.repeat_last_n >= 0, "--repeat-last-n must be >= 0"),
            # the draws key on the seed's 64 bits: -1 was 2^64-1 and 2^64 was 0, without a word
            (0 <= self.seed < 2**64, "--seed must be in [0, 2^64) (there is no random seed: a seed names its draws)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise BadInput(msg)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
