"""``train.py --resume``: continue an interrupted run of the pipeline in its output folder.

Steps run one after another, so an interruption stops one step: the steps it starts from finished, and whatever a
step after it holds was made from older inputs. A step's output or checkpoint therefore counts only when it was
made from the present outputs of the steps it starts from, and none of those runs now:
- its finished output of the same flags, those that cannot change its weights aside (metrics.json and
  training_args.json; ``weightless_differences``: ZeRO stages, flags of memory and speed, logs and evaluation alone,
  flags neither run read; step 1's --loss_agg compared by how it weighs a step's tokens, ``step1_loss_weighing``),
  made by this dschat's version of the step or an older one that no change since reaches (``older_step_output``):
  the step is skipped, saying the differences left aside;
- else, if it has no finished output, its last checkpoint: the step resumes from it (its own ``--resume``); a
  finished output's checkpoint (its own run's) only when the flags differ in how long to train, to train on. The
  checks the step's --resume makes of it from its files alone (its bound flags, its step, its dschat's version) are
  made first, before any step runs;
- else it starts afresh.
A step removes its metrics.json when it starts training, so an interrupted run never looks finished. What an output
or checkpoint was made from is read from the run ids it recorded of its inputs (``steps.common.input_runs``).
"""
import contextlib
import json
import math
import os
import re
from argparse import Namespace
from typing import NamedTuple

from dschat.args import conditional_flags_of, recorded_flags_now
from dschat.data.fields import same_data_fields, same_datasets
from dschat.data.raw_datasets import changed_data_files
from dschat.errors import UsageError
from dschat.run_layout import CHECKPOINTS_DIR, FINISHED_MARK, RECIPE_STEP_FOLDERS, RUN_ARGS_FILE
from dschat.steps.common import (MODEL_PATH_FLAGS, OUTSIDE_MODEL_IDENTITY, REWARD_FN_FILE, STEP_VERSION,
                                 STEP_VERSION_CHANGES, STEP_VERSIONS, data_files_as_recorded, family_changes_reaching,
                                 finished_run_id, holds_model, listed_data_flags, loaded_model_types, model_identity,
                                 older_step_version, read_run_args, record_cwd, spared_by_versions_since,
                                 step1_loss_weighing)
from dschat.utils.checkpoints import DATA_FILES, HUB_DATA, LATEST, UNSUPERVISED_DATA, latest_tag, read_trainer_state

SKIP, RESUME, FRESH = "skip", "resume", "fresh"

# Flags that do not change what a finished step made, and are not said: the resume switches (a step's save interval is
# rewritten by a resumed run), where it writes (the record is in its output folder, wherever the run folder was moved;
# the data cache). A flag the record lacks (one added since) is taken as unchanged.
NOT_COMPARED = frozenset({"resume", "save_interval", "local_rank", "output_dir", "data_output_path",
                          "deepspeed", "deepscale"})
# Flags that say how a step's training is spread over its ranks' memory, not what it trains: a finished output of
# another ZeRO stage is the same model (a run given a higher stage after running out of memory keeps it), and its
# checkpoint resumes at the new stage (the step's --resume converts it).
ZERO_STAGE_FLAGS = frozenset({"zero_stage", "actor_zero_stage", "critic_zero_stage"})
# Flags that say how much memory or time a step takes, not what it trains (to rounding, as a ZeRO stage): a finished
# output given other values of them alone is the same model. Each with why:
MEMORY_SPEED_FLAGS = {
    "offload": "optimizer states (and ZeRO-3 parameters) on the CPU, updated by the same AdamW (DeepSpeed's CPU Adam)",
    "offload_reference_model": "DPO's and step 3's frozen reference (and EMA copy) kept on the CPU: the same forwards",
    "offload_reward_model": "step 3's frozen reward model kept on the CPU: the same scores",
    "gradient_checkpointing": "activations recomputed in the backward (dropout's RNG state with them): same gradients",
    "actor_gradient_checkpointing": "as --gradient_checkpointing, for step 3's actor",
    "critic_gradient_checkpointing": "as --gradient_checkpointing, for step 3's critic",
    "zero3_fetch": "the unit ZeRO-3 gathers parameters by: the same numbers (docs/benchmarks.md)",
    "logprob_chunk_size": "step 3's log-probs worked out this many positions at a time: the same values",
    "unpin_actor_parameters": "the hybrid engine gathers the ZeRO-3 actor layer by layer: the same weights generate",
    "release_inference_cache": "the hybrid engine frees its KV cache between generations: the same answers",
    "tp_gather_partition_size": "decoder layers the hybrid engine gathers at a time under ZeRO-3: the same weights",
    "enable_cuda_graph": "the decode step replayed from CUDA graphs, drawing the eager loop's noise: same answers, to "
                         "rounding",
    "compile_decode_step": "the decode step's kernels fused by torch.compile: the same answers, to rounding",
    "decode_attention": "the decode step's attention kernel (Triton or SDPA): the same attention, to rounding",
    "fuse_projections": "linears of one input run as one GEMM while generating: the same products, to rounding",
    "num_padding_at_beginning": "accepted for DeepSpeed-Chat's scripts; nothing reads it",
    "print_loss": "what a step prints",
}
# (Not among them, as they may change what a step makes: --check_grad_overflow skips steps; --pad_to_multiple_of,
# --padded_forwards, --enable_hybrid_engine, --inference_tp_size and --logprobs_from_generation change what step 3
# generates or trains on; --preprocessing_num_workers where the unsupervised blocks are cut.)
# Flags that say what a step logs and how its held-out evaluation runs, not what it trains: a finished output given
# other values of them alone is the same model, whose metrics.json stays the finished run's evaluation. (Its
# evaluation loaders draw from generators of their own, ``samplers.loader_generator``, the evaluations run in eval
# mode without gradients, step 3's answers greedy: no RNG draw nor weight moves. Not step 3's --eval_max_new_tokens:
# it sizes the hybrid engine's KV cache, ``engine.longest_sequence``.) Each with why:
LOG_EVAL_FLAGS = {
    "enable_tensorboard": "whether it writes TensorBoard curves",
    "tensorboard_path": "where it writes TensorBoard curves",
    "print_answers": "whether step 3 prints an answer",
    "print_answers_interval": "how often step 3 prints an answer",
    "eval_interval": "how often steps 1, 2 and DPO evaluate while training",
    "eval_iters": "how many held-out batches their evaluations score",
    "per_device_eval_batch_size": "the size of those batches",
    "eval_prompts": "how many held-out prompts step 3 scores before and after training",
}
# Flags a resumed run may raise to train on past the end of a finished one.
EXTENDING = frozenset({"max_steps", "num_train_epochs"})
# Flags naming files or folders: compared as absolute paths (from the working directory each run had).
DATA_PATH_FLAGS = ("sft_only_data_path", "data_path")
PATH_FLAGS = MODEL_PATH_FLAGS + DATA_PATH_FLAGS


