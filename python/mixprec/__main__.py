"""python -m mixprec report RUN_DIR [RUN_DIR ...] [--out FILE.html] [--title TEXT]
python -m mixprec doctor

`mixprec report` for Python users without the C++ command-line program: the same function.
`doctor`: the installed versions against the tested ones, the CPU's instruction sets and the back
end of each kernel family, and which integrations are usable (mixprec/doctor.py)."""

from __future__ import annotations

import argparse
import sys

from .report import report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mixprec", description="mixprec from Python")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="one HTML file of one or several run folders")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR")
    rep.add_argument("--out", default=None, help="the HTML file (default RUN_DIR/report.html)")
    rep.add_argument("--title", default="mixprec report")
    sub.add_parser("doctor", help="versions, CPU features and kernels, usable integrations")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .doctor import main as doctor
        return doctor()
    try:
        out = report(args.runs, args.out, title=args.title)
    except (ValueError, RuntimeError) as e:
        print(f"python -m mixprec report: error: {e}", file=sys.stderr)
        return 1
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
