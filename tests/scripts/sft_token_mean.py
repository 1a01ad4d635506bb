"""One optimizer step of step 1's training loop (``common.run_training`` with ``sft.lm_loss``, a DeepSpeed engine)
over micro-batches of very different token counts, against the gradient plain torch takes of the same loss: ``run``
returns, per --loss_agg mode and ZeRO stage, the gradient the step applied (DeepSpeed's, averaged over the ranks;
whole), the one torch computes from all ranks' micro-batches in one process, and the step's logged loss and its
torch value. Every rank builds the same tiny model and the same micro-batches; rank r of W trains MICRO_BATCHES[r::W]
(2 of the 4 on each of two ranks, all 4 on one; the micro-batches of a rank's optimizer step differ in tokens, and so do
the ranks').

Run by tests/test_sft_loss_agg.py in its own process (one rank) and through the deepspeed launcher on 2 ranks,
``sft_token_mean.py <out>`` (rank 0 saves ``<out>/results.pt``).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dschat.utils.dist import ensure_distributed, get_rank, get_world_size, local_device  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from one_training_step import one_training_step  # noqa: E402

VOCAB = 32
# (rows, length, labelled answer tokens of each row): a step's micro-batches of 2 and of 30 labelled tokens
MICRO_BATCHES = [(1, 4, 2), (2, 17, 15), (1, 20, 18), (1, 3, 1)]
MODES = ("global_token_mean", "token_mean")
STAGES = (0, 2)


def micro_batch(index):
    """A micro-batch of MICRO_BATCHES[index]: random ids, the last tokens of each row labelled (the answer), the first
    ones -100 (the prompt)."""
    rows, length, answer = MICRO_BATCHES[index]
    ids = torch.randint(2, VOCAB, (rows, length), generator=torch.Generator().manual_seed(index))
    labels = ids.clone()
    labels[:, :length - answer] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def torch_reference(mode, batches):
    """(gradient, loss) of ``mode``'s loss over ``batches`` (every rank's micro-batches of one step), in plain torch:
    the token mean over all of them (global_token_mean), or the mean of each micro-batch's token mean. Computed on the
    device the step trains on (the same kernels: the tolerance compares loss aggregations, not CPU and GPU kernels);
    the gradient returned on the CPU."""
    from dschat.steps.common import to_device

    model = tiny_model().to(local_device())
    sums, counts = [], []
    for batch in (to_device(batch, local_device()) for batch in batches):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        sums.append(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                      batch["labels"][:, 1:].reshape(-1), reduction="sum"))
        counts.append(int((batch["labels"][:, 1:] != -100).sum()))
    if mode == "global_token_mean":
        loss = sum(sums) / sum(counts)
    else:
        loss = sum(s / n for s, n in zip(sums, counts)) / len(batches)
    loss.backward()
    return torch.cat([p.grad.flatten().cpu() for p in model.parameters()]), loss.item()


def trained_step(mode, stage):
    """(the gradient the optimizer step applied, its logged loss) of one step of ``run_training`` over this rank's
    micro-batches, --loss_agg ``mode`` at ZeRO ``stage``."""
    from dschat.steps import sft

    mine = [micro_batch(i) for i in range(get_rank(), len(MICRO_BATCHES), get_world_size())]
    return one_training_step(tiny_model(), mine, sft.lm_loss, sft.SFT, mode, "step1", stage)



def run():
    """{f"{mode}_zero{stage}": {"trained": (gradient, loss), "torch": (gradient, loss)}}."""
    reference = {mode: torch_reference(mode, [micro_batch(i) for i in range(len(MICRO_BATCHES))]) for mode in MODES}
    return {f"{mode}_zero{stage}": {"trained": trained_step(mode, stage), "torch": reference[mode]}
            for mode in MODES for stage in STAGES}


if __name__ == "__main__":
    ensure_distributed()
    results = run()
    if get_rank() == 0:
        torch.save(results, Path(sys.argv[-1]) / "results.pt")
    from dschat.utils.cli import end_script

    end_script()
