"""Step-3 checkpoints: models, optimizers, schedulers, EMA, KL controller, data position and RNG, atomically
(the tag folders, ``latest`` pointer and RNG states of ``dschat.utils.checkpoints``).
"""
import os

import torch

from dschat.errors import UsageError
from dschat.models.checkpoint import gathered_state_dict, settled_module
from dschat.steps.common import (OUTSIDE_MODEL_IDENTITY, finished_run_id, holds_model, input_runs, model_identity,
                                 restart_deepspeed_tensorboard, step_data_records)
from dschat.utils.checkpoints import (ACTOR, CRITIC, check_complete, check_same_flags, latest_tag,
                                      load_rank_state, publish, read_trainer_state, reading, refuse_other_rank_count,
                                      save_trainer_state, tag_of, take_restored_flags, trainer_folder)
from dschat.utils.dist import get_world_size, is_rank_0, rank_0_decides

# Flags a checkpoint is bound to, stored with it and compared on --resume: the models' and optimizers' saved states
# have the LoRA layout, ZeRO partitioning, precision and optimizer (--offload: DeepSpeed's CPU Adam) these give them
# (otherwise DeepSpeed's loading, or the first step after it, fails with a traceback that names no flag), and its data
# position counts batches of this many prompts, of the prompt set (and unsupervised stream) these data flags make, in
# the order this seed draws (otherwise the resumed run silently skips or repeats prompts, or trains on others, and
# its held-out scores before and after PPO come from two prompt sets). The critic's only where the run trains one.
DATA_RESUME_FLAGS = ("data_path", "data_split", "data_fields", "max_prompt_seq_len", "unsupervised_dataset_name",
                     "unsupervised_dataset_config_name", "eval_prompts", "eval_max_new_tokens")
# The unsupervised stream's blocks are max_prompt_seq_len + max_answer_seq_len tokens: with one, its position counts
# blocks of that length.
UNSUPERVISED_RESUME_FLAGS = ("max_answer_seq_len",)
# (The weight decays too: the optimizers' parameter groups depend on whether it is 0.)
# (--advantage_estimator too: a run continued by another algorithm would be neither's.)
# (--lora_alpha too: the scale of the adapters' saved weights. The training batch size may change: the position counts
# generation batches, and the schedules are moved to where this run's stand at the checkpoint's iteration,
# ppo.realign_schedules.)
ACTOR_RESUME_FLAGS = ("actor_lora_dim", "actor_lora_module_name", "lora_alpha", "only_optimize_lora",
                      "actor_weight_decay", "actor_zero_stage", "dtype", "offload", "per_device_generation_batch_size",
                      "seed", "advantage_estimator") + DATA_RESUME_FLAGS
CRITIC_RESUME_FLAGS = ("critic_lora_dim", "critic_lora_module_name", "critic_weight_decay", "critic_zero_stage")
# Flags whose saved value DeepSpeed restores (the optimizer's and the scheduler's base learning rates, LoRA's
# parameter group's too): another value on --resume is said to change nothing, not refused. (--lr_scheduler_type and
# --num_warmup_steps do apply: the restored scheduler keeps its step and base rates, the schedule's shape comes from
# the flags.)
RESTORED_FLAGS = ("actor_learning_rate", "critic_learning_rate", "actor_lora_learning_rate",
                  "critic_lora_learning_rate")
# Stored and compared, but bound to nothing the checkpoint holds: another value is said, and the run trains with it.
FREE_FLAGS = ("actor_dropout",)
CRITIC_FREE_FLAGS = ("critic_dropout",)
# (Steps 1, 2 and DPO resume on another number of ranks, dschat.steps.resume; step 3 does not.)
OTHER_RANKS_WHY = ("step 3 resumes only on as many ranks as saved its checkpoint (its actor's and critic's ZeRO "
                   "partitions, each rank's generation RNG, and its place in the prompts, counted in batches of "
                   "--per_device_generation_batch_size on each rank, are not converted for another number; steps 1, "
                   "2 and DPO are)")
BOUND_WHY = ("Its algorithm (--advantage_estimator), its model and optimizer states (LoRA layout and scale, weight "
             "decay, ZeRO stage, precision, offload) and its place in the prompts (batches of "
             "--per_device_generation_batch_size of the prompts its data flags make, in --seed's order) hold for its "
             "own")


def save_checkpoint(trainer, root, position, keep_last=2):
    """Save everything a resumed run needs; ``position`` = {"iteration", "epoch", "batch"} (next to run) and
    "unsup_batches" (unsupervised batches consumed so far, skipped on resume)."""
    tag = tag_of("iter", position["iteration"])
    trainer.actor_model.save_checkpoint(os.path.join(root, ACTOR), tag=tag, save_latest=False)
    if trainer.critic_model is not None:
        trainer.critic_model.save_checkpoint(os.path.join(root, CRITIC), tag=tag, save_latest=False)
    ema_state = gathered_state_dict(settled_module(trainer.actor_ema)) if trainer.actor_ema is not None else None
    if is_rank_0() and ema_state is not None:  # before the trainer state, which marks a tag complete
        os.makedirs(trainer_folder(root, tag), exist_ok=True)
        torch.save(ema_state, os.path.join(trainer_folder(root, tag), "ema.pt"))
    save_trainer_state(root, tag, {**position, "kl_ctl": trainer.kl_ctl.state_dict(), "flags": resume_flags(trainer),
                                   "inputs": input_runs(trainer.args)}, trainer.generator)
    publish(root, tag, keep_last)
    return tag


