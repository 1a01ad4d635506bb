"""Plot generation seconds against batch size, with the bandwidth floor of the same runs, from bench JSON results.

    python bench/plot.py docs/results/2026-11-29_generation_opt-1.3b_graph_*.json \
        docs/results/2026-11-30_generation_qwen2.5-7b_*.json --out docs/generation_vs_floor.png

One panel per model; one line per variant (median seconds of each batch size; where several files measured the same
variant and batch, the newest file's row wins); the floor as a dashed line. Each panel's title names the GPU its rows
record; for files written before generation.py recorded it, the GPU that the ``gpu.txt`` beside the file names (the
GPU calls' ``nvidia-smi --query-gpu=name,... --format=csv``), else ``--device`` (docs/results' flat files of 2026-11-29
and -30 ran on an NVIDIA H200, docs/benchmarks.md), else the title says the GPU was not recorded and the files are
named on stderr. Runs on the CPU (matplotlib only).
"""
import argparse
import json
import os
import re
import sys
from collections import defaultdict

LABELS = {"floor": "bandwidth floor", "hf_static": "HF generate, static cache", "hf_dynamic": "HF generate, dynamic",
          "dschat_z0": "dschat ZeRO-0, eager", "dschat_z0_graph": "dschat ZeRO-0, CUDA graph",
          "dschat_z3_graph": "dschat ZeRO-3, CUDA graph (gather incl.)",
          "dschat_z0_graph_compiled": "dschat ZeRO-0, graph + compile (fused)",
          "dschat_z3_graph_compiled": "dschat ZeRO-3, graph + compile",
          "dschat_z0_graph_compiled_nofuse": "dschat ZeRO-0, graph + compile, unfused"}
LABELS.update({f"{variant}+triton": f"{label}, Triton attention" for variant, label in list(LABELS.items())
               if variant.startswith("dschat")})


def variant_key(row):
    """Rows measured with dschat's Triton decode attention are their own line (older rows have no such field; the
    ``_sdpa`` variants measured SDPA like them). ``_fuse`` is what auto does on CUDA since the seventh session, so it
    joins the plain variant's line (leave out older unfused ``_compiled`` rows with ``--skip``)."""
    variant = row["variant"].replace("_sdpa", "").removesuffix("_fuse")
    return variant + ("+triton" if row.get("decode_attention") == "triton" else "")


DATED = re.compile(r"\d{4}-\d{2}-\d{2}")


def run_order(path):
    """Sort key putting later runs last: the date, then the session number as a number (``_s10_`` after ``_s9_``,
    which a plain string sort gets wrong). The date is the last part of the path that starts with one: a session's
    folder (``2026-12-06_s52/speed/generation.json``) as well as a file's name; by the name alone, every session's
    ``generation.json`` tied, and the order of the command line chose which session's row won."""
    parts = os.path.normpath(path).split(os.sep)
    dated = [i for i, part in enumerate(parts) if DATED.match(part)]
    stamp = "/".join(parts[dated[-1]:]) if dated else parts[-1]
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", stamp)]


UNRECORDED = "GPU not recorded"
GPU_FILE = "gpu.txt"


def neighbour_device(folder):
    """The GPU named by ``folder``'s gpu.txt (nvidia-smi's CSV of names, with or without its header), where it names
    one kind; None where there is no such file or it names several (which of them ran a file's rows is unknown)."""
    try:
        with open(os.path.join(folder, GPU_FILE)) as f:
            lines = [line.split(",")[0].strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError):
        return None
    names = {name for name in lines if name != "name"}  # (the header's first column)
    return names.pop() if len(names) == 1 else None


def load_rows(paths, skip=()):
    """{model: {variant: {batch: seconds}}}, later files overriding earlier ones; floors as variant "floor". ``skip``:
    "PART:variant" pairs left out (a row whose meaning a later change of defaults altered; ``skipped_by``)."""
    return load_panels(paths, skip)[0]


def load_panels(paths, skip=(), unrecorded_device=None):
    """(``load_rows``'s table, {model: the set of GPU names its plotted rows record}); a row that records none counts
    as the GPU of the gpu.txt beside its file (``neighbour_device``), else as ``unrecorded_device``, else as UNRECORDED
    (its files named on stderr: a figure titled "GPU not recorded" said nothing of how to name it)."""
    table = defaultdict(lambda: defaultdict(dict))
    measured_on = defaultdict(dict)  # {model: {(variant, batch): (GPU, file)}}: a later file's row replaces its GPU too
    skipped = set()
    for path in sorted(paths, key=run_order):
        file_device = neighbour_device(os.path.dirname(os.path.abspath(path))) or unrecorded_device
        for r in generation_rows(path):
            if pairs := skipped_by(path, r.get("variant"), skip):
                skipped.update(pairs)
                continue
            if not r.get("ok") or "model" not in r:
                continue
            table[r["model"]][variant_key(r)][r["batch"]] = r["seconds"]
            table[r["model"]]["floor"][r["batch"]] = r["floor_s"]
            measured = (r.get("device") or file_device or UNRECORDED, path)
            measured_on[r["model"]].update({(variant_key(r), r["batch"]): measured, ("floor", r["batch"]): measured})
    # (a pair that left out nothing, e.g. a misspelt variant or a folder not on the file's path, plotted the row it was
    # meant to leave out, and said nothing)
    if unmatched := sorted(set(skip) - skipped):
        raise SystemExit(f"--skip {','.join(unmatched)}: no row of that variant in a results file of that name or "
                         "folder (a file's name, a folder on its path such as a session's, or several of its parts in "
                         "a row, then ':' and a variant of its rows)")
    plotted = [measured for points in measured_on.values() for measured in points.values()]
    if unnamed := sorted({path for device, path in plotted if device == UNRECORDED}, key=run_order):
        print(f"plot.py: {', '.join(unnamed)}: rows that record no GPU, and no {GPU_FILE} beside them names one: their "
              "panels say 'GPU not recorded'; give --device NAME (e.g. 'NVIDIA H200'; docs/benchmarks.md says which "
              "GPU each session's calls ran on)", file=sys.stderr)
    return table, {model: {device for device, _ in points.values()} for model, points in measured_on.items()}


