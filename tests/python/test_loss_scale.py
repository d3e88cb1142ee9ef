"""mixprec.LossScale against the rules of docs/loss_scaling.md, written again here in Python.

The torch, mixprec and deepspeed rules below are independent of the core: they follow the
documented arithmetic (float32 scale and double products for torch/mixprec, Python floats for
deepspeed) and the floor policy, and are compared step by step on long sequences of random
overflow bursts and droughts, plus the edges (collapse below 1, growth up to float's maximum).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import mixprec

PRESETS = ["mixprec", "torch", "deepspeed", "megatron", "apex", "keras", "tf-keras", "jmp", "static", "layerwise"]
KEYS = ["rule", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "min_scale", "max_scale",
        "hysteresis", "consecutive_hysteresis", "refuse_nonfinite_growth", "floor_policy", "max_floor_overflows"]


class Collapse(Exception):
    pass


class TorchRule:
    """torch._amp_update_scale_ (float32 scale, products in double), with mixprec's floor and
    floor policy: the `mixprec` preset is min_scale 1 and an error after 10 overflows there."""

    def __init__(self, init=65536.0, growth=2.0, backoff=0.5, interval=2000, min_scale=0.0,
                 floor_error_after=None):
        self.scale = np.float32(init)
        self.growth, self.backoff, self.interval = growth, backoff, interval
        self.min = min_scale
        self.error_after = floor_error_after
        self.tracker = 0
        self.floor_overflows = 0

    def update(self, found_inf):
        if found_inf:
            if self.min > 0 and self.scale <= np.float32(self.min):
                if self.error_after is not None and self.floor_overflows + 1 >= self.error_after:
                    raise Collapse()
                self.floor_overflows += 1
            else:
                self.floor_overflows = 0
            n = np.float32(float(self.scale) * self.backoff)
            if self.min > 0:
                n = max(n, np.float32(self.min))
            self.scale = n
            self.tracker = 0
            return "backed_off"
        self.floor_overflows = 0
        t = self.tracker + 1
        if t == self.interval:
            self.tracker = 0
            with np.errstate(over="ignore"):
                n = np.float32(float(self.scale) * self.growth)
            if math.isfinite(n):
                self.scale = n
                return "grew"
            return "unchanged"
        self.tracker = t
        return "unchanged"


class DeepSpeedRule:
    """DeepSpeed's DynamicLossScaler.update_scale (Python float scale), raise_error_at_min_scale."""

    def __init__(self, init=65536.0, factor=2.0, window=1000, min_scale=1.0, hysteresis=2):
        self.scale = float(init)
        self.factor, self.window, self.min = factor, window, min_scale
        self.hysteresis = hysteresis
        self.cur_hysteresis = hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, found_inf):
        action = "unchanged"
        if found_inf:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale == self.min:
                    raise Collapse()
                self.scale = max(self.scale / self.factor, self.min)
                action = "backed_off"
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.window == 0:
                self.cur_hysteresis = self.hysteresis
                self.scale *= self.factor
                action = "grew"
        self.cur_iter += 1
        return action


def bursts_and_droughts(n, seed, p_calm=0.01, p_burst=0.6, switch=0.02):
    """Overflow flags from a two-state chain: long clean droughts, then bursts of overflows."""
    rng = np.random.default_rng(seed)
    out, burst = [], False
    for _ in range(n):
        if rng.random() < switch:
            burst = not burst
        out.append(bool(rng.random() < (p_burst if burst else p_calm)))
    return out


def reference_for(preset, overrides):
    interval = overrides.get("growth_interval")
    if preset == "torch":
        return TorchRule(init=overrides.get("init_scale", 65536.0), interval=interval or 2000)
    if preset == "mixprec":
        return TorchRule(init=overrides.get("init_scale", 65536.0), interval=interval or 2000, min_scale=1.0,
                         floor_error_after=10)
    if preset == "deepspeed":
        return DeepSpeedRule(init=overrides.get("init_scale", 65536.0), window=interval or 1000)
    raise AssertionError(preset)


def compare_step_by_step(preset, overrides, steps):
    """update() and the reference on the same flags; returns the step that collapsed, or None."""
    ls = mixprec.LossScale(preset, **overrides)
    rule = reference_for(preset, overrides)
    for i, found_inf in enumerate(steps):
        try:
            want_action = rule.update(found_inf)
        except Collapse:
            before = ls.scale
            with pytest.raises(mixprec.ScaleCollapseError, match="collapsed"):
                ls.update(found_inf)
            assert ls.scale == before, "a collapse must leave the scale as it was"
            return i
        got = ls.update(found_inf)
        with np.errstate(over="ignore"):
            want_f32 = float(np.float32(rule.scale))  # scale is float32 (deepspeed's double beyond range: inf)
        assert (got.scale, ls.exact_scale, got.action) == (want_f32, float(rule.scale), want_action), \
            f"{preset} {overrides} step {i} (found_inf={found_inf}): got {got} exact {ls.exact_scale}, " \
            f"expected {float(rule.scale)} {want_action}"
        assert got.found_inf is found_inf
    return None


