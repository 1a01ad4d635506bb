"""--mask_truncated_answers' optimizer steps with no token in the loss: ``run`` trains a tiny GPT-2 actor and critic
(GAE) on hand-built rollouts (no generation) of ``ROWS`` answers per rank, one optimizer step of two micro-batches,
whose answers ``CASES`` ends with an EOS or cuts (at --max_answer_seq_len, no EOS: out of the loss) on each rank, after
a first step on answers that all ended (so that Adam's momentum and weight decay would move the weights of a step on
zero gradients). It returns, per case, each model's state (``model_state``) before and after the step, and what
``train_rollout`` returned.

Run by tests/test_no_token_steps.py in its own process for one rank, and through the deepspeed launcher on 2 ranks
(``no_token_steps.py <out>``; rank 0 saves ``<out>/results.pt``).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dschat.steps.common import to_device  # noqa: E402
from dschat.utils.dist import barrier, ensure_distributed, get_rank, get_world_size  # noqa: E402

ROWS, PROMPT, ANSWER, EOS, PAD = 4, 4, 6, 0, 1

SETTINGS = {"dtype": "fp32", "max_prompt_seq_len": PROMPT, "max_answer_seq_len": ANSWER, "num_warmup_steps": 0,
            "max_steps": 4, "actor_learning_rate": 1e-3, "critic_learning_rate": 1e-3, "actor_weight_decay": 0.1,
            "critic_weight_decay": 0.1, "actor_dropout": 0.0, "critic_dropout": 0.0, "reward_model_weight": 0.0,
            "reward_fn": "dschat.tiny.scorer:score_batch", "advantage_estimator": "gae",
            "mask_truncated_answers": True, "gradient_accumulation_steps": 2, "per_device_training_batch_size": 2,
            "per_device_generation_batch_size": ROWS}


def every_answer_cut(rank, world):
    return []


def tokens_on_the_last_rank_only(rank, world):
    """One answer of the last rank's second micro-batch ends: on one rank, one micro-batch of the step has tokens."""
    return [ROWS - 1] if rank == world - 1 else []


# {case: (the rows of each rank whose answers end, settings)}; "ptx": PPO-ptx, its language-model micro-steps (on
# ``unsupervised_batch``) in the actor's optimizer step
CASES = {"every_answer_cut": (every_answer_cut, {}),
         "every_answer_cut_zero2": (every_answer_cut, {"actor_zero_stage": 2, "critic_zero_stage": 2}),
         "every_answer_cut_ptx": (every_answer_cut, {"unsupervised_dataset_name": "unsupervised_batch"}),
         "tokens_on_the_last_rank_only": (tokens_on_the_last_rank_only, {})}


def rollout(trainer, ended):
    """This rank's ``ROWS`` answers: those of ``ended`` end with an EOS after 3 tokens, the others run to ``ANSWER``
    tokens with none (cut); old log-probs the actor's own plus noise, reference ones further off, random values."""
    g = torch.Generator().manual_seed(3 + get_rank())
    prompts = torch.randint(5, 200, (ROWS, PROMPT), generator=g)
    answers = torch.randint(5, 200, (ROWS, ANSWER), generator=g)
    action_mask = torch.ones(ROWS, ANSWER, dtype=torch.long)
    for row in ended:
        answers[row, 2], answers[row, 3:], action_mask[row, 3:] = EOS, PAD, 0
    seq = torch.cat([prompts, answers], 1)
    attention_mask = torch.cat([torch.ones_like(prompts), action_mask], 1)
    on_device = to_device({"input_ids": seq, "attention_mask": attention_mask}, trainer.device)
    with torch.no_grad():
        logprobs = trainer._logprobs(trainer.actor_model, on_device["input_ids"], on_device["attention_mask"],
                                     PROMPT - 1).cpu()
    # (drawn on the CPU, whose generator gives the same values whatever the models' device; trained on theirs)
    return to_device({"prompts": prompts, "input_ids": seq, "attention_mask": attention_mask,
                      "action_mask": action_mask, "logprobs": logprobs + 0.1 * torch.randn(ROWS, ANSWER, generator=g),
                      "ref_logprobs": logprobs + 0.3 * torch.randn(ROWS, ANSWER, generator=g),
                      "rewards": torch.randn(ROWS, generator=g), "value": torch.randn(ROWS, ANSWER, generator=g)},
                     trainer.device)


