"""One optimizer step of DPO's training loop (``common.run_training`` with ``DPOStep.loss`` and --rpo_alpha, a DeepSpeed
engine) over the same four preference pairs split into micro-batches in every way the ranks allow, against the
gradient plain torch takes of the same loss: the mean DPO loss over the pairs plus rpo_alpha times the chosen answers'
NLL per token, that token mean over all four pairs (--loss_agg global_token_mean) or the mean of each micro-batch's
own (token_mean). ``run`` returns, per mode and split, the gradient the step applied (DeepSpeed's, averaged over the
ranks; whole) and its logged loss, and torch's gradient and loss. Rank r of W trains PAIRS[r::W], in micro-batches of
1 to 4 / W pairs; the chosen answers have 1 to 14 tokens, so the micro-batches' token counts differ.

Run by tests/test_dpo_rpo_token_mean.py in its own process (one rank: 1x4, 2x2, 4x1 micro-batches x pairs) and
through the deepspeed launcher on 2 ranks (1x2, 2x1 on each), ``dpo_rpo_token_mean.py <out>`` (rank 0 saves
``<out>/results.pt``).
"""
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dschat.utils.dist import ensure_distributed, get_rank, get_world_size, local_device  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from one_training_step import one_training_step  # noqa: E402

VOCAB = 32
# (prompt tokens, chosen answer tokens, rejected answer tokens) of each pair
PAIRS = [(3, 2, 5), (2, 14, 3), (4, 6, 6), (2, 1, 9)]
LENGTH = max(prompt + max(chosen, rejected) for prompt, chosen, rejected in PAIRS)
MODES = ("global_token_mean", "token_mean")
BETA, RPO_ALPHA = 0.1, 1.0


def pair_rows(index):
    """(chosen row, rejected row) of PAIRS[index]: each (ids, attention mask, response mask) of LENGTH, padded on the
    right; the two answers follow the same random prompt."""
    prompt, *answers = PAIRS[index]
    ids = torch.randint(2, VOCAB, (3, LENGTH), generator=torch.Generator().manual_seed(index))
    rows = []
    for side, answer in enumerate(answers):
        row = torch.cat([ids[0, :prompt], ids[side + 1, prompt:]])
        attention = (torch.arange(LENGTH) < prompt + answer).long()
        response = attention * (torch.arange(LENGTH) >= prompt).long()
        rows.append((row * attention, attention, response))
    return rows


def dpo_batch(indices):
    """A DPO micro-batch of the pairs ``indices``: chosen rows first, then rejected (DataCollatorDPO's layout)."""
    chosen, rejected = zip(*(pair_rows(i) for i in indices))
    ids, attention, response = (torch.stack(column) for column in zip(*chosen, *rejected))
    return {"input_ids": ids, "attention_mask": attention, "response_mask": response}


def tiny_model(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def dpo_step(mode):
    """DPO's loss with --rpo_alpha, its reference a model of other weights than the policy's (seed 1)."""
    from dschat.steps.dpo import DPOStep

    step = DPOStep(SimpleNamespace(beta=BETA, label_smoothing=0.0, rpo_alpha=RPO_ALPHA, loss_agg=mode))
    step.reference = tiny_model(1).to(local_device()).eval()
    return step


def torch_reference(mode, micro_batches):
    """(gradient, loss) of ``mode``'s loss over ``micro_batches`` (lists of pair indices: every rank's micro-batches of
    one step) in plain torch: the DPO loss's mean over all pairs plus RPO_ALPHA times the chosen answers' NLL, its mean
    over all their tokens (global_token_mean) or the mean of each micro-batch's token mean; the gradient on the CPU."""
    from dschat.rlhf.dpo import dpo_loss
    from dschat.steps.common import to_device
    from dschat.steps.dpo import sequence_log_probs, split_pairs

    model, step = tiny_model(0).to(local_device()), dpo_step(mode)
    pair_losses, nll_sums, counts = [], [], []
    for batch in (to_device(dpo_batch(indices), local_device()) for indices in micro_batches):
        chosen, rejected = split_pairs(sequence_log_probs(model, batch))
        with torch.no_grad():
            reference = split_pairs(sequence_log_probs(step.reference, batch))
        pair_losses.append(dpo_loss(chosen, rejected, *reference, BETA)[0])
        nll_sums.append(-chosen.sum())
        counts.append(int(split_pairs(batch["response_mask"])[0][:, 1:].sum()))  # (the predicted chosen tokens)
    if mode == "global_token_mean":
        nll = sum(nll_sums) / sum(counts)
    else:
        nll = sum(s / n for s, n in zip(nll_sums, counts)) / len(micro_batches)
    loss = torch.cat(pair_losses).mean() + RPO_ALPHA * nll
    loss.backward()
    return torch.cat([p.grad.flatten().cpu() for p in model.parameters()]), loss.item()


def trained_step(mode, pairs_per_micro_batch):
    """(the gradient the optimizer step applied, its logged loss) of one step of ``run_training`` over this rank's
    pairs in micro-batches of ``pairs_per_micro_batch``, --loss_agg ``mode``."""
    mine = list(range(get_rank(), len(PAIRS), get_world_size()))
    micro_batches = [dpo_batch(mine[i:i + pairs_per_micro_batch]) for i in range(0, len(mine), pairs_per_micro_batch)]
    step = dpo_step(mode)
    return one_training_step(tiny_model(0), micro_batches, step.loss, step.recipe(), mode, "step2_dpo")



def splits():
    """{name: pairs per micro-batch} of this world size: "2x2" is 2 micro-batches of 2 pairs on each rank."""
    per_rank = len(PAIRS) // get_world_size()
    return {f"{per_rank // size}x{size}": size for size in (4, 2, 1) if size <= per_rank}


def run():
    """{f"{mode}_{split}": {"trained": (gradient, loss), "torch": (gradient, loss)}}: torch's of the step's
    micro-batches on every rank."""
    results = {}
    for mode in MODES:
        for name, size in splits().items():
            ranks = [list(range(r, len(PAIRS), get_world_size())) for r in range(get_world_size())]
            every = [rank[i:i + size] for rank in ranks for i in range(0, len(rank), size)]
            results[f"{mode}_{name}"] = {"trained": trained_step(mode, size), "torch": torch_reference(mode, every)}
    return results


if __name__ == "__main__":
    ensure_distributed()
    results = run()
    if get_rank() == 0:
        torch.save(results, Path(sys.argv[-1]) / "results.pt")
    from dschat.utils.cli import end_script

    end_script()
