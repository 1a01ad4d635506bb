"""Training checkpoints, the part every step shares.

A checkpoint is a tag folder in each part of ``root``: a DeepSpeed engine's folder per model (``actor/<tag>``,
``model/<tag>``), and ``trainer/<tag>`` with the run's position and flags (``state.json``, rank 0) and each rank's RNG
states and own counters (``rng_rank<N>.pt``). Every rank writes its share; only when all have finished does rank 0
point ``latest`` at the tag (an atomic rename), so an interrupted save is never resumed from. The last ``keep_last``
tags are kept.

A checkpoint resumes on another number of ranks (steps 1, 2 and DPO: ``dschat.steps.resume``; step 3:
``dschat.rlhf.checkpointing``), decided before ``deepspeed.initialize`` (``ResumePlan``): its ZeRO partitions through a
universal copy that DeepSpeed's ``ds_to_universal`` makes beside the tag (``<part>/<tag>_universal``, see
``universal_copy`` and ``universal_load``; pruned with its tag, and removed by a resume that trains nothing), each
rank's RNG states from its own file where the checkpoint has one (``load_rank_state_of_others``).
"""
import argparse
import contextlib
import datetime
import errno
import hashlib
import io
import os
import random
import re
import shutil
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dschat.errors import UsageError
from dschat.utils.dist import barrier, get_rank, get_world_size, is_rank_0, print_rank_0, rank_0_decides
from dschat.utils.files import (FULL_DISK_ERRNOS, atomic_file, free_space, full_disk_code, full_disk_errno,
                                read_json_object, unreadable_file_reason, write_json_atomic)

LATEST = "latest"
TRAINER = "trainer"
# The parts a checkpoint writes (a step's model, step 3's actor and critic, the trainer's state) and the names of its
# tags: all a run removes or prunes in ``root`` (a user's own folder there stays).
MODEL, ACTOR, CRITIC = "model", "actor", "critic"
PARTS = (MODEL, ACTOR, CRITIC, TRAINER)
TAG = re.compile(r"(step|iter)_\d{7}")
# DeepSpeed's universal copy of a tag's ZeRO states (made to resume on another number of ranks), and the folder it is
# made in before the rename that completes it. Neither is a tag: ``latest`` never names one, and each goes with its tag.
UNIVERSAL = "_universal"
UNIVERSAL_PARTIAL = ".partial"
UNIVERSAL_COPY = re.compile(rf"(?P<tag>{TAG.pattern}){UNIVERSAL}(?:{re.escape(UNIVERSAL_PARTIAL)})?")


def tag_of(unit, number):
    """The tag of the checkpoint at ``number`` of ``unit`` ("step" or "iter"): zero-padded, so name order is number
    order."""
    return f"{unit}_{number:07d}"


# The key under which a checkpoint's (and a step output's) bound settings hold its local data files' paths and content
# hashes (``local_data_files``).
DATA_FILES = "data_files"
# ... and the data flags whose files those are (``steps.common.data_flags_read``: step 1's --sft_only_data_path's only in
# step 1's; a record without it, an older dschat's, listed them in every step's).
DATA_FILES_FLAGS = "data_files_flags"
# ... and which data of each hub dataset they read (``PromptDataset.hub_data``: each split's datasets fingerprint, which
# a new revision of it in the HF datasets cache changes). Records from before dschat kept it are not compared.
HUB_DATA = "hub_data"
# ... and what step 3's --unsupervised_dataset_name read (``unsupervised_data_record``: its files' content hashes or its
# hub revision), whose position in the unsupervised stream a checkpoint counts. Not compared where not recorded.
UNSUPERVISED_DATA = "unsupervised_data"


def rng_state(generator=None):
    """This rank's random states: Python's, NumPy's, torch's (CPU and CUDA) and ``generator``'s."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if generator is not None:
        state["generator"] = generator.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state, generator=None):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if generator is not None:
        generator.set_state(state["generator"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def trainer_folder(root, tag):
    return os.path.join(root, TRAINER, tag)


def save_trainer_state(root, tag, state, generator=None, rank_state=None):
    """Each rank's file: its RNG states (``generator``'s too) and ``rank_state`` (what differs between ranks); rank
    0's ``state`` (JSON). Into ``trainer/<tag>``; returns that folder."""
    folder = trainer_folder(root, tag)
    os.makedirs(folder, exist_ok=True)
    torch.save({**rng_state(generator), "rank_state": rank_state}, os.path.join(folder, f"rng_rank{get_rank()}.pt"))
    if is_rank_0():
        write_json_atomic(os.path.join(folder, "state.json"), state)
    return folder


def clear_tag(root, tag):
    """Before every rank saves ``tag``: rank 0 removes what an earlier save of it left in each part (a save killed
    before it published, or an earlier, longer run's tag, which the resumed run reaches again), its universal copies
    too, and every rank waits. Saved over, its files of ranks this run does not have stayed (another number of ranks
    than the earlier save's): one rank's RNG file too many made the checkpoint "saved by 2 rank(s)" (a 1-rank resume
    of it refused, naming another batch size to give), and DeepSpeed's partitions of the other run's ranks went into
    its universal copy or were loaded as its own."""
    if is_rank_0():
        for part in _parts(root):
            for name in (tag, universal_tag(tag), universal_tag(tag) + UNIVERSAL_PARTIAL):
                shutil.rmtree(os.path.join(root, part, name), ignore_errors=True)
    barrier()


def publish(root, tag, keep_last=2):
    """After every rank has written its share of ``tag``: rank 0 points ``latest`` at it and prunes older tags."""
    barrier()
    if is_rank_0():
        write_json_atomic(os.path.join(root, LATEST), {"tag": tag})
        _prune(root, tag, keep_last)
        print_rank_0(f"checkpoint {tag} saved in {root} (the last {keep_last} are kept)")
    barrier()


def published_tag(root):
    """The tag ``latest`` names, else None (no pointer or a damaged one, which ``latest_tag`` says what to do about)."""
    try:
        latest = read_json_object(os.path.join(root, LATEST))
    except UsageError:
        return None
    tag = (latest or {}).get("tag")
    return tag if isinstance(tag, str) and tag else None


def latest_tag(root):
    """The tag ``latest`` names (None: ``root`` holds no checkpoint to resume). Without the pointer, one complete tag
    is a first save killed before it published (said, not resumed: a requeued job starts over); several mean the
    pointer was lost, and a damaged one was never written by a save: a UsageError naming the last tag, as starting
    over would prune them."""
    path = os.path.join(root, LATEST)
    try:
        latest = read_json_object(path)
    except UsageError:
        latest = {}
    if latest is not None and isinstance(latest.get("tag"), str) and latest["tag"]:
        return latest["tag"]
    complete = complete_tags(root)
    if latest is None and len(complete) <= 1:
        if complete:
            print_rank_0(f"--resume: {root} holds checkpoint {complete[0]} but no {LATEST} pointer: its save did not "
                         f"finish (or the pointer was removed), so it is not resumed from; "
                         f"{_resume_from(root, complete[0])}")
        return None
    pointer = f"no {LATEST} pointer" if latest is None else f"a damaged {LATEST} pointer"
    held = f"checkpoints {', '.join(complete)}" if complete else "no complete checkpoint"
    restore = f"{_resume_from(root, complete[-1])}" if complete else "restore it"
    raise UsageError(f"--resume: {root} holds {held} and {pointer} (a save writes it last; removed or copied in "
                     f"part?): {restore}, or start afresh without --resume (which removes them)")


