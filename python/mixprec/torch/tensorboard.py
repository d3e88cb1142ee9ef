"""Telemetry(tensorboard=DIR): each recorded step's scalars as TensorBoard event files, through
torch.utils.tensorboard (docs/python.md, "TensorBoard").

The tags and values are the C++ core's (mixprec::monitor::StepScalars, bound as
mixprec._core.StepScalars): the same that `mixprec export tensorboard RUN_DIR` writes for any
run folder, so a live run and an exported one show the same charts.
"""

from __future__ import annotations

from typing import Any

from .. import _core


def require_tensorboard(logdir: Any) -> None:
    """Checks the argument and that torch.utils.tensorboard can be imported, before anything is
    written; ImportError saying what to install otherwise."""
    if not isinstance(logdir, str) or not logdir:
        raise TypeError(f"tensorboard: expected a folder name, found {logdir!r}")
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"Telemetry(tensorboard={logdir!r}): writing TensorBoard event files needs the tensorboard package "
            f"(import failed: {e}); pip install tensorboard (or \"mixprec[tensorboard]\"), or leave tensorboard= "
            "out and convert the run folder later with `mixprec export tensorboard RUN_DIR` (no Python package "
            "needed)") from e


class TensorBoardWriter:
    """One SummaryWriter; write() takes the log line Telemetry.record() wrote."""

    def __init__(self, logdir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=logdir)
        self._scalars = _core.StepScalars()
        self.logdir = logdir

    def write(self, line: str, step: int) -> None:
        for tag, value in self._scalars.add(line):
            self._writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
