"""Properties of the low-precision door's inputs under Hypothesis (issue 43): any text, any JSON
value and any bytes as a recipe file, and random arguments to mixprec.quantize / dequantize,
end as a result or as a refusal that names the argument or the file: never a crash, a hang or
a library's raw text. Profiles: tests/python/hypothesis_profiles.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (scripts/deps.sh)")
from hypothesis import example, given, strategies as st  # noqa: E402

import hypothesis_profiles  # noqa: E402,F401  (loads the profile)
from hypothesis_profiles import FORBIDDEN, ci_examples, clean_refusal  # noqa: E402
import mixprec  # noqa: E402
from mixprec import _core  # noqa: E402

RECIPES = ["fp8-delayed", "fp8-current", "mxfp8", "fp8-block", "nvfp4", "mxfp4"]
GOOD = {"format": "mixprec.low_precision", "version": 1, "modules": {"fc": "nvfp4"}}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


def refused_cleanly(text: str) -> None:
    try:
        _core.plan_assignment(text)
    except ValueError as e:
        assert clean_refusal(e, "recipe file"), str(e)
        assert "[json.exception" not in str(e)


@given(text=st.text(max_size=200))
@example(text="[" * 100000 + "]" * 100000)  # crashed the process (SIGSEGV)
@example(text="\ufeff" + json.dumps(GOOD))
@example(text=json.dumps(GOOD).replace('"fc": "nvfp4"', '"fc": "nvfp4", "fc": "mxfp8"'))
def test_any_text_as_a_recipe_file_is_a_plan_or_a_named_refusal(text):
    refused_cleanly(text)


@given(value=json_values)
def test_any_json_as_a_recipe_file_is_a_plan_or_a_named_refusal(value):
    refused_cleanly(json.dumps(value))


@given(modules=st.dictionaries(st.text(max_size=8), json_values, max_size=3),
       extra=st.dictionaries(st.sampled_from(["default", "options", "notes", "version", "x"]), json_values, max_size=2))
def test_any_module_entries_are_a_plan_or_a_named_refusal(modules, extra):
    refused_cleanly(json.dumps({**GOOD, "modules": modules, **extra}))


@ci_examples(20)
@given(data=st.binary(max_size=300))
@example(data=b"\xef\xbb\xbf" + json.dumps(GOOD).encode())
@example(data=json.dumps(GOOD).encode().replace(b"nvfp4", b"nvf\xe9p4"))
def test_any_bytes_as_a_recipe_file_on_disk(tmp_path_factory, data):
    torch = pytest.importorskip("torch")
    import mixprec.torch as mt
    path = tmp_path_factory.mktemp("recipe") / "recipe.json"
    path.write_bytes(data)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    try:
        mt.low_precision(model, str(path))
    except ValueError as e:
        text = str(e)
        assert not any(f in text for f in FORBIDDEN) and ("recipe file" in text or str(path) in text), text


arg_values = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                       st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                       st.sampled_from(["e4m3", "e5m2", "e2m1", "rowwise", "columnwise", "rceil", "floor",
                                        "te", "torchao"]))
ARGS = ["element", "layout", "tile_2d", "scale_rounding", "power_of_2_scales", "amax_epsilon", "value_for_inf",
        "scale", "rht", "stochastic_rounding", "seed", "flavour"]


@given(recipe=st.sampled_from(RECIPES + ["fp4", "", "NVFP4"]), kwargs=st.dictionaries(st.sampled_from(ARGS),
       arg_values, max_size=3), rows=st.integers(1, 40), cols=st.integers(1, 40))
@example(recipe="fp8-current", kwargs={"amax_epsilon": 1e-12}, rows=2, cols=16)
@example(recipe="fp8-delayed", kwargs={"scale": 0.1}, rows=2, cols=16)
def test_quantize_arguments_end_in_a_result_or_a_named_refusal(recipe, kwargs, rows, cols):
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    try:
        q = mixprec.quantize(x, recipe, **kwargs)
    except (TypeError, ValueError) as e:
        assert clean_refusal(e, "recipe", "x", *kwargs), f"{type(e).__name__}: {e}"
        return
    out = q.dequantize()
    assert out.shape == x.shape
    # dequantize into a wrong buffer: a named refusal.
    with pytest.raises((TypeError, ValueError)) as e:
        mixprec.dequantize(q, out=np.zeros((rows, cols + 1), np.float32))
    assert clean_refusal(e.value, "out"), str(e.value)