class Decision(NamedTuple):
    action: str
    why: str = ""


def step_inputs(recipe, step, rm_from_sft, ready_reward_model=False):
    """The earlier steps of ``recipe`` whose outputs ``step`` starts from (see ``pipeline.step_argv``);
    ``ready_reward_model``: step 3 scores with a trained reward model given to train.py, not step 2's output."""
    earlier = [s for s in RECIPE_STEP_FOLDERS[recipe] if s < step]
    if recipe == "ppo" and step == 2 and not rm_from_sft:
        return []  # the reward model starts from --reward-model
    if recipe == "ppo" and step == 3 and ready_reward_model:
        return [1]  # (the reward model's folder is a flag of step 3's, compared by its run id as the others)
    return earlier


def plan_steps(steps, recipe, output_dir, parsed, rm_from_sft=True, ready_reward_model=False, world_size=None,
               errors_of=None):
    """{step: Decision} for ``steps`` (in order); ``parsed``: step -> its parsed flags now; ``world_size``: the ranks
    of this run (None: the process group's); ``errors_of``: step -> a context manager its refusals are raised
    through (train.py's: they name the flags as its user typed them, ``pipeline.says_train_py_flags``). Rank 0's: a
    step's save that a kill stopped while it replaced the step's folder (``checkpoint.finish_interrupted_swap``) is
    finished first. A step it would start afresh in a folder whose last checkpoint another step saved is refused
    (``keep_another_steps_checkpoints``), as one it would resume is."""
    from dschat.utils.dist import get_world_size

    world_size = get_world_size() if world_size is None else world_size
    errors_of = errors_of or (lambda step: contextlib.nullcontext())
    plan = {}
    for step in steps:
        with errors_of(step):
            plan[step] = _step_decision(step, steps, recipe, output_dir, parsed[step], plan, rm_from_sft,
                                        ready_reward_model, world_size)
            if plan[step].action == FRESH:
                keep_another_steps_checkpoints(step, recipe, _folder(output_dir, recipe, step), plan[step].why)
    return plan


