"""mixprec.torch.Telemetry under Hypothesis: random record() arguments (numbers of every
kind, non-finite ones, wrong types, out-of-range integers) each end as a log line or a
refusal that names the argument and writes nothing; whatever the sequence, the folder reads
back (the core's reader, mixprec.report) with exactly the lines record() returned. Profiles:
tests/python/hypothesis_profiles.py."""

from __future__ import annotations

import json
import math
import pathlib
import tempfile

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (scripts/deps.sh)")
from hypothesis import example, given, strategies as st  # noqa: E402

import hypothesis_profiles  # noqa: E402,F401
from hypothesis_profiles import ci_examples, clean_refusal  # noqa: E402

torch = pytest.importorskip("torch")
import mixprec  # noqa: E402
from mixprec.torch import Telemetry  # noqa: E402

torch.set_num_threads(1)

value = st.one_of(st.none(), st.booleans(), st.integers(-2**66, 2**66), st.floats(allow_nan=True, allow_infinity=True),
                  st.text(max_size=4), st.sampled_from([np.float32(0.5), np.int64(7), np.float64(math.nan), 3.0,
                                                        2.9, torch.tensor(1.5), torch.ones(2)]))
call = st.fixed_dictionaries({}, optional={"lr": value, "tokens": value, "seconds": value, "val_loss": value,
                                           "clip_coef": value}).flatmap(
    lambda kw: st.tuples(st.just(kw), value))


@ci_examples(25)
@given(calls=st.lists(call, min_size=1, max_size=6))
@example(calls=[({"seconds": math.nan}, 1.0)])      # finding 4: was written as null, the folder then unreadable
@example(calls=[({"tokens": -5}, 1.0)])             # finding 11: nanobind's dump
@example(calls=[({"tokens": 2.9}, 1.0)])            # Low: truncated to 2
@example(calls=[({"lr": -1.0}, 1.0), ({}, 2.0)])    # Low: a negative lr reached the report
def test_each_record_is_a_line_or_a_named_refusal_and_the_folder_reads_back(calls):
    with tempfile.TemporaryDirectory() as d:
        run = pathlib.Path(d) / "run"
        returned = []
        with Telemetry(torch.nn.Linear(2, 2), run, precision="fp32") as tel:
            for kw, loss in calls:
                try:
                    returned.append(tel.record(loss=loss, **kw))
                except (TypeError, ValueError) as e:
                    assert clean_refusal(e, "loss", *kw), str(e)
                    assert tel.steps == len(returned)
        logged = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        assert logged == returned
        assert [r["step"] for r in logged] == list(range(1, len(logged) + 1))
        mixprec.report(run, out=pathlib.Path(d) / "r.html")  # every reader takes it
