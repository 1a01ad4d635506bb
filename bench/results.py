"""Where the GPU benchmarks leave their results: JSON files under $OUT (the device tool brings them back)."""
import json
import os
import subprocess
import sys
import tempfile


def require_cuda(cpu_alternative=None):
    """Stop with one line when torch sees no CUDA GPU (a CPU machine, a CPU build of torch): a GPU benchmark otherwise
    fails deep inside its first CUDA call ("Torch not compiled with CUDA enabled"). ``cpu_alternative``: what runs
    on the CPU instead, e.g. "--smoke checks the script on the CPU"."""
    import torch

    if not torch.cuda.is_available():
        hint = f"; {cpu_alternative}" if cpu_alternative else ""
        raise SystemExit(f"{os.path.basename(sys.argv[0])} needs a CUDA GPU, and torch {torch.__version__} sees none "
                         f"(run it through the device tool){hint}")


def write_json(name, payload):
    """``payload`` as $OUT/``name``; nothing when $OUT is not set (a run by hand prints its table only)."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, name), "w") as f:
            json.dump(payload, f, indent=1)


def run_in_fresh_processes(script, runs):
    """``script`` once per ``(label, argv)`` of ``runs``, each in a fresh Python process whose $OUT is a temporary
    folder, one after another; yields ``(label, payload, returncode)`` with the JSON the run wrote to
    ``$OUT/<label>.json`` (``--json <label>.json`` is added to its argv; argparse keeps the last), or None when it
    wrote none. What each run prints
    goes to this process's output. Why: nothing one run leaves in its process (tuning records, compiled code, memory)
    can change the next one's timing (the tenth session's mistuned second A/B rows, docs/benchmarks.md), and one
    run's failure cannot take the others with it."""
    with tempfile.TemporaryDirectory(prefix="dschat_bench_runs_") as tmp:
        for label, argv in runs:
            proc = subprocess.run([sys.executable, os.path.abspath(script), *argv, "--json", f"{label}.json"],
                                  env={**os.environ, "OUT": tmp})
            path = os.path.join(tmp, f"{label}.json")
            payload = None
            if os.path.exists(path):
                with open(path) as f:
                    payload = json.load(f)
                os.remove(path)
            yield label, payload, proc.returncode
