"""Step-3 checkpoints: models, optimizers, schedulers, EMA, KL controller, data position and RNG, atomically.

Each checkpoint is a tag folder written by every rank; only when all ranks have finished does rank 0 point
``latest`` at it (an atomic rename), so an interrupted save is never resumed from.
"""
import json
import os
import random

import numpy as np
import torch

from dschat.errors import UsageError
from dschat.models.checkpoint import gathered_state_dict, settled_module
from dschat.steps.common import restart_deepspeed_tensorboard, write_json_atomic
from dschat.utils.dist import barrier, get_rank, get_world_size, is_rank_0, print_rank_0

LATEST = "latest"
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
ACTOR_RESUME_FLAGS = ("actor_lora_dim", "actor_lora_module_name", "only_optimize_lora", "actor_zero_stage", "dtype",
                      "offload", "per_device_generation_batch_size", "seed") + DATA_RESUME_FLAGS
CRITIC_RESUME_FLAGS = ("critic_lora_dim", "critic_lora_module_name", "critic_zero_stage")
# Flags whose saved value DeepSpeed restores (the optimizer's and the scheduler's base learning rates): another value
# on --resume is said to change nothing, not refused. (--lr_scheduler_type and --num_warmup_steps do apply: the
# restored scheduler keeps its step and base rates, the schedule's shape comes from the flags.)
RESTORED_FLAGS = ("actor_learning_rate", "critic_learning_rate")


def _rng_state(generator):
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "generator": generator.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(state, generator):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(trainer, root, position, keep_last=2):
    """Save everything a resumed run needs; ``position`` = {"iteration", "epoch", "batch"} (next to run) and
    "unsup_batches" (unsupervised batches consumed so far, skipped on resume)."""
    tag = f"iter_{position['iteration']:07d}"
    trainer.actor_model.save_checkpoint(os.path.join(root, "actor"), tag=tag, save_latest=False)
    if trainer.critic_model is not None:
        trainer.critic_model.save_checkpoint(os.path.join(root, "critic"), tag=tag, save_latest=False)
    ema_state = gathered_state_dict(settled_module(trainer.actor_ema)) if trainer.actor_ema is not None else None
    state_dir = os.path.join(root, "trainer", tag)
    os.makedirs(state_dir, exist_ok=True)
    torch.save(_rng_state(trainer.generator), os.path.join(state_dir, f"rng_rank{get_rank()}.pt"))
    if is_rank_0():
        if ema_state is not None:
            torch.save(ema_state, os.path.join(state_dir, "ema.pt"))
        write_json_atomic(os.path.join(state_dir, "state.json"),
                          {**position, "kl_ctl": trainer.kl_ctl.state_dict(), "flags": resume_flags(trainer)})
    barrier()
    if is_rank_0():
        write_json_atomic(os.path.join(root, LATEST), {"tag": tag})
        _prune(root, tag, keep_last)
    barrier()
    return tag


def latest_tag(root):
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["tag"]


def load_checkpoint(trainer, root):
    """Restore the last complete checkpoint under ``root``; returns its position dict (None if none)."""
    tag = latest_tag(root)
    if tag is None:
        return None
    check_resumable(trainer, root, tag)
    for name, engine in (("actor", trainer.actor_model), ("critic", trainer.critic_model)):
        if engine is not None:
            engine.load_checkpoint(os.path.join(root, name), tag=tag)
            restart_deepspeed_tensorboard(engine)  # its events after the checkpoint's sample count are run again
    state_dir = os.path.join(root, "trainer", tag)
    with open(os.path.join(state_dir, "state.json")) as f:
        state = json.load(f)
    trainer.kl_ctl.load_state_dict(state.pop("kl_ctl"))
    state.pop("flags", None)
    if trainer.actor_ema is not None:
        _load_ema(trainer.actor_ema.module, os.path.join(state_dir, "ema.pt"))
    _restore_rng(torch.load(os.path.join(state_dir, f"rng_rank{get_rank()}.pt"), weights_only=False),
                 trainer.generator)
    if hasattr(trainer.actor_model, "mark_weights_stale"):
        trainer.actor_model.mark_weights_stale()
    return state


