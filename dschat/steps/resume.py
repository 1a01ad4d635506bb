"""Checkpoints of steps 1, 2 and DPO: ``--save_interval N`` saves every N optimizer steps into
``<output_dir>/checkpoints`` the model's DeepSpeed engine (weights, optimizer, scheduler), the position in the data
(epoch and micro-batches consumed), the train-loss sums and each rank's RNG states (dropout); ``--resume`` continues
from the last complete one (the tag folders and ``latest`` pointer of ``dschat.utils.checkpoints``, as step 3's). The
output folder must be one that every rank sees (shared storage), as for DeepSpeed's own checkpoints.

A checkpoint resumes on another number of ranks than saved it when each optimizer step takes as many samples
(--per_device_train_batch_size x --gradient_accumulation_steps x ranks): its steps, learning-rate schedule and data
position are the same. ZeRO-1/2/3 partitions load through DeepSpeed's universal checkpoint (``plan_resume`` decides it
from the files, before ``deepspeed.initialize``, and rank 0 makes the copy once); the data position skips the samples
of the epoch trained on (each epoch's order is one permutation of (seed, epoch), which the ranks' samplers deal out in
turn, so what N ranks consumed is a prefix of it); each rank's RNG is its own where the checkpoint has it. On as many
ranks, a step's samples may be split otherwise (another micro-batch and accumulation of the same product): the data
position and the loss sums are converted alike (``_other_split_of_as_many_samples``). At another ZeRO stage (1, 2 or 3:
--zero_stage 3 after running out of memory at 2), its states load through the same universal copy, fitted for the
new stage (``fit_universal_copy``), Adam's moments and all."""
import math
import os

from dschat.args import recorded_flags_now
from dschat.errors import UsageError
from dschat.report import counted
from dschat.run_layout import CHECKPOINTS_DIR
from dschat.steps.common import (STEP_VERSION, TOKENIZER_KEY, check_same_start, check_same_tokenizer, holds_model,
                                 input_runs, keep_resumed_inputs, loaded_model_types, recorded_data_flags,
                                 recorded_step_version, restart_deepspeed_tensorboard, resumed_save_interval,
                                 say_a_changed_schedule, schedule_length_flags, step_data_records, taken_data_flags)
from dschat.utils.checkpoints import (DATA_SOURCE_FLAGS, MODEL, STEP_NAME, ResumePlan, check_complete,
                                      check_position, check_same_flags, check_same_products, check_same_step,
                                      check_universal_fit, clear_earlier_run, clear_tag, latest_tag, load_rank_state,
                                      load_rank_state_of_others, loading_checkpoint, older_dschats_checkpoint,
                                      publish, published_tag, read_trainer_state, reading, remove_universal_copies,
                                      rng_said, save_trainer_state, say_an_older_dschats_checkpoint, tag_of,
                                      take_restored_flags, universal_load, with_universal_load)
from dschat.utils.dist import get_world_size, print_rank_0, rank_0_decides
from dschat.utils.files import writes_said_on_a_full_disk

# Flags a checkpoint is bound to, stored with it and compared on --resume: the saved model and optimizer states have
# the LoRA layout, ZeRO partitioning, precision and optimizer (--offload: DeepSpeed's CPU Adam) these give them; its
# records are tokenized by the model's tokenizer (and DPO's frozen reference is that model); and its position counts
# micro-batches of this size, grouped into steps of this many, of the records these data flags make, in the order
# this seed draws (otherwise a resumed run silently skips or repeats records).
# (--weight_decay too: the optimizer's parameter groups depend on whether it is 0.)
# (step 1's --multiturn too: it keeps conversations that end with a user turn, or are longer than --max_seq_len,
# which are skipped without it, so the records, their order and what the position counts differ.)
# (--sft_only_data_path binds step 1's alone, which reads it: ``unbound_data_flags``.)
RESUME_FLAGS = ("model_name_or_path", "add_eot_token", "eot_token", "lora_dim", "lora_module_name", "lora_alpha",
                "only_optimize_lora", "weight_decay", "zero_stage", "dtype", "offload", "per_device_train_batch_size",
                "gradient_accumulation_steps", "seed", "data_path", "data_split", "data_fields", "max_seq_len",
                "sft_only_data_path", "multiturn")
