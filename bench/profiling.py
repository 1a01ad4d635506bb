"""Kernel-time summaries from torch.profiler, shared by the GPU benchmarks: how much of a phase's wall time the GPU
spends in kernels, and in which ones (bandwidth-bound GEMMs and attention, or many small kernels)."""
import time

import torch


def _device_us(event):
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)


def profile_kernels(fn, label, log, top=20):
    """Run ``fn`` once under torch.profiler; log and return wall seconds, kernel seconds, launches and the top
    kernels by their own device time. Kernel seconds well under wall seconds: the phase waits on the host."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernels = [e for e in prof.key_averages() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    kernels.sort(key=_device_us, reverse=True)
    total_us = sum(_device_us(e) for e in kernels)
    rows = [{"kernel": e.key[:120], "count": e.count, "ms": _device_us(e) / 1e3} for e in kernels[:40]]
    summary = {"label": label, "wall_s": wall, "kernel_s": total_us / 1e6,
               "kernel_launches": sum(e.count for e in kernels), "top_kernels": rows}
    log(f"profile {label}: {wall:.3f} s wall, {total_us / 1e6:.3f} s of kernels, {summary['kernel_launches']} kernels")
    for row in rows[:top]:
        log(f"  {row['ms']:9.2f} ms {row['count']:7d}x  {row['kernel']}")
    return summary