def _resume_from(root, tag):
    return f"to resume from checkpoint {tag}, write {{\"tag\": \"{tag}\"}} into {os.path.join(root, LATEST)}"


def earlier_advice(root, tag):
    """", <how to resume from the last complete checkpoint before ``tag``>" ("" if there is none)."""
    earlier = [t for t in complete_tags(root) if t < tag]
    return f"; {_resume_from(root, earlier[-1])}" if earlier else ""


def read_trainer_state(root, tag):
    """The ``state.json`` rank 0 saved with ``tag`` (None: there is none)."""
    try:
        return read_json_object(os.path.join(trainer_folder(root, tag), "state.json"))
    except UsageError:
        raise UsageError(f"--resume: checkpoint {tag} in {root} has a damaged {TRAINER}/{tag}/state.json (not a JSON "
                         f"object; copied in part?): restore it{earlier_advice(root, tag)}; or start afresh without "
                         f"--resume") from None


def check_position(root, tag, state, keys):
    """The trainer state of checkpoint ``tag`` holds each of ``keys`` (its place: step or iteration, epoch, batch):
    one without them (edited, or another program's) failed later with a bare KeyError."""
    missing = [key for key in keys if key not in state]
    if missing:
        raise UsageError(f"--resume: checkpoint {tag} in {root} has a damaged {TRAINER}/{tag}/state.json (no "
                         f"{', '.join(map(repr, missing))}: its place in the run; edited?): restore it"
                         f"{earlier_advice(root, tag)}; or start afresh without --resume")


# (the trainer state's key for the step that saved a checkpoint, "step1", "step2", "step2_dpo" or "step3": every step
# keeps its checkpoints in <output_dir>/checkpoints, so another step's may be found there)
STEP_NAME = "step_name"


def check_same_step(root, tag, step, keep=None):
    """Checkpoint ``tag`` was saved by ``step`` (its trainer state's ``STEP_NAME``), checked before its folders are: a
    checkpoint another step saved in the same --output_dir (step 1's, found by DPO or step 2 given that folder; step
    1's found by step 3, or step 3's by step 1) is not this step's to continue. DPO resumed step 1's weights,
    optimizer and data position as its own when their flags matched (both default to tiny-llama), step 2 was refused
    for a flag ("--multiturn False -> None"), and steps 1 and 3 for a folder "removed or copied in part?" of the
    other's. A checkpoint from before the step was recorded is told by its tags (step 3's count iterations); else
    unchecked. ``keep``: how the refusal says to keep the other step's checkpoints (default: a step script's, another
    --output_dir; train.py's user chooses no step's folder, ``pipeline_resume.older_checkpoint``)."""
    saved = (read_trainer_state(root, tag) or {}).get(STEP_NAME)
    if saved is None and TAG.fullmatch(tag):
        saved = "step3" if tag.startswith("iter_") else "step 1, 2 or DPO"
        if (step == "step3") == (saved == "step3"):  # (one of them, unrecorded: not told apart)
            return
    if saved is not None and step is not None and saved != step:
        keep = keep or f"give {step} its own --output_dir"
        raise UsageError(f"--resume: the last checkpoint in {root} ({tag}) was saved by {saved}, not {step}: {keep}, "
                         f"or start afresh there without --resume (which removes {saved}'s checkpoints)")


def say_an_older_dschats_checkpoint(root, tag, step, families=None):
    """--resume of checkpoint ``tag`` of ``step`` (rank 0's, once): one saved by an older dschat, whose trainer state
    records an older step version than this dschat's (``STEP_VERSION``), or none (saved before checkpoints recorded
    it), is resumed, said in one line, as its step may have trained otherwise until there (its output then records this
    dschat's version, or the checkpoint's where a change of its models' families reaches it,
    ``recorded_step_version``), unless no change since reaches the families of its models (``families``:
    those the run loads, ``loaded_model_types``; None: unknown); one of a newer dschat is a UsageError naming its
    state.json (``older_dschats_checkpoint``)."""
    older = older_dschats_checkpoint(root, tag, step, families=families)
    if older:
        print_rank_0(f"[{step}] --resume: {older}")


def older_dschats_checkpoint(root, tag, step, remedy=None, families=None):
    """What resuming checkpoint ``tag`` of ``step`` (a step name, "step1", ...) in ``root`` takes on where an older
    dschat saved it (``older_step_version``: an older step version, or none recorded), None where this dschat did, or
    where no change since reaches the families of its models (``families``: those the run loads, None: unknown). One
    of a newer dschat is a UsageError naming its state.json, with ``remedy`` (default: the step's own --resume's).
    Read before any model loads (the step's own --resume, ``train.py --resume``'s plan): a newer dschat's checkpoint
    was refused only once the step's model had loaded."""
    from dschat.steps.common import STEP_VERSION, older_step_version

    state = read_trainer_state(root, tag) or {}
    remedy = remedy or (f"Resume it with that dschat, or train {step} afresh with this one (without --resume, which "
                        "removes its checkpoints)")
    # (no record: every change since but one of other families is said to reach it, as its state keeps only some of
    # the flags its run had, and not those of the runs it was resumed from)
    older = older_step_version(state.get(STEP_VERSION), step, os.path.join(trainer_folder(root, tag), "state.json"),
                               "checkpoint", remedy, families=families, null=STEP_VERSION in state)
    return older and (f"checkpoint {tag} in {root} is {older}; resumed all the same, though its step may have trained "
                      f"otherwise until {tag}")


def load_rank_state(root, tag, generator=None):
    """This rank's RNG states restored as saved with ``tag`` (``generator``'s too, if given); returns its
    ``rank_state`` (None if it saved none)."""
    saved = torch.load(os.path.join(trainer_folder(root, tag), f"rng_rank{get_rank()}.pt"), weights_only=False)
    restore_rng(saved, generator)
    return saved.get("rank_state")


def check_complete(root, tag, parts):
    """The folders of ``tag`` are all there (``parts`` and the trainer's, with its state). Checked from the files alone,
    before DeepSpeed's own errors, which name no flag. Returns the number of ranks that saved it (``saved_ranks``)."""
    for part in (*parts, TRAINER):
        if not os.path.isdir(os.path.join(root, part, tag)):
            raise UsageError(f"--resume: {os.path.join(root, LATEST)} names checkpoint {tag}, but {root} has no "
                             f"{part}/{tag} folder (removed or copied in part?): restore it"
                             f"{earlier_advice(root, tag)}; or start afresh without --resume")
    where = trainer_folder(root, tag)
    if not os.path.isfile(os.path.join(where, "state.json")):
        raise UsageError(f"--resume: checkpoint {tag} in {root} has no {TRAINER}/{tag}/state.json (removed or copied "
                         f"in part?): restore it{earlier_advice(root, tag)}; or start afresh without --resume")
    check_rank_files(root, tag)
    ranks = saved_ranks(root, tag)
    for part in parts:
        check_engine_files(root, part, tag, ranks)
    return ranks