# Restored by DeepSpeed with the optimizer's state: another value is said to change nothing.
RESTORED_FLAGS = ("learning_rate", "lora_learning_rate")
# Stored and compared, but bound to nothing the checkpoint holds: another value is said, and the run trains with it
# (DPO's loss coefficients and step 1's --include_prompt_in_loss too, which labels the same records otherwise: changed
# silently, a resumed run trained another objective than its log said; and step 1's --loss_agg, which weighs them
# otherwise: its running train loss is counted per micro-batch in either mode, so it carries on.)
FREE_FLAGS = ("dropout", "beta", "label_smoothing", "rpo_alpha", "include_prompt_in_loss", "loss_agg")
BOUND_WHY = ("Its model and optimizer states (model, LoRA layout, weight decay, ZeRO stage, precision, offload) and its "
             "place in the data (micro-batches of --per_device_train_batch_size, steps of "
             "--gradient_accumulation_steps, of the records its data flags and tokenizer make, in --seed's order) hold "
             "for its own")


def checkpoint_root(args):
    return os.path.join(args.output_dir, CHECKPOINTS_DIR)


def resume_flags(args, saved=None):
    """What a checkpoint stores and --resume compares (``saved``: the checkpoint's, ``step_data_records``)."""
    # (the same data, unedited: its position counts the records they make)
    return {**flag_values(args, saved), **step_data_records(args, saved)}


def flag_values(args, saved=None):
    """{flag: value} of the flags a checkpoint stores and --resume compares (its data files' records aside; ``saved``:
    the checkpoint's flags, ``unbound_data_flags``)."""
    unbound = unbound_data_flags(args, saved)
    flags = {name: getattr(args, name, None) for name in RESUME_FLAGS + RESTORED_FLAGS + FREE_FLAGS
             if name not in unbound}
    if flags["model_name_or_path"] and os.path.isdir(flags["model_name_or_path"]):  # the same folder, however named
        flags["model_name_or_path"] = os.path.abspath(flags["model_name_or_path"])
    return flags


def unbound_data_flags(args, saved=None):
    """The data path flags whose files a checkpoint does not record, which bind it to nothing: --sft_only_data_path
    in steps 2's and DPO's, which only step 1 reads (``data_flags_read``). What the checkpoint records: ``saved`` (its
    flags) says it, else the step's own take (``take_data_files``). An older dschat's checkpoint of step 2 or DPO
    recorded step 1's files too, and stays bound to the flag as its data files are compared
    (``data_files_as_recorded``)."""
    recorded = taken_data_flags(args) if saved is None else recorded_data_flags(saved)
    return [name for name in DATA_SOURCE_FLAGS if name not in recorded]


def model_path_as_saved(saved, now, inputs):
    """``now`` ({flag: value} of a run, compared with a checkpoint's ``saved``) with --model_name_or_path as the
    checkpoint stored it where the folder named now holds the model its run started from at the stored path
    (``inputs``: the run's recorded ``input_runs``, by run id): a run folder moved whole moves step 1's output, which
    steps 2 and DPO start from, and their checkpoints were refused for its old path (step 3's compares its actor by
    run id alone, ``check_same_start``). Both store a folder by its absolute path, as the run's working directory
    resolved a relative one (``flag_values``, ``input_runs``): a step script given a relative path resumes so too."""
    then, path = saved.get("model_name_or_path"), now.get("model_name_or_path")
    identity = (inputs or {}).get(then) if isinstance(then, str) and isinstance(path, str) and then != path else None
    if identity is not None and holds_model(path, identity):
        return {**now, "model_name_or_path": then}
    return now


def bound_flags(args, saved=None):
    """{flag: value} of the flags a checkpoint is bound to (``flag_values`` less the restored and free ones; ``saved``:
    its flags): the step's --resume refuses another value than the checkpoint's (``check_same_flags``), and so does
    ``train.py --resume``'s plan, before any step runs (``pipeline_resume.refuse_other_bound_flags``)."""
    return {name: value for name, value in flag_values(args, saved).items()
            if name not in RESTORED_FLAGS + FREE_FLAGS}


