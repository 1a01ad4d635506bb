"""Where the GPU benchmarks leave their results: JSON files under $OUT (the device tool brings them back)."""
import argparse
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


def list_flag(check):
    """An argparse type: the comma-separated value as given, each item checked by ``check`` (None when it is valid,
    else what is wrong): a name a benchmark has no entry for is a flag error, not a KeyError once the GPU work began."""
    def parse(value):
        for item in value.split(","):
            if wrong := check(item):
                raise argparse.ArgumentTypeError(f"{item!r}: {wrong}")
        return value
    return parse


def unknown_name(known, what):
    """A ``list_flag`` check: the item is a key of ``known``."""
    return lambda name: None if name in known else f"no such {what} (of {', '.join(known)})"


def positive_error(what):
    """A ``list_flag`` check: the item is a positive integer (``dschat.args.positive_int``), ``what`` being e.g.
    "a batch size"."""
    def check(item):
        from dschat.args import positive_int

        try:
            positive_int(item)
        except argparse.ArgumentTypeError as error:
            return f"{what}: {error}"
        return None
    return check


batch_error = positive_error("a batch size")


def choice_error(choices, what):
    """A ``list_flag`` check: the item is one of ``choices`` (strings), ``what`` saying what they are."""
    return lambda item: None if item in choices else f"{what}: {', '.join(choices[:-1])} or {choices[-1]}"


def check_filled(parser, filled, cache):
    """--filled (a count of visible cache slots, or several) within --cache: past it the mask and the cache were cut
    at --cache slots while the row reported the bandwidth of --filled."""
    if too_many := [n for n in filled if n > cache]:
        parser.error(f"--filled {','.join(map(str, too_many))}: more than --cache {cache} slots")


def temperature_flag(text):
    """An argparse type: a sampling temperature in dschat's bounds (``dschat.args.MIN_TEMPERATURE`` to
    ``MAX_TEMPERATURE``, what fp32 sampling can scale logits by; step 3 and chat.py check them too): 0, a negative
    one or nan failed in the hybrid engine's or HF's generate once the model was built, with a traceback."""
    from dschat.args import MAX_TEMPERATURE, MIN_TEMPERATURE

    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        raise argparse.ArgumentTypeError(f"a sampling temperature is a number from {MIN_TEMPERATURE:g} to "
                                         f"{MAX_TEMPERATURE:g}, got {text!r}")
    return value


def top_p_flag(text):
    """An argparse type: a nucleus-sampling top-p in (0, 1] (1: no filtering), which generate takes."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a top-p is a number in (0, 1] (1: no nucleus filtering), got {text!r}")
    return value


# set in the processes run_in_fresh_processes starts: each runs one row of its parent's flags (a check of the whole
# command, e.g. that --profile names one of --batches, is the parent's)
ROW_PROCESS_ENV = "DSCHAT_BENCH_ROW_PROCESS"


def in_row_process():
    return os.environ.get(ROW_PROCESS_ENV) == "1"


def json_name(text):
    """An argparse type for --json: a file name, which ``write_json`` writes under $OUT. A path's folder was joined
    to $OUT (a folder not there: the run failed writing its first result), and an absolute path replaced $OUT (the
    file written outside it, where the device tool brings nothing back)."""
    if not text or os.path.basename(text) != text or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"{text!r}: a file name, written to $OUT (no folder)")
    return text


def write_json(name, payload):
    """``payload`` as $OUT/``name``; nothing when $OUT is not set (a run by hand prints its table only). Written aside
    and renamed: a run killed while writing (its time limit) leaves the file it wrote last whole, not cut off."""
    out = os.environ.get("OUT")
    if out:
        path = os.path.join(out, name)
        with open(path + ".tmp", "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(path + ".tmp", path)


def run_benchmark(main):
    """``main()``, then the process group it started left as torch asks and the process ended with its status: every
    GPU benchmark's exit printed NCCL's "destroy_process_group() was not called before program exit" warning. A run
    that failed keeps its traceback (a collective of it may still be pending: no teardown)."""
    from dschat.utils.cli import end_script

    try:
        main()
        status = 0
    except SystemExit as stop:
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
        status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    end_script(status)


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
                                  env={**os.environ, "OUT": tmp, ROW_PROCESS_ENV: "1"})
            path = os.path.join(tmp, f"{label}.json")
            payload = None
            if os.path.exists(path):
                with open(path) as f:
                    payload = json.load(f)
                os.remove(path)
            yield label, payload, proc.returncode