def saved_ranks(root, tag):
    """How many ranks saved checkpoint ``tag``: one RNG file each."""
    return len(rank_files(root, tag))


def check_rank_files(root, tag):
    """Every rank that saved ``tag`` left its RNG file (the ranks its state records, else 0 up to the last file's):
    one gone made the checkpoint "saved by 0 rank(s)" (or by fewer than it was), and the error asked for another
    batch size, or another number of ranks, instead of the file."""
    files = rank_files(root, tag)
    recorded = (read_trainer_state(root, tag) or {}).get("world_size")
    ranks = recorded if isinstance(recorded, int) and recorded > 0 else max(files, default=0) + 1
    missing = [f"{TRAINER}/{tag}/rng_rank{rank}.pt" for rank in range(ranks) if rank not in files]
    if missing:
        raise UsageError(f"--resume: checkpoint {tag} in {root} has no {', '.join(missing)} (the RNG states each of "
                         f"the {ranks} rank(s) that saved it writes; removed or copied in part?): restore it"
                         f"{earlier_advice(root, tag)}; or start afresh without --resume")


def rank_files(root, tag):
    """{rank: its RNG file} of checkpoint ``tag``."""
    found = {}
    for name in os.listdir(trainer_folder(root, tag)):
        match = re.fullmatch(r"rng_rank(\d+)\.pt", name)
        if match:
            found[int(match.group(1))] = os.path.join(trainer_folder(root, tag), name)
    return found


# The files of a DeepSpeed engine's tag folder: its model states (one file; under ZeRO-3, one per rank) and its ZeRO
# optimizer partitions (one per rank, "bf16_" before a bf16 optimizer's).
MODEL_STATES = "mp_rank_00_model_states.pt"
RANK_MODEL_STATES = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt")
RANK_OPTIM_STATES = re.compile(r"(\w*?zero_pp_rank_)(\d+)(_mp_rank_00_optim_states\.pt)")
# The flag that set each part's ZeRO stage, as a checkpoint's state records it.
ZERO_STAGE_FLAGS = {MODEL: "zero_stage", ACTOR: "actor_zero_stage", CRITIC: "critic_zero_stage"}


def check_engine_files(root, part, tag, ranks):
    """``part``'s DeepSpeed folder of checkpoint ``tag`` (saved by ``ranks`` ranks) holds its model states and, where
    it holds ZeRO partitions or its recorded ZeRO stage made them (``zero_partition_forms``), every rank's: DeepSpeed's
    load failed on a missing model-states file with a bare AssertionError, said as "a file of it is damaged or
    missing" without naming one. (A folder of a checkpoint that records no stage, without optimizer partitions, is
    left to DeepSpeed's load.)"""
    names = set(os.listdir(os.path.join(root, part, tag)))
    flags = (read_trainer_state(root, tag) or {}).get("flags") or {}
    stage = flags.get(ZERO_STAGE_FLAGS.get(part))
    if stage == 3 or any(RANK_MODEL_STATES.fullmatch(name) for name in names):
        expected = [f"zero_pp_rank_{rank}_{MODEL_STATES}" for rank in range(ranks)]
    else:
        expected = [MODEL_STATES]
    forms = zero_partition_forms(names, stage, flags.get("dtype"))
    expected += [f"{start}{rank}{end}" for start, end in sorted(forms) for rank in range(ranks)]
    missing = [f"{part}/{tag}/{name}" for name in expected if name not in names]
    if missing:
        raise UsageError(f"--resume: checkpoint {tag} in {root} has no {', '.join(missing)} (DeepSpeed's states of "
                         f"its {part}, saved by {ranks} rank(s); removed or copied in part?): restore it"
                         f"{earlier_advice(root, tag)}; or start afresh without --resume")


def zero_partition_forms(names, stage, dtype):
    """The (start, end) of the names of a DeepSpeed folder's ZeRO optimizer partitions (``RANK_OPTIM_STATES``): those
    of ``names``; where none is there, those its recorded ZeRO ``stage`` and ``dtype`` made (ZeRO-1/2/3 save one per
    rank, "bf16_" before them in bf16). Only the partitions found were expected: on 1 rank, its one partition gone
    went unnamed, to DeepSpeed's FileNotFoundError from inside its load."""
    forms = {(found[1], found[3]) for found in map(RANK_OPTIM_STATES.fullmatch, names) if found}
    if not forms and stage in (1, 2, 3):
        forms = {("bf16_zero_pp_rank_" if dtype == "bf16" else "zero_pp_rank_", "_mp_rank_00_optim_states.pt")}
    return forms


def check_universal_fit(root, part, tag, saved_ranks, saved_stage, stage, flag, less_memory=""):
    """Whether ``part`` of checkpoint ``tag``, saved by ``saved_ranks`` ranks at ZeRO stage ``saved_stage``, loads at
    this run's stage ``stage`` (``flag``'s) as another stage: both ZeRO-1, 2 or 3 and not the same (a run that ran out
    of memory resumed at ZeRO-3). On another number of ranks, at another stage, or both, its states load through one
    universal copy made for this run's world (``universal_load``: ``universal_copy``, then ``fit_universal_copy`` for
    the stage). Where they cannot, one UsageError naming all that this run must give back (``refuse_universal_fit``):
    states of no ZeRO (stage 0: the optimizer saved whole, not converted) load as saved on any number of ranks, at
    stage 0 only; NVMe-offloaded optimizer states (one folder per rank) are not converted for either change. (The rank
    count's check and the stage's were two, each naming its own change: a resume that changed both was refused once
    for each.) ``less_memory``: how this step may fit in less memory at the saved stage, said with it."""
    restaged = saved_stage is not None and saved_stage != stage
    stage_change = (flag, saved_stage, stage) if restaged else None
    if restaged and 0 in (saved_stage, stage):
        refuse_universal_fit(root, tag, saved_ranks, "DeepSpeed's universal checkpoint moves the optimizer states of "
                             "ZeRO-1, 2 and 3 between stages, not those of stage 0 (saved whole, in another form)",
                             stage_change, less_memory, on_saved_ranks=False)
    if (restaged or saved_ranks != get_world_size()) and os.path.isdir(os.path.join(root, part, tag,
                                                                                     "offloaded_tensors")):
        refuse_universal_fit(root, tag, saved_ranks, f"its {part}'s optimizer states were offloaded to NVMe, one "
                             "folder per rank, which DeepSpeed's universal checkpoint does not convert", stage_change,
                             less_memory)
    return restaged


