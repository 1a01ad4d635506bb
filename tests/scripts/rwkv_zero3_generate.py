"""2 ranks: an RWKV actor loaded under ZeRO-3 (every weight partitioned) answers through step 3's HF-generate path
(``DeepSpeedPPOTrainer._generate_sequence`` without the hybrid engine: ``synced_gpus``, the batch generated as it
is) as each prompt alone on one rank without ZeRO: the rows of transformers' batched one-token decode step kept apart
(``compat.rwkv_decode_keeps_rows_apart``, mended on every rank). The ranks hold batches of other sizes and prompts
of one length (no padding, which RWKV's recurrence would read).

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
from hybrid_common import ds_config  # noqa: E402

NEW_TOKENS = 6


class Tokenizer:
    """What loading and HF generate's arguments read of a tokenizer."""
    pad_token_id, eos_token_id = 0, None

    def __len__(self):
        return 96


def prompts_of(rank):
    """Rank 0: 3 prompts, rank 1: 2, each of 4 tokens, none alike."""
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randint(3, 96, (3 - rank, 4), generator=g)


def answers_alone(model, prompts):
    """Each prompt's greedy answer generated alone (one row: transformers' decode step is right for it)."""
    call = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        return torch.cat([model.generate(p[None], attention_mask=torch.ones_like(p[None]), **call) for p in prompts])


def zero3_actor(folder):
    from dschat.models.loading import load_causal_lm
    from dschat.models.training_engine import initialize_engine

    config = ds_config(stage=3)
    config.pop("optimizer")
    config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * dist.get_world_size()
    model = load_causal_lm(folder, Tokenizer(), config)
    return initialize_engine(model, config, lr=1e-3, weight_decay=0.0, lora_learning_rate=None,
                             lr_scheduler_type="constant", num_warmup_steps=0, total_steps=1)


def step3_answers(actor, prompts):
    """Step 3's rollouts without the hybrid engine, on a stand-in trainer."""
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    args = SimpleNamespace(max_answer_seq_len=NEW_TOKENS, greedy=True, temperature=1.0, top_k=0, top_p=1.0,
                           repetition_penalty=1.0, logprobs_from_generation=False)
    trainer = SimpleNamespace(args=args, hybrid=False, actor_model=actor, tokenizer=Tokenizer(), eos_token_id=None,
                              pad_token_id=0, z3_enabled=True, generator=torch.Generator().manual_seed(0))
    seq, _ = DeepSpeedPPOTrainer._generate_sequence(trainer, prompts, torch.ones_like(prompts))
    return seq


def main():
    from dschat.utils.dist import ensure_distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True, help="where rank 0 saves the model both ranks load")
    parser.add_argument("--local_rank", type=int)  # (the launcher's)
    folder = parser.parse_args().folder
    rank, world = ensure_distributed()
    assert world == 2, world
    model = tiny_rwkv()
    prompts = prompts_of(rank)
    expected = answers_alone(model, prompts)
    if rank == 0:
        model.save_pretrained(folder)
    dist.barrier()
    actor = zero3_actor(folder)
    assert all(p.numel() == 0 for p in actor.module.parameters()), "every weight partitioned"
    got = step3_answers(actor, prompts)
    assert torch.equal(got, expected), (rank, got.tolist(), expected.tolist())
    print(f"rank {rank} answers as each prompt alone: OK", flush=True)


if __name__ == "__main__":
    from dschat.utils.cli import end_script

    main()
    end_script()
