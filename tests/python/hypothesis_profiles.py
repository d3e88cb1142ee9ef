"""The Hypothesis profiles of tests/python/test_hypothesis_*.py (docs/testing.md, "Property tests").

    ci    (default, make test): derandomized (a fixed seed: the same examples on every run),
          few examples per property, no example database: the whole suite in well under 2 minutes;
    fuzz  (make fuzz-python, MIXPREC_HYPOTHESIS=fuzz): random seeds, many examples, for exploration.

A case either profile finds is kept as an @example of its property: a regression test from
then on.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=40, derandomize=True, deadline=None, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("fuzz", max_examples=2000, derandomize=False, deadline=None, database=None,
                          print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
PROFILE = os.environ.get("MIXPREC_HYPOTHESIS", "ci")
settings.load_profile(PROFILE)


def ci_examples(n: int):
    """A property whose examples are slow (torch in the loop) takes n of them under the ci
    profile, to keep the suite inside its budget; the fuzz profile keeps its own count."""
    return settings(max_examples=n) if PROFILE == "ci" else settings()

# Text a user must never see from a refusal: nanobind's argument dump, C++ exception names.
FORBIDDEN = ("incompatible function arguments", "std::", "nanobind", "bad_cast", "Invoked with")


def clean_refusal(e: BaseException, *names: str) -> bool:
    """A refusal a user can act on: no dump, no C++ text, and it names one of `names` first."""
    text = str(e)
    return not any(f in text for f in FORBIDDEN) and any(text.startswith(n) or f"{n}:" in text for n in names)
