"""The distill view without a terminal (a log file, a pipe): progress lines inside long phases."""

from __future__ import annotations

import io

from rich.console import Console

from tsspec.display import DistillProgress


def logged(events, step_s):
    """Lines the view prints for ``events`` when each event takes ``step_s`` seconds of a fake clock."""
    out = io.StringIO()
    view = DistillProgress(Console(file=out, force_terminal=False, width=200))
    assert not view.live
    now = [0.0]
    view.clock = lambda: now[0]
    with view:
        for kind, d in events:
            now[0] += step_s
            view.event(kind, **d)
    return out.getvalue().splitlines()


def test_a_long_phase_logs_progress_about_once_a_minute():
    events = [("phase", dict(name="trunk features (train)", total=1000))]
    events += [("advance", dict(n=10))] * 100  # 100 chunks of 10 tokens, 5 s each: 500 s
    lines = logged(events, 5.0)
    assert lines[0] == "trunk features (train): 1000 tokens"
    progress = lines[1:]
    assert len(progress) == 8, lines  # one a minute over the 495 s after the phase began
    first = progress[0]
    assert first.startswith("trunk features (train): 120/1000 tokens, 1.0 min"), first
    assert "~7.3 min left" in first, first  # 60 s for 120 tokens: 880 more take 440 s


def test_training_lines_carry_the_loss_and_a_short_phase_logs_nothing_more():
    events = [("phase", dict(name="training", total=300, completed=100))]
    events += [("advance", dict(n=1, loss=2.0))] * 200
    lines = logged(events, 1.0)
    assert lines[0] == "training: 300 steps"
    assert lines[1].startswith("training: 160/300 steps, loss 2.000, 1.0 min"), lines[1]
    # resumed at step 100: 60 steps in this run's minute, so the 140 left take 2.3 min (not 140/160 of one)
    assert "~2.3 min left" in lines[1], lines[1]
    quick = logged([("phase", dict(name="trunk answers (train)", total=50))] + [("advance", dict(n=5))] * 10, 1.0)
    assert quick == ["trunk answers (train): 50 tokens"]