def _step_decision(step, steps, recipe, output_dir, flags, plan, rm_from_sft, ready_reward_model, world_size):
    """``plan_steps``' Decision for ``step`` (``flags``: its parsed flags now), after the steps before it (``plan``)."""
    from dschat.models.checkpoint import recover_interrupted_saves

    folder = _folder(output_dir, recipe, step)
    recover_interrupted_saves(folder)  # (its checkpoints went with the folder a kill stopped a save swapping)
    inputs = step_inputs(recipe, step, rm_from_sft, ready_reward_model)
    rerun = [s for s in inputs if s in plan and plan[s].action != SKIP]
    if rerun:
        return Decision(FRESH, f"it starts from step {rerun[-1]}'s new output")
    made_from = InputCheck([_folder(output_dir, recipe, s) for s in inputs])
    record = read_run_args(folder)
    current = made_from.current(finished_time(folder), record)
    reshaped = same_batches_on_other_ranks(step, record, flags, world_size)
    differing, alike = weigh_step1_loss_agg([name for name in changed_flags(record, flags, folder)
                                             if name not in reshaped], step, record, flags, world_size)
    ignored = weightless_differences(differing, step_name(recipe, step), record, flags)
    changed = [name for name in differing if name not in ignored]
    # a finished output's checkpoints are its own run's (a run that trains removes metrics.json first): they
    # resume only to train on for longer
    checkpoint = checkpoint_state(folder)
    # a raised --max_steps / --num_train_epochs (only those changed): the same run made longer (a lowered one
    # would resume past its new end)
    longer = bool(changed) and set(changed) <= EXTENDING and \
        all(_raised(name, record, flags) for name in changed)
    # a flag the checkpoint is bound to (--offload: its optimizer is DeepSpeed's CPU Adam; step 3's --eval_prompts):
    # a finished output given another value alone is skipped, but is not trained on from its checkpoint, which the
    # step would refuse (said as changed)
    bound = [name for name in ignored if _checkpoint_had_other(name, checkpoint, flags)]
    if longer and bound:
        longer, changed = False, changed + bound
    # (another --data_path is a changed flag, said as one below)
    edited = None if {"data_path", "sft_only_data_path"} & set(changed) else \
        edited_data(record if finished_time(folder) else None, checkpoint, flags)
    # (a newer dschat's output is refused only where this plan would keep it: skipped, or trained on from its
    # checkpoint; other flags or edited data train the step afresh anyway)
    kept = not changed or (checkpoint is not None and longer)
    older = older_step_output(folder, record, step, steps, kept) if current and not edited else None
    if edited:
        return Decision(FRESH, f"the content of its data files changed since its {edited[0]} in {folder}: "
                               f"{', '.join(edited[1])}")
    if older:
        return Decision(FRESH, older)
    if current and not changed:
        return Decision(SKIP, _same_output_why(ignored, alike, record, flags, folder))
    if not current and made_from.current(checkpoint_time(folder), checkpoint):
        return resumed_checkpoint(step, steps, recipe, folder, checkpoint, flags, "it was interrupted")
    if current and checkpoint is not None and longer:
        return resumed_checkpoint(step, steps, recipe, folder, checkpoint, flags,
                                  "to train on past its finished output ("
                                  + ", ".join(f"--{name}" for name in changed) + ")")
    if current:
        # (a longer run trains on from a checkpoint only: without one it starts over)
        extends = ", and it saved no checkpoint to train on from (--save_interval)" if longer else ""
        return Decision(FRESH, f"its finished output in {folder} had other values of "
                               f"{', '.join(said_change(name, record, flags, folder) for name in changed)}" + extends)
    if not os.path.isdir(folder):  # (not "holds no ...": that reads as if something were there)
        return Decision(FRESH, f"{folder} does not exist yet")
    if inputs:
        plural = "s" if len(inputs) > 1 else ""
        return Decision(FRESH, f"{folder} holds no finished output nor checkpoint made from the present "
                               f"output{plural} of step{plural} {', '.join(map(str, inputs))}")
    return Decision(FRESH, f"{folder} holds no finished output nor checkpoint")


def older_step_output(folder, record, step, steps, kept=True):
    """Why the finished output in ``folder`` (``record``: its training_args.json) is an older dschat's, whose step
    trained otherwise than this one's (``older_step_version``), else None; one of a newer dschat's is an error naming
    it where the plan would keep it (``kept``), else None (the step trains afresh for another reason)."""
    record = record or {}
    try:
        older = older_step_version(record.get(STEP_VERSION), record.get("step"), os.path.join(folder, RUN_ARGS_FILE),
                                   "output", f"Resume with that dschat, or train step {step} afresh with this one "
                                             f"({afresh_flags(step, steps)})", record, folder)
    except UsageError:
        if kept:
            raise
        return None
    return older and f"its finished output in {folder} is {older}, which may have trained it otherwise"


def step_name(recipe, step):
    """The name ``step`` of ``recipe`` records in its outputs and checkpoints ("step1", "step2", "step2_dpo", "step3")."""
    return "step2_dpo" if recipe == "dpo" and step == 2 else f"step{step}"


def resumed_checkpoint(step, steps, recipe, folder, checkpoint, flags, why):
    """The decision for ``step``, whose last checkpoint in ``folder`` (``checkpoint``: its state) the plan resumes for
    ``why``, checked as the step's own --resume checks it (``older_checkpoint``, ``refuse_other_bound_flags``): but an
    older dschat's that a change since reaches by the families of the models the step loads (``flags``) trains afresh,
    saying so: resumed, its output would record that older version (``recorded_step_version``) and train again at the
    next --resume. Another older one resumes, said: its output records this dschat's version, kept by the next
    --resume."""
    families = loaded_model_types(flags)
    older = older_checkpoint(step, steps, recipe, folder, families)
    name = step_name(recipe, step)
    then = (checkpoint or {}).get(STEP_VERSION)
    reaching = family_changes_reaching(then, name, families) if older else []
    if reaching:
        changed = set().union(*(STEP_VERSION_CHANGES[(name, version)].model_types for version in reaching))
        said = f"{STEP_VERSION} {then} of {name}" if then is not None else f"no {STEP_VERSION} of {name}"
        return Decision(FRESH, f"its last checkpoint in {os.path.join(folder, CHECKPOINTS_DIR)} is an older dschat's "
                               f"({said}, {STEP_VERSIONS[name]} now), "
                               f"whose step version {' and '.join(map(str, reaching))} changed how models of "
                               f"{', '.join(sorted(families & changed))} train: resumed, its output would train again "
                               "at the next --resume")
    refuse_other_bound_flags(step, steps, folder, checkpoint, flags)
    return Decision(RESUME, why + older)