def check_resumable(trainer, root, tag):
    """The checkpoint ``tag`` was saved by a run this one can continue: as many ranks (the ZeRO states and the RNG
    states are per rank), a critic when this run trains one, an EMA copy when this run keeps one. Checked on every
    rank from the files alone, so all ranks fail together (none waits in a collective) and before DeepSpeed's own
    errors, which name no flag."""
    where = os.path.join(root, "trainer", tag)
    for part in ("actor", "trainer"):
        if not os.path.isdir(os.path.join(root, part, tag)):
            raise UsageError(f"--resume: {os.path.join(root, LATEST)} names checkpoint {tag}, but {root} has no "
                             f"{part}/{tag} folder (removed or copied in part?); restore it, or start afresh "
                             f"without --resume")
    saved_ranks = sum(1 for name in os.listdir(where) if name.startswith("rng_rank") and name.endswith(".pt"))
    if saved_ranks != get_world_size():
        raise UsageError(f"--resume: checkpoint {tag} in {root} was saved by {saved_ranks} rank(s), this run has "
                         f"{get_world_size()}; its ZeRO and RNG states are per rank: resume on {saved_ranks} rank(s)")
    if trainer.critic_model is not None and not os.path.isdir(os.path.join(root, "critic", tag)):
        raise UsageError(f"--resume: checkpoint {tag} in {root} has no critic (it was saved by a critic-free run, "
                         f"--advantage_estimator other than gae); resume with that run's --advantage_estimator")
    if trainer.actor_ema is not None and not os.path.isfile(os.path.join(where, "ema.pt")):
        raise UsageError(f"--resume: checkpoint {tag} in {root} has no EMA copy (the run that saved it had no "
                         f"--enable_ema); resume without --enable_ema, or start afresh without --resume")
    check_same_flags(trainer, os.path.join(where, "state.json"), tag, root)


def resume_flags(trainer):
    """{flag: value} of the flags the checkpoint is bound to (``ACTOR_RESUME_FLAGS``, ``CRITIC_RESUME_FLAGS``)."""
    names = (ACTOR_RESUME_FLAGS + (CRITIC_RESUME_FLAGS if trainer.critic_model is not None else ()) + RESTORED_FLAGS
             + (UNSUPERVISED_RESUME_FLAGS if getattr(trainer.args, "unsupervised_dataset_name", None) else ()))
    return {name: getattr(trainer.args, name) for name in names}


def check_same_flags(trainer, state_path, tag, root):
    """The flags the checkpoint is bound to as it saved them (a checkpoint written before they were stored is not
    checked)."""
    if getattr(trainer, "args", None) is None or not os.path.isfile(state_path):
        return
    with open(state_path) as f:
        saved = json.load(f).get("flags", {})
    now = resume_flags(trainer)
    changed = [f"--{name} {saved[name]!r} -> {now[name]!r}" for name in now
               if name in saved and saved[name] != now[name] and name not in RESTORED_FLAGS]
    restored = [f"--{name} {now[name]!r} (the checkpoint's: {saved[name]!r})" for name in RESTORED_FLAGS
                if name in saved and saved[name] != now[name]]
    if restored and not changed:
        print_rank_0(f"[step3] --resume: {', '.join(restored)}: no effect, DeepSpeed restores the learning rates "
                     "from the checkpoint")
    if changed:
        raise UsageError(f"--resume: checkpoint {tag} in {root} was saved with other settings: "
                         f"{'; '.join(changed)}. Its model and optimizer states (LoRA layout, ZeRO stage, precision, "
                         "offload) and its place in the prompts (batches of --per_device_generation_batch_size of the "
                         "prompts its data flags make, in --seed's order) hold for its own: resume with the "
                         "checkpoint's values, or start afresh without --resume")


def _load_ema(module, path):
    """Rank 0 loads into ZeRO-3 gathers (then re-partitioned); unsharded copies load on every rank."""
    from dschat.rlhf.ema import _gathered

    sharded = any(hasattr(p, "ds_id") for p in module.parameters())
    state = torch.load(path, weights_only=True) if is_rank_0() or not sharded else None
    for name, param in module.named_parameters():
        with _gathered([param], modifier_rank=0):
            if state is not None:
                param.data.copy_(state[name])


def clear_earlier_run(root):
    """A run that starts afresh (no --resume) removes the checkpoints an earlier run left in ``root``, as it replaces
    that run's log and models: kept, ``--resume`` after an interruption could continue that other run, and its tags
    would mix with this run's. Returns whether there were any."""
    import shutil

    found = os.path.isdir(root) and bool(os.listdir(root))
    if found and is_rank_0():
        shutil.rmtree(root)
    barrier()
    return found


def _prune(root, current, keep_last):
    """Keep the last ``keep_last`` tags up to ``current``. Tags after it belong to an earlier, longer run in the same
    folder: kept, they would sort after this run's and be pruned in its place (tags sort as iterations)."""
    import shutil

    tags = sorted(os.listdir(os.path.join(root, "trainer")))
    done = [t for t in tags if t <= current]
    for tag in done[:-keep_last] + [t for t in tags if t > current]:
        for sub in ("actor", "critic", "trainer"):
            shutil.rmtree(os.path.join(root, sub, tag), ignore_errors=True)