def skipped_by(path, variant, skip):
    """The pairs of ``skip`` that leave out ``path``'s rows of ``variant``: "PART:variant", where PART is the file's
    name, a folder on its path (a session's, ``2026-12-06_s52``: newer sessions keep
    ``<session>/<call>/generation.json``, and the file name alone named every session's) or several of its parts in a
    row (``2026-12-06_s52/speed/generation.json``)."""
    parts = path_parts(os.path.abspath(path))
    pairs = set()
    for pair in skip:
        where, colon, skipped_variant = pair.rpartition(":")
        if colon and skipped_variant == variant and holds_run(parts, path_parts(where)):
            pairs.add(pair)
    return pairs


def path_parts(path):
    return [part for part in os.path.normpath(path).split(os.sep) if part not in ("", os.curdir)]


def holds_run(parts, run):
    """Whether ``run`` is a run of consecutive items of ``parts``."""
    return bool(run) and any(parts[i:i + len(run)] == run for i in range(len(parts) - len(run) + 1))


def panel_title(model, devices):
    """The model and the GPU its rows were measured on (each row records it): a panel whose rows come from several
    GPUs says so rather than naming one."""
    if len(devices) == 1:
        (device,) = devices
        gpu = device if device == UNRECORDED else f"one {device}"
    else:
        names = sorted(devices)
        gpu = f"rows from {', '.join(names[:-1])} and {names[-1]}"
    return f"{model} shape, {gpu}, bf16"


def generation_rows(path):
    """The rows of one bench/generation.py result file. A missing file, or another benchmark's JSON (a glob over
    docs/results/ takes ppo_iteration's and graph_equality's too), is an error naming the file, not a traceback."""
    try:
        with open(path) as f:
            payload = json.load(f)
    except (OSError, ValueError) as error:
        raise SystemExit(f"{path}: {error}") from None
    args = payload.get("args") if isinstance(payload, dict) else None
    # (the other benchmarks' results have rows too; generation.py's alone were run with --models and --variants)
    if not isinstance(args, dict) or not {"models", "variants"} <= set(args) \
            or not isinstance(payload.get("rows"), list):
        raise SystemExit(f"{path}: not a bench/generation.py result (no \"rows\" of a run with --models and "
                         "--variants)")
    return payload["rows"]


def plot(table, devices, out):
    """Writes the figure to ``out``; returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    models = sorted(table)
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        order = list(LABELS)
        for variant, points in sorted(table[model].items(), key=lambda kv: order.index(kv[0]) if kv[0] in order
                                      else len(order)):
            batches = sorted(points)
            # the same colour for a variant in every panel
            color = plt.cm.tab20(order.index(variant) % 20) if variant in order else None
            # (the floor's marker: a file of one batch size makes it one point, which a line alone does not draw)
            style = dict(linestyle="--", color="black", marker="_", markersize=14) if variant == "floor" else \
                dict(marker="o", color=color)
            ax.plot(batches, [points[b] for b in batches], label=LABELS.get(variant, variant), **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # the eager loop is 10x the others
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlabel("batch size (256 prompt + 256 sampled tokens)")
        ax.set_ylabel("seconds per generation")
        ax.set_title(panel_title(model, devices[model]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return fig


def check_out(path):
    """``--out`` checked before any file is read: a folder, or a path through a file, failed in matplotlib's savefig
    with a traceback once the figure was drawn (a missing folder is made, as the results' folders are)."""
    if os.path.isdir(path):
        raise SystemExit(f"--out {path}: a folder; give the image file to write, e.g. "
                         f"{os.path.join(path, 'generation_vs_floor.png')}")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise SystemExit(f"--out {path}: {parent} is a file, not a folder")


def main():
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("results", nargs="+", help="JSON files written by bench/generation.py")
    p.add_argument("--out", default="docs/generation_vs_floor.png")
    p.add_argument("--skip", default="",
                   help="comma-separated PART:variant pairs to leave out; PART: a results file's name, a folder on "
                        "its path (e.g. a session's, 2026-12-06_s52) or several of its parts in a row "
                        "(2026-12-06_s52/speed/generation.json)")
    p.add_argument("--device", default=None,
                   help="The GPU of rows that record none (files written before generation.py recorded it) and "
                        "have no gpu.txt beside them naming one, e.g. 'NVIDIA H200'; else their panel's title says "
                        "the GPU was not recorded.")
    args = p.parse_args()
    check_out(args.out)
    table, devices = load_panels(args.results, set(filter(None, args.skip.split(","))), args.device)
    if not table:  # (matplotlib's "Number of columns must be a positive integer" otherwise)
        raise SystemExit("no measured row to plot in " + ", ".join(args.results))
    plot(table, devices, args.out)


if __name__ == "__main__":
    main()
