"""shared/progress.py: a tqdm bar on a terminal; piped, a whole line per tenth or nothing; RS_PROGRESS=0
silences every bar. The stream here is an io.StringIO, which is no terminal, like a log file."""

from __future__ import annotations

import io

import pytest

from shared.progress import PROGRESS_ENV, progress_bar


def test_piped_progress_prints_a_line_per_tenth_without_carriage_returns() -> None:
    stream = io.StringIO()
    assert list(progress_bar(range(25), desc="steps", unit="step", stream=stream)) == list(range(25))
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    # 25 steps: the first line past each tenth (12 % is the first past 10 %).
    percents = [int(line.removeprefix("steps:").split("%")[0]) for line in lines]
    assert percents == [0, 12, 20, 32, 40, 52, 60, 72, 80, 92, 100]
    assert lines[-1].startswith("steps: 100% (25/25 step)")


def test_a_bar_without_a_total_prints_a_line_per_update() -> None:
    stream = io.StringIO()
    bar = progress_bar(desc="soak", unit="s", stream=stream)
    bar.update(2)
    bar.update(3)
    bar.close()
    assert [line.split(" [")[0] for line in stream.getvalue().splitlines()] == ["soak: 0 s", "soak: 2 s", "soak: 5 s"]


def test_benchmarks_print_nothing_when_piped() -> None:
    stream = io.StringIO()
    assert sum(progress_bar(range(10), desc="repeats", lines_when_piped=False, stream=stream)) == 45
    assert stream.getvalue() == ""


def test_rs_progress_0_silences_every_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROGRESS_ENV, "0")
    stream = io.StringIO()
    assert sum(progress_bar(range(10), desc="steps", stream=stream)) == 45
    assert stream.getvalue() == ""
