"""2 ranks: an RWKV actor loaded under ZeRO-3 (every weight partitioned) answers through step 3's HF-generate path
(``DeepSpeedPPOTrainer._generate_sequence`` without the hybrid engine: ``synced_gpus``) left-padded prompts as each
prompt alone on one rank without ZeRO: each rank generates the rows of each prompt length together without their
padding (which RWKV's recurrence would read), the rows of transformers' batched one-token decode step kept apart
(``compat.rwkv_decode_keeps_rows_apart``, mended on every rank). The ranks hold other mixes of prompt lengths: rank
0 makes 2 generate calls of its own, rank 1 makes 3, so rank 0 must make one more
(``trainer.generate_in_step_with_other_ranks``) or the ranks hang. Then rank 1 is given a batch of no prompt: every
rank is refused together, in that agreement (it raised alone before it, and rank 0 waited for ever).

Run by tests/test_ppo.py through the deepspeed launcher.
"""
import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import tiny_rwkv  # noqa: E402
from hybrid_common import zero3_actor  # noqa: E402

NEW_TOKENS = 6


class Tokenizer:
    """What loading and HF generate's arguments read of a tokenizer."""
    pad_token_id, eos_token_id = 0, None

    def __len__(self):
        return 96


PROMPT_LENGTHS = {0: [4, 2, 4], 1: [1, 3, 4]}  # rank 0: 2 prompt lengths (2 rows of 4 together), rank 1: 3


def prompts_of(rank):
    """This rank's prompts (``PROMPT_LENGTHS``, none alike), left-padded with 0, and their mask."""
    g = torch.Generator().manual_seed(10 + rank)
    lengths = torch.tensor(PROMPT_LENGTHS[rank])
    width = int(lengths.max())
    mask = (torch.arange(width) >= width - lengths[:, None]).long()
    return torch.randint(3, 96, mask.shape, generator=g) * mask, mask


def answers_alone(model, prompts, mask):
    """The left-padded prompts followed by each one's greedy answer generated alone, from its real tokens (one row:
    transformers' decode step is right for it)."""
    call = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        answers = [model.generate(p[m.bool()][None], **call)[0, int(m.sum()):] for p, m in zip(prompts, mask)]
    return torch.cat([prompts, torch.stack(answers)], dim=1)


def step3_answers(actor, prompts, mask):
    """Step 3's rollouts without the hybrid engine, on a stand-in trainer."""
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    args = SimpleNamespace(max_answer_seq_len=NEW_TOKENS, greedy=True, temperature=1.0, top_k=0, top_p=1.0,
                           repetition_penalty=1.0, logprobs_from_generation=False)
    trainer = SimpleNamespace(args=args, hybrid=False, actor_model=actor, tokenizer=Tokenizer(), eos_token_id=None,
                              pad_token_id=0, z3_enabled=True, generator=torch.Generator().manual_seed(0))
    seq, _ = DeepSpeedPPOTrainer._generate_sequence(trainer, prompts, mask)
    return seq


def refused_together(actor, rank, prompts, mask):
    """HF generate (as ``evaluate_policy`` calls it) of rank 1 given a batch of no prompt: each rank's UsageError."""
    from dschat.errors import UsageError
    from dschat.rlhf.trainer import hf_generate

    if rank == 1:
        prompts, mask = prompts[:0], mask[:0]
    try:
        with torch.no_grad():
            hf_generate(actor.module, Tokenizer())(prompts, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                                   do_sample=False)
    except UsageError as error:
        return str(error)
    return None


def main():
    from dschat.utils.dist import ensure_distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True, help="where rank 0 saves the model both ranks load")
    parser.add_argument("--local_rank", type=int)  # (the launcher's)
    folder = parser.parse_args().folder
    rank, world = ensure_distributed()
    assert world == 2, world
    model = tiny_rwkv()
    prompts, mask = prompts_of(rank)
    expected = answers_alone(model, prompts, mask)
    if rank == 0:
        model.save_pretrained(folder)
    dist.barrier()
    actor = zero3_actor(folder, Tokenizer())
    assert all(p.numel() == 0 for p in actor.module.parameters()), "every weight partitioned"
    got = step3_answers(actor, prompts, mask)
    assert torch.equal(got, expected), (rank, got.tolist(), expected.tolist())
    print(f"rank {rank} answers as each prompt alone: OK", flush=True)
    refusal = refused_together(actor, rank, prompts, mask)
    assert refusal is not None, f"rank {rank} generated"
    print(f"rank {rank} refused: {refusal}", flush=True)


if __name__ == "__main__":
    from dschat.utils.cli import end_script

    main()
    end_script()
