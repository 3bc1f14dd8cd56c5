"""Progress on stderr for long steps (the model fetch, the benchmarks): tqdm, readable in a log too.

On a terminal a step gets tqdm's bar. Piped or redirected (a log file, CI, a test's captured stderr) a
carriage-return bar would be one long garbled line, so the step prints a whole line at each tenth of
its total instead (each update when the total is unknown), or nothing where the caller asks for that.
`RS_PROGRESS=0` turns every bar off; stdout is never written, so a JSON report there stays clean.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm import tqdm

PROGRESS_ENV = "RS_PROGRESS"
LINE_FORMAT = "{desc}: {percentage:3.0f}% ({n_fmt}/{total_fmt} {unit}) [{elapsed}]{postfix}"
LINE_FORMAT_NO_TOTAL = "{desc}: {n_fmt} {unit} [{elapsed}]{postfix}"


class LineProgress(tqdm):
    """tqdm that prints a plain line (no carriage return) whenever the done fraction passes a tenth."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._last_tenth = -1
        # Every update reaches display(), which decides itself whether a line is due.
        kwargs.update(mininterval=0, miniters=1, leave=False)
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # tqdm clearing the bar on close: a line-per-step log has nothing to clear
            return False
        tenth = int(10 * self.n / self.total) if self.total else self.n
        if tenth == self._last_tenth:
            return False
        self._last_tenth = tenth
        self.fp.write((msg if msg is not None else str(self)) + "\n")
        self.fp.flush()
        return True

    def clear(self, nolock: bool = False) -> None:
        """Nothing to erase: the lines already printed stay (tqdm.write would print a stray '\\r')."""


def progress_enabled() -> bool:
    """False when `RS_PROGRESS=0` asks for no progress anywhere."""
    return os.environ.get(PROGRESS_ENV, "1").strip() != "0"


def progress_bar(
    iterable: Iterable[Any] | None = None,
    *,
    desc: str,
    total: float | None = None,
    unit: str = "it",
    enabled: bool = True,
    lines_when_piped: bool = True,
    stream: TextIO | None = None,
    **tqdm_kwargs: Any,
) -> tqdm:
    """A tqdm over `iterable` (or updated by hand) on `stream` (default stderr).

    A terminal gets tqdm's bar; otherwise plain lines at each tenth (`lines_when_piped`) or nothing.
    `enabled=False` or `RS_PROGRESS=0`: a disabled tqdm, which still iterates.
    """
    stream = stream if stream is not None else sys.stderr
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    common = dict(desc=desc, total=total, unit=unit, file=stream, **tqdm_kwargs)
    if not (enabled and progress_enabled()):
        return tqdm(iterable, disable=True, **common)
    if _is_terminal(stream):
        return tqdm(iterable, dynamic_ncols=True, **common)
    if not lines_when_piped:
        return tqdm(iterable, disable=True, **common)
    return LineProgress(iterable, bar_format=LINE_FORMAT if total else LINE_FORMAT_NO_TOTAL, **common)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-less stream
        return False


def say(message: str) -> None:
    """Print a line to stdout (flushed, for logs) without breaking a bar drawn on the terminal."""
    tqdm.write(message, file=sys.stdout)
    sys.stdout.flush()
