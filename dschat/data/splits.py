"""Deterministic, seeded index splits (train/eval of one file, and the per-phase shares of "2,4,4").

The same idea as DeepSpeed-Chat's ``get_raw_dataset_split_index``: shuffle ``range(size)`` with a seeded
NumPy RNG and cut it at the cumulative fractions, so the shares are disjoint, cover every record and are
identical on every rank and every run with the same seed.
"""
import math
import os

import numpy as np

from dschat.errors import UsageError
from dschat.utils.files import atomic_file


def parse_data_split(data_split, num_parts=3):
    """ "2,4,4" -> [0.2, 0.4, 0.4]; any non-negative weights with a positive sum."""
    try:
        weights = [float(part) for part in str(data_split).split(",")]
    except ValueError:
        raise UsageError(f"--data_split {data_split!r} must be comma-separated numbers such as '2,4,4'") from None
    if num_parts is not None and len(weights) != num_parts:
        raise UsageError(f"--data_split {data_split!r} must have {num_parts} parts (one per phase), e.g. '2,4,4'")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise UsageError(f"--data_split {data_split!r} needs finite, non-negative weights with a positive sum")
    total = sum(weights)
    return [w / total for w in weights]


def check_phase_share(data_split, phase, other_data=False):
    """A step whose phase gets no share of --data_split would find no record in --data_path: an error before anything
    loads (``other_data``: the step has data of its own, step 1's --sft_only_data_path)."""
    if parse_data_split(data_split)[phase - 1] == 0 and not other_data:
        raise UsageError(f"--data_split {data_split} gives phase {phase} (the data of step {phase}) no share of "
                         f"--data_path; give it a weight > 0, e.g. '2,4,4'")


def get_shuffle_idx(seed, size):
    rng = np.random.RandomState(seed=seed)
    index = np.arange(size, dtype=np.int64)
    rng.shuffle(index)
    return index


def split_boundaries(fractions, size):
    """Cut points from cumulative fractions; rounding the running sum (not each share) makes the last cut
    exactly ``size``, so nothing is lost or duplicated."""
    cumulative = np.cumsum(fractions)
    cuts = [0] + [int(round(c * size)) for c in cumulative]
    cuts[-1] = size
    return cuts


def compute_split_indices(seed, data_split, data_size, num_parts=None):
    fractions = parse_data_split(data_split, num_parts)
    cuts = split_boundaries(fractions, data_size)
    shuffled = get_shuffle_idx(seed, data_size)
    return [shuffled[cuts[i]:cuts[i + 1]] for i in range(len(fractions))]


def get_raw_dataset_split_index(local_rank, output_path, dataset_name, seed, split_name, data_split,
                                split_index, data_size, rebuild=False):
    """Indices of share ``split_index`` of ``data_split`` over ``range(data_size)``, cached as .npy.

    The data size is part of the file name so that a grown or shrunk dataset never reuses stale indices.
    Files are written atomically (temp file + os.replace); ranks computing them at once write identical
    bytes, so no lock is needed. ``output_path=None`` computes without caching.
    """
    del local_rank  # kept for DeepSpeed-Chat's signature; every rank can compute the same indices
    if output_path is None:
        return compute_split_indices(seed, data_split, data_size)[split_index].tolist()
    os.makedirs(output_path, exist_ok=True)
    split_tag = str(data_split).replace(",", "-")

    def index_file(i):
        return os.path.join(output_path, f"{dataset_name}_seed{seed}_{split_name}_{split_tag}_{i}_n{data_size}.npy")

    if rebuild or not os.path.isfile(index_file(split_index)):
        for i, part in enumerate(compute_split_indices(seed, data_split, data_size)):
            _save_npy_atomically(index_file(i), part)
    return np.load(index_file(split_index)).tolist()


def _save_npy_atomically(path, array):
    with atomic_file(path, "wb") as f:
        np.save(f, array)
