"""mixprec.report: `mixprec report` from Python (the same C++ function), for run folders written
by `mixprec train --out`, mixprec::torch::Telemetry or mixprec.torch.Telemetry."""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

from . import _args, _core


def report(runs: Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]],
           out: Optional[Union[str, "os.PathLike[str]"]] = None, *, title: str = "mixprec report") -> str:
    """One self-contained HTML file (inline SVG, no script) of one or several run folders.

    out: the file to write (default: RUN/report.html for one run, ./report.html for several).
    Returns its path. Checked before anything is written, as `mixprec report --out`: its
    folder exists, it is a new name or a regular file (never a link, a FIFO or a folder), and it
    is none of the runs' own files (config.json, log.jsonl, ...): ValueError naming it. A folder
    that cannot be read (missing, no log.jsonl, a malformed line, a schema version this mixprec
    does not read) raises RuntimeError naming it; nothing is written then."""
    if isinstance(runs, (str, bytes, os.PathLike)):
        runs = [runs]
    try:
        dirs = list(runs)
    except TypeError:
        raise TypeError(f"runs: expected a run folder or a list of them, found {type(runs).__name__}") from None
    if not dirs:
        raise ValueError("runs: expected at least one run folder")
    dirs = [_args.path(f"runs[{i}]", d) for i, d in enumerate(dirs)]
    out = "" if out is None else _args.path("out", out)
    if not isinstance(title, str):
        raise TypeError(f"title: expected a str, found {type(title).__name__}")
    path, _ = _core.write_report(dirs, out, _args.utf8_text(title))
    return path
