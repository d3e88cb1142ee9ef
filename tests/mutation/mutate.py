#!/usr/bin/env python3
"""The mutation check's driver (tests/mutation/run.sh is its entry point).

For each mutation of mutations.py: replace its original text (which must occur
exactly once in its file) by the mutated text, rebuild the targets its tests
need, run those tests until one fails (the mutation is killed) or all pass (it
survived), and restore the file whatever happens. Before any mutation, the same
tests must pass on the unmutated source: a test that fails anyway kills nothing.
"""
import argparse
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mutations import MUTATIONS  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TEST_TIMEOUT_S = 900


def sh(cmd, **kw):
    return subprocess.run(cmd, cwd=ROOT, **kw)


def configure(build):
    if os.path.exists(os.path.join(build, "CMakeCache.txt")):
        return
    gen = ["-G", "Ninja"] if sh(["sh", "-c", "command -v ninja"], capture_output=True).returncode == 0 else []
    r = sh(["cmake", "-S", ".", "-B", build, *gen, "-DCMAKE_BUILD_TYPE=Release", "-DMIXPREC_BUILD_BENCH=OFF"])
    if r.returncode != 0:
        sys.exit(f"mutation: cmake could not configure {build}")


def build_targets(build, targets, quiet=True):
    r = sh(["cmake", "--build", build, "-j", str(os.cpu_count() or 2), "--target", *sorted(targets)],
           capture_output=quiet, text=True)
    return r.returncode == 0, (r.stdout or "")[-3000:] + (r.stderr or "")[-2000:] if quiet else ""


def test_command(build, test):
    """A test is 'BINARY' or 'BINARY:GTEST_FILTER' (a gtest program of build/tests),
    or 'ctest:REGEX' (ctest tests by name, for the CLI and script tests)."""
    if test.startswith("ctest:"):
        return ["ctest", "--test-dir", build, "-R", test[len("ctest:"):], "--output-on-failure", "--timeout", "600"]
    binary, _, flt = test.partition(":")
    cmd = [os.path.join(build, "tests", binary), "--gtest_brief=1"]
    if flt:
        cmd.append(f"--gtest_filter={flt}")
    return cmd


def test_targets(m):
    targets = set(m.get("targets", []))
    for t in m["tests"]:
        if not t.startswith("ctest:"):
            targets.add(t.partition(":")[0])
    return targets


def run_test(build, test):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    try:
        r = sh(test_command(build, test), capture_output=True, text=True, env=env, timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, "timed out"
    out = (r.stdout + r.stderr).strip().splitlines()
    return r.returncode == 0, "\n".join(out[-8:])


def check_list(mutations):
    ids = set()
    stale = []
    for m in mutations:
        if m["id"] in ids:
            stale.append(f"{m['id']}: duplicate id")
        ids.add(m["id"])
        path = os.path.join(ROOT, m["file"])
        if not os.path.exists(path):
            stale.append(f"{m['id']}: {m['file']} does not exist")
            continue
        n = open(path, encoding="utf-8").read().count(m["old"])
        if n != 1:
            stale.append(f"{m['id']}: the original text occurs {n} times in {m['file']}, expected once")
        if m["old"] == m["new"]:
            stale.append(f"{m['id']}: the mutated text equals the original")
    return stale


def main():
    ap = argparse.ArgumentParser(description="mixprec mutation check")
    ap.add_argument("--build", default="build/mutation")
    ap.add_argument("--only", default="")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    build = os.path.abspath(os.path.join(ROOT, a.build))

    mutations = MUTATIONS
    if a.only:
        want = a.only.split(",")
        unknown = [w for w in want if w not in {m["id"] for m in MUTATIONS}]
        if unknown:
            sys.exit(f"mutation: unknown id(s) {', '.join(unknown)}; --list shows them")
        mutations = [m for m in MUTATIONS if m["id"] in want]
    if a.list:
        for m in mutations:
            print(f"{m['id']:<32} {m['file']}: {m['why']}")
        return 0

    stale = check_list(mutations)
    if stale:
        print("mutation: the list is stale:\n  " + "\n  ".join(stale))
        return 2

    configure(build)
    all_targets = set().union(*(test_targets(m) for m in mutations))
    ok, log = build_targets(build, all_targets, quiet=False)
    if not ok:
        print("mutation: the unmutated source does not build")
        return 2
    # Baseline: every test used must pass before anything is mutated.
    for test in sorted({t for m in mutations for t in m["tests"]}):
        passed, out = run_test(build, test)
        print(f"baseline {test}: {'pass' if passed else 'FAIL'}", flush=True)
        if not passed:
            print(out)
            print("mutation: a test fails on the unmutated source, so it cannot show that it catches anything")
            return 2

    results = []
    original = {}

    def restore(*_):
        for path, text in original.items():
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        original.clear()

    signal.signal(signal.SIGINT, lambda *_: (restore(), sys.exit(130)))
    signal.signal(signal.SIGTERM, lambda *_: (restore(), sys.exit(143)))
    for m in mutations:
        path = os.path.join(ROOT, m["file"])
        text = open(path, encoding="utf-8").read()
        original[path] = text
        t0 = time.time()
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text.replace(m["old"], m["new"], 1))
            ok, log = build_targets(build, test_targets(m))
            if not ok:
                errors = [line for line in log.splitlines() if "error" in line] or ["(no compiler message)"]
                results.append((m, "INVALID", "does not compile: " + errors[0].strip()))
            else:
                verdict, detail = "SURVIVED", "every test passed: " + ", ".join(m["tests"])
                for test in m["tests"]:
                    passed, out = run_test(build, test)
                    if not passed:
                        verdict, detail = "killed", f"by {test}"
                        break
                results.append((m, verdict, detail))
        finally:
            restore()
        print(f"{results[-1][1]:<8} {m['id']:<32} {time.time() - t0:6.0f} s  {results[-1][2]}", flush=True)

    # Leave the build folder matching the source.
    build_targets(build, all_targets)
    killed = sum(1 for _, v, _ in results if v == "killed")
    survived = [m["id"] for m, v, _ in results if v == "SURVIVED"]
    invalid = [m["id"] for m, v, _ in results if v == "INVALID"]
    print()
    print(f"mutation check: {len(results)} mutations, {killed} killed, {len(survived)} survived, "
          f"{len(invalid)} invalid")
    if survived:
        print("survivors: " + ", ".join(survived))
    if invalid:
        print("invalid (do not compile; fix the list): " + ", ".join(invalid))
    return 1 if survived else (2 if invalid else 0)


if __name__ == "__main__":
    sys.exit(main())