def older_checkpoint(step, steps, recipe, folder, families=None):
    """``step``'s last checkpoint in ``folder``, which the plan resumes, checked as the step's own --resume checks it
    (``check_same_step``, ``older_dschats_checkpoint``; ``families``: those of the models the step loads), before any
    step runs: the step found another step's or a newer dschat's checkpoint when it started, after the steps before it
    had run. Returns "" for this dschat's, the words to add to the step's line for an older dschat's (resumed, as the
    step's own --resume does)."""
    from dschat.utils.checkpoints import older_dschats_checkpoint

    root, name = os.path.join(folder, CHECKPOINTS_DIR), step_name(recipe, step)
    tag = latest_tag(root)
    other = another_steps_checkpoint(step, recipe, folder)
    if other is not None:
        raise refused_under_train_py(other, step, steps)
    older = older_dschats_checkpoint(root, tag, name, f"Resume it with that dschat, or train step {step} afresh with "
                                                      f"this one ({afresh_flags(step, steps)})", families)
    return f"; {older}" if older else ""


def another_steps_checkpoint(step, recipe, folder):
    """The step's own --resume refusal (``check_same_step``) of the last checkpoint in ``folder`` where another step
    saved it, with advice train.py's user can follow; None where there is none, or it is ``step``'s (or cannot be
    told apart: one from before checkpoints recorded their step)."""
    from dschat.utils.checkpoints import check_same_step

    root = os.path.join(folder, CHECKPOINTS_DIR)
    if not os.path.isfile(os.path.join(root, LATEST)):
        # (no last checkpoint to tell the step of: latest_tag would say again what the plan's checkpoint_state said,
        # "holds checkpoint ... but no latest pointer", once more in the same plan)
        return None
    tag = latest_tag(root)
    # (train.py gives each step its folder: "its own --output_dir", a step script's advice, is no flag of its user's)
    keep = (f"train.py keeps only step {step}'s checkpoints there (another run given that folder, or a copy?); to keep "
            f"these, move {root} out of train.py's --output-dir before the next --resume")
    try:
        check_same_step(root, tag, step_name(recipe, step), keep)
    except UsageError as error:
        return error
    return None


def keep_another_steps_checkpoints(step, recipe, folder, why):
    """Refuse the plan's fresh start of ``step`` (for ``why``) in ``folder`` whose last checkpoint another step saved:
    starting afresh, the step removes the checkpoints there (``clear_earlier_run``, saying only "an earlier run's"), so
    another run's work given that folder went unnamed, though the same checkpoint is refused where the plan resumes
    the step (``older_checkpoint``). Kept: moved out (or removed, to let them go) before the next --resume."""
    other = another_steps_checkpoint(step, recipe, folder)
    if other is not None:
        raise UsageError(f"{STEP_AFRESH_CLOSE.sub('', str(other))}, or remove it to let them go: train.py --resume "
                         f"starts step {step} afresh ({why}), which removes the checkpoints in its folder")


def refuse_other_bound_flags(step, steps, folder, checkpoint, flags):
    """The step's own --resume refusal of a checkpoint (``checkpoint``: its state) saved with other values of the flags
    it is bound to (LoRA, precision, seed, data, ...; the step's ``bound_flags``), made before any step loads a model
    or its data: the plan said "resumes" and the step failed after loading both. The ZeRO stages and the batch flags
    are left to the step, which may convert them (another stage, the same batches split otherwise or on other ranks),
    but for a change of stage to or from 0, which no conversion moves (``check_universal_fit``): refused here too."""
    from dschat.utils.checkpoints import MODEL, check_same_flags, check_universal_fit
    from dschat.utils.dist import get_world_size

    saved = _saved_flags(checkpoint)
    if not saved:  # (a checkpoint that stored none: not compared, as the step does not)
        return
    if step == 3:
        from dschat.rlhf import checkpointing as own
        batch_flags = own.ITERATION_PROMPTS + own.STEP_ROWS
        bound = own.bound_flags(flags)
    else:
        from dschat.steps import resume as own
        batch_flags = own.BATCH_FLAGS
        # (the data path flags whose files the checkpoint records; its model's folder moved with the run folder)
        bound = own.model_path_as_saved(saved, own.bound_flags(flags, saved), checkpoint.get("inputs"))
    now = {name: value for name, value in bound.items() if name not in ZERO_STAGE_FLAGS and name not in batch_flags}
    root = os.path.join(folder, CHECKPOINTS_DIR)
    tag = latest_tag(root)
    try:
        check_same_flags(saved, now, (), tag, root, f"step{step}", own.BOUND_WHY)
        for flag in sorted(ZERO_STAGE_FLAGS & set(bound)):  # (the stages of the parts this run trains)
            part = flag.partition("_zero_stage")[0] if step == 3 else MODEL
            if 0 in (saved.get(flag), bound[flag]):  # (another of 1 to 3 converts: the step's, on its ranks)
                check_universal_fit(root, part, tag, get_world_size(), saved.get(flag), bound[flag], f"--{flag}",
                                    own.LESS_MEMORY)
    except UsageError as error:
        raise refused_under_train_py(error, step, steps) from None


