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

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t
    kernels = [e for e in prof.key_averages()  # GPU-side copies of named ranges (ours, the optimizer's) are not kernels
               if str(getattr(e, "device_type", "")).endswith("CUDA") and not _is_range(e)]
    kernels.sort(key=_device_us, reverse=True)
    total_us = sum(_device_us(e) for e in kernels)
    rows = [{"kernel": e.key[:120], "count": e.count, "ms": _device_us(e) / 1e3} for e in kernels[:40]]
    events = prof.events()
    merged = _busy_spans(events)
    busy_s = sum(end - start for start, end in merged) / 1e6
    summary = {"label": label, "wall_s": wall, "kernel_s": total_us / 1e6, "gpu_busy_s": busy_s,
               "kernel_launches": sum(e.count for e in kernels), "top_kernels": rows,
               "by_class": kernel_classes(kernels)}
    log(f"profile {label}: {wall:.3f} s wall, {total_us / 1e6:.3f} s of kernels, GPU busy {busy_s:.3f} s, "
        f"{summary['kernel_launches']} kernels")
    log("  by class: " + ", ".join(f"{name} {c['ms']:.2f} ms in {c['count']} kernels"
                                   for name, c in summary["by_class"].items()))
    for row in rows[:top]:
        log(f"  {row['ms']:9.2f} ms {row['count']:7d}x  {row['kernel']}")
    summary["top_host_ops"] = _top_host_ops(prof, log)
    summary["phases"] = gpu_idle_by_phase(events, merged, log)
    return summary


KERNEL_CLASSES = (  # first match wins; a kernel's class is read from its name
    ("attention", ("attention", "attn", "fmha", "flash", "_partial_kernel", "_combine_kernel", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "splitk", "matmul", "mm_")),
    ("copy", ("memcpy", "memset", "direct_copy", "index_copy", "_write_kernel")),
)


INDUCTOR_FUSED = ("triton_poi_", "triton_red_", "triton_per_")  # pointwise / reduction kernels torch.compile fused


def kernel_classes(kernels):
    """Device time and launches per class of kernel (attention, GEMM, copies, everything else). torch.compile's fused
    element-wise kernels are "other" even when their names list the ops they were fused around."""
    out = {name: {"ms": 0.0, "count": 0} for name, _ in KERNEL_CLASSES + (("other", ()),)}
    for e in kernels:
        name = e.key.lower()
        cls = "other" if name.startswith(INDUCTOR_FUSED) else next(
            (c for c, keys in KERNEL_CLASSES if any(k in name for k in keys)), "other")
        out[cls]["ms"] += _device_us(e) / 1e3
        out[cls]["count"] += e.count
    return out


def _top_host_ops(prof, log, top=12):
    """The operators with the most host time of their own (e.g. a first call that builds a cuDNN plan or compiles)."""
    ops = [e for e in prof.key_averages() if str(getattr(e, "device_type", "")).endswith("CPU") and not _is_range(e)]
    ops.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = [{"op": e.key[:100], "count": e.count, "self_host_ms": e.self_cpu_time_total / 1e3} for e in ops[:top]]
    log("  host time by operator (own):")
    for row in rows:
        log(f"  {row['self_host_ms']:9.2f} ms {row['count']:7d}x  {row['op']}")
    return rows


def _is_range(event):
    """A named range (record_function: dschat's phases, ``Optimizer.step#...``), not work the GPU did."""
    name = event.key if hasattr(event, "key") else event.name  # averaged events have only a key
    return getattr(event, "is_user_annotation", False) or name.startswith(
        ("dschat.", "Optimizer.step#"))


def _busy_spans(events):
    """The GPU's busy time as sorted, merged [start, end] spans (microseconds, the profiler's clock)."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA and not _is_range(e))
    merged = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _busy_within(merged, starts, lo, hi):
    """Microseconds of [lo, hi] inside the merged busy spans (``starts``: their start times)."""
    import bisect

    if not merged:
        return 0.0
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    busy = 0.0
    for start, end in merged[i:]:
        if start >= hi:
            break
        busy += max(0.0, min(end, hi) - max(start, lo))
    return busy


def gpu_idle_by_phase(events, merged, log):
    """For each ``dschat.*`` range (trainer phases, see dschat/rlhf/trainer.py): its host time and how much of it
    the GPU sat idle. Idle time inside a phase means the GPU waited for the host there (Python, launches, syncs)."""
    from torch.autograd import DeviceType

    starts = [start for start, _ in merged]
    table = {}
    for e in events:
        if e.device_type != DeviceType.CPU or not e.name.startswith("dschat."):
            continue
        lo, hi = e.time_range.start, e.time_range.end
        row = table.setdefault(e.name, {"phase": e.name, "count": 0, "host_ms": 0.0, "gpu_idle_ms": 0.0})
        row["count"] += 1
        row["host_ms"] += (hi - lo) / 1e3
        row["gpu_idle_ms"] += (hi - lo - _busy_within(merged, starts, lo, hi)) / 1e3
    rows = sorted(table.values(), key=lambda r: r["phase"])
    for r in rows:
        log(f"  {r['phase']:<34}{r['count']:>4}x {r['host_ms']:9.1f} ms host, GPU idle {r['gpu_idle_ms']:8.1f} ms")
    return rows


def profile_host(fn, label, log, top=25):
    """Run ``fn`` once under cProfile, with Python's garbage-collector pauses timed: where a host-bound phase spends
    its time (functions by own time; the collector's pauses by generation)."""
    import cProfile
    import gc
    import io
    import pstats

    pauses, started = {}, {}

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            gen = info["generation"]
            count, seconds = pauses.get(gen, (0, 0.0))
            pauses[gen] = (count + 1, seconds + time.perf_counter() - started.pop("t"))

    gc.callbacks.append(on_gc)
    profiler = cProfile.Profile()
    try:
        t = time.perf_counter()
        profiler.runcall(fn)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    finally:
        gc.callbacks.remove(on_gc)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    gc_line = ", ".join(f"gen{g}: {c}x {s * 1e3:.1f} ms" for g, (c, s) in sorted(pauses.items())) or "none"
    log(f"host profile {label}: {wall:.3f} s wall (under cProfile); garbage-collector pauses: {gc_line}")
    log("\n".join(text.getvalue().splitlines()[:top + 12]))
    return {"label": label, "wall_s": wall, "gc_pauses": {str(g): {"count": c, "seconds": s}
                                                           for g, (c, s) in pauses.items()}}
