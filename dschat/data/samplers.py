"""Evaluation data on several ranks without double counting.

``DistributedSampler`` gives every rank as many items by repeating the first ones; the ranks must keep them (they
run the same number of evaluation batches, which may be collectives: ZeRO-3 forwards, tensor-parallel generation),
but the metrics must not count them. ``PaddingMarkedSampler`` marks the repeats, ``EvalWeighted`` turns the mark into
an ``eval_weight`` (1.0 / 0.0) on each item, and ``weighted_collator`` puts the weights of a batch into a tensor that
the evaluation functions multiply their sums by.
"""
import torch
from torch.utils.data import Dataset, DistributedSampler


class PaddingMarkedSampler(DistributedSampler):
    """A DistributedSampler yielding ``(index, is_padding)``: the repeated indices it adds so every rank gets
    as many items (and runs as many, possibly collective, generation batches) are marked as padding."""

    def __iter__(self):
        # the k-th index of this rank sits at position rank + k * num_replicas of the padded list
        positions = range(self.rank, self.total_size, self.num_replicas)
        for position, index in zip(positions, super().__iter__()):
            yield index, position >= len(self.dataset)


class EvalWeighted(Dataset):
    """Items of ``dataset`` indexed by PaddingMarkedSampler's pairs, with ``eval_weight`` 0.0 on padding
    (evaluate_policy leaves those out of its means and counts) and 1.0 otherwise."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        index, is_padding = key
        return {**self.dataset[index], "eval_weight": 0.0 if is_padding else 1.0}


def eval_weights(batch, rows, device=None):
    """The batch's ``eval_weight`` as a float64 tensor of ``rows`` (all 1.0 when the loader did not mark padding)."""
    weights = batch.get("eval_weight")
    if weights is None:
        return torch.ones(rows, dtype=torch.float64, device=device)
    return torch.as_tensor(weights, dtype=torch.float64, device=device)


def weighted_collator(collator):
    """``collator`` for items of ``EvalWeighted``: the weights leave the items and come back as one batch tensor."""
    def collate(items):
        weights = [item.pop("eval_weight", 1.0) for item in items]
        batch = collator(items)
        batch["eval_weight"] = torch.tensor(weights, dtype=torch.float64)
        return batch

    collate.collator = collator  # (a loader made again of other items takes the one it wraps: eval_loader_of_first)
    return collate


def loader_generator(seed=0):
    """A DataLoader's own generator (its ``generator=``). Each new iterator of a loader draws a base seed (for worker
    processes) from it, else from torch's global generator, which dropout and answer sampling share: that draw would
    shift them, and a resumed run, whose checkpoint restored the global state, would start its loaders' iterators at
    other points of the stream than the run it continues did. With its own generator, iterating a loader never
    touches the global state. The data order is the sampler's (its own seeded generator, or DistributedSampler's
    seed and epoch), as before."""
    return torch.Generator().manual_seed(seed)


def distributed_eval_loader(dataset, batch_size, collator):
    """Every rank's share of ``dataset``, padding repeats marked with ``eval_weight`` 0."""
    from torch.utils.data import DataLoader

    return DataLoader(EvalWeighted(dataset), batch_size=batch_size, sampler=PaddingMarkedSampler(dataset, shuffle=False),
                      collate_fn=weighted_collator(collator), generator=loader_generator())
