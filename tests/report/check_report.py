#!/usr/bin/env python3
"""Checks a `mixprec report` as Chromium rendered it (tests/report/render_check.sh).

--dom: the DOM Chromium parsed (chromium --dump-dom): every chart is an SVG element
whose series carry their data (polyline points, marker counts, histogram bins).
--png: the screenshot is 1280 px wide, not blank, and shows the runs' colours.
The PNG check needs PIL (Debian's python3-pil, installed by scripts/deps.sh test);
without it only the PNG header and size are checked.
"""
import argparse
import struct
import sys
from html.parser import HTMLParser

RUN_COLORS = ["#2563eb", "#f59e0b", "#10b981", "#8b5cf6", "#06b6d4", "#ec4899"]
SKIP_COLOR = "#dc2626"

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


class Charts(HTMLParser):
    """Collects each <svg data-chart=...>: its groups' data-* attributes and polylines."""

    def __init__(self):
        super().__init__()
        self.charts = {}
        self.current = None
        self.scripts = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "script":
            self.scripts += 1
        if tag == "svg" and "data-chart" in a:
            self.current = {"groups": [], "polylines": [], "circles": 0, "text": []}
            self.charts[a["data-chart"]] = self.current
        elif self.current is not None:
            if tag == "g" and "class" in a:
                self.current["groups"].append(a)
            elif tag == "polyline":
                self.current["polylines"].append(len(a.get("points", "").split()))
            elif tag == "circle":
                self.current["circles"] += 1

    def handle_endtag(self, tag):
        if tag == "svg":
            self.current = None

    def handle_data(self, data):
        if self.current is not None and data.strip():
            self.current["text"].append(data.strip())


def groups(chart, cls):
    return [g for g in chart["groups"] if g.get("class") == cls]


def check_dom(path, runs, steps, histograms):
    with open(path, encoding="utf-8") as f:
        dom = f.read()
    p = Charts()
    p.feed(dom)
    charts = p.charts
    check(p.scripts == 0, "the report has no script")
    check("<h1>" in dom and "mixprec" in dom, "the page has its title")
    for name in ["loss", "loss-scale", "skip-rate", "underflow"]:
        check(name in charts, f"chart '{name}' rendered")
    if failures:
        return
    loss = charts["loss"]
    series = groups(loss, "series")
    check(len(series) == runs, f"loss: {runs} run lines, found {len(series)}")
    for g in series:
        check(int(g.get("data-points", 0)) == steps, f"loss: {g.get('data-label')} has {steps} points")
    check(len(loss["polylines"]) >= runs, f"loss: at least {runs} polylines, found {len(loss['polylines'])}")
    check(all(n >= steps for n in loss["polylines"]), f"loss: polylines of >= {steps} points: {loss['polylines']}")
    check(loss["circles"] >= runs, "loss: validation points drawn")
    skipped = [g for g in groups(charts["loss-scale"], "markers") if g.get("data-label") == "skipped step"]
    check(skipped and int(skipped[0]["data-points"]) >= runs,
          "loss scale: the injected overflow is marked in every run")
    check(any(n >= steps for n in charts["loss-scale"]["polylines"]), "loss scale: step lines drawn")
    check(len(groups(charts["underflow"], "series")) == runs, "underflow: one line per run")
    legend = " ".join(loss["text"])
    check("validation loss" in legend, "loss: legend has the validation entry")
    if histograms:
        hists = {k: v for k, v in charts.items() if k.startswith("hist-")}
        check(len(hists) == 4 * runs, f"histograms: 4 per run, found {len(hists)}")
        for k, h in hists.items():
            bars = groups(h, "bars")
            check(bars and int(bars[0]["data-bins"]) > 0, f"{k}: has bars")
            ranges = groups(h, "ranges")
            check(ranges and ranges[0]["data-formats"] == "4", f"{k}: the four format ranges")
    print(f"dom: {len(charts)} charts, loss polylines {loss['polylines']}, "
          f"skipped markers {skipped[0]['data-points'] if skipped else 0}")


def check_png(path, runs):
    with open(path, "rb") as f:
        data = f.read()
    check(data[:8] == b"\x89PNG\r\n\x1a\n", "screenshot is a PNG")
    width, height = struct.unpack(">II", data[16:24])
    check(width == 1280, f"screenshot width 1280, found {width}")
    check(len(data) > 30_000, f"screenshot larger than 30 KB, found {len(data)} bytes")
    try:
        from PIL import Image
    except ImportError:
        print(f"png: {width}x{height}, {len(data)} bytes (PIL missing: colours not checked)")
        return
    img = Image.open(path).convert("RGB")
    counts = img.getcolors(img.width * img.height)  # [(count, (r, g, b))], full resolution
    total = img.width * img.height
    background = {(255, 255, 255), (245, 246, 248)}
    ink = sum(n for n, px in counts if px not in background)
    colors = len(counts)
    check(ink / total > 0.03, f"screenshot not blank: {ink / total:.1%} non-background pixels")
    check(colors > 64, f"screenshot has many colours (anti-aliased charts and text): {colors}")

    def near(hexcolor, tol=40):
        r, g, b = (int(hexcolor[i:i + 2], 16) for i in (1, 3, 5))
        return sum(n for n, (pr, pg, pb) in counts if abs(pr - r) + abs(pg - g) + abs(pb - b) <= tol)

    found = {c: near(c) for c in RUN_COLORS[:runs] + [SKIP_COLOR]}
    for c in RUN_COLORS[:runs]:
        check(found[c] > 100, f"run colour {c} drawn: {found[c]} pixels")
    check(found[SKIP_COLOR] > 20, f"skipped-step markers ({SKIP_COLOR}) drawn: {found[SKIP_COLOR]} pixels")
    print(f"png: {width}x{height}, {len(data)} bytes, {ink / total:.1%} ink, {colors} colours, "
          + ", ".join(f"{c}: {n}" for c, n in found.items()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dom", required=True)
    ap.add_argument("--png", required=True)
    ap.add_argument("--runs", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--histograms", type=int, default=1)
    a = ap.parse_args()
    check_dom(a.dom, a.runs, a.steps, a.histograms)
    check_png(a.png, a.runs)
    if failures:
        for f in failures:
            print("FAIL:", f)
        sys.exit(1)
    print("report renders: ok")


if __name__ == "__main__":
    main()
