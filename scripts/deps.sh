#!/usr/bin/env bash
# Installs the Debian packages mixprec needs, and only those that are missing.
# Idempotent: a second run installs nothing and prints one line.
#
#   scripts/deps.sh          build and run (make run, make release): the Debian packages, then
#                            oneDNN $ONEDNN_VERSION (oneDNN 3.2, the OpenMP CPU build, and its headers
#                            and CMake package) from PyPI into a venv in build/onednn-venv
#                            (MIXPREC_ONEDNN_VENV overrides), which the build prefers to
#                            Debian's libdnnl-dev 2.6 (docs/gemm.md); where PyPI cannot be
#                            reached it says so and the build uses 2.6. Nothing if present.
#   scripts/deps.sh test     also what the tests need: chromium (headless screenshots of
#                            `mixprec report`, tests/report) and python3-pil (their check)
#   scripts/deps.sh fuzz     also what the fuzz targets need: clang (libFuzzer ships with
#                            clang only), its sanitizer/libFuzzer runtimes and LLVM's OpenMP
#                            (omp.h and the runtime clang's -fopenmp links); Debian 12 names
#   scripts/deps.sh torch    also libtorch for mixprec::torch (docs/libtorch.md): python3-venv,
#                            then a venv in build/torch-venv (MIXPREC_TORCH_VENV overrides)
#                            with the PyPI wheel torch==$TORCH_VERSION installed --no-deps
#                            (about 1.4 GB; only its C++ part, include/ and lib/, is used).
#                            Never the system Python's site-packages; nothing if present.
#   scripts/deps.sh python   also what the Python package needs to build and test (docs/python.md):
#                            python3-venv and python3-dev, then a venv in build/py-venv
#                            (MIXPREC_PY_VENV overrides) with the build requirements
#                            (scikit-build-core, nanobind) and the test ones (numpy, pytest,
#                            ml_dtypes) from PyPI, and torch==$TORCH_VERSION with its
#                            dependencies (mixprec.torch and its tests import torch; about
#                            4-5 GB), then the peers whose own loss-scale code
#                            tests/python/test_peer_replays.py replays: jax and jaxlib (CPU),
#                            jmp, keras (3), megatron-core, and deepspeed (an sdist: built with
#                            DS_BUILD_OPS=0, --no-build-isolation against the venv's torch,
#                            --no-deps with its Python dependencies named below; about 650 MB,
#                            under a minute). Pinned versions, under a constraint that keeps
#                            the venv's torch and numpy; then, under the same constraint, what
#                            the integration, low-precision and property tests use: torchvision,
#                            torchao, transformers, accelerate, lightning, tensorboard, hypothesis
#                            (EXTRA_PACKAGES). Nothing if the venv already has them.
set -euo pipefail

TORCH_VERSION=2.15.0
# oneDNN 3.2 as Intel publishes it on PyPI: the library (GNU OpenMP runtime, CPU only) and
# its headers and CMake package, of the same release.
ONEDNN_VERSION=2023.2.0
ONEDNN_PACKAGES=("onednn-cpu-gomp==$ONEDNN_VERSION" "onednn-devel-cpu-gomp==$ONEDNN_VERSION")
want_torch=0
want_python=0
PY_PACKAGES=("scikit-build-core>=0.10" "nanobind>=2.0" numpy pytest ml_dtypes)
# The peers of tests/python/test_peer_replays.py (pinned there too, and in docs/python.md).
PEER_PACKAGES=(jax==0.10.2 jaxlib==0.10.2 jmp==0.0.4 keras==3.15.1 megatron-core==0.16.1)
# What the integrations, the low-precision recipes and the property tests are tested against
# (docs/python.md): torchvision (ResNet-18), torchao (its MX/NVFP4 emulation), Hugging Face
# transformers and accelerate, Lightning, TensorBoard (its event reader) and Hypothesis.
# Pinned; installed under the same constraint that keeps the venv's torch and numpy.
EXTRA_PACKAGES=(torchvision==0.29.2 torchao==0.18.0 transformers==5.24.0 accelerate==1.15.0
  lightning==2.6.6 tensorboard==2.21.0 hypothesis==6.170.17)
DEEPSPEED_PACKAGES=(deepspeed==0.19.8  # sdist; with --no-deps, so its dependencies follow
  hjson==3.1.0 msgpack==1.2.4 psutil==7.2.2 py-cpuinfo==9.0.0 pydantic==2.14.4 pydantic_core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 tqdm==4.70.1 einops==0.8.2)

packages=(
  g++ cmake ninja-build make pkg-config
  ccache                          # rebuilds (a second clone, the ASan and Python builds of make test) from its cache
  libgtest-dev libgmock-dev libbenchmark-dev
  libfmt-dev libcli11-dev nlohmann-json3-dev
  libdnnl-dev ocl-icd-opencl-dev  # oneDNN; its CMake config (GPU runtime OCL) needs OpenCL dev files
  openmpi-bin libopenmpi-dev      # mixprec train --distributed (mpirun) and its tests (docs/distributed.md)
  python3 python3-venv            # the venv of oneDNN 3.2 from PyPI (below)
)
for set in "$@"; do
  case "$set" in
    test) packages+=(chromium python3-pil) ;;
    fuzz) packages+=(clang libclang-rt-14-dev libomp-14-dev) ;;
    torch) packages+=(python3 python3-venv); want_torch=1 ;;
    python) packages+=(python3 python3-venv python3-dev); want_python=1 ;;
    *) echo "deps: unknown package set '$set'; allowed: test, fuzz, torch, python" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [ "$status" = "installed" ] || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "deps: all ${#packages[@]} packages present"
