"""`python -m mixprec doctor`: what this installation can do (docs/python.md, "doctor").

The installed versions against the tested ones (the `torch` extra of pyproject.toml, read from
the installed package's metadata: one list), the CPU's instruction sets and the back end each
of mixprec's kernel families runs, whether torch's autocast runs float16 and bfloat16 on this
CPU, and which integrations are usable (imported for real; the error when not)."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import platform
import shutil
import sys
from typing import Dict, List, Optional, Tuple

from . import _core, __version__

# The integrations and what each imports (mixprec.integrations.<name>).
INTEGRATIONS = [
    ("mixprec.torch (GradScaler, Telemetry)", "mixprec.torch", ["torch"]),
    ("Hugging Face Trainer (mixprec.integrations.transformers)", "mixprec.integrations.transformers",
     ["transformers", "accelerate"]),
    ("Accelerate loop (mixprec.integrations.accelerate)", "mixprec.integrations.accelerate", ["accelerate"]),
    ("Lightning (mixprec.integrations.lightning)", "mixprec.integrations.lightning", ["lightning"]),
    ("TensorBoard (Telemetry(tensorboard=DIR))", "torch.utils.tensorboard", ["tensorboard"]),
]


def tested_requirements() -> Dict[str, str]:
    """package -> requirement text of the `torch` extra (the versions tested)."""
    out: Dict[str, str] = {}
    try:
        reqs = metadata.requires("mixprec") or []
    except metadata.PackageNotFoundError:
        return out
    for r in reqs:
        spec, _, marker = r.partition(";")
        if "extra" in marker and "torch" in marker:
            name = spec.strip().split("[")[0]
            for sep in "<>=!~ ":
                name = name.split(sep)[0]
            out[name.lower()] = spec.strip()
    return out


def _installed(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _satisfies(requirement: str, version: str) -> Optional[bool]:
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return None
    return Requirement(requirement).specifier.contains(version, prereleases=True)


def versions() -> List[Tuple[str, Optional[str], str, str]]:
    """(package, installed version or None, tested requirement, verdict)."""
    rows = []
    tested = tested_requirements()
    for name in ["numpy", "torch", "transformers", "accelerate", "lightning", "tensorboard"]:
        have = _installed(name)
        req = tested.get(name, "")
        if have is None:
            verdict = "not installed"
        elif not req:
            verdict = "ok"
        else:
            ok = _satisfies(req, have)
            verdict = "ok (tested)" if ok else ("untested version" if ok is False else "installed")
        rows.append((name, have, req, verdict))
    return rows


def autocast_dtypes() -> Dict[str, str]:
    """Whether torch's CPU autocast produces each low-precision dtype (a tiny matmul)."""
    out = {}
    try:
        import torch
    except ImportError as e:
        return {"float16": f"no torch ({e})", "bfloat16": f"no torch ({e})"}
    a = torch.ones(4, 4)
    for dtype in (torch.float16, torch.bfloat16):
        try:
            with torch.autocast("cpu", dtype=dtype):
                got = (a @ a).dtype
            out[str(dtype).replace("torch.", "")] = "yes" if got == dtype else f"no (matmul gave {got})"
        except Exception as e:  # noqa: BLE001  (report whatever this torch says)
            out[str(dtype).replace("torch.", "")] = f"no ({type(e).__name__}: {e})"
    return out


def integrations() -> List[Tuple[str, str]]:
    rows = []
    for label, module, _ in INTEGRATIONS:
        try:
            importlib.import_module(module)
            rows.append((label, "usable"))
        except ImportError as e:
            rows.append((label, f"not usable: {e}"))
        except Exception as e:  # noqa: BLE001  (a broken install says so here, not as a traceback)
            rows.append((label, f"not usable: {type(e).__name__}: {e}"))
    return rows


def report() -> str:
    lines = [f"mixprec {__version__} (Python {platform.python_version()}, {platform.machine()}, "
             f"{platform.system()})", ""]
    lines.append("packages (tested: the \"torch\" extra, pip install \"mixprec[torch]\")")
    for name, have, req, verdict in versions():
        lines.append(f"  {name:<13} {have or '-':<12} {req or '':<28} {verdict}")
    p = _core.platform()
    lines += ["", "CPU and kernels"]
    avail = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in p["isa_available"].items())
    lines.append(f"  instruction sets       {avail}; AVX512-BF16 {'yes' if p['avx512_bf16'] else 'no'}")
    lines.append(f"  best back end          {p['best_isa']}")
    if p["active_isa"] is None:
        lines.append(f"  active back end        error: {p['active_isa_error']}")
    else:
        lines.append(f"  active back end        {p['active_isa']} (MIXPREC_ISA overrides)")
        lines.append(f"  format conversions     {p['format_kernels']} (encode/decode, counted conversions, Telemetry)")
        lines.append(f"  gradient check/unscale {p['active_isa']} (GradScaler.unscale_/step on CPU tensors)")
    g = p["gemm"]
    lines.append(f"  GEMM                   oneDNN {g['onednn_version']} ({g['cpu_isa']}); bf16 "
                 + (f"native ({g['bf16_impl']})" if g["bf16_native"] else "widened to f32") + "; f16 "
                 + (f"native ({g['f16_impl']})" if g["f16_native"] else "widened to f32"))
    lines.append(f"  fp16 products          AVX512-FP16 {'yes' if g['avx512_fp16'] else 'no'}, AMX-FP16 "
                 f"{'yes' if g['amx_fp16'] else 'no'}: with fp32 accumulation "
                 + ("on fp16 tiles" if g["amx_fp16"] and g["f16_native"] else "at the f32 rate"))
    for dtype, ok in autocast_dtypes().items():
        lines.append(f"  torch autocast {dtype:<8} on the CPU: {ok}")
    lines += ["", "integrations"]
    for label, state in integrations():
        lines.append(f"  {label:<60} {state}")
    lines.append(f"  {'mixprec export tensorboard (the C++ CLI; no Python package)':<60} "
                 f"{'mixprec on PATH' if shutil.which('mixprec') else 'mixprec not on PATH (build tools/mixprec)'}")
    try:
        import torch.distributed as dist
        gloo = dist.is_available() and dist.is_gloo_available()
        lines.append(f"  {'torch.distributed gloo (DDP, FSDP2 on the CPU)':<60} {'usable' if gloo else 'not available'}")
    except ImportError:
        pass
    compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    lines.append(f"  {'torch.compile (inductor needs a C++ compiler on the CPU)':<60} "
                 f"{'compiler ' + compiler if compiler else 'no C++ compiler found'}")
    return "\n".join(lines)


def main() -> int:
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
