"""Installing like a package: the `torch` extra of pyproject.toml (what `pip install "mixprec[torch]"`
adds) names every integration's package at the versions tested, the pins of scripts/deps.sh (the
test venv) fall inside it, the installed metadata carries it, and `python -m mixprec doctor` reports
the versions against it, the CPU's back ends as the core sees them and each integration usable."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from integration_support import skip_without_integrations

skip_without_integrations()
from packaging.requirements import Requirement  # noqa: E402

import mixprec  # noqa: E402
from mixprec import _core, doctor  # noqa: E402
from mixprec.__main__ import main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
INTEGRATION_PACKAGES = ["torch", "transformers", "accelerate", "lightning", "tensorboard"]


def extras():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_torch_extra_names_every_integration_at_the_tested_versions():
    torch_extra = {Requirement(r).name: Requirement(r) for r in extras()["torch"]}
    assert sorted(torch_extra) == sorted(INTEGRATION_PACKAGES)
    # scripts/deps.sh pins the test venv: each pin lies inside the extra's range
    deps = (REPO / "scripts" / "deps.sh").read_text()
    pins = dict(re.findall(r"\b(transformers|accelerate|lightning|tensorboard)==([0-9][0-9.]*)", deps))
    pins["torch"] = re.search(r"^TORCH_VERSION=([0-9][0-9.]*)$", deps, re.M).group(1)
    assert sorted(pins) == sorted(INTEGRATION_PACKAGES)
    for name, version in pins.items():
        assert torch_extra[name].specifier.contains(version), f"{name}=={version} (deps.sh) outside {torch_extra[name]}"
        assert metadata.version(name) == version, f"the venv's {name} is not the pinned one"
    # every per-integration extra is a subset of "torch"
    for extra, reqs in extras().items():
        for r in map(Requirement, reqs):
            assert str(r) == str(torch_extra[r.name]), f"[{extra}] {r} differs from [torch]'s"


def test_installed_metadata_carries_the_extra():
    tested = doctor.tested_requirements()
    assert sorted(tested) == sorted(INTEGRATION_PACKAGES)
    assert {k: str(Requirement(v).specifier) for k, v in tested.items()} == \
        {Requirement(r).name: str(Requirement(r).specifier) for r in extras()["torch"]}


def test_doctor(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"mixprec {mixprec.__version__} (Python ")
    for name in INTEGRATION_PACKAGES:
        assert re.search(rf"^  {name} +{re.escape(metadata.version(name))} .* ok \(tested\)$", out, re.M), name
    p = _core.platform()
    assert f"best back end          {p['best_isa']}" in out
    assert f"format conversions     {p['format_kernels']}" in out
    assert f"AVX512-BF16 {'yes' if p['avx512_bf16'] else 'no'}" in out
    g = p["gemm"]
    assert re.search(r"^\d+\.\d+\.\d+$", g["onednn_version"]), g
    assert g["bf16_native"] == (g["bf16_impl"] != "") and g["f16_native"] == (g["f16_impl"] != ""), g
    assert f"GEMM                   oneDNN {g['onednn_version']} ({g['cpu_isa']}); bf16 " in out
    assert ("f16 native (" if g["f16_native"] else "f16 widened to f32") in out
    assert f"AVX512-FP16 {'yes' if g['avx512_fp16'] else 'no'}, AMX-FP16 {'yes' if g['amx_fp16'] else 'no'}" in out
    for label, _, _ in doctor.INTEGRATIONS:
        assert re.search(rf"^  {re.escape(label)} +usable$", out, re.M), label
    assert "torch autocast float16  on the CPU: yes" in out


def test_doctor_names_what_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "_installed", lambda name: None if name == "lightning" else metadata.version(name))
    real_import = doctor.importlib.import_module

    def fake_import(name):
        if name.startswith("mixprec.integrations.lightning"):
            raise ImportError("mixprec.integrations.lightning needs the lightning package (import failed: ...)")
        return real_import(name)

    monkeypatch.setattr(doctor.importlib, "import_module", fake_import)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  lightning +- .* not installed$", out, re.M)
    assert "Lightning (mixprec.integrations.lightning)" in out and "not usable: mixprec.integrations.lightning " \
        "needs the lightning package" in out