def load_checkpoint(trainer, root):
    """Restore the last complete checkpoint under ``root``; returns its position dict (None if none). Rank 0 picks
    and checks it for every rank, before DeepSpeed loads anything."""
    found = rank_0_decides(lambda: _checked_latest(trainer, root))
    if found is None:
        return None
    tag, state = found
    engines = [engine for engine in (trainer.actor_model, trainer.critic_model) if engine is not None]
    with reading(root, tag):
        for name, engine in zip((ACTOR, CRITIC), engines):
            engine.load_checkpoint(os.path.join(root, name), tag=tag)
        if trainer.actor_ema is not None:
            _load_ema(trainer.actor_ema.module, os.path.join(trainer_folder(root, tag), "ema.pt"))
        load_rank_state(root, tag, trainer.generator)
    for engine in engines:
        restart_deepspeed_tensorboard(engine)  # its events after the checkpoint's sample count are run again
    trainer.kl_ctl.load_state_dict(state.pop("kl_ctl"))
    take_restored_flags(state, getattr(trainer, "args", None))  # (set where the checks had flags to compare)
    if hasattr(trainer.actor_model, "mark_weights_stale"):
        trainer.actor_model.mark_weights_stale()
    return state


def _checked_latest(trainer, root):
    """(tag, saved state less its flags) of the last complete checkpoint that this run may continue, else None."""
    tag = latest_tag(root)
    return None if tag is None else (tag, check_resumable(trainer, root, tag))


def check_resumable(trainer, root, tag):
    """The checkpoint ``tag`` was saved by a run this one can continue (``checkpoints.check_complete``): also a
    critic when this run trains one, an EMA copy when this run keeps one, and the flags it is bound to. Returns its
    saved state, less the flags."""
    saved = check_complete(root, tag, (ACTOR,))
    if saved != get_world_size():
        refuse_other_rank_count(root, tag, saved, OTHER_RANKS_WHY)
    if trainer.critic_model is not None and not os.path.isdir(os.path.join(root, CRITIC, tag)):
        raise UsageError(f"--resume: checkpoint {tag} in {root} has no critic (it was saved by a critic-free run, "
                         f"--advantage_estimator other than gae); resume with that run's --advantage_estimator")
    if trainer.actor_ema is not None and not os.path.isfile(os.path.join(trainer_folder(root, tag), "ema.pt")):
        raise UsageError(f"--resume: checkpoint {tag} in {root} has no EMA copy (the run that saved it had no "
                         f"--enable_ema); resume without --enable_ema, or start afresh without --resume")
    state = read_trainer_state(root, tag)
    saved_flags = state.pop("flags", {})
    if getattr(trainer, "args", None) is not None:
        state["restored"] = check_same_flags(saved_flags, resume_flags(trainer), RESTORED_FLAGS, tag, root, "step3",
                                             BOUND_WHY, FREE_FLAGS + CRITIC_FREE_FLAGS)
        check_same_reference(state.get("inputs"), trainer.args.actor_model_name_or_path, tag, root)
    return state


def check_same_reference(saved_inputs, actor_path, tag, root):
    """The actor model a checkpoint's run started from is its frozen reference (what the KL penalty measures against;
    the actor's own weights come from the checkpoint): another one is an error. Compared by the run ids of the models
    it recorded (``input_runs``), so a moved run folder still resumes; a hub name is not compared."""
    if not saved_inputs or not os.path.isdir(actor_path) or model_identity(actor_path) is None:
        return
    # (holds_model: also an identity recorded before dschat counted the tokenizer files)
    if not any(holds_model(actor_path, identity) for identity in saved_inputs.values()):
        outside = "" if finished_run_id(actor_path) else f" ({OUTSIDE_MODEL_IDENTITY})"
        raise UsageError(f"--resume: checkpoint {tag} in {root} was saved by a run whose actor started from another "
                         f"model than --actor_model_name_or_path {actor_path}, which is the reference model its KL "
                         f"penalty measures against{outside}: resume with that run's actor model, or start afresh "
                         "without --resume")


def resume_flags(trainer):
    """{flag: value} of the flags a checkpoint stores and --resume compares (the bound ``ACTOR_RESUME_FLAGS`` and
    ``CRITIC_RESUME_FLAGS``, the ``RESTORED_FLAGS`` and ``FREE_FLAGS`` said when changed), and its data files."""
    critic = CRITIC_RESUME_FLAGS + CRITIC_FREE_FLAGS if trainer.critic_model is not None else ()
    names = (ACTOR_RESUME_FLAGS + FREE_FLAGS + critic + RESTORED_FLAGS
             + (UNSUPERVISED_RESUME_FLAGS if getattr(trainer.args, "unsupervised_dataset_name", None) else ()))
    flags = {name: getattr(trainer.args, name) for name in names}
    if not (trainer.args.actor_lora_dim or trainer.args.critic_lora_dim):
        flags["lora_alpha"] = None  # (read by no model: given, it is said to be ignored, and binds nothing)
    return {**flags, **step_data_records(trainer.args)}  # the same prompt data, unedited: its position counts


def _load_ema(module, path):
    """Rank 0 loads into ZeRO-3 gathers (then re-partitioned); unsharded copies load on every rank."""
    from dschat.models.zero3 import gathered, is_zero3_param

    sharded = any(is_zero3_param(p) for p in module.parameters())
    state = torch.load(path, weights_only=True) if is_rank_0() or not sharded else None
    for name, param in module.named_parameters():
        with gathered([param], modifier_rank=0):
            if state is not None:
                param.data.copy_(state[name])
