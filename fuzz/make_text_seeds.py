#!/usr/bin/env python3
"""Writes the hand-made seeds of fuzz/corpus/ (NumPy is not needed):
  npy/     .npy files byte by byte as np.save writes them (versions 1.0, 2.0, 3.0; f4/f2/f8,
           both byte orders, C and Fortran order, scalar, empty), and near-valid ones;
  cli/     command lines, one argument per NUL- or newline-separated field;
  config/  hand-written JSON configs (the generated seeds come from fuzz_make_seeds);
and the libFuzzer dictionaries config.dict (every JSON key and name in corpus/config) and
cli.dict (commands, every --flag of tools/mixprec, values). Run from the repository root
after fuzz_make_seeds: python3 fuzz/make_text_seeds.py"""
import glob
import json
import os
import re
import shutil
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(sub, name, data):
    os.makedirs(os.path.join(ROOT, sub), exist_ok=True)
    with open(os.path.join(ROOT, sub, name), "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def npy(descr, shape, data, fortran=False, version=1):
    shape_text = "(" + "".join(f"{d}, " for d in shape)[:-2] + ("," if len(shape) == 1 else "") + ")"
    header = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, fortran, shape_text)
    prefix = 10 if version == 1 else 12
    header += " " * ((64 - (prefix + len(header) + 1) % 64) % 64) + "\n"
    length = struct.pack("<H", len(header)) if version == 1 else struct.pack("<I", len(header))
    return b"\x93NUMPY" + bytes([version, 0]) + length + header.encode("latin1") + data


# ---- npy ------------------------------------------------------------------------------
f4 = [1.0, -2.5, 0.0, 3.0e-8, 65504.0, -1.0e-40]
write("npy", "f4_2x3.npy", npy("<f4", (2, 3), struct.pack("<6f", *f4)))
write("npy", "f4_be_fortran.npy", npy(">f4", (3, 2), struct.pack(">6f", *f4), fortran=True))
write("npy", "f2_le.npy", npy("<f2", (5,), struct.pack("<5H", 0x3C00, 0x0001, 0x7BFF, 0xFC00, 0x7E00)))
write("npy", "f2_be_v2.npy", npy(">f2", (2, 2), struct.pack(">4H", 0x3C00, 0x8001, 0x0400, 0x7C00), version=2))
# float64 values that narrow to 0 and to inf in fp32, and a NaN.
write("npy", "f8_narrow_v3.npy", npy("<f8", (4,), struct.pack("<4d", 1e-50, 1e300, -0.5, float("nan")), version=3))
write("npy", "f8_be.npy", npy(">f8", (1, 1, 2), struct.pack(">2d", 2.0**-20, -(2.0**20))))
write("npy", "scalar.npy", npy("<f4", (), struct.pack("<f", 0.125)))
write("npy", "empty.npy", npy("<f4", (0, 3), b""))
# Near-valid: an integer dtype, a value short, a dict key misspelt.
write("npy", "bad_i4.npy", npy("<i4", (3,), struct.pack("<3i", 1, 2, 3)))
write("npy", "bad_short.npy", npy("<f4", (4,), struct.pack("<3f", 1.0, 2.0, 3.0)))
write("npy", "bad_key.npy", npy("<f4", (1,), struct.pack("<f", 1.0)).replace(b"'shape'", b"'shapo'"))
fixtures = os.path.join(os.path.dirname(ROOT), "..", "tests", "cli", "fixtures")
shutil.copy(os.path.join(fixtures, "inspect_spread.npy"), os.path.join(ROOT, "npy", "inspect_spread.npy"))

