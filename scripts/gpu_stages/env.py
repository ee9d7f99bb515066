"""Stage env: what the machine is, before anything is measured on it. Versions, the device and its
multiprocessors, which SDPA backends run (tried, not just flagged), the TF32 flags as a fresh
process has them, and the two ceilings every later number is read against: device copy bandwidth
and bf16 matmul rate."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys

import torch
import torch.nn.functional as F

from gpu_stages.common import REPO, Context, copy_gbps, one_line, time_ms


def run(ctx: Context) -> None:
    ctx.measure("versions", versions)
    ctx.measure("device", lambda: device(ctx))
    ctx.measure("sdpa_backends", lambda: sdpa_backends(ctx))
    ctx.measure("tf32", tf32_flags)
    ctx.measure("ceilings", lambda: ceilings(ctx))
    ctx.measure("nccl_flight_recorder", nccl_flight_recorder)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def nccl_flight_recorder() -> dict:
    """`depthscale trace hang` reads NCCL's recorder through the private
    `_dump_nccl_trace(includeCollectives, includeStackTraces, onlyActive)`
    (observe/flight_recorder.py): on a torch built with NCCL, its arguments are still those."""
    from depthscale.observe.flight_recorder import NCCL_DUMP

    dump = getattr(torch._C._distributed_c10d, NCCL_DUMP, None)
    if dump is None:
        return {"available": False}  # a torch built without NCCL (the dry run's)
    doc = dump.__doc__ or ""
    missing = [
        a for a in ("includeCollectives", "includeStackTraces", "onlyActive") if a not in doc
    ]
    if missing:
        raise AssertionError(f"{NCCL_DUMP} no longer takes {', '.join(missing)}: {doc[:200]}")
    return {"available": True}


def versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError as err:
        triton_version = f"missing ({err})"
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
            timeout=10,
        ).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        rev = None  # the device machine gets a copy of the tree, without .git
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": triton_version,
        "transformers": _version("transformers"),
        "tokenizers": _version("tokenizers"),
        "pytest": _version("pytest"),
        "depthscale_rev": rev,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "env": {
            k: os.environ[k]
            for k in ("CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET", "TORCH_CUDA_SANITIZER")
            if k in os.environ
        },
    }


def device(ctx: Context) -> dict:
    if not ctx.cuda:
        return {"name": "cpu", "processor": platform.processor() or platform.machine()}
    props = torch.cuda.get_device_properties(ctx.device)
    values = {
        "name": props.name,
        "capability": list(torch.cuda.get_device_capability(ctx.device)),
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "l2_mib": round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
        "device_count": torch.cuda.device_count(),
    }
    query = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw"
    try:  # reads only: the card's settings are left as they are
        smi = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=15,
        )  # fmt: skip
        values["nvidia_smi"] = dict(zip(query.split(","), smi.stdout.strip().split(", ")))
    except (OSError, subprocess.SubprocessError) as err:
        values["nvidia_smi"] = f"unavailable: {err}"
    return values


def sdpa_backends(ctx: Context) -> dict:
    """Each SDPA backend tried alone on a causal bf16 GQA forward + backward at the model's head
    size: 'ok', or why it does not run here (CPU has flash and math only)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, Hkv, T, d = (1, 8, 2, 256, 64) if not ctx.dry_run else (1, 4, 2, 32, 16)
    gen = torch.Generator(ctx.device).manual_seed(0)
    q = torch.randn(B, H, T, d, device=ctx.device, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, T, d, device=ctx.device, generator=gen, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    tried = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            tried[name.lower()] = "not in this torch"
            continue
        try:
            with sdpa_kernel(backend):
                qq = q.clone().requires_grad_()
                out = F.scaled_dot_product_attention(qq, k, v, is_causal=True, enable_gqa=True)
                out.float().sum().backward()
            ctx.sync()
            tried[name.lower()] = "ok"
        except Exception as err:  # noqa: BLE001 - a backend that cannot run is a finding
            tried[name.lower()] = one_line(err, 200)
    flags = {}
    for flag in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "cudnn_sdp_enabled",
                 "math_sdp_enabled"):  # fmt: skip
        fn = getattr(torch.backends.cuda, flag, None)
        flags[flag] = fn() if fn else "not in this torch"
    values = {"gqa_causal_bf16": tried, "flags": flags}
    try:
        from torch.nn.attention import flex_attention  # noqa: F401

        values["flex_attention"] = "importable"
    except ImportError as err:
        values["flex_attention"] = f"missing ({err})"
    if ctx.cuda:
        is_available = getattr(torch.backends.cuda, "is_flash_attention_available", None)
        values["flash_built"] = is_available() if is_available else "unknown"
    return values


def tf32_flags() -> dict:
    return {
        "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def ceilings(ctx: Context) -> dict:
    """Copy bandwidth (bytes read + written; 1 GiB buffers on a GPU, well past its L2) and the bf16
    matmul rate on random data: KINDS.md measured ~4.3 TB/s and ~790 TFLOP/s on an H200."""
    n_bytes, n = (2**30, 8192) if ctx.cuda else (2**24, 256)
    gbps = copy_gbps(ctx, n_bytes)
    a = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    ms = time_ms(ctx, lambda: a @ b, warmup=3, reps=10)
    return {
        "copy_gb_per_s": float(f"{gbps:.4g}"),
        "copy_bytes": n_bytes,
        "matmul_bf16_tflops": float(f"{2 * n**3 / (ms * 1e-3) / 1e12:.4g}"),
        "matmul_n": n,
    }
