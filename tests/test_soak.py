"""Soak, the short variant of bench/soak.py: nats-server, a tokenizer, two workers and a gateway as real
processes serving the embedded default model, four client threads sending every kind of request
(chat and completions, streaming and not, n=2, JSON-schema constrained, streams the client closes,
native streams aborted by rid, bad requests) for 36 s, while one worker is SIGKILLed in the middle
(once its scheduler holds requests) and started again under its id.

One run, judged several ways: no request failed (each was answered, cleanly failed or aborted as asked),
every request sent has an outcome, the killed worker's requests moved or ended cleanly, memory stayed
within its bound, and afterwards every worker's KV pool is whole and no gateway holds a request.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak import SoakConfig, SoakReport, run_soak


@pytest.fixture(scope="module")
def report(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> SoakReport:
    config = SoakConfig(duration_s=36, restart_every_s=18, workers=2, gateways=1, concurrency=4,
                        model_path=str(default_model_path), request_timeout_s=60, warmup_s=10,
                        log_dir=str(tmp_path_factory.mktemp("soak_logs")), progress=False)
    return run_soak(config)


def test_no_request_fails_while_a_worker_is_killed_and_restarted(report: SoakReport) -> None:
    assert report.outcomes["failed"] == 0, report.failures
    assert [r["worker"] for r in report.restarts] == ["w0"]
    assert report.restarts[0]["error"] is None


def test_every_request_sent_has_exactly_one_outcome(report: SoakReport) -> None:
    assert report.sent == sum(report.outcomes.values()) == sum(sum(row.values()) for row in report.by_kind.values())
    assert report.outcomes["ok"] > 0


def test_the_killed_workers_requests_move_to_the_other_worker_or_end_cleanly(report: SoakReport) -> None:
    restart = report.restarts[0]
    assert restart["running_at_kill"]  # counted by the worker's scheduler right before the SIGKILL
    assert report.migrations + len(report.server_errors) >= 1, (restart, report.lost_in_flight)
    assert all(e["status"] in (502, 503) for e in report.server_errors)


def test_every_workers_kv_pool_is_whole_once_traffic_stops(report: SoakReport) -> None:
    assert set(report.invariant) == {"w0", "w1"}
    for wid, row in report.invariant.items():
        assert row["holds"], (wid, row)
    assert report.gateways_in_flight == [0.0]


def test_service_memory_stays_within_its_bound(report: SoakReport) -> None:
    checked = {label: row for label, row in report.rss.items() if row["checked"]}
    assert {"nats-server", "tokenizer", "g0", "w1"} <= set(checked)
    for label, row in checked.items():
        assert row["within_bound"], (label, row)
    assert report.passed, report.reasons
