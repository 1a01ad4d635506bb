"""A local JSON Lines file's load (``get_raw_dataset``, as a training run reads its --data_path) cold, then warm, each
in a fresh process, on the CPU: what a later run of the same data still spends reading it. The file has a column
whose values have mixed types ("meta": a number in one record, text in the next), which datasets reads as its
``Json`` type and dschat rebuilds from the json module's records (``reading._exact_json_dataset``).

    python bench/data_warm_load.py                   # ~100 MB, a cold load and 2 warm ones
    python bench/data_warm_load.py --mb 20 --same-types   # "meta" always text: no column of mixed types

Prints a table of seconds: the whole load (after the imports) and, of it, the rebuild of the mixed-type columns
(``_exact_json_dataset``: the json module's parse of the file and the dataset built from it, or its kept copy read).
The file and datasets' cache are in a temporary folder (``--dir`` to choose where), removed at the end.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_records(path, megabytes, same_types):
    """A JSON Lines file of about ``megabytes`` MB of preference records, "meta" a number in every other one unless
    ``same_types``; returns the number of records."""
    filler = "lorem ipsum dolor sit amet " * 12
    count, size, target = 0, 0, megabytes * 10**6
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            meta = f"id{count}" if same_types or count % 2 else count
            line = json.dumps({"prompt": f"Question {count}: {filler}", "chosen": f"Answer {count}. {filler}",
                               "rejected": f"No. {filler}", "meta": meta}) + "\n"
            f.write(line)
            size += len(line)
            count += 1
    return count


def load_once(path, output):
    """One load in this process: {"total": seconds, "rebuild": seconds in ``_exact_json_dataset``, "records": N}."""
    from dschat.data import reading
    from dschat.data.raw_datasets import get_raw_dataset

    spent = [0.0]
    rebuild = reading._exact_json_dataset

    def timed_rebuild(*args, **kwargs):
        start = time.perf_counter()
        try:
            return rebuild(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    reading._exact_json_dataset = timed_rebuild
    start = time.perf_counter()
    data = get_raw_dataset(path, output, 1234, 0)
    total = time.perf_counter() - start
    return {"total": total, "rebuild": spent[0], "records": len(data.get_train_data())}


def load_in_a_fresh_process(path, work):
    env = {**os.environ, "HF_DATASETS_CACHE": os.path.join(work, "hf_cache"), "PYTHONPATH": REPO,
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", path, os.path.join(work, "out")],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the load failed:\n{done.stdout}{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=100, help="the file's size in MB (default 100)")
    parser.add_argument("--warm", type=int, default=2, help="warm loads after the cold one (default 2)")
    parser.add_argument("--same-types", action="store_true", help="'meta' always text (no mixed-type column)")
    parser.add_argument("--dir", help="where the temporary folder goes (default: the system's)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(load_once(*args.child)))
        return
    work = tempfile.mkdtemp(prefix="data_warm_load_", dir=args.dir)
    try:
        path = os.path.join(work, "train.jsonl")
        count = write_records(path, args.mb, args.same_types)
        print(f"{path}: {os.path.getsize(path) / 1e6:.0f} MB, {count} records, 'meta' "
              f"{'text only' if args.same_types else 'of mixed types'}; each load in a fresh process")
        print(f"{'load':<8} {'total s':>8} {'rebuild s':>10}")
        for number in range(1 + args.warm):
            result = load_in_a_fresh_process(path, work)
            name = "cold" if number == 0 else f"warm {number}"
            print(f"{name:<8} {result['total']:>8.2f} {result['rebuild']:>10.2f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