# ---- cli ------------------------------------------------------------------------------
CLI = {
    "formats": ["formats"],
    "formats_value": ["formats", "--value", "1e-7"],
    "formats_hex": ["formats", "--value=0x1p-24"],
    "memory": ["memory", "--params", "7e9", "--optimizer", "sgd-momentum", "--precision", "bf16-pure"],
    "scaler_replay": ["scaler", "replay", "--preset", "torch", "--set", "growth_factor=2", "--set",
                      "backoff_factor=0.25", "--set", "growth_interval=2", "--overflows", "001", "--json"],
    "scaler_bad": ["scaler", "replay", "--preset", "deepspeed", "--set", "backoff_factor=0.25", "--overflows", "01"],
    "train": ["train", "--steps", "3", "--precision", "bf16", "--loss-scale", "static:1024", "--out", "runs/x"],
    "train_config": ["train", "--config", "c.json", "--lr", "1e-3", "--inject-overflow-at", "2,3", "--resume", "r"],
    "train_help": ["train", "--help"],
    "compare": ["compare", "--quick", "--only", "fp32,fp16-static", "--static-scale", "512", "--json", "c.json"],
    "inspect": ["inspect", "g.npy", "--formats", "fp16,e4m3", "--max-scale-log2", "8", "--every", "2", "--json"],
    "bench": ["bench", "formats", "--benchmark_filter=none", "--benchmark_min_time=0.01"],
    "report": ["report", "run1", "run2", "--out", "r.html", "--title", "t"],
    "version": ["--version"],
    "unknown": ["frobnicate", "x"],
}
for name, args in CLI.items():
    write("cli", name + ".args", "\0".join(args))
write("cli", "newlines.args", "train\n--steps\n3\n--model\nmlp\n")

# ---- config ---------------------------------------------------------------------------
write("config", "empty.json", "{}")
write("config", "small.json", '{"steps": 3, "precision": "fp16", "loss-scale": "torch", "lr": 0.01, "warmup": 1,'
      ' "inject-overflow-at": [2], "vocab": "word:64", "model": "mlp"}\n')
write("config", "bad_type.json", '{"steps": "3"}')
write("config", "bad_nested.json", '{"steps": [1, {"a": null}], "lr": 1e400}')
shutil.copy(os.path.join(fixtures, "train_malformed.json"), os.path.join(ROOT, "config", "train_malformed.json"))
shutil.copy(os.path.join(fixtures, "train_unknown_key.json"), os.path.join(ROOT, "config", "train_unknown_key.json"))

# ---- dictionaries -----------------------------------------------------------------------
def dict_file(name, words):
    lines = []
    for w in sorted(set(words)):
        escaped = "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else "\\x%02x" % ord(c) for c in w)
        lines.append('"%s"' % escaped)
    with open(os.path.join(os.path.dirname(ROOT), name), "w") as f:
        f.write("# libFuzzer dictionary, written by fuzz/make_text_seeds.py\n" + "\n".join(lines) + "\n")


names = set()


def walk(v):
    if isinstance(v, dict):
        for k, x in v.items():
            names.add(k)
            walk(x)
    elif isinstance(v, list):
        for x in v:
            walk(x)
    elif isinstance(v, str) and v:
        names.add(v)


for path in glob.glob(os.path.join(ROOT, "config", "*")):
    try:
        walk(json.load(open(path)))
    except ValueError:
        pass
words = ["none", "dynamic", "static:", "fp32", "fp16", "bf16", "fp16-pure", "bf16-pure", "adam", "adamw", "sgd",
         "sgd-momentum", "word:", "char", "gpt", "mlp", "mixprec", "torch", "deepspeed", "megatron", "apex", "keras",
         "tf-keras", "jmp", "static", "inf", "nan"]
numbers = ["1e400", "-0", "0.5", "1e-45", "18446744073709551616", "-1", "2147483648", "4294967296"]
dict_file("config.dict", ['"%s"' % n for n in names | set(words)] + numbers +
          ["null", "true", "false", "[]", "{}", ":", ","])
tools = os.path.join(os.path.dirname(ROOT), "..", "tools", "mixprec")
flags = set()
for path in glob.glob(os.path.join(tools, "cmd_*.cpp")):
    flags.update(re.findall(r'"(--[a-z0-9-]+)"', open(path).read()))
keys = list(json.load(open(os.path.join(ROOT, "config", "config_default.json"))))  # train's --KEY flags
commands = ["formats", "bench", "memory", "scaler", "replay", "train", "compare", "inspect", "report", "gemm", "optim"]
dict_file("cli.dict", sorted(flags) + ["--" + k for k in keys] + ["--help", "-h", "--version", "="] + commands + words +
          numbers + ["0x1p-24", "1,2"])
print("make_text_seeds: wrote seeds under", ROOT, "and fuzz/config.dict, fuzz/cli.dict")
