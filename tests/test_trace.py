"""shared/trace.py (RS_TRACE_DIR request-path timestamps) and bench/pipeline_trace.py's stage medians."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import pipeline_trace
from shared import trace


def test_mark_writes_nothing_unless_a_trace_dir_is_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "TRACE_DIR", None)
    monkeypatch.chdir(tmp_path)
    trace.mark("r1", "gateway.submit")
    assert list(tmp_path.iterdir()) == []


def test_marks_are_lines_per_process_on_the_monotonic_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "TRACE_DIR", str(tmp_path))
    monkeypatch.setattr(trace, "_files", {})
    trace.mark("ttft-gateway-0", "client.sent")
    trace.mark("ttft-gateway-0", "client.first")
    lines = (tmp_path / f"{os.getpid()}.trace").read_text().splitlines()
    assert [line.split()[:2] for line in lines] == [["ttft-gateway-0", "client.sent"], ["ttft-gateway-0", "client.first"]]
    first, last = (int(line.split()[2]) for line in lines)
    assert 0 <= last - first < 10**9


def test_a_mark_can_carry_a_time_taken_earlier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "TRACE_DIR", str(tmp_path))
    monkeypatch.setattr(trace, "_files", {})
    trace.mark("r1", "client.sent", 123)
    assert (tmp_path / f"{os.getpid()}.trace").read_text() == "r1 client.sent 123\n"


def test_mark_each_gives_every_request_the_same_moment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Req:
        def __init__(self, rid: str) -> None:
            self.rid = rid

    monkeypatch.setattr(trace, "TRACE_DIR", None)
    trace.mark_each([Req("r0")], "scheduler.launched")  # off: nothing, not even a file
    monkeypatch.setattr(trace, "TRACE_DIR", str(tmp_path))
    monkeypatch.setattr(trace, "_files", {})
    assert list(tmp_path.iterdir()) == []
    trace.mark_each([Req("r1"), Req("r2")], "scheduler.launched")
    lines = [line.split() for line in (tmp_path / f"{os.getpid()}.trace").read_text().splitlines()]
    assert [line[:2] for line in lines] == [["r1", "scheduler.launched"], ["r2", "scheduler.launched"]]
    assert lines[0][2] == lines[1][2]


def test_a_missing_trace_dir_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    where = tmp_path / "not" / "yet"
    monkeypatch.setattr(trace, "TRACE_DIR", str(where))
    monkeypatch.setattr(trace, "_files", {})
    trace.mark("r1", "gateway.submit")
    assert (where / f"{os.getpid()}.trace").read_text().split()[:2] == ["r1", "gateway.submit"]


def test_stage_medians_follow_each_side_s_order_across_process_files(tmp_path: Path) -> None:
    # Two processes' files for three traced gateway requests and one engine request; one gateway request
    # skipped the scheduler (a floor request), and lines of other requests are ignored.
    (tmp_path / "1.trace").write_text(
        "ttft-gateway-0 client.sent 1000\nttft-gateway-0 client.first 9000\n"
        "ttft-gateway-1 client.sent 2000\nttft-gateway-1 client.first 12000\n"
        "ttft-gateway-2 client.sent 0\nttft-gateway-2 client.first 5000\n"
        "ttft-engine-0 client.sent 0\nttft-engine-0 engine.queued 1000\nttft-engine-0 client.first 4000\n"
        "some-other-rid gateway.submit 5\n"
    )
    (tmp_path / "2.trace").write_text(
        "ttft-gateway-0 gateway.submit 3000\nttft-gateway-0 scheduler.added 4000\n"
        "ttft-gateway-1 gateway.submit 3000\nttft-gateway-1 scheduler.added 8000\n"
        "ttft-gateway-1 gateway.submit 2500\n"  # the earliest mark of a stage counts
        "ttft-gateway-2 gateway.submit 1000\n"
    )
    result = pipeline_trace.breakdown(pipeline_trace.read(tmp_path))
    gateway, engine = result["ttft"]["gateway"], result["ttft"]["engine"]
    assert gateway["pairs"] == 3 and engine["pairs"] == 1
    assert gateway["client.sent -> gateway.submit"] == 1.0  # median of 2, 0.5, 1 us
    assert gateway["gateway.submit -> scheduler.added"] == 3.25  # median of 1 and 5.5 us
    assert gateway["scheduler.added -> client.first"] == 4.5
    assert gateway["gateway.submit -> client.first"] == 4.0  # the request without scheduler stages
    assert gateway["total"] == 8.0
    assert engine == {"client.sent -> engine.queued": 1.0, "engine.queued -> client.first": 3.0, "total": 4.0, "pairs": 1}