def refuse_universal_fit(root, tag, saved_ranks, why, stage_change=None, less_memory="", on_saved_ranks=True):
    """A checkpoint of ``saved_ranks`` ranks whose states cannot load in this run's world (``why``): a UsageError
    naming what to resume with, all at once: the saved number of ranks (where this run has another and
    ``on_saved_ranks``) and the saved ZeRO stage (``stage_change``: (flag, saved, now), where it changed; with
    ``less_memory``, how to fit in less memory at it)."""
    ranks = get_world_size()
    other_ranks = on_saved_ranks and saved_ranks != ranks
    if stage_change is None:
        refuse_other_rank_count(root, tag, saved_ranks, why)
    flag, saved, now = stage_change
    if not other_ranks:
        raise UsageError(f"--resume: checkpoint {tag} in {root} was saved at ZeRO stage {saved} ({flag} {saved}), "
                         f"this run has {now}; {why}: resume with {flag} {saved}{less_memory}, or start afresh "
                         "without --resume")
    raise UsageError(f"--resume: checkpoint {tag} in {root} was saved by {saved_ranks} rank(s) at ZeRO stage {saved} "
                     f"({flag} {saved}), this run has {ranks} at {now}; {why}: resume on {saved_ranks} rank(s) with "
                     f"{flag} {saved}{less_memory}, or start afresh without --resume")


def refuse_other_rank_count(root, tag, saved, why):
    """A checkpoint of ``saved`` ranks that this run, of another number, cannot continue: a UsageError saying
    ``why``."""
    raise UsageError(f"--resume: checkpoint {tag} in {root} was saved by {saved} rank(s), this run has "
                     f"{get_world_size()}; {why}: resume on {saved} rank(s)")


@dataclass
class ResumePlan:
    """What ``--resume`` continues, decided from the files before the engines exist: the checkpoint's ``tag`` (None:
    there is none) and saved ``state`` (its position, less its flags), the number of ranks that saved it, and the tag
    each part's DeepSpeed engine loads (``load_tags``; its universal copy's, on another number of ranks with ZeRO
    partitions, ``universal_load``; a part not named loads ``tag``; None: nothing, its engine is as made; then
    ``lora_from`` may name the DeepSpeed folder whose LoRA adapters its model takes before its engine is made)."""

    tag: str = None
    state: dict = field(default_factory=dict)
    saved_ranks: int = 0
    load_tags: dict = field(default_factory=dict)
    lora_from: dict = field(default_factory=dict)
    notice: str = None  # (what a resume on another number of ranks does, said when it loads)

    @property
    def other_ranks(self):
        return self.tag is not None and self.saved_ranks != get_world_size()

    def load_tag(self, part):
        return self.load_tags.get(part, self.tag)

    @property
    def universal(self):
        """The parts whose engines load a universal copy: their DeepSpeed configs need ``checkpoint.load_universal``
        before ``deepspeed.initialize``."""
        return frozenset(part for part, tag in self.load_tags.items() if tag not in (self.tag, None))


def with_universal_load(ds_config):
    """``ds_config`` asking DeepSpeed to load its checkpoint from a universal copy (``universal_load``'s tag): set
    before ``deepspeed.initialize``, which builds the engine's loader from it."""
    ds_config.setdefault("checkpoint", {})["load_universal"] = True
    return ds_config


# How long the other ranks wait for rank 0's conversion of a part (``universal_copy``; a large model's states take well
# over the process group's timeout).
CONVERSION_PATIENCE = datetime.timedelta(hours=24)


def universal_load(root, part, tag, saved_ranks, stage, whose="its", into_stage=None):
    """(the tag ``part``'s engine loads, what is said of it) on a run of another number of ranks than checkpoint
    ``tag``'s (``saved_ranks``), or of another ZeRO stage (``into_stage``; ``stage``: the checkpoint's): ZeRO-1/2/3
    partitions (``zero_partitioned``) through their universal copy, which rank 0 makes (``universal_copy``; for
    another stage, ``fit_universal_copy``) while every rank waits (its engine's config then needs DeepSpeed's
    ``checkpoint.load_universal``); states of no ZeRO (``stage`` 0) as saved."""
    if not rank_0_decides(lambda: zero_partitioned(os.path.join(root, part, tag))):
        return tag, f"{whose} DeepSpeed states are not partitioned over the ranks (no ZeRO) and load as saved"
    restaged = into_stage is not None and into_stage != stage

    def copy_for_this_run():
        load_tag, made = universal_copy(root, part, tag, saved_ranks)
        if restaged:
            fit_universal_copy(os.path.join(root, part, load_tag), into_stage)
        return load_tag, made

    load_tag, made = rank_0_decides(copy_for_this_run, CONVERSION_PATIENCE)
    into = f" into ZeRO-{into_stage}" if restaged else ""
    return load_tag, (f"{whose} ZeRO-{stage} states load{into} from DeepSpeed's universal copy {part}/{load_tag} ("
                      + ("made now" if made else "made by an earlier resume") + ")")


# The file of a DeepSpeed engine's model states (its scheduler, step counts) that a universal load reads: ZeRO-3's
# engine reads rank 0's of its own name, ZeRO-1/2's the one shared file.
UNIVERSAL_MODEL_STATES = {3: f"zero_pp_rank_0_{MODEL_STATES}", 1: MODEL_STATES, 2: MODEL_STATES}


def fit_universal_copy(folder, into_stage):
    """The universal copy in ``folder`` made loadable by an engine of ZeRO stage ``into_stage`` (rank 0, before the
    engines load it; idempotent: a copy reused by runs of either stage keeps what each needs). DeepSpeed 0.19.8's
    ``ds_to_universal`` writes what the checkpoint's own stage reads back: a ZeRO-1/2 engine failed on a ZeRO-3
    copy, and a ZeRO-3 engine on a ZeRO-1/2 copy, with a bare AssertionError (no model-states file of the name it
    globs for) and, past that, on the optimizer file's layout (ZeRO-3 reads Adam's step count from its optimizer's
    state dict, ZeRO-1/2 from each parameter's ``step.pt``). Added here, from the copy's own contents: the
    model-states file under the name this stage reads, and the step count where this stage reads it."""
    from deepspeed.checkpoint.constants import DS_VERSION, OPTIMIZER_STATE_DICT

    wanted = os.path.join(folder, UNIVERSAL_MODEL_STATES[into_stage])
    if not os.path.isfile(wanted):
        _link_or_copy(os.path.join(folder, _saved_model_states(folder)), wanted)
    zero = os.path.join(folder, "zero")
    optimizer_file = os.path.join(zero, "optimizer_state.pt")
    optimizer = torch.load(optimizer_file, weights_only=False)
    step_files = [os.path.join(zero, name, "step.pt") for name in sorted(os.listdir(zero))
                  if os.path.isdir(os.path.join(zero, name))]
    if into_stage == 3 and OPTIMIZER_STATE_DICT not in optimizer:
        step = _saved_step_count(folder, step_files)
        optimizer[OPTIMIZER_STATE_DICT] = {"state": {0: {"step": step}}, "param_groups": optimizer["param_groups"]}
        _save_atomic(optimizer, optimizer_file)
    elif into_stage != 3 and DS_VERSION not in optimizer:
        step = optimizer[OPTIMIZER_STATE_DICT]["state"][0]["step"]
        for path in step_files:
            _wrap_bare_tensors(os.path.dirname(path))
            if not os.path.isfile(path):
                _save_atomic(step, path)
        # (ZeRO-1/2's load asserts the version of DeepSpeed that saved it: the model states' own)
        optimizer[DS_VERSION] = torch.load(wanted, weights_only=False).get(DS_VERSION)
        _save_atomic(optimizer, optimizer_file)