def save_step_checkpoint(engine, args, position, keep_last=2):
    """Every rank: the engine's states, this rank's RNG and train-loss sums under tag ``step_<N>``; ``position``:
    {"step", "epoch", "batch" (micro-batches of that epoch consumed), "loss_sum", "loss_count" (this rank's),
    "seconds" (the step's so far), "total" (the run's steps) and STEP_NAME (the step's name, "step1", ...: which step
    a resume may continue it, ``check_same_step``; its STEP_VERSION is recorded with it)}."""
    root = checkpoint_root(args)
    tag = tag_of("step", position["step"])
    clear_tag(root, tag)
    with writes_said_on_a_full_disk(root):
        engine.save_checkpoint(os.path.join(root, MODEL), tag=tag, save_latest=False)
        place = {key: position[key] for key in ("step", "epoch", "batch", "seconds", "total", STEP_NAME, TOKENIZER_KEY)
                 if key in position}
        if STEP_NAME in position:  # (how this dschat trains the step: another's resume says so)
            place[STEP_VERSION] = recorded_step_version(args, position[STEP_NAME])
        sums = {key: position[key] for key in ("loss_sum", "loss_count")}
        save_trainer_state(root, tag, {**place, "save_interval": args.save_interval, "flags": resume_flags(args),
                                       "inputs": input_runs(args), "world_size": get_world_size()}, rank_state=sums)
    publish(root, tag, keep_last)
    return tag


# The flags whose product with the number of ranks is an optimizer step's samples: on another number of ranks they may
# change, as long as the product does not.
BATCH_FLAGS = ("per_device_train_batch_size", "gradient_accumulation_steps")


def _checked_latest(args, step, tokenizer=None):
    """(tag, saved position, ranks that saved it) of the last complete checkpoint that this run may continue, else
    None. On another number of ranks, the samples of an optimizer step must be the checkpoint's (``BATCH_FLAGS``); on
    as many, their split may differ (``_other_split_of_as_many_samples``)."""
    root = checkpoint_root(args)
    tag = latest_tag(root)
    if tag is None:
        return None
    check_same_step(root, tag, step)
    say_an_older_dschats_checkpoint(root, tag, step, loaded_model_types(args))
    saved_ranks = check_complete(root, tag, (MODEL,))
    state = read_trainer_state(root, tag)
    saved = recorded_flags_now(state.pop("flags", {}), step)  # (a flag it predates: the value it trained with)
    # (before the batch flags' products: one that cannot load on these ranks at this stage at all is said first)
    restaged = check_universal_fit(root, MODEL, tag, saved_ranks, saved.get("zero_stage"),
                                   getattr(args, "zero_stage", None), "--zero_stage", LESS_MEMORY)
    if saved_ranks != get_world_size():
        _check_other_ranks(root, tag, saved, saved_ranks, args)
    reshaped = saved_ranks != get_world_size() or _other_split_of_as_many_samples(saved, args)
    if reshaped:
        state["saved_micro_batch"] = saved["per_device_train_batch_size"]
        state["saved_accumulation"] = saved["gradient_accumulation_steps"]
    now = model_path_as_saved(saved, resume_flags(args, saved), state.get("inputs"))
    if reshaped:
        now = {name: value for name, value in now.items() if name not in BATCH_FLAGS}  # (their product: compared)
    if restaged:
        state["saved_zero_stage"] = saved["zero_stage"]
        now.pop("zero_stage")
    state["restored"] = check_same_flags(saved, now, RESTORED_FLAGS, tag, root, step, BOUND_WHY, FREE_FLAGS)
    if tokenizer is not None:
        check_same_tokenizer(state.get(TOKENIZER_KEY), tokenizer, args.model_name_or_path, tag, root)
    if step in REFERENCE_STEPS:
        check_same_start(state.get("inputs"), args.model_name_or_path, "--model_name_or_path", tag, root,
                         "that started", "DPO's frozen reference (the policy's weights come from the checkpoint, the "
                         "reference from that folder)")
    check_position(root, tag, state, ("step", "epoch", "batch"))
    return tag, state, saved_ranks


# What a resume that cannot change the ZeRO stage may do to fit in less memory (``check_universal_fit``): the same
# samples a step, split otherwise (``_other_split_of_as_many_samples``).
LESS_MEMORY = (" (to fit in less memory: a smaller --per_device_train_batch_size with a --gradient_accumulation_steps "
               "as many times larger, the same samples a step)")


def _other_split_of_as_many_samples(saved, args):
    """Whether this run, on the checkpoint's number of ranks, splits an optimizer step's samples otherwise than the
    checkpoint's (``saved``: its flags) did: another --per_device_train_batch_size x --gradient_accumulation_steps of
    the same product (a smaller micro-batch that fits in memory, say). Its steps, schedule and data position are the
    same, converted as on another number of ranks (``_position_on_these_ranks``); it was refused as a changed flag,
    which the same split on another number of ranks was not."""
    if any(name not in saved for name in BATCH_FLAGS):
        return False
    then, now = [saved[name] for name in BATCH_FLAGS], [getattr(args, name) for name in BATCH_FLAGS]
    return then != now and math.prod(then) == math.prod(now)


