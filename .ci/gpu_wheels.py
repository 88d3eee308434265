"""Fill ``.whl/`` with what `.ci/gpu_session.sh` installs on a device machine, which has
torch, transformers and CUDA but reaches no package registry.

Run it here, in the repository's virtual environment, before carrying ``.whl``:

    .venv/bin/python .ci/gpu_wheels.py

It writes NexRL's own distributions as wheels built from this tree (their entry points
are what register the plugins, so a wheel of an older tree registers modules that moved),
and downloads, for the device's Python (3.12, x86-64), every distribution those and the
GPU benchmark's peers (``trl``) need at the versions installed here, less those the
device's image already holds (``DEVICE_HAS``). It prints the wheelhouse's size, which
must stay well under the 64 MiB a device call carries.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
WHEELHOUSE = ROOT / ".whl"
DISTRIBUTIONS = (
    ".", "plugins/nexrl_engine", "plugins/nexrl_episodes", "nexrl_fsdp", "plugins/nexrl_grpo", "plugins/nexrl_math",
    "plugins/nexrl_remote_api", "plugins/nexrl_service", "plugins/nexrl_sinks", "plugins/nexrl_testing", "nexrl_tinker",
    "nexrl_weaver",
)  # fmt: skip
"""NexRL's distributions, as folders from the repository root."""
PEERS = ("tinker", "tinker-cookbook", "nex-weaver", "trl")
"""What the GPU tests and benchmark drive besides NexRL (the SDKs, TRL's trainer)."""
DEVICE_HAS = frozenset(
    """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-
    cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-
    operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py
    mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
    numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
    nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless opt-einsum opt-einsum-fx optax optimistix orbax-checkpoint packaging pandas pathspec
    patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil py-cpuinfo pyarrow
    pybind11 pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
    pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
    safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentence-transformers sentencepiece
    setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-
    data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torch-geometric
    torchaudio torchdiffeq torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
    typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
    """.split()
)
"""Distributions the device image holds (the device tool's KINDS.md, 'Python packages
already there', as read on 2026-11-17)."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, str]:
    """Every installed distribution ``roots`` need (no extras), name -> version."""
    found: dict[str, str] = {}
    stack = list(roots)
    while stack:
        name = normalized(stack.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found[name] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": "", "python_version": "3.12"}):
                stack.append(requirement.name)
    return found


def distribution_name(folder: str) -> str:
    return normalized(tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]["name"])


def main() -> int:
    """Empty the wheelhouse (two versions of one distribution stop the whole install),
    then fill it."""
    WHEELHOUSE.mkdir(exist_ok=True)
    for old in WHEELHOUSE.glob("*.whl"):
        old.unlink()
    for folder in DISTRIBUTIONS:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(WHEELHOUSE), str(ROOT / folder)], check=True)
    ours = {distribution_name(folder) for folder in DISTRIBUTIONS}
    needed = closure([*ours, *PEERS])
    missing = {
        name: version for name, version in needed.items() if name not in DEVICE_HAS and name not in ours and not name.startswith("nvidia-")
    }
    platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    for name, version in sorted(missing.items()):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
             "--implementation", "cp", *platforms, "-d", str(WHEELHOUSE), f"{name}=={version}"],
            check=True,
        )  # fmt: skip
    size = sum(path.stat().st_size for path in WHEELHOUSE.glob("*.whl"))
    print(f"{len(list(WHEELHOUSE.glob('*.whl')))} wheels in {WHEELHOUSE}, {size / 2**20:.1f} MiB: {', '.join(sorted(missing))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