def _saved_model_states(folder):
    """The name of the model-states file of the universal copy in ``folder`` (the first, by name). None there (a copy
    damaged or emptied since it was made) was a bare ValueError of min()."""
    names = sorted(name for name in os.listdir(folder) if name.endswith(MODEL_STATES))
    if not names:
        raise UsageError(f"--resume: DeepSpeed's universal copy {folder} has no *{MODEL_STATES} file (the engine's "
                         f"model states: its scheduler and step counts): remove {folder} so that the next --resume "
                         "makes it again from its checkpoint, or resume at the ZeRO stage the checkpoint was saved at")
    return names[0]


def _saved_step_count(folder, step_files):
    """Adam's step count of a ZeRO-1/2 universal copy in ``folder``: the first of its parameters' ``step_files``
    there. None there (a copy damaged or emptied since it was made) was a bare StopIteration."""
    for path in step_files:
        if os.path.isfile(path):
            return torch.load(path, weights_only=False)
    raise UsageError(f"--resume: DeepSpeed's universal copy {folder} has no step.pt in any parameter folder of its "
                     "zero/ folder (Adam's step count, which a ZeRO-3 engine reads from its optimizer states): remove "
                     f"{folder} so that the next --resume makes it again from its checkpoint, or resume at the ZeRO "
                     "stage the checkpoint was saved at")


def _wrap_bare_tensors(folder):
    """A parameter's folder of a ZeRO-3 universal copy, its states (``fp32.pt``, ``exp_avg.pt``, ...) as ZeRO-1/2's
    load reads them: each a dict with its tensor under "param" (ZeRO-3's copy saves the flat tensor alone, which
    ZeRO-3's load reads either way)."""
    from deepspeed.checkpoint.constants import PARAM

    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name != "step.pt" and name.endswith(".pt"):
            states = torch.load(path, weights_only=False)
            if torch.is_tensor(states):
                _save_atomic({PARAM: states}, path)


def _save_atomic(states, path):
    # (whole or not at all: a half-written file would be taken as made by a later resume's fitting)
    with atomic_file(path, "wb") as out:
        torch.save(states, out)


def _link_or_copy(source, target):
    try:
        os.link(source, target)
    except OSError:  # (another file system: a copy, written whole)
        with open(source, "rb") as src, atomic_file(target, "wb") as out:
            shutil.copyfileobj(src, out)


def remove_universal_copies(root, plan, step):
    """After a resume on another number of ranks or at another ZeRO stage that trains nothing (``plan``'s checkpoint at
    the run's last step): rank 0 removes the universal copies its engines loaded (``plan.universal``), and says so.
    Each is a full copy of the checkpoint's optimizer states, made for this run's ranks and stage to go on from, which
    only a later save pruned (``_prune``): a finished run resumed on other ranks left one beside its checkpoints for
    good."""
    copies = [f"{part}/{plan.load_tag(part)}" for part in sorted(plan.universal)]
    if not copies or not is_rank_0():
        return
    for copy in copies:
        shutil.rmtree(os.path.join(root, copy), ignore_errors=True)
    print_rank_0(f"[{step}] --resume: removed DeepSpeed's universal {'copy' if len(copies) == 1 else 'copies'} "
                 f"{', '.join(copies)} of checkpoint {plan.tag}, loaded on {get_world_size()} rank(s): nothing is "
                 "left to train from it")


def check_same_products(root, tag, saved, saved_ranks, args, products, unrecorded):
    """A checkpoint of ``saved_ranks`` ranks that this run of another number continues: for each (flag pair, what it
    took, unit, what counts it) of ``products``, the pair's product with the ranks is the checkpoint's (``saved``: its
    recorded values of the flags; a pair not recorded is refused, saying ``unrecorded``); else a UsageError naming the
    flag and value to give (``same_product_advice``), for every pair that differs at once (one error per try made
    step 3's resume on half the ranks take two)."""
    if not saved or any(name not in saved for flags, *_ in products for name in flags):
        refuse_other_rank_count(root, tag, saved_ranks, unrecorded)
    ranks = get_world_size()
    differing = []
    for flags, took, unit, counts in products:
        then = saved[flags[0]] * saved[flags[1]] * saved_ranks
        now = getattr(args, flags[0]) * getattr(args, flags[1]) * ranks
        if now != then:
            differing.append(
                f"{took} {saved[flags[0]]} x {saved[flags[1]]} x {saved_ranks} = {then} {unit} (--{flags[0]} x "
                f"--{flags[1]} x ranks), this run's {getattr(args, flags[0])} x {getattr(args, flags[1])} x {ranks} = "
                f"{now}; {counts} {then} {unit}: "
                + same_product_advice(then, *((name, getattr(args, name)) for name in flags), ranks, unit))
    if differing:
        raise UsageError(f"--resume: checkpoint {tag} in {root} was saved by {saved_ranks} rank(s), this run has "
                         f"{ranks}: " + "; and ".join(differing))


def same_product_advice(total, first, second, ranks, unit="samples"):
    """How this run of ``ranks`` ranks takes ``total`` ``unit`` (the samples of an optimizer step, the prompts of an
    iteration) as ``first`` x ``second`` x ranks, each a (flag, its value now) pair: the flag to change, if it can."""
    (first_flag, first_value), (second_flag, second_value) = first, second
    if total % (first_value * ranks) == 0:
        return f"resume with --{second_flag} {total // (first_value * ranks)}"
    if total % (second_value * ranks) == 0:
        return f"resume with --{first_flag} {total // (second_value * ranks)}"
    if total % ranks == 0:
        return f"resume with --{first_flag} and --{second_flag} whose product is {total // ranks}"
    return f"{total} {unit} do not split over {ranks} ranks: resume on another number of ranks"


def rng_said(saved_ranks, states="RNG states", unit="step"):
    """What a run of another number of ranks than the checkpoint's (``saved_ranks``) does with each rank's
    ``states`` (``load_rank_state_of_others``): its own where saved, else drawn from (--seed, rank, ``unit``)."""
    ranks = get_world_size()
    own = min(saved_ranks, ranks)
    if ranks == 1:
        return f"rank 0 restores its own {states}"
    if own == ranks:
        return f"each rank restores its own {states}"
    return (f"{_ranks(0, own - 1)} restore{'s' if own == 1 else ''} {'its' if own == 1 else 'their'} own {states}, "
            f"{_ranks(own, ranks - 1)} (none saved) draw{'s' if own == ranks - 1 else ''} "
            f"{'its' if own == ranks - 1 else 'theirs'} from (--seed, rank, {unit})")