else
  echo "deps: installing ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "deps: need root to install packages (run as root or: sudo apt-get install ${missing[*]})" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# oneDNN 3.2 from PyPI, in a venv of its own (docs/gemm.md). Not fatal: without it the
# build links Debian's oneDNN 2.6 and says so.
onednn_venv=${MIXPREC_ONEDNN_VENV:-build/onednn-venv}
have=$("$onednn_venv/bin/python" -c 'import importlib.metadata as m; print(m.version("onednn-devel-cpu-gomp"), m.version("onednn-cpu-gomp"))' 2>/dev/null || true)
if [ "$have" = "$ONEDNN_VERSION $ONEDNN_VERSION" ]; then
  echo "deps: oneDNN $ONEDNN_VERSION (3.2) present in $onednn_venv"
else
  echo "deps: installing ${ONEDNN_PACKAGES[*]} into the venv $onednn_venv"
  if { [ -x "$onednn_venv/bin/python" ] || python3 -m venv "$onednn_venv"; } &&
     "$onednn_venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "${ONEDNN_PACKAGES[@]}"; then
    :
  else
    echo "deps: oneDNN $ONEDNN_VERSION could not be installed from PyPI; the build uses Debian's oneDNN 2.6 (docs/gemm.md)" >&2
  fi
fi

# libtorch from the PyPI torch wheel, in a venv of its own (docs/libtorch.md).
if [ "$want_torch" = 1 ]; then
  venv=${MIXPREC_TORCH_VENV:-build/torch-venv}
  have=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
  if [ "$have" = "$TORCH_VERSION" ]; then
    echo "deps: torch $TORCH_VERSION present in $venv"
  else
    echo "deps: installing torch==$TORCH_VERSION (C++ part used) into the venv $venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "torch==$TORCH_VERSION"
  fi
fi

# The Python package's build and test requirements, in a venv of its own (docs/python.md).
if [ "$want_python" = 1 ]; then
  venv=${MIXPREC_PY_VENV:-build/py-venv}
  if "$venv/bin/python" -c 'import scikit_build_core, nanobind, numpy, pytest, ml_dtypes' 2>/dev/null; then
    echo "deps: Python build and test packages present in $venv"
  else
    echo "deps: installing ${PY_PACKAGES[*]} into the venv $venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${PY_PACKAGES[@]}"
  fi
  # mixprec.torch (GradScaler) and its tests import torch: the full wheel with its Python
  # dependencies (import torch needs the nvidia-* libraries too; --no-deps is not enough).
  have=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
  if [ "$have" = "$TORCH_VERSION" ]; then
    echo "deps: torch $TORCH_VERSION present in $venv"
  else
    echo "deps: installing torch==$TORCH_VERSION (with its dependencies, for import torch) into the venv $venv"
    t0=$(date +%s)
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==$TORCH_VERSION"
    echo "deps: torch installed in $(( $(date +%s) - t0 )) s"
  fi
  # The peers' own loss-scale code (tests/python/test_peer_replays.py), pinned. Present means
  # importlib.metadata finds each pinned version (nothing is imported: quick when present).
  missing_peers=$("$venv/bin/python" - "${PEER_PACKAGES[@]}" "${DEEPSPEED_PACKAGES[@]}" "${EXTRA_PACKAGES[@]}" <<'PY'
import importlib.metadata as m, sys
for spec in sys.argv[1:]:
    name, version = spec.split("==")
    try:
        have = m.version(name)
    except m.PackageNotFoundError:
        have = None
    if have != version:
        print(spec)
PY
)
  if [ -z "$missing_peers" ]; then
    echo "deps: loss-scale peers and integration packages present in $venv"
  else
    echo "deps: installing the loss-scale peers and integration packages into the venv $venv:" $missing_peers
    t0=$(date +%s)
    # Keep the venv's torch and numpy whatever a peer asks for (pip fails rather than change them).
    constraints=$(mktemp)
    "$venv/bin/python" -c 'import importlib.metadata as m; print("torch==" + m.version("torch")); print("numpy==" + m.version("numpy"))' > "$constraints"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints" "${PEER_PACKAGES[@]}"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints" "${EXTRA_PACKAGES[@]}"
    # DeepSpeed's setup.py imports torch: build against the venv's (no isolation), no ops compiled.
    DS_BUILD_OPS=0 "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints" \
      --no-build-isolation --no-deps "${DEEPSPEED_PACKAGES[@]}"
    rm -f "$constraints"
    echo "deps: loss-scale peers and integration packages installed in $(( $(date +%s) - t0 )) s"
  fi
fi