def afresh_advice(step, steps):
    """What to give train.py to train ``step``, which --resume resumes and cannot, afresh and keep the steps before,
    and what that costs (said in the step's own advice, which ``refused_under_train_py`` leaves out for this line)."""
    keep = " and keep the steps before it" if step > 1 else ""  # (step 1 has none before it)
    return f"(train.py --resume resumes step {step}: to train it afresh{keep}, give " \
           f"{afresh_flags(step, steps)}, which removes the checkpoints in step {step}'s folder)"


# The close of a step's own --resume refusal that says to start afresh: "..., or start afresh without --resume",
# "; or start afresh there without --resume (which removes ...)"
STEP_AFRESH_CLOSE = re.compile(r"[,;] or start afresh (there )?without --resume( \([^()]*\))?$")


def refused_under_train_py(error, step, steps):
    """``step``'s --resume refusal ``error`` as train.py says it: the step's own "or start afresh without --resume"
    left out for ``afresh_advice``, which names the --step to give: said after the step's, the same advice came
    twice."""
    return UsageError(f"{STEP_AFRESH_CLOSE.sub('', str(error))}\n{afresh_advice(step, steps)}")


def afresh_flags(step, steps):
    """The train.py flags that train ``step`` and the later ones of ``steps`` afresh, keeping the steps before."""
    return f"--step {' '.join(str(s) for s in steps if s >= step)} without --resume"


def outdated_outputs(steps, recipe, output_dir, rm_from_sft=True, ready_reward_model=False):
    """Folders of ``recipe``'s steps that this run leaves out (``steps``: those it ran or skipped) and that were not
    made from the present outputs of the steps they start from: a full run, then ``--step 1`` with other flags, then
    ``--step 1 --resume`` (skipped) leaves step 2's and 3's folders the first step-1 output's."""
    outdated = []
    for step, name in RECIPE_STEP_FOLDERS[recipe].items():
        finished = finished_time(os.path.join(output_dir, name))
        if step in steps or finished is None:  # (an unfinished output has nothing to report)
            continue
        inputs = [_folder(output_dir, recipe, s) for s in step_inputs(recipe, step, rm_from_sft, ready_reward_model)]
        if not InputCheck(inputs).current(finished, read_run_args(os.path.join(output_dir, name))):
            outdated.append(name)
    return outdated


class InputCheck:
    """Whether an output or checkpoint was made from the present outputs of the steps it starts from (their folders
    ``inputs``): by the run ids it recorded of them; for an input or a record from before dschat kept run ids, by file
    times (made after that input finished)."""

    def __init__(self, inputs):
        self.inputs = [(finished_run_id(folder), finished_time(folder)) for folder in inputs]

    def current(self, written, record):
        """``written``: when the output or checkpoint was (None: there is none); ``record``: what it saved (its
        training_args.json, its checkpoint's state)."""
        if written is None:
            return False
        made_from = (record or {}).get("inputs")
        for run, finished in self.inputs:
            if run is not None and made_from is not None:
                if run not in made_from.values():
                    return False
            elif finished is not None and written <= finished:
                return False
        return True


def edited_data(record, checkpoint, flags):
    """("finished output" or "checkpoint", [paths and hub datasets]) when the local data files the step reads now, or
    the data of its hub datasets (step 3: or its unsupervised data), differ from what its finished output
    (``record``) or, without one, its last checkpoint recorded; else None. Records from before dschat kept them are
    not compared."""
    for what, saved in (("finished output", record or {}), ("checkpoint", _saved_flags(checkpoint))):
        if saved.get(DATA_FILES) is not None:
            changed = changed_data_files(saved[DATA_FILES], data_files_as_recorded(saved, flags)) + \
                changed_hub_revisions(saved.get(HUB_DATA), flags) + \
                changed_unsupervised_data_now(saved.get(UNSUPERVISED_DATA), flags)
            return (what, changed) if changed else None
    return None


def changed_unsupervised_data_now(saved, flags):
    """The files or hub dataset of step 3's unsupervised data (``saved``: a record's UNSUPERVISED_DATA) that differ
    now. Data that cannot be read here (a file gone, a hub dataset offline) is left to the step's own check."""
    from dschat.data.unsupervised import changed_unsupervised_data, unsupervised_data_record

    name = getattr(flags, "unsupervised_dataset_name", None)
    if saved is None or not name:  # (another name, or none now: a changed flag, compared as such)
        return []
    try:
        now = unsupervised_data_record(name, getattr(flags, "unsupervised_dataset_config_name", None))
    except Exception:  # (any failure to read it: the step compares it again when it runs)
        return []
    return changed_unsupervised_data(saved, now)