@pytest.mark.parametrize("preset", ["torch", "mixprec", "deepspeed"])
@pytest.mark.parametrize("interval", [None, 1, 7, 50])
@pytest.mark.parametrize("seed", [1, 2])
def test_update_follows_the_documented_rule(preset, interval, seed):
    overrides = {} if interval is None else {"growth_interval": interval}
    steps = bursts_and_droughts(20_000, seed * 1000 + (interval or 0))
    compare_step_by_step(preset, overrides, steps)


@pytest.mark.parametrize("preset", ["torch", "mixprec", "deepspeed"])
def test_replay_equals_the_rule_on_a_long_sequence(preset):
    steps = bursts_and_droughts(50_000, 7, p_burst=0.3)
    overrides = {"growth_interval": 20}
    rule = reference_for(preset, overrides)
    want = []
    collapsed = False
    for s in steps:
        try:
            rule.update(s)
        except Collapse:
            collapsed = True
            break
        with np.errstate(over="ignore"):
            want.append(float(np.float32(rule.scale)))
    ls = mixprec.LossScale(preset, **overrides)
    if collapsed:
        with pytest.raises(mixprec.ScaleCollapseError, match=f"replay step {len(want)} "):
            ls.replay(steps)
        assert mixprec.LossScale(preset, **overrides).replay(steps[:len(want)]) == want
    else:
        got = ls.replay(steps)
        assert len(got) == len(steps)
        first_bad = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
        assert first_bad is None, f"step {first_bad}: got {got[first_bad]}, expected {want[first_bad]}"
        assert len(set(got)) > 5  # the sequence really moved the scale


def test_torch_collapses_below_one_to_zero_without_a_floor():
    ls = mixprec.LossScale("torch")
    got = ls.replay([True] * 200)
    rule = TorchRule()
    want = [float(rule.scale) for _ in range(200) if rule.update(True) or True]
    assert got == want
    assert got[15] == 1.0 and got[16] == 0.5 and got[-1] == 0.0
    assert ls.replay("1111") == [0.0] * 4


def test_torch_growth_stops_at_float_max_with_interval_one():
    ls = mixprec.LossScale("torch", growth_interval=1)
    got = ls.replay([False] * 200)
    assert got[110] == 2.0 ** 127 and got[-1] == 2.0 ** 127
    assert all(math.isfinite(s) for s in got)
    assert ls.update(False).action == "unchanged"


def test_mixprec_preset_raises_the_collapse_error_with_the_cores_message():
    ls = mixprec.LossScale()  # preset mixprec
    assert ls.preset == "mixprec"
    scales = ls.replay([True] * 16)
    assert scales[-1] == 1.0
    for _ in range(9):  # overflows at the floor: 9 tolerated, the 10th raises
        assert ls.update(True).action == "backed_off"
    with pytest.raises(mixprec.ScaleCollapseError) as e:
        ls.update(True)
    msg = str(e.value)
    assert "collapsed" in msg and "floor" in msg and "floor_policy=continue" in msg
    assert isinstance(e.value, RuntimeError)
    assert ls.scale == 1.0 and ls.counters["steps"] == 25
    # floor_policy=continue keeps skipping instead
    ls = mixprec.LossScale("mixprec", floor_policy="continue")
    assert ls.replay([True] * 100)[-1] == 1.0


def test_deepspeed_errors_at_the_minimum_scale():
    steps = [True] * 40
    i = compare_step_by_step("deepspeed", {}, steps)
    assert i is not None and i > 16


def test_state_dict_round_trip_continues_identically():
    steps = bursts_and_droughts(4000, 3, p_burst=0.3)
    a = mixprec.LossScale("deepspeed", growth_interval=9, floor_policy="continue")
    a.replay(steps[:2000])
    state = a.state_dict()
    assert state["format"] == "mixprec.loss_scale" and state["version"] == 1
    assert state["config"]["rule"] == "deepspeed" and state["config"]["growth_interval"] == 9
    b = mixprec.LossScale("torch")  # any dynamic scale takes the state, config included
    b.load_state_dict(state)
    assert b.state_dict() == state and b.config == a.config
    assert b.replay(steps[2000:]) == a.replay(steps[2000:])
    c = mixprec.LossScale("deepspeed")
    assert c.config != a.config
    c.load_state_dict(json.dumps(a.state_dict()))  # JSON text too
    assert c.state_dict() == a.state_dict()