def _ranks(first, last):
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def param_group_settings(engine):
    """The optimizer's parameter groups' settings (weight decay, betas, ...), less their parameters."""
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def restore_param_group_settings(engine, groups):
    """After a universal load: the parameter groups' settings as this run made them (``param_group_settings`` before
    the load), and their learning rates where the restored scheduler left them, as a load of the checkpoint itself
    restores them. DeepSpeed's ZeRO-3 universal load (0.19.8, ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``)
    gives every group the first group's (its weight decay to the no-decay group, the base learning rate to LoRA's).
    The flags that make them are bound, so these are the checkpoint's."""
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
    rates = engine.lr_scheduler.get_last_lr() if engine.lr_scheduler is not None else None
    for index, (group, settings) in enumerate(zip(optimizer.param_groups, groups)):
        group.update({key: value for key, value in settings.items() if key != "lr"})
        if rates is not None:
            group["lr"] = rates[index]
    own_step_counts(optimizer)


def own_step_counts(optimizer):
    """After a universal load: each optimizer state its own Adam step count. DeepSpeed's ZeRO-3 universal load (0.19.8)
    gives every sub-group the one step tensor of the checkpoint's first state; torch's AdamW (the CPU's optimizer)
    adds 1 to it in place for each sub-group, so with two (weight decay and none, LoRA's own learning rate, a model
    past ``sub_group_size``) every step after the resume counted as two or more in Adam's bias corrections, and the
    run drifted from the uninterrupted one's (and saved the inflated count in its next checkpoints)."""
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def follow_this_runs_schedule(engine):
    """After ``engine.load_checkpoint``: the learning rates the next optimizer step applies, from this run's schedule
    at the restored position. DeepSpeed restores the scheduler's step count and the optimizer's rates as the
    checkpoint's run had set them, and the scheduler sets new ones only after the next step: a run of another length
    than its checkpoint's (--max_steps, --num_train_epochs) took that step at the old schedule's rate (0.0 after a
    schedule that had ended) although it said the rates follow its own. The restored base rates are kept (another
    --learning_rate has no effect on resume); the same length gives the same rates."""
    scheduler = getattr(engine, "lr_scheduler", None)
    lambdas = getattr(scheduler, "lr_lambdas", None)  # transformers' schedules are LambdaLRs
    if not lambdas:
        return
    rates = [base * rate(scheduler.last_epoch) for base, rate in zip(scheduler.base_lrs, lambdas)]
    for group, rate in zip(scheduler.optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates


@contextlib.contextmanager
def loading_checkpoint(engine, plan, part):
    """Around ``engine.load_checkpoint`` of ``plan``'s ``part``, what DeepSpeed's load would otherwise take from the
    checkpoint's run instead of this one: after a universal load, the parameter groups' settings put back
    (``restore_param_group_settings``); after any load, the learning rates of this run's schedule at the restored
    position (``follow_this_runs_schedule``) and this run's gradient clipping (``keep_this_runs_clipping``); and
    Adam's step counts of an older ZeRO-0 fp16/bf16 checkpoint counted back (``recount_restored_allocation_step``)."""
    from dschat.models.training_engine import recount_restored_allocation_step

    groups = param_group_settings(engine) if part in plan.universal else None
    clipping = getattr(getattr(engine, "optimizer", None), "clip_grad", None)
    yield
    if groups is not None:
        restore_param_group_settings(engine, groups)
    follow_this_runs_schedule(engine)
    keep_this_runs_clipping(engine, clipping)
    recounted = recount_restored_allocation_step(engine)
    if recounted:
        print_rank_0(f"--resume: the {part}'s Adam state in checkpoint {plan.tag} counted {recounted[0]} steps for the "
                     f"{recounted[1]} it took (a ZeRO-0 fp16/bf16 checkpoint of dschat before its optimizer's setup "
                     f"step was taken back): it counts {recounted[1]} now")


def keep_this_runs_clipping(engine, clipping):
    """After ``engine.load_checkpoint``: the optimizer clips gradients at ``clipping``, the DeepSpeed config's
    ``gradient_clipping`` it was made with (None: an optimizer that keeps none, e.g. torch's at ZeRO-0 in fp32, which
    the engine clips at its config's). DeepSpeed's ZeRO-1/2 optimizer (and its bf16 and fp16 ones) put back the
    checkpoint's run's value with its state: a resume whose config file gave another clipped at the old one, while
    its config (and the ``[ds_config]`` line) said the new one, and ZeRO-0 and ZeRO-3 applied the new one."""
    if clipping is not None:
        engine.optimizer.clip_grad = clipping


def universal_tag(tag):
    return f"{tag}{UNIVERSAL}"


def zero_partitioned(folder):
    """Whether the DeepSpeed checkpoint in ``folder`` (one tag of one engine) holds per-rank ZeRO partitions (its
    ``*optim_states.pt`` files: ZeRO-1, 2, 3), which another number of ranks loads only through a universal copy;
    without them (no ZeRO: the whole optimizer is in ``mp_rank_00_model_states.pt``) any number of ranks loads it."""
    return any(name.endswith("optim_states.pt") for name in os.listdir(folder))


def universal_copy(root, part, tag, saved):
    """The universal copy of ``part``'s checkpoint ``tag`` (saved by ``saved`` ranks): (its tag, whether it was made
    now). Rank 0; made once by DeepSpeed's ``ds_to_universal`` into ``<tag>_universal.partial`` and renamed into place
    when complete, so a conversion killed part-way is made again, never loaded; a complete one is reused by a later
    resume. Removed with its tag (``_prune``), by a new save of the same tag, and by a resume that trains nothing
    (``remove_universal_copies``). A conversion DeepSpeed fails is a UsageError naming its error (or the full disk).
    Said when it starts, and with its seconds when done: it grows with the states' size (an OPT-350m-shaped model's
    took 19-53 s on a CPU machine: docs/rank_change_resume.md), time the run otherwise spent in silence."""
    from deepspeed.checkpoint import ds_to_universal

    folder = os.path.join(root, part)
    final = os.path.join(folder, universal_tag(tag))
    if os.path.isdir(final):
        return universal_tag(tag), False
    scratch = final + UNIVERSAL_PARTIAL
    shutil.rmtree(scratch, ignore_errors=True)
    # its folder one level down: ds_to_universal writes a ``latest_universal`` pointer beside the folder it makes,
    # which would name the partial folder in ``part``
    made = os.path.join(scratch, universal_tag(tag))
    # no worker processes: this rank's process group has threads that a forked worker would copy in any state;
    # inject_missing_state: dschat's models carry no universal_checkpoint_info (no tensor or pipeline parallelism:
    # the defaults are theirs)
    options = argparse.Namespace(input_folder=os.path.join(folder, tag), output_folder=made, num_extract_workers=1,
                                 num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    print_rank_0(f"--resume: converting {part}/{tag} (saved by {saved} rank(s)) into DeepSpeed's universal copy "
                 f"{part}/{universal_tag(tag)} for {get_world_size()} rank(s) (ds_to_universal, once; the other "
                 "ranks wait)")
    started = time.time()
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            ds_to_universal.main(options)
    except Exception as error:
        full = _conversion_full_disk(error, scratch)  # (asked before the partial copy goes, which frees its space)
        shutil.rmtree(scratch, ignore_errors=True)
        if full is not None:
            _refuse_full_disk_for_conversion(error, full, root, part, tag, saved)
        _refuse_damaged_for_conversion(error, root, part, tag)
        raise UsageError(f"--resume: checkpoint {tag} in {root} was saved by {saved} rank(s), this run has "
                         f"{get_world_size()}, and DeepSpeed could not convert its {part} states for another number "
                         f"of ranks (ds_to_universal: {type(error).__name__}: {error}{_conversion_hint(error)}): "
                         f"resume on {saved} rank(s)") from error
    os.rename(made, final)
    shutil.rmtree(scratch)
    print_rank_0(f"--resume: {part}/{universal_tag(tag)} made in {time.time() - started:.0f} s")
    return universal_tag(tag), True


def _conversion_full_disk(error, scratch):
    """(ENOSPC or EDQUOT, the bytes free then or None) where the conversion's failure ``error`` is its writing into
    ``scratch`` on a full disk or quota (torch's writer names no cause: ``full_disk_errno`` asks the disk), else
    None."""
    code = full_disk_code(error) if isinstance(error, OSError) else full_disk_errno(error, scratch)
    if code is None:
        return None
    return code, free_space(scratch) if code == errno.ENOSPC else None  # (a quota's limit is not the disk's space)


def _refuse_full_disk_for_conversion(error, full, root, part, tag, saved):
    """A conversion for another number of ranks that ran out of space where it writes (``full``:
    ``_conversion_full_disk``'s): a UsageError saying so, naming the folder, the space left and about what the copy
    needs. It was said as DeepSpeed failing to convert the states, with its error (torch's "unexpected pos 704 vs
    598" names no cause)."""
    code, free = full
    left = f", {free / 2**20:.1f} MiB free" if free is not None else ""
    states = sum(entry.stat().st_size for entry in os.scandir(os.path.join(root, part, tag)) if entry.is_file())
    raise UsageError(f"--resume: checkpoint {tag} in {root} was saved by {saved} rank(s), this run has "
                     f"{get_world_size()}, and DeepSpeed's conversion of its {part} states for another number of ranks "
                     f"ran out of space ({os.strerror(code)}{left}) in {os.path.join(root, part)}, where it writes "
                     f"the universal copy {part}/{universal_tag(tag)} (with its temporary files, up to about twice the "
                     f"{states / 2**20:.1f} MiB of {part}/{tag}; the part written was removed): free some space "
                     f"there, or resume on {saved} rank(s), which loads the checkpoint without a copy") from error


# How the conversion's writing into the checkpoint's folder fails that says nothing of the checkpoint's files
WRITE_REFUSED_ERRNOS = (*FULL_DISK_ERRNOS, errno.EACCES, errno.EPERM, errno.EROFS)


def _refuse_damaged_for_conversion(error, root, part, tag):
    """A conversion that failed on a file of ``part``'s states that cannot be read (cut short: torch's loader's
    "OSError: [Errno 22] Invalid argument", its zip reader's error, an EOFError): a UsageError saying the checkpoint
    is damaged, as its load on its own number of ranks does (``reading``); the conversion's error advised resuming on
    the checkpoint's ranks, where it fails too. (A full disk's or quota's OSError, and a refused write's, a read-only
    checkpoints folder's, are the conversion's writing: no file of the checkpoint is damaged.)"""
    if isinstance(error, OSError) and error.errno in WRITE_REFUSED_ERRNOS:
        return
    reason = unreadable_file_reason(error, (OSError,))
    if reason is not None:
        raise UsageError(f"--resume: checkpoint {tag} in {root} cannot be converted for {get_world_size()} rank(s) "
                         f"(ds_to_universal on {part}/{tag}: {reason}); a file of it is damaged or missing (copied in "
                         f"part?): restore it{earlier_advice(root, tag)}; or start afresh without --resume") from error


def _conversion_hint(error):
    """Why ds_to_universal fails as it does where that is known: it reads Adam's moments, which a ZeRO optimizer
    holds only after a step has updated it (a bare KeyError: 0 before)."""
    if isinstance(error, KeyError):
        return ("; DeepSpeed converts an optimizer only once a step has updated it: every step of this part so far "
                "may have been skipped, e.g. on fp16 overflows")
    return ""


def load_rank_state_of_others(root, tag, seed, step, generator=None):
    """On a run of another number of ranks than checkpoint ``tag``'s: this rank's RNG states restored from its own
    file where the checkpoint has one (its rank was among those that saved it), else drawn from (``seed``, rank,
    ``step``), the same on every resume. Returns (whether its own were restored, the ``rank_state`` of every rank
    that saved it, by rank)."""
    files = rank_files(root, tag)
    saved = {rank: torch.load(path, weights_only=False) for rank, path in sorted(files.items())}
    own = saved.get(get_rank())
    if own is not None:
        restore_rng(own, generator)
    else:
        seed_rng(derived_seed(seed, get_rank(), step))
        if generator is not None:  # (a seed of its own: seeded alike, it would draw what torch's global RNG draws)
            generator.manual_seed(derived_seed(seed, get_rank(), step, "generator"))
    return own is not None, {rank: state.get("rank_state") for rank, state in saved.items()}


def derived_seed(seed, rank, step, stream=None):
    """A seed of (``seed``, ``rank``, ``step``) (and ``stream``: a generator's own), for a rank that has no saved RNG
    states to restore."""
    key = f"{seed}/{rank}/{step}" + (f"/{stream}" if stream else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little")


def seed_rng(value):
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)  # (CUDA's too)


# How DeepSpeed's loaders fail on a checkpoint file that is missing or cut short: a bare assertion when a rank's file
# is absent, a KeyError for a state without its entries, an OSError (besides ``unreadable_file_reason``'s own).
DEEPSPEED_LOAD_FAILURES = (AssertionError, KeyError, OSError)


@contextlib.contextmanager
def reading(root, tag):
    """Loading checkpoint ``tag`` of ``root``: a file of it that cannot be read is one UsageError naming the
    checkpoint, what failed and the earlier checkpoint kept, instead of a traceback from inside torch or DeepSpeed
    that names no file (``DSCHAT_TRACEBACK=1`` shows it). Other failures (out of memory, another rank's) stay.
    Loaded on this rank, it waits for every rank's load: no rank goes on (says it resumed, clears the output's
    finished mark) while another failed to load its files (that rank stops with its error, and the wait fails)."""
    try:
        yield
        barrier()
    except UsageError:
        raise
    except Exception as error:
        reason = unreadable_file_reason(error, DEEPSPEED_LOAD_FAILURES)  # (not another rank's failure: no file's)
        if reason is None:
            raise
        raise UsageError(f"--resume: checkpoint {tag} in {root} cannot be loaded ({reason}); a file of it is damaged "
                         f"or missing (copied in part?): restore it{earlier_advice(root, tag)}; or start afresh "
                         "without --resume") from error


def check_same_flags(saved, now, restored, tag, root, step, why, free=()):
    """The flags a checkpoint is bound to (``now``: {flag: value}) as it saved them (``saved``; a checkpoint that
    stored none is not checked): any other value is a UsageError naming each, with ``why`` they bind it. The
    ``restored`` flags' saved values are DeepSpeed's to restore (the optimizer's learning rates): another value is
    said to change nothing; returns {flag: saved value} of those, for the run to record the values it trains with.
    The ``free`` flags (dropout) bind nothing a checkpoint holds: another value is said, and applies from here."""
    differ = [name for name in now if name in saved and not _same_flag_value(name, saved[name], now[name])]
    changed = [_changed_said(name, saved[name], now[name], differ) for name in differ if name not in (*restored, *free)]
    changed = [said for said in changed if said]
    if changed:
        raise UsageError(f"--resume: checkpoint {tag} in {root} was saved with other settings: "
                         f"{'; '.join(changed)}. {why}: resume with the checkpoint's values, or start afresh without "
                         f"--resume")
    ignored = {name: saved[name] for name in differ if name in restored}
    if ignored:
        said = ", ".join(f"--{name} {now[name]!r} (the checkpoint's: {value!r})" for name, value in ignored.items())
        print_rank_0(f"[{step}] --resume: {said}: no effect, DeepSpeed restores the learning rates from the checkpoint")
    applied = [f"--{name} {_value_or_models(saved[name])} -> {_value_or_models(now[name])}" for name in differ
               if name in free]
    if applied:
        print_rank_0(f"[{step}] --resume: {', '.join(applied)}: the rest of the run trains with the new value")
    return ignored


def _same_flag_value(name, saved, now):
    """Whether a flag's value now is the one a checkpoint saved: --data_fields by the renaming it gives (the order of
    its mappings, spaces, another spelling of a dataset's path aside), --data_path and --sft_only_data_path by the
    datasets they read (./x.jsonl is jsonl:x.jsonl), any other as it is."""
    if name == "data_fields":
        from dschat.data.fields import same_data_fields

        return same_data_fields(saved, now)
    if name in DATA_SOURCE_FLAGS:
        from dschat.data.fields import same_datasets

        return same_datasets(saved, now)
    return saved == now


def _value_or_models(value):
    return "(the model's own)" if value is None else repr(value)


# The flags that choose the sources whose content DATA_FILES and HUB_DATA record: where one of them changed, the
# sources only one run reads are that flag's change, not an edit.
DATA_SOURCE_FLAGS = ("data_path", "sft_only_data_path")


def _changed_said(name, saved, now, differ=()):
    """What ``--name`` changing from ``saved`` to ``now`` is said as (``differ``: every bound flag that changed);
    None where another flag's change says it all (another --data_path reads other files)."""
    both_only = any(flag in differ for flag in DATA_SOURCE_FLAGS)
    if name == DATA_FILES:
        from dschat.data.raw_datasets import changed_data_files

        edited = changed_data_files(saved, now, both_only)
        return f"the content of its data files changed since: {', '.join(edited)}" if edited else None
    if name == HUB_DATA:
        from dschat.data.raw_datasets import changed_names

        edited = changed_names(saved, now, both_only)
        return (f"the data of its hub datasets changed since: {', '.join(edited)} (another revision in the HF datasets "
                "cache)") if edited else None
    if name == UNSUPERVISED_DATA:
        from dschat.data.unsupervised import changed_unsupervised_data

        return f"its unsupervised data changed since: {', '.join(changed_unsupervised_data(saved, now))}"
    return f"--{name} {saved!r} -> {now!r}"


def take_restored_flags(state, args):
    """The learning rates DeepSpeed restored (``check_same_flags``' return, kept in ``state["restored"]``) set on
    ``args``: the run trains with them, and its record of flags says so."""
    for name, value in state.pop("restored", {}).items():
        setattr(args, name, value)


def clear_earlier_run(root):
    """A run that starts afresh (no --resume) removes the checkpoints an earlier run left in ``root``, as it replaces
    that run's log and models: kept, ``--resume`` after an interruption could continue that other run, and its tags
    would mix with this run's. Only a checkpoint's parts and pointer go; anything else there is named and stays.
    Returns whether there were any."""
    found = [name for name in (*PARTS, LATEST) if os.path.exists(os.path.join(root, name))]
    barrier()  # every rank has looked before rank 0 removes
    if found and is_rank_0():
        for name in found:
            path = os.path.join(root, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        others = sorted(os.listdir(root))
        if others:
            print_rank_0(f"{root}: kept {', '.join(others)} (no checkpoint's)")
        else:
            os.rmdir(root)
    barrier()
    return bool(found)


def _parts(root):
    return [name for name in PARTS if os.path.isdir(os.path.join(root, name))]


def _tags(root, parts):
    return sorted({tag for part in parts for tag in os.listdir(os.path.join(root, part))  # (DeepSpeed puts its
                   if TAG.fullmatch(tag) and os.path.isdir(os.path.join(root, part, tag))})  # zero_to_fp32.py there)


def complete_tags(root):
    """The tags in ``root`` whose save got as far as the trainer state, oldest first."""
    if not os.path.isdir(root):
        return []
    return [t for t in _tags(root, _parts(root)) if os.path.isfile(os.path.join(trainer_folder(root, t), "state.json"))]


def _prune(root, current, keep_last):
    """Keep the last ``keep_last`` complete tags up to ``current`` (those with their trainer state), in every part;
    remove every other tag: older ones, ones a save killed part-way left, and ones after ``current``, which belong to
    an earlier, longer run in the same folder (kept, they would sort after this run's and be pruned in its place). A
    universal copy goes with its tag, and ``current``'s too: it was made from the files this save replaced; one a
    conversion killed part-way left (``.partial``) goes too."""
    parts = _parts(root)
    keep = set([t for t in complete_tags(root) if t <= current][-keep_last:])
    for tag in _tags(root, parts):
        if tag not in keep:
            for part in parts:
                shutil.rmtree(os.path.join(root, part, tag), ignore_errors=True)
    for part in parts:
        for name in os.listdir(os.path.join(root, part)):
            copy = UNIVERSAL_COPY.fullmatch(name)
            if copy and (name.endswith(UNIVERSAL_PARTIAL) or copy.group("tag") not in keep
                         or copy.group("tag") == current):
                shutil.rmtree(os.path.join(root, part, name), ignore_errors=True)