def changed_hub_revisions(saved, flags):
    """The hub datasets of ``saved`` (a record's HUB_DATA) whose data in the HF datasets cache is other now, each said
    as such. One that cannot be loaded here (not in this machine's cache, offline) is left to the step's own check."""
    from dschat.data.pipeline import hub_data_fingerprint
    from dschat.data.raw_datasets import get_raw_dataset

    if not saved:
        return []
    changed, output_path, seed = [], flags.data_output_path, flags.seed
    for spec, fingerprint in saved.items():
        try:
            now = hub_data_fingerprint(get_raw_dataset(spec, output_path, seed, 0).raw_datasets)
        except Exception:  # (any failure to read it: the step compares it again when it runs)
            continue
        if now != fingerprint:
            changed.append(f"{spec} (another revision in the HF datasets cache)")
    return changed


def checkpoint_state(folder):
    """The state the step's last checkpoint in ``folder`` saved (None: no checkpoint; {} one without its state)."""
    root = os.path.join(folder, CHECKPOINTS_DIR)
    tag = latest_tag(root)
    return None if tag is None else read_trainer_state(root, str(tag)) or {}


def _folder(output_dir, recipe, step):
    return os.path.join(output_dir, RECIPE_STEP_FOLDERS[recipe][step])


def finished_time(folder):
    """When the step's output in ``folder`` was finished (its metrics.json's time), else None."""
    path = os.path.join(folder, FINISHED_MARK)
    return os.path.getmtime(path) if os.path.isfile(path) else None


def changed_flags(record, flags, folder):
    """The flags whose value now differs from the one the step recorded (``record``: its training_args.json in
    ``folder``, written through JSON, anything else as a string; its relative paths from ``record_cwd``); every flag
    when there is no record. A model that was a step output is the same while that folder holds the same finished
    run (by run id), wherever the run folder is now."""
    now = json.loads(json.dumps(vars(flags), default=str))
    names = [name for name in now if name not in NOT_COMPARED and not name.startswith("_")]
    if record is None:
        return names
    recorded, then = recorded_flags_now(record.get("flags", {}), record.get("step")), record_cwd(record, folder)
    return sorted(name for name in names if name in recorded and (
        (_differs(name, recorded[name], now[name], then, record.get("inputs", {}))
         and not _moved_with_output(name, recorded, now, then))
        or (name == "reward_fn" and _edited_reward_fn(record, flags) is not None)))


# Places a step writes beside its output folder: train.py puts its TensorBoard curves in <output-dir>/tensorboard,
# beside the step's folder, so a run folder moved whole gave every finished step another --tensorboard_path, said in
# each one's line as a change of what it logs, though its user gave none.
BESIDE_OUTPUT = ("tensorboard_path",)


def _moved_with_output(name, recorded, now, then_cwd):
    """Whether flag ``name`` of ``BESIDE_OUTPUT`` names the same place relative to the step's --output_dir in the
    record (``recorded``: its flags, relative paths from ``then_cwd``) as now (``now``), inside the run folder (the
    one holding the step's folder), which moved with it. A place outside it stays where it was when the run folder
    moves (a user's --tensorboard_path /data/alice/tb beside /data/alice/run): another one now, however like the
    old one it lies from the step's folder, is a change."""
    if name not in BESIDE_OUTPUT or not all(isinstance(flags.get(key), str) for flags in (recorded, now)
                                            for key in (name, "output_dir")):
        return False

    def place(flags, cwd):
        return os.path.relpath(os.path.join(cwd, flags[name]), os.path.join(cwd, flags["output_dir"]))

    then = place(recorded, then_cwd)
    return then.split(os.sep)[:2] != [os.pardir, os.pardir] and then == place(now, os.getcwd())


def same_batches_on_other_ranks(step, record, flags, world_size):
    """The batch flags of ``step`` when its recorded run had another number of ranks and each product of them with
    the ranks (an optimizer step's samples; step 3's: an iteration's prompts, an optimizer step's rows) is the
    recorded run's: set for the new ranks, the same batches train the same output, and its checkpoint resumes (the
    step's --resume checks the products too); else none."""
    from dschat.rlhf.checkpointing import ITERATION_PROMPTS, STEP_ROWS
    from dschat.steps.resume import BATCH_FLAGS

    then_ranks = (record or {}).get("world_size")
    if not isinstance(then_ranks, int) or then_ranks == world_size:
        return set()
    groups = (ITERATION_PROMPTS, STEP_ROWS) if step == 3 else (BATCH_FLAGS,)
    then, now = record.get("flags", {}), vars(flags)
    for names in groups:
        counts = [[values.get(name) for name in names] for values in (then, now)]
        if not all(isinstance(c, int) for side in counts for c in side) or \
                math.prod(counts[0]) * then_ranks != math.prod(counts[1]) * world_size:
            return set()
    return {name for names in groups for name in names}