# Steps whose --model_name_or_path is also their frozen reference, loaded from it again on --resume (the policy's
# weights come from the checkpoint): the same path may hold another model by then (step 1 run again into it).
REFERENCE_STEPS = ("step2_dpo",)


def _check_other_ranks(root, tag, saved, saved_ranks, args):
    """A checkpoint of ``saved_ranks`` ranks that this run of another number may continue: the same samples per
    optimizer step (its states' conversion: ``check_universal_fit``)."""
    check_same_products(root, tag, saved, saved_ranks, args, (
        (BATCH_FLAGS, "its optimizer steps took", "samples",
         "its step count, learning-rate schedule and place in the data count steps of"),),
        "it does not record its batch sizes, so the samples of its optimizer steps (and its place in the data) are not "
        "known")


def check_resumed_step(args, step):
    """--resume: the checkpoint the output folder's ``latest`` pointer names was saved by ``step`` (``check_same_step``)
    and by no newer dschat (``older_dschats_checkpoint``), checked before any model loads (as step 3 checks before its
    engines): DPO given step 1's folder, or a newer dschat's checkpoint, was refused only once the step's models had
    loaded. The rest is ``plan_resume``'s, once the data is loaded (which says an older dschat's checkpoint)."""
    if args.resume:
        root = checkpoint_root(args)
        rank_0_decides(lambda: _check_published_step(root, step))


def _check_published_step(root, step):
    tag = published_tag(root)
    if tag is not None:
        check_same_step(root, tag, step)
        older_dschats_checkpoint(root, tag, step)  # (a newer one's: refused; an older one's: said when it resumes)


def plan_resume(args, step, ds_config=None, train_loader=None, tokenizer=None):
    """--resume: the checkpoint to continue (``ResumePlan``; its tag None when there is none), picked and checked by
    rank 0 for every rank before DeepSpeed loads anything, so a checkpoint of another setup is one error naming the
    flags, on every rank. Called before ``deepspeed.initialize``: a checkpoint of another number of ranks with ZeRO
    partitions gets its universal copy (rank 0 makes it, every rank waits) and ``ds_config`` DeepSpeed's
    ``checkpoint.load_universal``; that is said once, with what it does to the data position (``train_loader``: this
    run's; ``tokenizer``: the one it made its records with, which must be the checkpoint's)."""
    if not args.resume:
        return ResumePlan()
    found = rank_0_decides(lambda: _checked_latest(args, step, tokenizer))
    if found is None:
        return ResumePlan()
    tag, state, saved_ranks = found
    plan = ResumePlan(tag, state, saved_ranks)
    root = checkpoint_root(args)
    stage = (ds_config or {}).get("zero_optimization", {}).get("stage", getattr(args, "zero_stage", None))
    saved_stage = plan.state.get("saved_zero_stage", stage)
    if not plan.other_ranks and saved_stage == stage:
        if "saved_micro_batch" in plan.state:
            _plan_another_split(plan, root, step, train_loader, args)
        return plan
    if ds_config is None or train_loader is None:
        raise UsageError(f"--resume: checkpoint {tag} in {root} was saved by {saved_ranks} rank(s) at ZeRO-"
                         f"{saved_stage}, this run has {get_world_size()} at ZeRO-{stage}: its ZeRO states "
                         "load through a universal copy, which DeepSpeed's config asks for before "
                         "deepspeed.initialize, and its data position is converted for this run's loader "
                         "(plan_resume(args, step, ds_config, train_loader) before the engine is made)")
    load_tag, said = universal_load(root, MODEL, tag, saved_ranks, saved_stage, into_stage=stage)
    plan.load_tags[MODEL] = load_tag
    if MODEL in plan.universal:
        with_universal_load(ds_config)
    if plan.other_ranks:
        plan.state["batch"], data_said = _position_on_these_ranks(plan.state, saved_ranks, train_loader, args)
        said = [said, data_said, rng_said(saved_ranks) + "; the train-loss sums of its ranks are pooled"]
        plan.notice = (f"[{step}] --resume: checkpoint {tag} saved by {saved_ranks} rank(s), this run has "
                       f"{get_world_size()}: {'; '.join(said)}")
        return plan
    restaged = (f"[{step}] --resume: checkpoint {tag} saved at ZeRO-{saved_stage}, this run has ZeRO-"
                f"{stage} (--zero_stage): {said}; its Adam moments and step count, scheduler and place in "
                "the data go on as saved")
    if "saved_micro_batch" in plan.state:  # (and its step's samples split otherwise: said too)
        _plan_another_split(plan, root, step, train_loader, args)
    plan.notice = "\n".join(filter(None, (restaged, plan.notice)))
    return plan