def unsupervised_batch(device):
    """``ROWS`` rows of language-model data on ``device``: every token a label."""
    ids = torch.randint(5, 200, (ROWS, PROMPT + ANSWER), generator=torch.Generator().manual_seed(5 + get_rank()))
    return to_device({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}, device)


def model_state(engine):
    """{"weights": this rank's master weights (those its torch optimizer updates: the parameters, or the fp32 copies or
    partitions of DeepSpeed's wrappers), "optimizer": Adam's state (step counts and moments), "lr_steps": the lr
    scheduler's steps, "lr": its rates, "skipped_steps": DeepSpeed's count}, each flattened into one tensor on the CPU
    (on an accelerator, Adam's "step" counts stay on the CPU while its moments are on the device)."""
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)  # (DeepSpeed's wrappers hold the torch optimizer)
    weights = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None) or \
        [p for group in base.param_groups for p in group["params"]]  # (ZeRO-3 hands its partitions in at each step)
    moments = [value.detach().flatten().float().cpu() for state in base.state.values()
               for _, value in sorted(state.items()) if torch.is_tensor(value)]
    return {"weights": torch.cat([w.detach().flatten().cpu() for w in weights]),  # (cat copies: a snapshot)
            "optimizer": torch.cat(moments) if moments else torch.zeros(0),
            "lr_steps": engine.lr_scheduler.last_epoch, "lr": engine.get_lr(), "skipped_steps": engine.skipped_steps}


def run_case(folder, ended, settings):
    from dschat import DeepSpeedPPOTrainer, DeepSpeedPPOTrainerUnsupervised, DeepSpeedRLHFEngine
    from dschat.tiny import load_tiny_tokenizer

    tokenizer = load_tiny_tokenizer()
    tokenizer.padding_side = "left"
    args = {**SETTINGS, **settings, "critic_model_name_or_path": str(folder)}
    with DeepSpeedRLHFEngine(actor_model_name_or_path=str(folder), tokenizer=tokenizer, args=args) as engine:
        ptx = bool(args.get("unsupervised_dataset_name"))
        trainer = (DeepSpeedPPOTrainerUnsupervised if ptx else DeepSpeedPPOTrainer)(engine=engine, args=args)
        unsup = [unsupervised_batch(trainer.device)] if ptx else []
        models = {"actor": engine.actor, "critic": engine.critic}
        trainer.train_rollout([rollout(trainer, range(ROWS))], unsup)  # a real step: Adam's moments no longer 0
        before = {name: model_state(model) for name, model in models.items()}
        result = trainer.train_rollout([rollout(trainer, ended(get_rank(), get_world_size()))], unsup)
        after = {name: model_state(model) for name, model in models.items()}
        return {"before": before, "after": after, "result": result}


def run(folder):
    return {name: run_case(folder, ended, settings) for name, (ended, settings) in CASES.items()}


def model_folder(root):
    from dschat.tiny import create_tiny_model

    return create_tiny_model("tiny-gpt2", Path(root) / "tiny-gpt2", seed=7)


if __name__ == "__main__":
    ensure_distributed()
    out = Path(sys.argv[-1])  # (after the launcher's --local_rank)
    if get_rank() == 0:
        model_folder(out)
    barrier()
    results = run(model_folder(out))
    if get_rank() == 0:
        torch.save(results, out / "results.pt")
    from dschat.utils.cli import end_script

    end_script()
