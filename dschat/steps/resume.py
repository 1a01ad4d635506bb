"""Checkpoints of steps 1, 2 and DPO: ``--save_interval N`` saves every N optimizer steps into
``<output_dir>/checkpoints`` the model's DeepSpeed engine (weights, optimizer, scheduler), the position in the data
(epoch and micro-batches consumed), the train-loss sums and each rank's RNG states (dropout); ``--resume`` continues
from the last complete one (the tag folders and ``latest`` pointer of ``dschat.utils.checkpoints``, as step 3's). The
output folder must be one that every rank sees (shared storage), as for DeepSpeed's own checkpoints."""
import os

from dschat.errors import UsageError
from dschat.run_layout import CHECKPOINTS_DIR
from dschat.steps.common import (input_runs, restart_deepspeed_tensorboard, resumed_save_interval,
                                 say_a_changed_schedule, step_data_records)
from dschat.utils.checkpoints import (MODEL, check_complete, check_same_flags, clear_earlier_run, latest_tag,
                                      load_rank_state, publish, read_trainer_state, reading, save_trainer_state, tag_of,
                                      take_restored_flags)
from dschat.utils.dist import print_rank_0, rank_0_decides

# Flags a checkpoint is bound to, stored with it and compared on --resume: the saved model and optimizer states have
# the LoRA layout, ZeRO partitioning, precision and optimizer (--offload: DeepSpeed's CPU Adam) these give them; its
# records are tokenized by the model's tokenizer (and DPO's frozen reference is that model); and its position counts
# micro-batches of this size, grouped into steps of this many, of the records these data flags make, in the order
# this seed draws (otherwise a resumed run silently skips or repeats records).
# (--weight_decay too: the optimizer's parameter groups depend on whether it is 0.)
RESUME_FLAGS = ("model_name_or_path", "add_eot_token", "eot_token", "lora_dim", "lora_module_name", "lora_alpha",
                "only_optimize_lora", "weight_decay", "zero_stage", "dtype", "offload", "per_device_train_batch_size",
                "gradient_accumulation_steps", "seed", "data_path", "data_split", "data_fields", "max_seq_len",
                "sft_only_data_path")
# Restored by DeepSpeed with the optimizer's state: another value is said to change nothing.
RESTORED_FLAGS = ("learning_rate", "lora_learning_rate")
# Stored and compared, but bound to nothing the checkpoint holds: another value is said, and the run trains with it.
FREE_FLAGS = ("dropout",)
BOUND_WHY = ("Its model and optimizer states (model, LoRA layout, weight decay, ZeRO stage, precision, offload) and its "
             "place in the data (micro-batches of --per_device_train_batch_size, steps of "
             "--gradient_accumulation_steps, of the records its data flags and tokenizer make, in --seed's order) hold "
             "for its own")


def checkpoint_root(args):
    return os.path.join(args.output_dir, CHECKPOINTS_DIR)


def resume_flags(args):
    flags = {name: getattr(args, name, None) for name in RESUME_FLAGS + RESTORED_FLAGS + FREE_FLAGS}
    if flags["model_name_or_path"] and os.path.isdir(flags["model_name_or_path"]):  # the same folder, however named
        flags["model_name_or_path"] = os.path.abspath(flags["model_name_or_path"])
    return {**flags, **step_data_records(args)}  # the same data, unedited: the records its position counts


def save_step_checkpoint(engine, args, position, keep_last=2):
    """Every rank: the engine's states, this rank's RNG and train-loss sums under tag ``step_<N>``; ``position``:
    {"step", "epoch", "batch" (micro-batches of that epoch consumed), "loss_sum", "loss_count" (this rank's),
    "seconds" (the step's so far) and "total" (the run's steps)}."""
    root = checkpoint_root(args)
    tag = tag_of("step", position["step"])
    engine.save_checkpoint(os.path.join(root, MODEL), tag=tag, save_latest=False)
    place = {key: position[key] for key in ("step", "epoch", "batch", "seconds", "total") if key in position}
    sums = {key: position[key] for key in ("loss_sum", "loss_count")}
    save_trainer_state(root, tag, {**place, "save_interval": args.save_interval, "flags": resume_flags(args),
                                   "inputs": input_runs(args)}, rank_state=sums)
    publish(root, tag, keep_last)
    return tag


def _checked_latest(args, step):
    """(tag, saved position) of the last complete checkpoint that this run may continue, else None."""
    root = checkpoint_root(args)
    tag = latest_tag(root)
    if tag is None:
        return None
    check_complete(root, tag, (MODEL,))
    state = read_trainer_state(root, tag)
    state["restored"] = check_same_flags(state.pop("flags", {}), resume_flags(args), RESTORED_FLAGS, tag, root, step,
                                         BOUND_WHY, FREE_FLAGS)
    return tag, state


def load_step_checkpoint(engine, args, step):
    """Restore the last complete checkpoint of this step's output folder into ``engine`` (weights, optimizer,
    scheduler), and this rank's RNG; returns its position with this rank's loss sums (None when there is none).
    Rank 0 picks and checks it for every rank, before DeepSpeed loads anything: a checkpoint of another setup is
    one error naming the flags, on every rank."""
    found = rank_0_decides(lambda: _checked_latest(args, step))
    if found is None:
        return None
    tag, position = found
    take_restored_flags(position, args)
    root = checkpoint_root(args)
    with reading(root, tag):
        engine.load_checkpoint(os.path.join(root, MODEL), tag=tag)
        rank_state = load_rank_state(root, tag)
    restart_deepspeed_tensorboard(engine)  # its events after the checkpoint's sample count are run again
    return {**position, **rank_state}


def resume_or_start(engine, args, name, total_steps):
    """--resume: the position of the last checkpoint in the output folder, restored into ``engine`` (None when there
    is none: the run starts over). Otherwise None, and an earlier run's checkpoints there are removed. Sets
    ``args.save_interval`` (not given: the resumed run's). A checkpoint past this run's ``total_steps`` is an error
    (the run would train on, past the end of its schedule)."""
    return resume_or_afresh(lambda: load_step_checkpoint(engine, args, name), checkpoint_root(args), args, name,
                            total_steps)


def resume_or_afresh(load, root, args, name, total, unit="step"):
    """The loop of every step around its checkpoints in ``root``: with --resume the position ``load()`` restores (its
    ``unit``, e.g. "step" or "iteration", is its count), checked against the run's ``total`` and said; None when there
    is none (the run starts over) or without --resume, which removes an earlier run's checkpoints. Sets
    ``args.save_interval`` (not given: the resumed run's)."""
    position = load() if args.resume else None
    if position is not None:
        if position[unit] > total:
            raise UsageError(f"--resume: the last checkpoint in {root} is at {unit} {position[unit]}, past this run's "
                             f"{total} {unit}s (--max_steps, --num_train_epochs): give at least as many, or start "
                             "afresh without --resume")
        print_rank_0(f"[{name}] resumed from {unit} {position[unit]} ({root})"
                     + (f": its last {unit}, nothing left to train" if position[unit] == total else ""))
        say_a_changed_schedule(name, position, total, f"{unit}s")
    elif args.resume:
        print_rank_0(f"[{name}] --resume: no complete checkpoint in {root}; starting from {unit} 0")
    elif clear_earlier_run(root):
        print_rank_0(f"[{name}] starting afresh (no --resume): removed an earlier run's checkpoints from {root}")
    args.save_interval = resumed_save_interval(args.save_interval, position, name, f"{unit}s")
    return position