def split_said(plan, args):
    """Where ``plan``'s checkpoint, of as many ranks, split an optimizer step's samples otherwise
    (``_plan_another_split``): what that does to the run's length (each epoch's last micro-batches fill other steps:
    100 records a rank over 2 epochs are 13 steps of 8 x 2, 12 of 4 x 4), else ""."""
    state = getattr(plan, "state", None) or {}
    if "saved_micro_batch" not in state or plan.other_ranks:  # (the ranks' change is said as such)
        return ""
    return (f"or each epoch's last micro-batches in steps of {args.per_device_train_batch_size} x "
            f"{args.gradient_accumulation_steps} rather than the checkpoint's {state['saved_micro_batch']} x "
            f"{state['saved_accumulation']} (--per_device_train_batch_size x --gradient_accumulation_steps)")


def _plan_another_split(plan, root, step, train_loader, args):
    """``plan`` of a checkpoint of as many ranks whose optimizer steps took as many samples split otherwise
    (``_other_split_of_as_many_samples``): its data position in this run's micro-batches, said."""
    if train_loader is None:
        raise UsageError(f"--resume: checkpoint {plan.tag} in {root} took micro-batches of another size: its data "
                         "position is converted for this run's loader (plan_resume(args, step, ds_config, "
                         "train_loader) before the engine is made)")
    plan.state["batch"], data_said = _position_on_these_ranks(plan.state, plan.saved_ranks, train_loader, args)
    saved_micro, saved_steps = plan.state["saved_micro_batch"], plan.state["saved_accumulation"]
    plan.notice = (f"[{step}] --resume: checkpoint {plan.tag}'s optimizer steps took {saved_micro} x {saved_steps} "
                   f"samples a rank (--per_device_train_batch_size x --gradient_accumulation_steps), this run's "
                   f"{args.per_device_train_batch_size} x {args.gradient_accumulation_steps}, as many: {data_said}; "
                   "its train-loss sums count its micro-batches as this run's")


def _position_on_these_ranks(state, saved_ranks, loader, args):
    """(micro-batches of the checkpoint's epoch this run skips on each rank, what it says of that). The checkpoint's
    ranks consumed the first ``batch`` x micro-batch x ranks samples of the epoch's order (all of it, at its end); this
    run skips as many whole micro-batches of its own on every rank as those cover. Where they do not divide into this
    run's micro-batches x ranks, it skips fewer: the rest are trained on a second time (said, with how many)."""
    batch, epoch, micro = state["batch"], state["epoch"], state["saved_micro_batch"]
    records = len(loader.dataset)
    per_rank = math.ceil(records / saved_ranks)  # (DistributedSampler's share, padded)
    if batch >= math.ceil(per_rank / micro):  # the checkpoint's epoch was done: so is this run's
        return len(loader), f"the data position: epoch {epoch + 1} was done, training goes on from the next"
    consumed, step_samples = batch * micro * saved_ranks, args.per_device_train_batch_size * get_world_size()
    skipped = consumed // step_samples
    again = consumed - skipped * step_samples
    said = (f"the data position: the first {consumed} of epoch {epoch + 1}'s {counted(records, 'record')} (in its "
            f"order) were trained on, this run skips {counted(skipped, 'micro-batch', 'micro-batches')} of "
            f"{args.per_device_train_batch_size} on each rank")
    if again:
        said += (f", {counted(skipped * step_samples, 'record')}: the last {again} are trained on again ({consumed} "
                 f"is not a multiple of --per_device_train_batch_size {args.per_device_train_batch_size} x "
                 f"{get_world_size()} rank(s))")
    return skipped, said


