"""bench/report.py: bench/RESULTS.md is generated from the JSON in bench/results/ and cannot drift
from it; the soak table reads whatever fields a run recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import report

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "report.py"


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--check", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_results_page_is_what_the_report_writes_from_the_json() -> None:
    done = _check()
    assert done.returncode == 0, done.stderr


def test_check_fails_when_the_page_differs_from_the_json(tmp_path: Path) -> None:
    page = tmp_path / "RESULTS.md"
    page.write_text((ROOT / "bench" / "RESULTS.md").read_text().replace("**met**", "**missed**", 1))
    done = _check("--page", str(page))
    assert done.returncode == 1
    assert "make report" in done.stderr


def test_every_current_figure_names_a_dated_json_that_exists() -> None:
    for area in report.AREAS:
        for fig in area.figures:
            assert (report.RESULTS / fig.file).is_file(), fig.file
            assert report.DATE_IN_NAME.search(fig.file), fig.file


def test_soak_section_says_no_run_recorded_without_a_run() -> None:
    lines, rows = report.soak_section(None)
    assert rows == []
    assert "No run recorded (`bench/results/soak_cpu_*.json`)." in lines


def test_soak_table_shows_the_fields_a_run_recorded_and_judges_hung_and_lost(tmp_path: Path) -> None:
    run = tmp_path / "soak_cpu_2026-12-02_a.json"
    run.write_text(json.dumps({
        "requests": 1200, "outcomes": {"ok": 1190, "error": 10, "hung": 0, "lost": 1}, "failed": 10,
        "migrations": 7, "restarts": 3, "rss": {"start_mb": 410, "end_mb": 415}, "invariant_ok": True,
        "unknown_field": "ignored",
    }))
    rows = {r.figure: r for r in report.soak_rows(run)}
    assert rows["requests sent"].value == "1200"
    assert rows["outcome: hung"].verdict == "**met**"
    assert rows["outcome: lost"].verdict == "**missed**"
    assert rows["failed requests (an error answer)"].verdict == "—"
    assert rows["streams moved to another worker"].value == "7"
    assert rows["worker restarts"].value == "3"
    assert json.loads(rows["resident memory"].value) == {"end_mb": 415, "start_mb": 410}
    assert rows["every request answered exactly once (invariant)"].verdict == "**met**"
    assert {r.date for r in rows.values()} == {"2026-12-02"}


def test_soak_run_with_no_known_field_is_named_not_tabled(tmp_path: Path) -> None:
    run = tmp_path / "soak_cpu_2026-12-02_a.json"
    run.write_text(json.dumps({"schema": 2, "phases": []}))
    lines, rows = report.soak_section(run)
    assert rows == []
    assert any("soak_cpu_2026-12-02_a.json` holds none of the fields" in line for line in lines)