# The groups ``weightless_differences`` says a flag in (else: the setting an unread flag is read only with).
ZERO_STAGE, MEMORY_SPEED, LOG_EVAL = "the ZeRO stage", "memory and speed", "logs and evaluation"


def weightless_differences(differing, step, record, flags):
    """{flag: its group}: the flags of ``differing`` (those whose values differ from the finished output's ``record``)
    that cannot have made the step's trained weights otherwise, said in the step's line (``_same_output_why``): the
    ZeRO stages, ``MEMORY_SPEED_FLAGS``, ``LOG_EVAL_FLAGS``, and a flag that ``step`` (its recorded name, "step1", ...)
    reads only while a setting is on that neither the recorded run nor this one (``flags``) has on (its group: that
    setting, ``unread_in_both``). The one rule of what a difference leaves skipped: any other flag trains again."""
    ignored = {}
    for name in differing:
        group = ZERO_STAGE if name in ZERO_STAGE_FLAGS else MEMORY_SPEED if name in MEMORY_SPEED_FLAGS else \
            LOG_EVAL if name in LOG_EVAL_FLAGS else unread_in_both(name, step, record, flags)
        if group:
            ignored[name] = group
    return ignored


def unread_in_both(name, step, record, flags):
    """The setting ("--enable_ema") that step ``step`` reads flag ``name`` only with (``args.conditional_flags_of``,
    the table each step says its ignored flags by), where neither the run ``record`` recorded nor this one
    (``flags``) has it on: neither read the flag, so its values made no difference. None where either reads it, or
    cannot tell (a setting a record or stand-in lacks: taken as read). A data path flag whose files the record lists
    stays compared (``listed_data_flags``: --sft_only_data_path's in step 1's, and in an older dschat's record of any
    step where it gave a dataset, which is compared as before)."""
    if not record or name in DATA_PATH_FLAGS and name in listed_data_flags(record):
        return None
    then = Namespace(**recorded_flags_now(record.get("flags", {}), step))
    for names, read, setting in conditional_flags_of(step):
        if name not in names:
            continue
        try:
            if not read(then) and not read(flags):
                return setting
        except AttributeError:
            continue
    return None


def _same_output_why(ignored, alike, record, flags, folder=None):
    """Why a finished step is skipped though flags differ now: ``ignored`` (``weightless_differences``), and ``alike``
    (step 1's --loss_agg where its loss weighs the tokens alike, ``step1_loss_weighing``); and where its output (in
    ``folder``) is an older dschat's that no change since reaches (``spared_by_versions_since``). "" where none of
    these holds."""
    then = recorded_flags_now(record.get("flags", {}), record.get("step"))  # (a flag it predates: as it trained)

    def said(names):
        return ", ".join(f"--{name} {then.get(name)} -> {getattr(flags, name, None)}" for name in names)

    def of(group):
        return [name for name, its in ignored.items() if its == group]

    stages, settings, logged = of(ZERO_STAGE), of(MEMORY_SPEED), of(LOG_EVAL)
    unread = [name for name, group in ignored.items() if group not in (ZERO_STAGE, MEMORY_SPEED, LOG_EVAL)]
    parts = ([f"the ZeRO stage ({said(stages)})"] if stages else []) + \
        ([f"flags of memory and speed alone ({said(settings)})"] if settings else []) + \
        ([f"what it logs and how it evaluates ({said(logged)}: its metrics.json is the finished run's evaluation)"]
         if logged else []) + \
        ([f"flags it read in neither run ({'; '.join(f'{said([n])}: read only with {ignored[n]}' for n in unread)})"]
         if unread else []) + \
        ([f"{said(['loss_agg'])} (one micro-batch an optimizer step on one rank: its token mean is the step's)"]
         if "loss_agg" in alike else [])
    why = [f"its output does not depend on {' nor on '.join(parts)}"] if parts else []
    version = spared_by_versions_since(record.get(STEP_VERSION), record.get("step"), record, folder)
    return "; ".join(why + ([f"its output is {version}"] if version else []))  # ("": the same flags)


def weigh_step1_loss_agg(differing, step, record, flags, world_size):
    """(``differing``, the flags that differ from the finished output's ``record``, with step 1's --loss_agg in it
    where its loss weighs the tokens otherwise than the record's did, whatever its name (``step1_loss_weighing``);
    [--loss_agg] where it is named otherwise but weighs them alike, else []). The record's: token_mean before it
    recorded --loss_agg (``FLAGS_BEFORE_RECORDED``), this run's ranks before it recorded its own. Other steps', or
    either side naming none (a record that stored no flags): ``differing`` as it is."""
    if step != 1 or not record:
        return differing, []
    then_ranks = record.get("world_size")
    then = step1_loss_weighing(recorded_flags_now(record.get("flags", {}), record.get("step")),
                               then_ranks if isinstance(then_ranks, int) else world_size)
    now = step1_loss_weighing(vars(flags), world_size)
    if then is None or now is None:
        return differing, []
    others = [name for name in differing if name != "loss_agg"]
    if then != now:
        return sorted(others + ["loss_agg"]), []
    return others, [name for name in differing if name == "loss_agg"]