def load_step_checkpoint(engine, args, step, plan=None):
    """Restore the checkpoint of ``plan`` (``plan_resume``'s; None: planned now, which a checkpoint of another number
    of ranks with ZeRO partitions refuses: its engine was made without DeepSpeed's universal loading) into ``engine``
    (weights, optimizer, scheduler), and this rank's RNG; returns its position with this rank's loss sums (None when
    there is none)."""
    if plan is None:
        plan = plan_resume(args, step)
    if plan.tag is None:
        return None
    position = dict(plan.state)
    take_restored_flags(position, args)
    root = checkpoint_root(args)
    if plan.notice:
        print_rank_0(plan.notice)
    with reading(root, plan.tag):
        with loading_checkpoint(engine, plan, MODEL):
            engine.load_checkpoint(os.path.join(root, MODEL), tag=plan.load_tag(MODEL))
        if plan.other_ranks:
            rank_state = _pooled_rank_state(root, plan, args, position["step"])
        else:
            rank_state = _own_rank_state(root, plan, args)
    restart_deepspeed_tensorboard(engine)  # its events after the checkpoint's sample count are run again
    position.pop("saved_micro_batch", None)
    position.pop("saved_accumulation", None)
    position.pop("saved_zero_stage", None)
    return {**position, **rank_state}


def _pooled_rank_state(root, plan, args, step):
    """This rank's RNG (``load_rank_state_of_others``) and its share of the train-loss sums of every rank that saved
    the checkpoint. The sums count micro-batch mean losses: the checkpoint's, of its micro-batch size, count as that
    many of this run's micro-batches, and each of this run's ranks takes 1/ranks of the totals, so the mean over
    ranks of each rank's mean loss, which the run reports, weighs every sample of the run alike, as the uninterrupted
    run's does."""
    _, saved = load_rank_state_of_others(root, plan.tag, args.seed, step)
    scale = plan.state["saved_micro_batch"] / args.per_device_train_batch_size / get_world_size()
    return {key: sum(state[key] for state in saved.values()) * scale for key in ("loss_sum", "loss_count")}


def _own_rank_state(root, plan, args):
    """This rank's RNG and train-loss sums as saved; the sums of micro-batches of another size (``plan``'s checkpoint
    took steps of as many samples split otherwise) counted as that many of this run's, as ``_pooled_rank_state``
    does."""
    sums = load_rank_state(root, plan.tag)
    scale = plan.state.get("saved_micro_batch", args.per_device_train_batch_size) / args.per_device_train_batch_size
    return {key: value * scale for key, value in sums.items()} if scale != 1 else sums


def resume_or_start(engine, args, name, total_steps, plan=None):
    """--resume: the position of the last checkpoint in the output folder (``plan``: ``plan_resume``'s), restored into
    ``engine`` (None when there is none: the run starts over). Otherwise None, and an earlier run's checkpoints there
    are removed. Sets ``args.save_interval`` (not given: the resumed run's). A checkpoint past this run's
    ``total_steps`` is an error (the run would train on, past the end of its schedule)."""
    return resume_or_afresh(lambda: load_step_checkpoint(engine, args, name, plan), checkpoint_root(args), args, name,
                            total_steps, plan=plan)


def resume_or_afresh(load, root, args, name, total, unit="step", plan=None):
    """The loop of every step around its checkpoints in ``root``: with --resume the position ``load()`` restores (its
    ``unit``, e.g. "step" or "iteration", is its count), checked against the run's ``total`` and said; None when there
    is none (the run starts over) or without --resume, which removes an earlier run's checkpoints. Sets
    ``args.save_interval`` (not given: the resumed run's). A resume that trains nothing removes the universal copies
    ``plan`` (the ``ResumePlan`` ``load`` restored) loaded on another number of ranks or at another ZeRO stage
    (``remove_universal_copies``)."""
    position = load() if args.resume else None
    keep_resumed_inputs(args, position)
    if position is not None:
        split = split_said(plan, args)
        if position[unit] > total:
            raise UsageError(f"--resume: the last checkpoint in {root} is at {unit} {position[unit]}, past this run's "
                             f"{total} {unit}s ({schedule_length_flags(None, split)}): give at least as many, or "
                             "start afresh without --resume")
        print_rank_0(f"[{name}] resumed from {unit} {position[unit]} ({root})"
                     + (f": its last {unit}, nothing left to train" if position[unit] == total else ""))
        if position[unit] == total and plan is not None:
            remove_universal_copies(root, plan, name)
        say_a_changed_schedule(name, position, total, f"{unit}s", split)
    elif args.resume:
        print_rank_0(f"[{name}] --resume: no complete checkpoint in {root}; starting from {unit} 0")
    elif clear_earlier_run(root):
        print_rank_0(f"[{name}] starting afresh (no --resume): removed an earlier run's checkpoints from {root}")
    args.save_interval = resumed_save_interval(args.save_interval, position, name, f"{unit}s")
    return position
