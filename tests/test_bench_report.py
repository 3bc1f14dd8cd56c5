"""bench/report.py: bench/RESULTS.md is generated from the JSON in bench/results/ and cannot drift
from it; every table has a plot the report draws, with every row of the table in it; the soak table
reads whatever fields a run recorded."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
    lines, rows = report.soak_section([])
    assert rows == []
    assert "No run recorded (`bench/results/soak_cpu_*.json`)." in lines


def soak_run(tmp_path: Path, failed: int, within: bool, holds: bool) -> Path:
    run = tmp_path / "soak_cpu_2026-12-02.json"
    run.write_text(json.dumps({
        "config": {"duration_s": 360.0, "restart_every_s": 90.0, "workers": 2, "gateways": 2},
        "sent": 693, "outcomes": {"ok": 486, "clean_error": 125, "aborted": 82 - failed, "failed": failed},
        "migrations": 13.0, "restarts": [{"worker": "w0"}, {"worker": "w1"}, {"worker": "w0"}],
        "rss": {"g0": {"checked": True, "growth_mb": 5.9, "bound_mb": 50.0, "within_bound": True},
                "w0-restart1": {"checked": True, "growth_mb": 34.1, "bound_mb": 306.0, "within_bound": within},
                "w0": {"checked": False, "note": "killed"}},
        "invariant": {"w0": {"holds": True}, "w1": {"holds": holds}},
        "command": "bench/soak.py --duration-s 360", "date": "2026-12-02T04:56:04+00:00",
    }))
    return run


def test_a_clean_soak_run_meets_every_target(tmp_path: Path) -> None:
    rows = {r.figure.split(" (")[0]: r for r in report.soak_rows(soak_run(tmp_path, 0, True, True))}
    assert rows["failed requests"].value == "0 of 693" and rows["failed requests"].verdict == "**met**"
    assert rows["answered / clean errors / aborted as asked"].value == "486 / 125 / 82"
    assert rows["workers killed; streams moved"].value == "3; 13"
    assert rows["largest memory growth after warm-up"].value.startswith("+34.1 MB on w0-restart1 (bound 306 MB")
    assert rows["largest memory growth after warm-up"].verdict == "**met**"
    assert rows["KV pool invariant at the end"].verdict == "**met**"
    assert {r.date for r in rows.values()} == {"2026-12-02"}
    assert all("6 min, 2 workers, 2 gateways, a kill every 90 s" in r.figure for r in rows.values())


def test_a_failed_request_a_leak_or_a_broken_pool_is_missed(tmp_path: Path) -> None:
    rows = {r.figure.split(" (")[0]: r for r in report.soak_rows(soak_run(tmp_path, 1, False, False))}
    assert rows["failed requests"].verdict == "**missed**"
    assert rows["largest memory growth after warm-up"].verdict == "**missed**"
    assert rows["KV pool invariant at the end"].verdict == "**missed**"


PLOT_LINK = re.compile(r"!\[[^\]]*\]\((plots/[^)]+\.png)\)")
UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")


@pytest.fixture(scope="module")
def drawn(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, dict[Path, list[str]]]:
    """The page as the report writes it, and the plots it draws (into a temporary folder)."""
    text, per_area = report.build(report.Results())
    plots = tmp_path_factory.mktemp("plots")
    return text, plots, report.plot(per_area, plots)


def tables(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """Each section of the page that holds a table: its figure names and the plots it links."""
    out = {}
    for section in text.split("\n## ")[1:]:
        lines = section.splitlines()
        rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith(("| figure |", "| --- |"))]
        if rows:
            names = [UNESCAPED_PIPE.split(ln)[1].strip().replace("\\|", "|") for ln in rows]
            out[lines[0]] = (names, PLOT_LINK.findall(section))
    return out


def test_every_table_links_one_plot_that_the_report_wrote(drawn: tuple[str, Path, dict[Path, list[str]]]) -> None:
    text, plots, written = drawn
    sections = tables(text)
    assert len(sections) == len(report.AREAS) + 1  # every area and the soak runs
    for title, (_, links) in sections.items():
        assert len(links) == 1, f"{title}: links {links}"
        path = plots / Path(links[0]).name
        assert path in written, f"{title}: {links[0]} was not drawn"
        assert path.read_bytes().startswith(b"\x89PNG"), path
        assert (report.BENCH / links[0]).is_file(), f"{links[0]} is not committed: run `make report`"
    assert {p.name for p in written} == {Path(links[0]).name for _, links in sections.values()}
    assert sorted(p.name for p in plots.glob("*.png")) == sorted(p.name for p in written)


def test_every_row_of_a_table_is_drawn_in_its_plot(drawn: tuple[str, Path, dict[Path, list[str]]]) -> None:
    text, plots, written = drawn
    for title, (names, links) in tables(text).items():
        assert names == written[plots / Path(links[0]).name], title