def test_bad_states_are_refused_and_leave_the_scale_alone():
    a = mixprec.LossScale("torch")
    a.replay([True, False, False])
    before = a.state_dict()
    bad = json.loads(json.dumps(before))
    bad["config"]["growth_interval"] = 0
    with pytest.raises(ValueError, match="growth_interval"):
        a.load_state_dict(bad)
    with pytest.raises(ValueError):
        a.load_state_dict("{not json")
    static = mixprec.LossScale("static", init_scale=128.0).state_dict()
    with pytest.raises(ValueError):
        a.load_state_dict(static)
    assert a.state_dict() == before


def test_presets_keys_and_config_echo():
    assert mixprec.preset_names() == PRESETS
    assert mixprec.config_keys() == KEYS
    ls = mixprec.LossScale("torch", init_scale=1024.0, growth_interval=3, min_scale=None, max_scale=float("inf"),
                           refuse_nonfinite_growth=False)
    assert ls.scale == 1024.0
    cfg = ls.config
    assert cfg["rule"] == "torch" and cfg["init_scale"] == 1024.0 and cfg["growth_interval"] == 3
    assert cfg["min_scale"] is None and cfg["max_scale"] is None and cfg["refuse_nonfinite_growth"] is False
    assert "growth_interval = 3" in ls.describe()
    # a one-factor rule: growth_factor also sets backoff_factor, whatever the keyword order
    ls = mixprec.LossScale("keras", growth_factor=4.0, init_scale=64.0)
    assert ls.config["backoff_factor"] == 0.25
    assert ls.replay("1") == [16.0]
    static = mixprec.LossScale("static", init_scale=8.0)
    assert static.replay("0101") == [8.0] * 4


def test_misuse_is_refused_with_what_is_allowed():
    with pytest.raises(ValueError) as e:
        mixprec.LossScale("pytorch")
    assert all(p in str(e.value) for p in PRESETS)
    with pytest.raises(ValueError) as e:
        mixprec.LossScale("torch", growth_intervall=10)
    assert "growth_intervall" in str(e.value) and all(k in str(e.value) for k in KEYS)
    with pytest.raises(ValueError, match="growth_interval"):
        mixprec.LossScale("torch", growth_interval=0)
    with pytest.raises(ValueError, match="backoff_factor"):
        mixprec.LossScale("torch", backoff_factor=1.5)
    with pytest.raises(ValueError, match="min_scale"):  # across fields: validate()
        mixprec.LossScale("torch", init_scale=2.0, min_scale=4.0)
    with pytest.raises(ValueError, match="floor_policy"):
        mixprec.LossScale("torch", floor_policy="explode")
    with pytest.raises(TypeError, match="growth_interval"):
        mixprec.LossScale("torch", growth_interval=[1])
    with pytest.raises(TypeError, match="preset"):
        mixprec.LossScale(3)
    ls = mixprec.LossScale("torch")
    with pytest.raises(TypeError, match="found_inf: expected a bool, found int"):
        ls.update(1)
    with pytest.raises(TypeError, match=r"overflows\[1\]"):
        ls.replay([True, 0])
    with pytest.raises(ValueError, match="0 and 1"):
        ls.replay("01x")
    assert ls.replay(np.array([True, False])) == [32768.0, 32768.0]


def test_integers_take_whole_floats_as_torch_amp_does():
    # One number grammar (docs/configuration.md): torch.amp keeps growth_interval as a Python
    # number, so 20.0 means 20; 2.9 is no integer; the message names the key's whole range.
    assert mixprec.LossScale("torch", growth_interval=20.0).config["growth_interval"] == 20
    assert mixprec.LossScale("torch", growth_interval=np.float64(2e3)).config["growth_interval"] == 2000
    assert mixprec.LossScale("torch", hysteresis=1.0).config["hysteresis"] == 1
    with pytest.raises(ValueError, match=r"growth_interval: expected an integer in \[1, 2147483647\], found '2.9'"):
        mixprec.LossScale("torch", growth_interval=2.9)
    with pytest.raises(ValueError, match=r"growth_interval: expected an integer in \[1, 2147483647\], found '1e\+22'"):
        mixprec.LossScale("torch", growth_interval=1e22)
    with pytest.raises(ValueError, match=r"init_scale: expected a finite number > 0, found inf"):
        mixprec.LossScale("torch", init_scale=float("inf"))
    with pytest.raises(ValueError, match=r"init_scale: expected a finite number > 0, found nan"):
        mixprec.LossScale("torch", init_scale=float("nan"))