def _saved_flags(checkpoint):
    """The flags a checkpoint's state (``checkpoint_state``; None: no checkpoint) stores, {} where none."""
    return (checkpoint or {}).get("flags") or {}


def _checkpoint_had_other(name, checkpoint, flags):
    """Whether the checkpoint's state (``checkpoint_state``) binds it to another value of flag ``name`` than now."""
    saved = _saved_flags(checkpoint)
    return name in saved and saved[name] != getattr(flags, name, None)


def _raised(name, record, flags):
    """Whether the flag ``name`` (a count: --max_steps, --num_train_epochs) is now larger than the run recorded."""
    def count(value):  # (--max_steps 0: no cap, the epochs decide)
        return math.inf if name == "max_steps" and value == 0 else value

    then, now = record.get("flags", {}).get(name), getattr(flags, name, None)
    return isinstance(then, (int, float)) and isinstance(now, (int, float)) and count(now) > count(then)


def _edited_reward_fn(record, flags):
    """The --reward_fn file's path when its content differs from what the run recorded (None: the same, or no file
    recorded: a module's function, a record from before dschat kept it)."""
    from dschat.rlhf.reward_fn import reward_fn_file

    saved = record.get(REWARD_FN_FILE)
    if not saved:
        return None
    now = reward_fn_file(getattr(flags, "reward_fn", None))
    return None if now is not None and now[1] == saved[1] else saved[0]  # (by content, as data files)


def said_change(name, record, flags, folder):
    """``--name``, and why when its value is as before: a --reward_fn file edited since, or a model folder whose
    model is another since (``record``: the training_args.json in ``folder``)."""
    then, now = record.get("flags", {}).get(name), getattr(flags, name, None)
    edited = _edited_reward_fn(record, flags) if name == "reward_fn" and then == now else None
    if edited is not None:
        return f"--{name} (its file {edited} changed since)"
    if name == "loss_agg" and recorded_flags_now(record.get("flags", {}), record.get("step")).get(name) == now:
        # (the same value, which weighs the tokens otherwise on another split: ``step1_loss_weighing``)
        return f"--{name} ({now} weighs each micro-batch's mean alike: a step's micro-batches are split otherwise now)"
    same_folder = name in MODEL_PATH_FLAGS and isinstance(then, str) and isinstance(now, str) and \
        _as_path(name, then, record_cwd(record, folder)) == _as_path(name, now, os.getcwd())
    if not same_folder:
        return f"--{name}"
    if not (os.path.isdir(now) and model_identity(now)):
        return f"--{name} (the folder {now} holds no finished model now)"
    if not finished_run_id(now):  # (a model made elsewhere: its files tell)
        return f"--{name} (the model files in {now} changed since: {OUTSIDE_MODEL_IDENTITY})"
    return f"--{name} (the model in {now} was trained again since)"


def _differs(name, then_value, now_value, then_cwd, made_from):
    if name == "data_fields":  # (the renaming they give, not their text)
        return not same_data_fields(then_value, now_value, then_cwd)
    if name in DATA_PATH_FLAGS:  # (the datasets they read: jsonl:x.jsonl is ./x.jsonl)
        return not same_datasets(then_value, now_value, then_cwd)
    if name in MODEL_PATH_FLAGS and isinstance(then_value, str) and isinstance(now_value, str):
        run = made_from.get(os.path.normpath(os.path.join(then_cwd, then_value)))
        if run is not None:
            return not holds_model(now_value, run)
    return _as_path(name, then_value, then_cwd) != _as_path(name, now_value, os.getcwd())


def _as_path(name, value, cwd):
    """A path flag's local path as an absolute one (a hub name stays as it is)."""
    if name not in PATH_FLAGS or value is None:
        return value
    if isinstance(value, list):
        return [_as_path(name, item, cwd) for item in value]
    local = os.path.join(cwd, value)
    return os.path.normpath(local) if os.path.exists(local) else value


def checkpoint_time(folder):
    """When the step's last checkpoint in ``folder`` was saved (its ``latest`` pointer's time), else None."""
    path = os.path.join(folder, CHECKPOINTS_DIR, LATEST)
    return os.path.getmtime(path) if os.path.isfile(path) else None


def describe(step, decision, folder):
    """The line that says what the plan does with ``step``."""
    if decision.action == SKIP:
        if decision.why:
            return f"step {step}: finished earlier in {folder}; skipped (--resume): {decision.why}"
        return f"step {step}: finished earlier in {folder} with the same flags; skipped (--resume)"
    if decision.action == RESUME:
        return (f"step {step}: resumes from its last checkpoint in {os.path.join(folder, CHECKPOINTS_DIR)} (--resume): "
                f"{decision.why}")
    return f"step {step}: starts afresh: {decision.why}"
