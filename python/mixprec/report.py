"""mixprec.report: `mixprec report` from Python (the same C++ function), for run folders written
by `mixprec train --out`, mixprec::torch::Telemetry or mixprec.torch.Telemetry."""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

from . import _core


def report(runs: Union[str, Sequence[str]], out: Optional[str] = None, *, title: str = "mixprec report") -> str:
    """One self-contained HTML file (inline SVG, no script) of one or several run folders.

    out: the file to write (default: RUN/report.html for one run, ./report.html for several).
    Returns its path. A folder that cannot be read (missing, no log.jsonl, a malformed line)
    raises RuntimeError naming it; nothing is written then."""
    dirs = [runs] if isinstance(runs, (str, os.PathLike)) else list(runs)
    if not dirs:
        raise ValueError("runs: expected at least one run folder")
    dirs = [os.fspath(d) for d in dirs]
    if out is None:
        out = os.path.join(dirs[0], "report.html") if len(dirs) == 1 else "report.html"
    out = os.fspath(out)
    parent = os.path.dirname(out)
    if parent and not os.path.isdir(parent):
        raise ValueError(f"out: folder '{parent}' does not exist")
    if os.path.isdir(out):
        raise ValueError(f"out: '{out}' is a folder; expected a file name")
    _core.write_report(dirs, out, title)
    return out
