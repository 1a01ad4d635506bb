"""What the training steps share: set-up, data loaders, the DeepSpeed engine, progress and metrics."""
import functools
import json
import os
import socket
import time
import uuid
from contextlib import closing
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from dschat.errors import UsageError
from dschat.models.left_padding import LEFT_PADDING_MOVES_SCORES
from dschat.models.training_engine import check_schedule_reaches_its_end, initialize_engine, released_engines
from dschat.models.zero3 import full_numel
from dschat.rlhf.algorithms import check_finite
from dschat.report import counted
from dschat.run_layout import (ACTOR_DIR, ACTOR_EMA_DIR, CRITIC_DIR, FINISHED_MARK, RUN_ARGS_FILE, STEP_FOLDER_NAMES,
                               unfinished_reason)
from dschat.utils.checkpoints import DATA_FILES, DATA_FILES_FLAGS, DATA_SOURCE_FLAGS, HUB_DATA, UNSUPERVISED_DATA
from dschat.utils.dist import (all_reduce, barrier, check_same_on_every_rank, ensure_distributed, gathered_objects,
                               get_world_size, is_rank_0, local_device, print_rank_0, rank_0_decides, rank_mean)
from dschat.utils.ds_config import check_dtype_supported
from dschat.utils.files import check_writable_folder, read_json_object, write_json_atomic
from dschat.utils.optim import optimizer_step, skipped_steps


def setup_run(args, trains=True):
    """Distributed init, seeds and the device; returns the device. ``trains=False``: nothing trains (an evaluation
    tool's held-out prompts), so --dtype is no training precision the accelerator must support."""
    from transformers import set_seed

    from dschat.args import step_flag_dests

    if trains:
        check_dtype_supported(args.dtype)
    ensure_distributed()
    device = local_device()
    check_same_on_every_rank({name: value for name, value in vars(args).items() if name in step_flag_dests()}, device)
    check_same_ds_config_file(args, device)
    set_seed(args.seed)
    return device


def check_same_ds_config_file(args, device):
    """A --deepspeed_config file each node reads from its own disk: copies that differ (ZeRO's bucket sizes, say) made
    the ranks' collectives differ, and they failed deep in DeepSpeed (gloo: "Received data size doesn't match expected
    size"; NCCL: a hang), or trained apart (gradient clipping); the ranks compare the flags, not the file. Collective."""
    from dschat.utils.dist import names_differing_between_ranks
    from dschat.utils.ds_config import CONFIG_FLAGS, load_user_ds_config, user_ds_config_path

    path = user_ds_config_path(args)
    if get_world_size() == 1 or not isinstance(path, str):  # (a notebook's dict is the same object's copy)
        return
    try:
        content = json.dumps(load_user_ds_config(path), sort_keys=True)
    except UsageError as error:  # (one node without it, or with a broken copy: that differs too; on every node, the
        content = str(error)     # config's own check says so)
    if names_differing_between_ranks({"config": content}, device):
        raise UsageError(f"DeepSpeed config {path!r} ({CONFIG_FLAGS}): its content differs between the ranks (each "
                         "node's own copy): give every node the same file")


def check_output_dir(folder, device):
    """A step's --output_dir, checked before training, not when its models are saved: writable, and on several hosts
    storage they all see. A save there that a kill stopped while it replaced a model folder is finished first."""
    from dschat.models.checkpoint import recover_interrupted_saves

    rank_0_decides(lambda: recover_interrupted_saves(folder))
    check_not_a_checkpoints_folder(folder)
    check_writable_folder(folder, "--output_dir")
    check_output_dir_shared(folder, device)


def check_not_a_checkpoints_folder(folder):
    """An --output_dir that is a step's checkpoints folder (its ``latest`` pointer names a checkpoint there), given
    for the step's output folder: --resume looked in its own checkpoints folder inside, found none and started over,
    and the run saved its model and checkpoints among the earlier run's."""
    from dschat.utils.checkpoints import published_tag, trainer_folder

    tag = published_tag(folder)
    if tag is not None and os.path.isdir(trainer_folder(folder, tag)):
        raise UsageError(f"--output_dir {folder} is a step's checkpoints folder (it holds checkpoint {tag}): give the "
                         f"step's output folder, {os.path.dirname(os.path.abspath(folder))}, which --resume continues "
                         "from")


def check_output_dir_shared(folder, device):
    """The ranks of several hosts save, resume and hand models to the next step through ``folder``: one that each node
    has its own copy of failed late (step 2's ranks on other nodes found no step-1 model; a resume found other
    ranks' checkpoint shards missing). Said at the start instead: rank 0 writes a file there, every rank looks.
    Called by the steps that write ``folder`` (``check_output_dir``); not at set-up, which the RLHF engine,
    the prompt loaders and the evaluation tools share: they write no --output_dir (step 3's default is not theirs)."""
    if get_world_size() == 1:
        return
    hosts = gathered_objects(socket.gethostname(), device)
    if len(set(hosts)) == 1:  # (one machine: one file system)
        return
    name, made = rank_0_decides(lambda: _write_probe(folder))
    probe = os.path.join(folder, name)
    seen = gathered_objects(os.path.exists(probe), device)
    barrier()
    if is_rank_0():
        os.remove(probe)
        for path in made:  # as check_writable_folder, it leaves no folder (a step failing later left an empty one)
            try:
                os.rmdir(path)
            except OSError:
                break
    blind = [f"rank {rank} ({host})" for rank, (host, saw) in enumerate(zip(hosts, seen)) if not saw]
    if blind:
        raise UsageError(f"--output_dir {folder}: {', '.join(blind)} cannot see the file rank 0 ({hosts[0]}) wrote "
                         "there: the ranks of several nodes save, resume and pass models to the next step through "
                         "it, so it must be storage every node sees (a shared file system), under the same path")


def _write_probe(folder):
    """An empty file of a new name in ``folder``: its name, and the folders made for it, innermost first."""
    made, missing = [], os.path.abspath(folder)
    while not os.path.exists(missing):
        made.append(missing)
        missing = os.path.dirname(missing)
    os.makedirs(folder, exist_ok=True)
    name = f".shared-check-{uuid.uuid4().hex}"
    with open(os.path.join(folder, name), "w"):
        pass
    return name, made


def warn_of_unfinished_inputs(paths):
    """Each model of ``paths`` that an interrupted run of its step left (``unfinished_reason``), said: train.py refuses
    one before its steps; a step script or a notebook goes on with it."""
    for path in dict.fromkeys(filter(None, paths)):
        if isinstance(path, str) and (reason := unfinished_reason(path)):
            print_rank_0(f"warning: {reason}")


def build_dataloaders(train_dataset, eval_dataset, collator, train_batch_size, eval_batch_size, seed,
                      drop_last=False):
    """(train loader, eval loader); no train loader for ``train_dataset`` None (an evaluation alone)."""
    from dschat.data.samplers import loader_generator

    evaluation = eval_loader(eval_dataset, eval_batch_size, collator, seed)
    if train_dataset is None:
        return None, evaluation
    if get_world_size() > 1:
        train_sampler = DistributedSampler(train_dataset, shuffle=True, seed=seed)
    else:
        train_sampler = RandomSampler(train_dataset, generator=torch.Generator().manual_seed(seed))
    # the loaders' own generators keep their iterators off torch's global RNG (loader_generator says why)
    train = DataLoader(train_dataset, batch_size=train_batch_size, sampler=train_sampler, collate_fn=collator,
                       drop_last=drop_last, generator=loader_generator(seed))
    return train, evaluation


def eval_loader(eval_dataset, batch_size, collator, seed):
    from dschat.data.samplers import distributed_eval_loader, loader_generator

    if get_world_size() > 1:  # the ranks' padding repeats get eval_weight 0, so the evaluation counts every item once
        return distributed_eval_loader(eval_dataset, batch_size, collator)
    return DataLoader(eval_dataset, batch_size=batch_size, sampler=SequentialSampler(eval_dataset), collate_fn=collator,
                      generator=loader_generator(seed))


def evaluated_records(eval_dataset, eval_iters, batch_size):
    """The eval records each evaluation of steps 1, 2 and DPO scores: the first ``eval_iters`` batches of
    ``batch_size`` of the eval split (0: all of it), shared among the ranks, so that any number of ranks scores the
    same records and reports the same metrics (DeepSpeed-Chat's step 2 has every rank read the same first batches;
    Megatron's --eval-iters counts global batches). A cap per rank read twice the records on two ranks."""
    from torch.utils.data import Subset

    count = eval_iters * batch_size
    if not eval_iters or count >= len(eval_dataset):
        return eval_dataset
    return Subset(eval_dataset, range(count))


def eval_loader_of_first(loader, count, seed):
    """``eval_loader``'s ``loader`` made again of the first ``count`` items of its dataset alone."""
    from torch.utils.data import Subset

    from dschat.data.samplers import EvalWeighted

    dataset = loader.dataset.dataset if isinstance(loader.dataset, EvalWeighted) else loader.dataset
    collator = getattr(loader.collate_fn, "collator", loader.collate_fn)  # (the one weighted_collator wraps)
    return eval_loader(Subset(dataset, range(count)), loader.batch_size, collator, seed)


def reseed_epoch(loader, seed, epoch):
    """Each epoch's data order depends on (seed, epoch) only, so a resumed run skips exactly what it consumed."""
    sampler = loader.sampler
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    elif getattr(sampler, "generator", None) is not None:
        sampler.generator.manual_seed(seed + epoch)


def resumed_save_interval(given, checkpoint, step, unit):
    """--save_interval as given; not given: the interval of the run a resume continues (``checkpoint``: its saved
    position, None when not resuming), so that a second interruption loses no more, else 0 (off)."""
    if given is not None:
        return given
    if checkpoint is None:
        return 0
    if "save_interval" not in checkpoint:  # a step-3 checkpoint written before it was kept
        print_rank_0(f"[{step}] --resume: the checkpoint does not say its run's --save_interval; no further "
                     "checkpoints unless --save_interval is given")
    interval = checkpoint.get("save_interval", 0)
    if interval:
        print_rank_0(f"[{step}] checkpointing every {interval} {unit}, as the resumed run did (--save_interval "
                     "changes it, 0 turns it off)")
    return interval


def num_update_steps(num_batches, gradient_accumulation_steps, epochs, max_steps=0):
    """Optimizer steps the run takes. DeepSpeed's accumulation runs on across epochs, so an epoch's leftover
    micro-batches join the next epoch's, and only the last ones, short of a whole step, are never applied (the
    loop stops before them)."""
    steps = num_batches * epochs // gradient_accumulation_steps
    if steps == 0:
        raise UsageError(f"{counted(num_batches, 'micro-batch', 'micro-batches')} per epoch x {epochs} epoch(s): too "
                         f"few to fill one optimizer step of --gradient_accumulation_steps "
                         f"{gradient_accumulation_steps}: give more data, more epochs or a smaller batch")
    say_max_steps_past_the_epochs(max_steps, steps, epochs, "optimizer step")
    if not max_steps or max_steps >= steps:
        say_micro_batches_left_out(num_batches * epochs - steps * gradient_accumulation_steps, num_batches, epochs,
                                   gradient_accumulation_steps)
    return min(steps, max_steps) if max_steps else steps


def say_micro_batches_left_out(left_out, num_batches, epochs, gradient_accumulation_steps):
    """The run's last micro-batches that fill no whole optimizer step are never trained on (the loop ends at the last
    step; HF's Trainer steps on such a group, DeepSpeed only on whole ones): said, as step 3 says the prompts of no
    whole iteration, rather than a share of the data left out without a word."""
    if left_out:
        last, fill, are = ("the last", "fills", "is") if left_out == 1 else (f"the last {left_out}", "fill", "are")
        print_rank_0(f"--gradient_accumulation_steps {gradient_accumulation_steps}: {last} of the run's "
                     f"{num_batches * epochs} micro-batches on each rank ({num_batches} per epoch x {epochs} "
                     f"epoch(s)) {fill} no whole optimizer step and {are} not trained on; a "
                     f"--gradient_accumulation_steps that divides {num_batches * epochs}, or another batch size or "
                     "number of epochs, trains them all")


def say_max_steps_past_the_epochs(max_steps, available, epochs, unit):
    """--max_steps stops a run early; it never adds epochs (HF's Trainer's does): a larger one is said, not
    silently cut to what the epochs hold. ``unit``: what ``available`` counts, in the singular."""
    if max_steps and max_steps > available:
        print_rank_0(f"--max_steps {max_steps}: --num_train_epochs {epochs} hold {counted(available, unit)}, so the "
                     "run ends there (--max_steps only stops a run early; raise --num_train_epochs to train longer)")


def restart_deepspeed_tensorboard(engine):
    """DeepSpeed's own TensorBoard writer (its monitor: on with --enable_tensorboard, as in DeepSpeed-Chat) opened
    again with a purge just past the engine's sample count, its event steps: an earlier run's events in the same
    folder after that count (a re-run's whole curve; after a resume, the steps that followed the checkpoint) are
    hidden, not drawn a second time. Called once a run knows where it starts: from 0, or from a resumed checkpoint;
    rank 0."""
    monitor = getattr(getattr(engine, "monitor", None), "tb_monitor", None)
    writer = getattr(monitor, "summary_writer", None)
    if writer is None:
        return
    writer.close()
    remove_unwritten_event_files(writer.log_dir)  # (the writer DeepSpeed opened as it made the engine wrote nothing)
    # DeepSpeed logs a step's events (learning rate, loss scale, timers) at the count after the step: those at the
    # checkpoint's count are its last step's, which the resumed run does not log again (a purge at the count hid them)
    monitor.summary_writer = purging_writer(writer.log_dir, engine.global_samples + 1)


def remove_unwritten_event_files(log_dir):
    """Delete the events files this process made in ``log_dir`` that hold only the header every events file starts
    with: the one of the writer DeepSpeed opened as it made the engine, closed before it wrote, which TensorBoard lists
    beside the writer that replaced it, with nothing in it. Tensorboard keeps a writer's file name private, so the
    files are told by their names (events.out.tfevents.<second>.<host>.<process id>.<n>): another process's file may
    be a writer still open. A writer of this process still open there is another engine's monitor sharing the
    folder (a --deepspeed_config's tensorboard job_name), restarted too."""
    for name in _listdir(log_dir):
        path = os.path.join(log_dir, name)
        if made_by_this_process(name) and os.path.isfile(path) and holds_only_the_header(path):
            os.remove(path)


def holds_only_the_header(event_file):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return all(event.HasField("file_version") for event in EventFileLoader(event_file).Load())


def made_by_this_process(event_file_name):
    """Whether an events file's name (events.out.tfevents.<second>.<host>.<process id>.<n>, tensorboard's) is of
    this host and process; a host name may hold dots."""
    parts = event_file_name.split(".", 4)  # ["events", "out", "tfevents", second, "<host>.<process id>.<n>"]
    if parts[:3] != ["events", "out", "tfevents"] or len(parts) < 5:
        return False
    return parts[4].rsplit(".", 2)[:2] == [socket.gethostname(), str(os.getpid())]


class Throughput:
    """Samples/s, tokens/s and an estimate of achieved TFLOPs (6 x params x tokens, 8 x with checkpointing), over all
    ranks. ``rows_per_record``: the batch rows one sample takes (a preference pair's chosen and rejected rows: 2), so
    that a sample is a record of the data, as --per_device_train_batch_size and DeepSpeed's sample count have it.
    ``device``: where the ranks' counts are summed (the rank's accelerator)."""

    def __init__(self, num_params, gradient_checkpointing=False, rows_per_record=1, device=None):
        self.flops_per_token = (8 if gradient_checkpointing else 6) * num_params
        self.rows_per_record = rows_per_record
        self.device = device
        self.start = time.time()
        self.samples = self.tokens = 0

    def update(self, rows, tokens):
        self.samples += rows // self.rows_per_record
        self.tokens += tokens

    def summary(self):
        """The rates; None for a run that trained nothing (a resume from its last step's checkpoint): 0 samples/s
        would be a measurement of no work. Collective: the counts are summed over the ranks (their batches' tokens
        differ; rank 0's times the ranks was only an estimate)."""
        if not self.samples:  # (every rank alike: each trains as many batches of as many records)
            return dict.fromkeys(("samples_per_s", "tokens_per_s", "tflops_per_rank"))
        elapsed = max(time.time() - self.start, 1e-9)
        samples, tokens = all_reduce(torch.tensor([self.samples, self.tokens], dtype=torch.float64,
                                                  device=self.device)).tolist()
        return {"samples_per_s": samples / elapsed, "tokens_per_s": tokens / elapsed,
                "tflops_per_rank": self.flops_per_token * tokens / get_world_size() / elapsed / 1e12}


def count_params(model):
    return sum(full_numel(p) for p in model.parameters())


def tensorboard_writer(args, name, purge_step=None):
    """The step's SummaryWriter (rank 0, --enable_tensorboard). ``purge_step``: the run's first step; events an earlier
    run wrote to the same folder from that step on, which this run writes again, are hidden (TensorBoard's purge)."""
    if not getattr(args, "enable_tensorboard", False) or not is_rank_0():
        return None
    return purging_writer(os.path.join(args.tensorboard_path or f"{name}_tensorboard", name), purge_step)


def purging_writer(log_dir, purge_step):
    """A SummaryWriter whose purge TensorBoard reads after every earlier run's events in ``log_dir``. TensorBoard reads
    a folder's event files in name order, and a name starts with the second the file was made: a run started in the
    same second as the one before it (a quick re-run; in one process the names then sort by a counter, where "10"
    comes before "9") had its purge read first, and the earlier run's points stayed drawn beside its own."""
    from torch.utils.tensorboard import SummaryWriter

    newest = max((_event_file_second(name) for name in _listdir(log_dir)), default=-1)
    deadline = time.time() + 2  # a file from a clock set ahead is not waited for
    while int(time.time()) <= newest and time.time() < deadline:
        time.sleep(0.05)
    return SummaryWriter(log_dir, purge_step=purge_step)


def _event_file_second(name):
    parts = name.split(".")
    if name.startswith("events.out.tfevents.") and len(parts) > 3 and parts[3].isdigit():
        return int(parts[3])
    return -1


def _listdir(folder):
    return os.listdir(folder) if os.path.isdir(folder) else []


REWARD_FN_FILE = "reward_fn_file"  # (its key for the --reward_fn file's path and content hash)

# What each step's finished output is, as this dschat trains it, kept in its training_args.json (STEP_VERSION): bumped
# when the same flags and data make another output (the step's loss, what it trains on), so that ``train.py --resume``
# trains a finished output of an older dschat again instead of skipping it (``pipeline_resume.older_step_output``).
# Not the data cache's FORMAT_VERSION: its bumps mostly concern records of one kind (a CSV quirk, a JSON key order)
# that a run's data may not hold, and a cache rebuilds in minutes where a step trains for hours; a data format change
# that changes what a step trains on bumps the step's version too.
# 1: recorded from here on (an output without it is older: step 2's loss subtracts each pair's margin since
#    FORMAT_VERSION 45, and earlier changes are not told apart). Such an output is never kept, as one recording null
#    may be (``kept_null_output``: a versioned dschat's run that resumed an unversioned checkpoint, saying so): its
#    whole run was a dschat's from before 8b009f6, and nothing its folder holds dates it past the changes of what the
#    steps train made shortly before (step 2's margins, ce89ebb; ZeRO-0 bf16/fp16's start and first Adam step, 39baa43
#    and 326ae58; LoRA's default targets leaving out an LM head, 6752c94): no flag and no training_args.json key was
#    added from ce89ebb to 8b009f6, and step 2's metrics.json count of margin pairs (0f0ad79) dates one past ce89ebb
#    alone. train.py --resume trains it again, its line naming the training_args.json that records no step_version.
# step2_dpo 2: --rpo_alpha's NLL term follows --loss_agg, by default (global_token_mean) the mean over the chosen tokens
#    of the whole optimizer step, all micro-batches and ranks; 1 took each micro-batch's own mean whatever the flag said
#    (the same output without --rpo_alpha, or where --loss_agg weighs the term as that mean: STEP_VERSION_CHANGES)
# step3 2: --enable_ema's average no longer ticks on an optimizer step skipped (fp16 overflow, --align_overflow,
#    --mask_truncated_answers' steps of no token); 1 decayed it towards the unmoved weights once more. Version 1 also
#    spans the no-token skip of --mask_truncated_answers (ba9774c, 0fcfa1d, 4ffe81f, none of them a bump): an older
#    version 1 took an optimizer step of zero gradients there, which Adam's momentum still moves the weights by (the
#    same output without --enable_ema and without --mask_truncated_answers: STEP_VERSION_CHANGES)
# step1 2, step2 2, step2_dpo 3, step3 3 (session 59, 88d3ac3, 12231cc, 53f9454): an RWKV model is saved with its
#    weights as trained (its last eval-mode forward had divided some in place, transformers' rescale_every, and the save
#    kept them divided), and the value head's width probe no longer divides an RWKV backbone's loaded weights (the
#    reward model and step 3's critic and reward model trained or scored from them). step3 3 also (sessions 59-60,
#    341d908, 56abe06, f772be9, ba61fe6): an actor of a LEFT_PADDING_MOVES_SCORES family generates each row (HF
#    generate) or each prompt length (the hybrid engine) without its padding, and RecurrentGemma's module-held states
#    start fresh at each generation. These reach outputs of those families alone (``VersionChange.model_types``).
# The rule ``train.py --resume`` keeps a finished output by: an older version, or none, trains the step again where a
# change since reaches it (``STEP_VERSION_CHANGES``: a version with no entry reaches every output; the dschat without
# a version is any of many, whose steps and data formats changed often); within this version, a flag added since with
# a new default that trains otherwise is read as the value the output trained with (``args.FLAGS_BEFORE_RECORDED``)
# and compared as any flag (step 1's --loss_agg by how it weighs a step's tokens, ``step1_loss_weighing``): a precise
# alternative to a bump, which would train such an output again under any value.
STEP_VERSIONS = {"step1": 2, "step2": 2, "step2_dpo": 3, "step3": 3}
STEP_VERSION = "step_version"


class VersionChange(NamedTuple):
    """What version N of a step changed (``said``, in full; ``topic``, in a few words for the line of an output it
    spares), and which outputs of the version before it it reaches: ``reaches(record)``, whether the run recorded as
    ``record`` (its training_args.json: its "flags" and "world_size") trained otherwise than this version does with the
    same flags, True where the record cannot tell (a flag it lacks); ``spared``: the outputs it reaches alone, in a few
    words (a clause after ``topic``), said where one is skipped ("": those of ``model_types``); ``model_types``: the
    backbone families (config.model_type) whose outputs alone it changed, an output of none of them spared
    (``output_model_types``; None: every family's)."""
    said: str
    topic: str
    reaches: Callable
    spared: str = ""
    model_types: frozenset = None

    def reached_alone(self):
        """The outputs it reaches alone, in a few words (``spared``)."""
        return self.spared or f"reaches models of {', '.join(sorted(self.model_types))} alone"


def _recorded(record):
    return (record or {}).get("flags") or {}


def rpo_term_weighed_otherwise(record):
    """Whether DPO's version 2 reaches the run ``record``: its --rpo_alpha NLL term (not 0, or unrecorded), which
    version 1 weighed as each micro-batch's own mean, is weighed otherwise by its --loss_agg over the recorded split
    (``step1_loss_weighing``: global_token_mean over more than one micro-batch a step or rank; the two are the same
    to the bit over one, the factor being exactly 1)."""
    flags = _recorded(record)
    if flags.get("rpo_alpha") == 0:
        return False
    ranks = record.get("world_size")
    if not isinstance(ranks, int):
        return True
    weighing = step1_loss_weighing(flags, ranks)
    return weighing is None or weighing != step1_loss_weighing({**flags, "loss_agg": "token_mean"}, ranks)


def ema_or_no_token_steps(record):
    """Whether step 3's version 2 reaches the run ``record``: it kept an --enable_ema average, which version 1 also
    ticked on skipped optimizer steps, or it ran with --mask_truncated_answers, whose steps of no token in the loss a
    version 1 from before ba9774c (or 0fcfa1d, 4ffe81f where a step spans micro-batches) took with zero gradients
    (either flag unrecorded: reached). Whether a step was skipped is not recorded."""
    flags = _recorded(record)
    return any(flags.get(name) is not False for name in ("enable_ema", "mask_truncated_answers"))


def whatever_its_flags(record):
    """A change that reaches every output of its families (``VersionChange.model_types``) whatever it recorded."""
    return True


RWKV = frozenset({"rwkv"})
RWKV_SAVE = ("how an RWKV model is saved (its weights as trained: its last eval-mode forward had divided some in "
             "place, transformers' rescale_every, and the save kept them divided)")
RWKV_PROBE = "the RWKV weights the value head's width probe, run on the loaded backbone, left divided"
# An actor of these families generates each row (HF generate) or each prompt length (the hybrid engine) without its
# padding, RecurrentGemma from fresh states each time (an RWKV critic or reward model: RWKV_PROBE).
LEFT_PADDING_GENERATION = ("how an actor of a family whose outputs left padding moves generates (without its padding; "
                           "RecurrentGemma from fresh states)")

STEP_VERSION_CHANGES = {
    ("step2_dpo", 2): VersionChange("how --rpo_alpha's NLL term is weighed (by --loss_agg; 1 took each micro-batch's own "
                                    "mean)", "--rpo_alpha's term weighing", rpo_term_weighed_otherwise,
                                    "leaves a run without --rpo_alpha, or whose --loss_agg weighs it as 1 did, alike"),
    ("step3", 2): VersionChange("--enable_ema's average (a skipped optimizer step no longer ticks it) and, within "
                                "version 1, --mask_truncated_answers' steps of no token (skipped, not taken with zero "
                                "gradients)", "--enable_ema's average, --mask_truncated_answers' empty steps",
                                ema_or_no_token_steps, "reaches a run with either alone"),
    ("step1", 2): VersionChange(RWKV_SAVE, "RWKV saves", whatever_its_flags, model_types=RWKV),
    ("step2", 2): VersionChange(f"{RWKV_SAVE} and {RWKV_PROBE}", "RWKV saves and width probe", whatever_its_flags,
                                model_types=RWKV),
    ("step2_dpo", 3): VersionChange(RWKV_SAVE, "RWKV saves", whatever_its_flags, model_types=RWKV),
    ("step3", 3): VersionChange(f"{RWKV_SAVE}, {RWKV_PROBE} (its critic's and reward model's) and "
                                f"{LEFT_PADDING_GENERATION}",
                                "RWKV saves and width probe, generation without left padding", whatever_its_flags,
                                model_types=frozenset(LEFT_PADDING_MOVES_SCORES)),
}


def version_changes_since(then, name, record, folder=None, families=None):
    """(reached, spared): the versions of step ``name`` after ``then`` up to this dschat's, split by whether their
    change reaches the output or checkpoint recorded as ``record`` (``STEP_VERSION_CHANGES``; None: unknown, reached)
    and, for a change of some families alone, made in ``folder`` (the finished output's: ``output_model_types``) or of
    ``families`` (a checkpoint's: those its run loads, ``loaded_model_types``); neither known: reached."""
    known = functools.cache(lambda: families if families is not None else
                            None if folder is None else output_model_types(folder, record))
    reached, spared = [], []
    for version in range(then + 1, STEP_VERSIONS[name] + 1):
        change = STEP_VERSION_CHANGES.get((name, version))
        (reached if _change_reaches(change, record, known) else spared).append(version)
    return reached, spared


def _change_reaches(change, record, families):
    """Whether ``change`` (None: a version with no entry, every output) reaches the output or checkpoint recorded as
    ``record`` (None: unknown, reached), whose models are of the families ``families()`` (None: unknown)."""
    if change is None:
        return True
    if change.model_types is not None and families() is not None and not families() & change.model_types:
        return False  # (an output of other families, whatever else its record says)
    return record is None or change.reaches(record)


# A finished output's model folders, by step (their config.json names each one's family): step 3's actor, its EMA copy
# and critic (those it saved), the other steps' folder itself.
SAVED_MODEL_FOLDERS = {"step3": (ACTOR_DIR, ACTOR_EMA_DIR, CRITIC_DIR)}


def output_model_types(folder, record):
    """The backbone families (config.model_type) of the models the finished output in ``folder`` (``record``: its
    training_args.json) was made with, that a version change of some families alone is judged by
    (``VersionChange.model_types``): those it saved, read from their config.json beside its record (older outputs
    have them too: nothing needs recording), and step 3's reward model, which it does not save (its recorded path's
    config.json, a local folder or the hub cache's copy). None where any cannot be read: every change reaches it."""
    record = record or {}
    subfolders = SAVED_MODEL_FOLDERS.get(record.get("step"))
    folders = [os.path.join(folder, sub) for sub in subfolders] if subfolders else [folder]
    types = [_model_type_in(path) for path in folders if os.path.isdir(path)]
    flags = _recorded(record)
    if record.get("step") == "step3" and flags.get("reward_model_weight", 1.0):  # (0: it scored with none)
        types.append(_model_type_in(_reward_model_path(flags, record_cwd(record, folder))))
    return _known_families(types)


def loaded_model_types(args):
    """The backbone families (config.model_type) of the models the step of ``args`` loads (``loaded_model_paths``:
    a local folder from the working folder, or the hub cache's copy), which a version change of some families alone
    is judged by where no finished output holds them yet: a checkpoint its run resumes trained the same models. None
    where any cannot be read."""
    return _known_families([_model_type_in(path) for path in loaded_model_paths(args)])


def _known_families(types):
    """``types`` as a frozenset, None where any is unknown (None) or there are none."""
    return frozenset(types) if types and None not in types else None


def _reward_model_path(flags, cwd):
    """The reward model of step 3's recorded ``flags`` (``loaded_model_paths``' rule: --reward_model_name_or_path,
    else --critic_model_name_or_path), a local one as its path from ``cwd``; None where they name none."""
    path = flags.get("reward_model_name_or_path") or flags.get("critic_model_name_or_path")
    if not isinstance(path, str):
        return None
    local = os.path.join(cwd, path)
    return local if os.path.isdir(local) else path


def _model_type_in(path):
    """config.model_type of the model in folder, tiny preset or hub name ``path``, from its config.json on this
    machine (a hub model's in the hub cache: no download; a preset's config, a folder of its name first, as the model
    loads: ``resolve_model_path``); None where it cannot be read."""
    if path is None:
        return None
    config = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        from dschat.tiny.presets import tiny_preset_model_type

        if (preset := tiny_preset_model_type(path)) is not None:
            return preset
        from huggingface_hub import try_to_load_from_cache

        try:
            config = try_to_load_from_cache(path, "config.json")
        except Exception:  # (not a hub name: unknown)
            return None
        if not isinstance(config, str):
            return None
    saved = read_json_object(config)
    return saved.get("model_type") if saved else None


def older_step_version(then, name, where, made, remedy, record=None, folder=None, families=None, null=None):
    """How version ``then`` of step ``name`` (``STEP_VERSION``), read from ``where`` (the file that records it, a step's
    ``made``: "output" or "checkpoint"), is an older dschat's than this one (``STEP_VERSIONS``) whose changes since
    reach it (``version_changes_since``; ``record``: what ``where`` recorded of its run, None: every change reaches
    it but one of other families than its models'; ``folder``: an output's, whose models' families a change of some
    families alone is judged by; ``families``: those, where known otherwise, a checkpoint's): the words to say of it
    ("of a dschat from before ...", "an older dschat's (...)"), None where it is this dschat's or no change since
    reaches it (an output recording null: ``kept_null_output``). A newer dschat's (or a value no dschat records) is a
    UsageError naming ``where``, with ``remedy``: what to do instead. ``null``: whether ``where`` records ``then`` None
    as null, not without the key (None: whether ``record`` holds the key)."""
    now = STEP_VERSIONS.get(name)
    if then is None:
        null = STEP_VERSION in (record or {}) if null is None else null
        if null and made == "output" and kept_null_output(name, record, folder):
            return None
        return _unversioned(made, where, null)
    if now is None or type(then) is not int or then > now:  # (bool is an int: not a version)
        latest = f"its latest is {now}" if now is not None else "nor a step of that name"
        raise UsageError(f"{where} records {STEP_VERSION} {then!r} of {name}, which this dschat does not know "
                         f"({latest}): a newer dschat's {made}, whose step this one may train otherwise. {remedy}")
    if then < now and version_changes_since(then, name, record, folder, families)[0]:
        return (f"an older dschat's ({STEP_VERSION} {then} of {name}, {now} now: STEP_VERSIONS in "
                "dschat/steps/common.py says what changed)")
    return None


# The step versions of the dschats that recorded step_version null in the output of a run resumed from a checkpoint
# that recorded none (d99bfd7 to 50b0eb5, whatever its models; since, only where a change of some families alone
# reaches them, ``recorded_step_version``): such an output's step trained as these versions did after the checkpoint.
NULL_RECORDED_BY = {"step1": 2, "step2": 2, "step2_dpo": 3, "step3": 3}


def kept_null_output(name, record, folder):
    """Whether the finished output of step ``name`` in ``folder`` (``record``: its training_args.json) that records
    step_version null is kept as this dschat's, by the rule a run resumed from an unversioned checkpoint records
    this dschat's version by now (``recorded_step_version``): no change of some families alone since version 1
    reaches the families of its models (``output_model_types``: unknown, reached), and no change reaches it since the
    version that recorded null (``NULL_RECORDED_BY``). The null of the dschats before 50b0eb5 trained such an output
    again at every train.py --resume, though its run had taken the checkpoint on, said, as now."""
    then = NULL_RECORDED_BY.get(name)
    if then is None or folder is None:
        return False
    families = output_model_types(folder, record)
    return families is not None and not family_changes_reaching(None, name, families) and \
        not version_changes_since(then, name, record, folder)[0]


def _unversioned(made, where, null):
    """The words for a step's ``made`` ("output" or "checkpoint") whose ``where`` records no step version: without the
    key, an older dschat's from before they recorded it; null, one of this dschat's runs resumed from such a checkpoint
    (``recorded_step_version``)."""
    if null:
        return (f"one resumed from a checkpoint of a dschat from before checkpoints recorded the step's version "
                f"({STEP_VERSION} null in {where})")
    return f"of a dschat from before its {made}s recorded the step's version (no {STEP_VERSION} in {where})"


def family_changes_reaching(then, name, families):
    """The versions of step ``name`` after ``then`` (an older dschat's checkpoint's; None: one from before checkpoints
    recorded the step's version, which every version's change since the first reached) whose change of some families
    alone (``VersionChange.model_types``) reaches a model of ``families`` (known: those the run resuming it loads,
    ``loaded_model_types``): the output of that run would record ``then`` (``recorded_step_version``) and train again
    at the next train.py --resume. [] where none does, or ``families`` is unknown, or ``then`` is no version."""
    if families is None or then is not None and type(then) is not int:
        return []
    reached = version_changes_since(0 if then is None else then, name, None, families=families)[0]
    return [version for version in reached
            if getattr(STEP_VERSION_CHANGES.get((name, version)), "model_types", None) is not None]


def spared_by_versions_since(then, name, record, folder=None):
    """Where an older version ``then`` of step ``name`` is kept as this dschat's (``older_step_version`` None: no
    change since reaches ``record``, the output in ``folder``), the words saying so; else ""."""
    if not isinstance(then, int) or type(then) is bool or then >= STEP_VERSIONS.get(name, then):
        return ""
    reached, spared = version_changes_since(then, name, record, folder)
    if reached:
        return ""
    changes = [STEP_VERSION_CHANGES[(name, version)] for version in spared]
    return (f"{STEP_VERSION} {then} of {name} ({STEP_VERSIONS[name]} now), which no change since reaches: "
            + "; ".join(f"version {version} ({change.topic}) {change.reached_alone()}"
                        for version, change in zip(spared, changes))
            + " (STEP_VERSION_CHANGES in dschat/steps/common.py)")


def write_results(args, metrics, step):
    """The step's ``metrics.json`` and ``training_args.json`` (which step, and its flags as it ran: what the tools read
    to evaluate its output on the same data, e.g. ppo_eval's held-out prompts; the step's version, this output's run
    id and those of the step outputs it started from: what ``train.py --resume`` reads) in its output folder (rank
    0)."""
    if is_rank_0():
        write_run_args(args, step)
        # Last: metrics.json marks the output finished (a kill before it must leave it unfinished, not new weights
        # under the old run's flags and id, which --resume would take as done).
        write_json_atomic(os.path.join(args.output_dir, FINISHED_MARK), metrics)
        print_rank_0(f"metrics: {json.dumps(metrics)}")


def write_run_args(args, step):
    """The output folder's training_args.json (see ``write_results``), with a new run id (rank 0)."""
    from dschat.rlhf.reward_fn import recorded_reward_fn, reward_fn_file

    flags = {key: value for key, value in sorted(vars(args).items()) if not key.startswith("_")}
    record = {}
    if "reward_fn" in flags:  # a notebook's function: as a spec the tools can load
        flags["reward_fn"] = recorded_reward_fn(flags["reward_fn"])
        record[REWARD_FN_FILE] = reward_fn_file(flags["reward_fn"])
    os.makedirs(args.output_dir, exist_ok=True)
    write_json_atomic(os.path.join(args.output_dir, RUN_ARGS_FILE),  # cwd: what relative paths were read from
                      {"step": step, STEP_VERSION: recorded_step_version(args, step), "world_size": get_world_size(),
                       "cwd": os.getcwd(), "flags": flags, "run_id": uuid.uuid4().hex, "inputs": input_runs(args),
                       **step_data_records(args), **record}, default=str)


# The flags of the models a step may start from.
MODEL_PATH_FLAGS = ("model_name_or_path", "actor_model_name_or_path", "critic_model_name_or_path",
                    "reward_model_name_or_path")


def loaded_model_paths(args):
    """The model folders or names this step loads: step 3's critic only with GAE (or as the reward model), its reward
    model (else the critic's) only with a reward-model weight."""
    paths = [getattr(args, "model_name_or_path", None), getattr(args, "actor_model_name_or_path", None)]
    if hasattr(args, "advantage_estimator"):
        scored = bool(getattr(args, "reward_model_weight", 1.0))
        if args.advantage_estimator == "gae" or (scored and not args.reward_model_name_or_path):
            paths.append(args.critic_model_name_or_path)
        if scored:
            paths.append(args.reward_model_name_or_path)
    return [path for path in paths if isinstance(path, str)]


def data_flags_read(phase=None):
    """The data flags whose sources a step of data ``phase`` reads: --data_path, and step 1's --sft_only_data_path
    (None: a step not said, read as both)."""
    return list(DATA_SOURCE_FLAGS) if phase in (1, None) else ["data_path"]


def step_data_files(args, flags=None):
    """``local_data_files`` of the data flags ``flags`` (by default those the step reads, ``take_data_files``; not
    taken: --data_path and --sft_only_data_path): as the step read them (a file edited later in the run is not what
    it trained on), else as they are now."""
    from dschat.data.raw_datasets import local_data_files

    read = taken_data_flags(args)
    flags = read if flags is None else flags  # ([]: a record that lists no flag's files, ``listed_data_flags``)
    taken = getattr(args, "_data_files", None)
    if taken is not None and list(flags) == list(read):
        return taken
    specs = []
    for name in flags:
        value = getattr(args, name, None) or []
        specs += [value] if isinstance(value, str) else list(value)
    return local_data_files(specs)


def taken_data_flags(args):
    """The data flags whose files ``take_data_files`` kept on ``args`` (not taken: both, ``data_flags_read``)."""
    return getattr(args, "_data_flags", None) or data_flags_read()


def recorded_data_flags(record):
    """The data flags a record's data was taken by (its DATA_FILES_FLAGS): one from before dschat kept them took
    --sft_only_data_path's whatever the step (a checkpoint's stays bound to it, ``resume.unbound_data_flags``)."""
    return record.get(DATA_FILES_FLAGS) or data_flags_read()


def listed_data_flags(record):
    """The data flags whose files a record's DATA_FILES lists (``record``: an output's training_args.json, its flags
    under "flags", or a checkpoint's flags): ``recorded_data_flags``, but for an older record's flag that gave no
    dataset (empty): it listed no file of it, as today's record of a step that does not read it, so another value now
    is compared as there (by whether the step reads it: steps 2, DPO and 3 do not), not as data of the record's that
    changed. A flag the record lacks stays listed (step 3's checkpoints keep no --sft_only_data_path, yet an older
    one listed its files)."""
    if record.get(DATA_FILES_FLAGS):
        return record[DATA_FILES_FLAGS]
    values = record.get("flags", record)  # (an output's record keeps them under "flags", a checkpoint's state not)
    return [name for name in data_flags_read() if name not in values or values[name]]


def data_files_as_recorded(record, args):
    """``step_data_files`` of ``args`` as ``record`` (an output's or a checkpoint's) lists them: the files of the data
    flags it lists (``listed_data_flags``; an older record's: step 1's --sft_only_data_path's in every step's, where
    it gave any, so that they are compared as before)."""
    return step_data_files(args, listed_data_flags(record))


def take_data_files(args, phase=None):
    """Keep on ``args`` the data files as the step of data ``phase`` reads them (``data_flags_read``): what its
    checkpoints and its output record."""
    args._data_files = None  # (read them again, not an earlier take's)
    args._data_flags = data_flags_read(phase)
    args._data_files = step_data_files(args)
    args._hub_data = None  # (``take_hub_data`` once the data is read)
    args._unsupervised_data = None  # (step 3's ``take_unsupervised_data``)


def take_hub_data(args, dataset):
    """Keep on ``args`` which data of each hub dataset the step read (``dataset.hub_data``: the data the hub load gave,
    which the tokenized data was keyed by): what its checkpoints and its output record beside the local files. A
    dataset that says nothing of it (not ``create_prompt_dataset``'s: a test's or a caller's stand-in) records none."""
    args._hub_data = getattr(dataset, "hub_data", None)


def take_unsupervised_data(args, data):
    """Keep on ``args`` what step 3's unsupervised data was read from (``get_unsupervised_data``'s ``data_record``),
    recorded beside the prompt data's files: a checkpoint counts how many of its batches were trained on."""
    args._unsupervised_data = getattr(data, "data_record", None)


def step_data_records(args, saved=None):
    """{DATA_FILES: ``step_data_files``, DATA_FILES_FLAGS: the flags they are of, HUB_DATA: ``take_hub_data``'s,
    UNSUPERVISED_DATA: ``take_unsupervised_data``'s} of a step's data: kept with its checkpoints and its output, and
    compared on --resume (``saved``: the checkpoint's, whose DATA_FILES are compared with the same flags' files,
    ``data_files_as_recorded``). Neither of the last two before the step read its data (not compared then)."""
    records = {DATA_FILES: step_data_files(args) if saved is None else data_files_as_recorded(saved, args),
               DATA_FILES_FLAGS: taken_data_flags(args)}
    for key, taken in ((HUB_DATA, "_hub_data"), (UNSUPERVISED_DATA, "_unsupervised_data")):
        if getattr(args, taken, None) is not None:
            records[key] = getattr(args, taken)
    return records


def input_runs(args):
    """{folder: run id} of the finished step outputs among the models this step loads: kept with its output and its
    checkpoints, so that ``train.py --resume`` knows which outputs they were made from (not file times). A resumed
    run's are its checkpoint's where a folder holds another model since (``keep_resumed_inputs``)."""
    runs = {}
    for path in loaded_model_paths(args):
        run = model_identity(path) if os.path.isdir(path) else None
        if run is not None:
            runs[os.path.abspath(path)] = run
    started = getattr(args, "_resumed_inputs", None)
    if started is None:
        return runs
    # (the checkpoint's run's models, a moved folder's by its path now; a model new to this run, at a path the
    # checkpoint's did not load; not a folder that holds another model than the checkpoint's run loaded from it,
    # moved or not)
    kept = {path_now: started[path] for path, path_now in
            _resumed_paths_now(started, runs, getattr(args, "output_dir", None)).items()}
    return {**kept, **{path: run for path, run in runs.items() if path not in kept and path not in started}}


def _resumed_paths_now(started, runs, output_dir=None):
    """{path: its path now} of the model folders a resumed checkpoint's run loaded (``started``: {path: run id}), by
    the models this run loads (``runs``, ``input_runs``): a folder that holds the same run is where it is loaded now
    (the run folder moved or copied); one whose sibling folders moved so is where they moved to, where this run loads
    a model there (the run folder moved or copied, then its step trained again in it: the same folder, another model,
    recorded under the run the checkpoint started from, not beside it under the new one's id); a step folder of a run
    folder (``STEP_FOLDER_NAMES``) where no sibling it loaded tells (step 3's actor given from elsewhere), that of its
    name beside this step's ``output_dir``, where this run loads a model there (the run folder moved or copied with
    this step's own); else where it was."""
    loaded_at = {run: path for path, run in runs.items()}
    moved = {path: loaded_at[run] for path, run in started.items() if run in loaded_at}
    parents = {}
    for path, path_now in moved.items():
        parents.setdefault(os.path.dirname(path), set()).add(os.path.dirname(path_now))
    # (the one folder each recorded parent moved to, where its moved folders agree)
    parent_now = {parent: now.pop() for parent, now in parents.items() if len(now) == 1}
    run_folder = output_dir and os.path.dirname(os.path.abspath(output_dir))  # (this step's own folder is in it)

    def now(path):
        if path in moved:
            return moved[path]
        parent = parent_now.get(os.path.dirname(path))
        beside = parent and os.path.join(parent, os.path.basename(path))
        if beside in runs:
            return beside
        ours = run_folder and os.path.basename(path) in STEP_FOLDER_NAMES and \
            os.path.join(run_folder, os.path.basename(path))
        return ours if ours in runs else path

    return {path: now(path) for path in started}


def keep_resumed_inputs(args, position):
    """A run resumed from a checkpoint (``position``: its state) records the models its checkpoint's run started from
    (``input_runs``), in its output and its own checkpoints: its weights grew from them, whatever their folders hold
    now. (A step's own --resume does not refuse a step 1 trained again into its --model_name_or_path, say, whose
    new run id its output recorded: train.py --resume, which trains such a step afresh, then kept it as made from the
    new one.) A checkpoint that recorded none, or no resume (None), leaves this run's. Its step version is kept
    alike (``recorded_step_version``)."""
    args._resumed_inputs = (position or {}).get("inputs")
    args._resumed = position is not None
    args._resumed_version = (position or {}).get(STEP_VERSION)


def recorded_step_version(args, name):
    """The STEP_VERSION an output or checkpoint of step ``name`` (its run's ``args``) records: this dschat's, also for
    a run resumed from an older dschat's checkpoint (or one that recorded none), which its resume took on, saying so,
    as train.py --resume's plan did: recording the checkpoint's version left its finished output to train again at the
    next train.py --resume. But where a change since of some families alone reaches the models this run loads
    (``family_changes_reaching``), that checkpoint's (None where it recorded none): such an output is known to have
    trained otherwise, and train.py --resume trains it again (its plan trains such a checkpoint afresh at once; a
    step's own --resume resumes it, saying so). (A newer dschat's checkpoint is refused at the resume.)"""
    now = STEP_VERSIONS[name]
    if not getattr(args, "_resumed", False):
        return now
    then = args._resumed_version
    if then != now and family_changes_reaching(then, name, loaded_model_types(args)):
        return then
    return now


LEGACY_FILES_IDENTITY = "files:"  # (a model_identity recorded before the tokenizer files counted)


# How a model made elsewhere is recognised, said where a change of it stops a resume.
OUTSIDE_MODEL_IDENTITY = ("a model made outside dschat is recognised by its files' names, sizes and modification "
                          "times, so a copy that does not keep the times (plain cp; cp -p keeps them) counts as another")


def model_identity(folder, tokenizer_files=True):
    """What tells the model in ``folder`` from another saved there later: dschat's finished step output's run id;
    a model made elsewhere (TRL's, OpenRLHF's, a download) has none, so the names, sizes and modification times of its
    config, weights and tokenizer files (its chat template too: what the data is formatted with) stand for it. None: no
    finished output, no model files."""
    import hashlib

    from dschat.models.loading import TOKENIZER_EXTRA_FILES, TOKENIZER_FILES, is_weights_file
    from dschat.models.reward_model import VALUE_HEAD_FILE

    run = finished_run_id(folder)
    if run is not None or os.path.isfile(os.path.join(folder, RUN_ARGS_FILE)):  # (a dschat step's, unfinished)
        return run
    described = {"config.json", VALUE_HEAD_FILE, *((*TOKENIZER_FILES, *TOKENIZER_EXTRA_FILES) if tokenizer_files
                                                   else ())}
    files = sorted(name for name in os.listdir(folder) if name in described or is_weights_file(name))
    if "config.json" not in files:
        return None
    stats = [(name, st.st_size, st.st_mtime_ns) for name, st in
             ((name, os.stat(os.path.join(folder, name))) for name in files)]
    kind = "files+tokenizer:" if tokenizer_files else LEGACY_FILES_IDENTITY
    return kind + hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]


def holds_model(folder, identity):
    """Whether ``folder`` holds the model recorded as ``identity`` (``model_identity``; one recorded before dschat
    counted the tokenizer files, by its config and weights files alone: an upgrade is not a change of model)."""
    legacy = isinstance(identity, str) and identity.startswith(LEGACY_FILES_IDENTITY)
    return os.path.isdir(folder) and identity == model_identity(folder, tokenizer_files=not legacy)


def among_inputs(path, inputs):
    """Whether the model folder ``path`` is one of a checkpoint's or output's recorded ``inputs`` (``input_runs``);
    None where that cannot be told: no record, a hub name, a folder without a model or finished output."""
    if not inputs or not os.path.isdir(path) or model_identity(path) is None:
        return None
    # (holds_model: also an identity recorded before dschat counted the tokenizer files)
    return any(holds_model(path, identity) for identity in inputs.values())


def check_same_start(saved_inputs, path, flag, tag, root, started, role):
    """A checkpoint whose run ``started`` ("that started", "whose actor started") from another model than ``flag``'s
    ``path``, which is its ``role`` (its frozen reference: the policy's weights come from the checkpoint, the
    reference from that folder again), is an error. Compared by the run ids of the models it recorded
    (``input_runs``), so a moved run folder still resumes; a hub name is not compared."""
    if among_inputs(path, saved_inputs) is False:
        outside = "" if finished_run_id(path) else f" ({OUTSIDE_MODEL_IDENTITY})"
        raise UsageError(f"--resume: checkpoint {tag} in {root} was saved by a run {started} from another model than "
                         f"{flag} {path}, which is {role}{outside}: resume with that run's model, or start afresh "
                         "without --resume")


# Where a checkpoint's trainer state records the tokenizer its run made its records with (``tokenizer_record``).
TOKENIZER_KEY = "tokenizer"


def tokenizer_record(tokenizer):
    """What a checkpoint records of the tokenizer its records were made with
    (``check_same_tokenizer``): its size, special tokens and a digest of its vocabulary."""
    import hashlib

    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    special = {name: value if isinstance(value, str) else [str(token) for token in value]
               for name, value in tokenizer.special_tokens_map.items()}
    named = {token for value in special.values() for token in ([value] if isinstance(value, str) else value)}
    if extra := sorted(set(map(str, tokenizer.all_special_tokens)) - named):  # (added ones: a chat format's markers)
        special["extra_special"] = extra
    return {"tokens": len(tokenizer), "special": special, "vocab": hashlib.sha256(vocab.encode()).hexdigest()[:16]}


def check_same_tokenizer(saved, tokenizer, path, tag, root, flag="--model_name_or_path"):
    """A checkpoint trained with another tokenizer than the one ``flag``'s ``path`` holds now (its files replaced
    since, or a hub name's new revision; the path is the same, so the flags matched) is an error naming both: the
    resumed run would tokenize its data otherwise (its place in the data, its labels, step 3's prompts) and feed the
    checkpoint's embeddings other ids. A checkpoint from before dschat recorded it (None) is not compared."""
    now = tokenizer_record(tokenizer)
    if saved is None or saved == now:
        return
    raise UsageError(f"--resume: checkpoint {tag} in {root} was trained with another tokenizer than "
                     f"{flag} {path} holds now: {_tokenizer_said(saved)} then, {_tokenizer_said(now)} now"
                     + (" (its vocabulary differs)" if _tokenizer_said(saved) == _tokenizer_said(now) else "")
                     + ": resume with the tokenizer it was trained with, or start afresh without --resume")


def _tokenizer_said(record):
    special = ", ".join(f"{name.removesuffix('_token')} {value!r}" for name, value in sorted(record["special"].items()))
    return f"{record['tokens']} tokens ({special or 'no special tokens'})"


def finished_run_id(folder):
    """The run id of the finished step output in ``folder`` (None: none, unfinished (no metrics.json), from before
    dschat recorded them, or unreadable)."""
    if not os.path.isfile(os.path.join(folder, FINISHED_MARK)):
        return None
    try:
        record = read_run_args(folder)
    except UsageError:  # unreadable: no id (a step recording what it started from does not fail on it)
        return None
    run = record.get("run_id") if record else None
    return run if isinstance(run, str) else None


def clear_results(args, name, resumed):
    """A step that starts training removes its folder's metrics.json, the mark of a finished output (``train.py
    --resume`` skips a step that has one; the report reads it): an interrupted run leaves none (rank 0). A fresh run
    over an earlier finished output says that its save will replace that output. A first run writes its
    training_args.json now, so that a kill before its results (after its save, say) also leaves the folder marked
    unfinished (``unfinished_reason``), not model files that look like another's."""
    if not is_rank_0():
        return
    path = os.path.join(args.output_dir, FINISHED_MARK)
    if os.path.isfile(path):
        if not resumed:
            print_rank_0(f"[{name}] {args.output_dir} holds an earlier run's finished output: this run's save replaces "
                         "its model files (other files there stay)")
        os.remove(path)
    if not os.path.isfile(os.path.join(args.output_dir, RUN_ARGS_FILE)):
        write_run_args(args, name)


def read_run_args(folder, step=None):
    """The ``training_args.json`` that ``step`` (None: any step) wrote in ``folder`` ({"flags", "world_size", "cwd",
    "run_id", "inputs"}: its flags, number of ranks, working directory, run ids), else None."""
    record = read_json_object(os.path.join(folder, RUN_ARGS_FILE))
    return record if record is not None and step in (None, record.get("step")) else None


def record_cwd(record, folder):
    """The working folder the relative paths of ``record`` (a step's training_args.json, read from ``folder``) were
    read from: its "cwd". A record from before dschat kept it was written by a process whose working folder is
    unknown, and the present one's is a guess; but the record lies in that process's --output_dir, so where its
    --output_dir is relative and ends in ``folder``'s own names, that working folder is the one ``folder`` lies at
    --output_dir from (--output_dir output/step1_sft, the record in /r/output/step1_sft: /r), wherever the run is
    resumed from. Else (an absolute --output_dir, one climbing with "..", a folder renamed since) it cannot be told:
    the present working folder, the guess that a run is resumed from where it ran."""
    cwd = record.get("cwd")
    if isinstance(cwd, str):
        return cwd
    output_dir = (record.get("flags") or {}).get("output_dir")
    return _folder_reached_from(output_dir, folder) or os.getcwd()


def _folder_reached_from(relative, folder):
    """The folder from which the relative path ``relative`` leads to ``folder`` by its names, else None."""
    if not isinstance(relative, str) or not relative or os.path.isabs(relative):
        return None
    tidy = os.path.normpath(relative)
    names = [] if tidy == os.curdir else tidy.split(os.sep)
    if os.pardir in names:  # (the name of the folder it climbed from is unknown)
        return None
    here = os.path.abspath(folder)
    for name in reversed(names):
        here, last = os.path.split(here)
        if last != name:
            return None
    return here


def progress(iterable, total, desc):
    """A tqdm bar on rank 0, the bare iterable elsewhere."""
    if not is_rank_0():
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, mininterval=2.0)


def to_device(batch, device):
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def run_training(engine, train_loader, loss_fn, evaluate, args, device, name, total_steps, writer=None,
                 throughput=None, position=None, save=None, loss_tokens=None):
    """The optimizer-step loop shared by steps 1 and 2 (and DPO).

    ``loss_fn(engine, batch) -> (loss, tokens_in_batch)``; ``evaluate() -> dict`` runs every
    ``args.eval_interval`` optimizer steps (and is the caller's job at the end); ``save(position)`` every
    ``args.save_interval`` steps. ``position``: where a resumed run continues (``steps.resume``), else the start.
    ``loss_tokens(batch) -> int``: the tokens ``loss_fn``'s mean loss is over; given (step 1's --loss_agg
    global_token_mean), each optimizer step's loss is the mean over the tokens of all its micro-batches on all ranks
    (``step_loss_weights``), else the mean of its micro-batches' means. A loss of two terms (``RecordAndTokenMeans``:
    DPO's with its RPO NLL term) takes that token mean for its token term alone.
    The optimizer steps DeepSpeed skips are said on the step's and the evaluation's lines (``SkippedSteps``).
    Returns the mean train loss (over the whole run's micro-batches, a resumed run's included).
    """
    position = dict(position or {"step": 0, "epoch": 0, "batch": 0, "loss_sum": 0.0, "loss_count": 0})
    step, grad_accum = position["step"], args.gradient_accumulation_steps
    # (checkpoints fall between steps: no micro-batch of a step is pending)
    loss_sum, loss_count = position["loss_sum"], position["loss_count"]
    skipped = SkippedSteps(engine, step)
    if step >= total_steps:  # resumed from the last step's checkpoint
        return loss_sum / max(loss_count, 1)
    engine.train()
    # (closed on an error too: its epoch's progress bar then ends its line before the error is printed)
    with closing(train_micro_batches(train_loader, args, name, position, (total_steps - step) * grad_accum)) as \
            micro_batches:
        for group in accumulation_groups(micro_batches, grad_accum):
            weights = step_loss_weights(group, loss_tokens, grad_accum, device)
            over_ranks = loss_tokens is not None
            step_loss, lr = _train_group(engine, group, weights, loss_fn, name, step, throughput, device, over_ranks)
            epoch, index, bar, _ = group[-1]
            if over_ranks:  # (the token mean over every rank's micro-batches: each rank's shares of it summed)
                step_loss = all_reduce(torch.tensor(step_loss, dtype=torch.float64, device=device)).item()
            # (counted per micro-batch, in either mode: a resume may change --loss_agg)
            loss_sum, loss_count = loss_sum + step_loss * len(group), loss_count + len(group)
            if len(group) < grad_accum:  # micro-batches short of a whole last step: trained on but never applied
                break
            step += 1
            _log_step(args, name, step, step_loss, lr, writer, throughput, bar, skipped, device, over_ranks)
            if save is not None and args.save_interval and step % args.save_interval == 0:
                save({"step": step, "epoch": epoch, "batch": index + 1, "loss_sum": loss_sum, "loss_count": loss_count})
            if args.eval_interval and step % args.eval_interval == 0 and step < total_steps:
                metrics = evaluate()
                print_rank_0(f"[{name}] step {step} eval: {format_metrics(metrics)}{skipped.said_since_report(step)}")
                _scalars(writer, f"{name}/eval", metrics, step)
                engine.train()
            if step >= total_steps:
                _close_at(bar, index + 1)
                break
    return loss_sum / max(loss_count, 1)


class RecordAndTokenMeans(NamedTuple):
    """A micro-batch's loss of two terms (DPO's with --rpo_alpha): ``records``, a mean over its records (pairs), which
    DeepSpeed's mean over the micro-batches and ranks weighs as it is, as all records weigh alike; ``tokens``, a mean
    over its ``loss_tokens`` (the RPO NLL term's chosen answer tokens), weighed as a whole loss of tokens is
    (``step_loss_weights``: under --loss_agg global_token_mean, the token mean over the optimizer step)."""

    records: torch.Tensor
    tokens: torch.Tensor


def _backpropagated(loss, weight):
    """What a micro-batch's ``loss`` is backpropagated as: a token mean times its ``step_loss_weights`` factor, a
    records term as it is. A plain loss (step 1's tokens; step 2's and plain DPO's pairs, whose factor is 1) is all
    tokens term, taken as it was before there were two terms: no extra kernel, the same bits."""
    if isinstance(loss, RecordAndTokenMeans):
        return loss.records + loss.tokens * weight
    return loss * weight


def _own_loss_and_share(loss, share, record_share):
    """(the micro-batch's own loss, a tensor: what a diverged run is told by; its share of the step's logged loss, a
    float). One host read of the loss a micro-batch, as before there were two terms (two ``item()``s waited on the
    accelerator twice, for every micro-batch of steps 1 and 2 too). Two terms are weighed and summed on the device, in
    fp32 as the loss itself: with shares of 1 (one micro-batch a step on one rank, the tiny default) the logged loss is
    the float a single-term loss gave, to the bit (a sum of the two on the host, in float64, was not)."""
    if not isinstance(loss, RecordAndTokenMeans):
        return loss, loss.item() * share
    records, tokens = loss.records.detach().float(), loss.tokens.detach().float()
    return loss.records + loss.tokens, (records * record_share + tokens * share).item()


def _train_group(engine, group, weights, loss_fn, name, step, throughput, device, over_ranks=False):
    """Forward and backward of each micro-batch of an optimizer step's ``group`` (``step_loss_weights``' ``weights``),
    and the step DeepSpeed takes at the last; returns (this rank's share of the step's loss, the learning rate
    applied). ``over_ranks``: the shares are summed over the ranks (the token mean's), so a records term's share is a
    rank's part of the ranks' mean."""
    step_loss = 0.0
    record_share = 1.0 / (len(group) * (get_world_size() if over_ranks else 1))
    for (*_, batch), (weight, share) in zip(group, weights):
        batch = to_device(batch, device)
        loss, tokens = loss_fn(engine, batch)
        engine.backward(_backpropagated(loss, weight))
        lr = applied_lr(engine)  # (the scheduler moves on in the step)
        optimizer_step(engine, name)
        loss, loss_share = _own_loss_and_share(loss, share, record_share)
        step_loss += loss_share
        # a diverged run stops, as step 3's, before anything of it is saved (checked after the item() that waits for
        # the step anyway: no extra wait on the accelerator)
        check_finite(f"{name}: the training loss (step {step + 1})", loss)
        if throughput is not None:
            throughput.update(batch["input_ids"].shape[0], tokens)
    return step_loss, lr


def train_micro_batches(train_loader, args, name, position, count):
    """(epoch, index in it, its progress bar, batch) of the next ``count`` micro-batches from ``position`` on, epoch
    after epoch (the data order of each depends on (seed, epoch) only: ``reseed_epoch``)."""
    for epoch in range(position["epoch"], args.num_train_epochs):
        reseed_epoch(train_loader, args.seed, epoch)
        consumed = position["batch"] if epoch == position["epoch"] else 0
        # the bar counts the micro-batches this epoch runs: all of them, or up to the last step (--max_steps)
        bar = progress(train_loader, min(len(train_loader), consumed + count),
                       f"{name} epoch {epoch + 1}/{args.num_train_epochs}")
        for index, batch in enumerate(bar):
            if index < consumed:
                continue  # trained on before the checkpoint this run resumed from
            yield epoch, index, bar, batch
            count -= 1
            if count == 0:
                return


def accumulation_groups(micro_batches, grad_accum):
    """The micro-batches of each optimizer step, in lists of ``grad_accum`` (DeepSpeed's accumulation runs on across
    epochs, so a step may take the last micro-batches of one and the first of the next); the last list may be short
    where the data ends first. A whole list is given without reading the micro-batch after it."""
    group = []
    for micro_batch in micro_batches:
        group.append(micro_batch)
        if len(group) == grad_accum:
            yield group
            group = []
    if group:
        yield group


def step_loss_weights(group, loss_tokens, grad_accum, device):
    """(the factor its mean loss is backpropagated with, its share of the step's loss) of each micro-batch of an
    optimizer step's ``group``. Without ``loss_tokens``: 1, and 1 / the step's micro-batches, DeepSpeed's mean of the
    micro-batches' means (and of the ranks'). With it, the token mean over the step's micro-batches on all ranks (step
    3's --loss_agg global_token_mean, ``algorithms.agg_loss``; HF Trainer's num_items_in_batch): a micro-batch of n of
    the step's N tokens (all ranks', all-reduced once a step) weighs n / N, times the gradient_accumulation_steps x
    ranks that DeepSpeed's backward (1 / gradient_accumulation_steps) and its average over the ranks take back."""
    if loss_tokens is None:
        return [(1.0, 1.0 / len(group))] * len(group)
    counts = [loss_tokens(batch) for *_, batch in group]
    total = all_reduce(torch.tensor(float(sum(counts)), dtype=torch.float64, device=device)).item()
    # (no tokens at all: every loss is NaN, which check_finite stops at; not a division by 0 before it)
    total = max(total, 1.0)
    ranks = get_world_size()
    return [(n / total * grad_accum * ranks, n / total) for n in counts]


def step1_loss_weighing(flags, world_size):
    """How step 1's loss weighs the tokens of an optimizer step, which its --loss_agg names (``flags``: its flag values
    by name; ``world_size``: its ranks), None where it names none: each token alike (global_token_mean; token_mean
    where a step is one micro-batch on one rank, whose token mean is then the step's: global_token_mean's factor for
    it is exactly 1, ``step_loss_weights``, the model the same to the bit, docs/tiny_default.md), else each
    micro-batch's mean alike (token_mean), which another split of a step's samples (the micro-batches' size, how many a
    rank accumulates, the ranks) weighs otherwise."""
    from dschat.steps.resume import BATCH_FLAGS

    agg, split = flags.get("loss_agg"), tuple(flags.get(name) for name in BATCH_FLAGS) + (world_size,)
    if agg == "global_token_mean" or (agg == "token_mean" and split[1:] == (1, 1)):
        return "each token alike"
    return ("each micro-batch's mean alike", *split) if agg == "token_mean" else None


def _close_at(bar, done):
    """Close a bar left inside its loop after ``done`` items (tqdm counts an item only when the next is asked for,
    so the last step's bar would stop one short)."""
    if hasattr(bar, "close"):
        bar.n = done
        bar.close()


def applied_lr(engine):
    """The learning rate the engine's next optimizer step applies (read before it: the step moves the scheduler on,
    and ``get_lr`` then says the following step's)."""
    return engine.get_lr()[0] if hasattr(engine, "get_lr") else float("nan")


def _log_step(args, name, step, loss, lr, writer, throughput, bar, skipped, device=None, over_ranks=False):
    """``loss``: the step's, of this rank's micro-batches, or of every rank's (``over_ranks``: step 1's token mean)."""
    step_skipped = skipped.last_step_skipped()
    if hasattr(bar, "set_postfix"):
        shown = {"skipped": skipped.total} if skipped.total else {}
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", **shown, refresh=False)  # shown at the bar's own refresh:
        # a log file gets a line every 2 s, not one per step (each with a stale count)
    if getattr(args, "print_loss", False):  # (on several ranks rank 0's mean: said, as it is not the step's)
        whose = (f" (rank 0's micro-batches, 1 of {get_world_size()} ranks)" if get_world_size() > 1 and not over_ranks
                 else "")
        print_rank_0(f"[{name}] step {step} loss {loss:.4f}{whose} lr {lr:.3e}"
                     + (f" ({SKIPPED_STEP_SAID})" if step_skipped else ""))
    if getattr(args, "enable_tensorboard", False):  # (every rank: the loss and rates are over the ranks; rank 0 writes)
        # the step's loss over every rank's micro-batches, as metrics.json's train_loss and step 3's curves are (and
        # HF's Trainer logs); rank 0's alone followed a quarter of the step's records on 4 ranks
        scalars = {"loss": loss if over_ranks else rank_mean(loss, device), "lr": lr, "skipped_steps": skipped.total}
        if throughput is not None:
            scalars.update(throughput.summary())
        _scalars(writer, f"{name}/train", scalars, step)


SKIPPED_STEP_SAID = "optimizer step skipped by DeepSpeed: inf/NaN gradients"


class SkippedSteps:
    """Says the optimizer steps DeepSpeed skipped (``skipped_steps``) where the training loop reports: fp16's loss
    scaler skips each step whose gradients overflow without a word (``optimizer_step``), and a run whose steps keep
    overflowing trains nothing."""

    def __init__(self, engine, step):
        self.engine = engine
        self.seen = self.reported = self.total  # (a resumed run's earlier skips were the earlier process's to say)
        self.reported_step = step

    @property
    def total(self):
        return skipped_steps(self.engine)

    def last_step_skipped(self):
        """Whether the optimizer step taken since the last call was skipped."""
        step_skipped, self.seen = self.total > self.seen, self.total
        return step_skipped

    def said_since_report(self, step):
        """The steps skipped since the last report (or the run's start), at optimizer step ``step``, as the end of a
        report's line; "" when none was."""
        count, steps = self.total - self.reported, step - self.reported_step
        self.reported, self.reported_step = self.total, step
        if not count:
            return ""
        return f" ({count} of the last {steps} optimizer steps skipped by DeepSpeed: inf/NaN gradients)"


def warn_of_skipped_steps(engine, name, steps, lr_flag="--learning_rate", no_token_skips=0):
    """A warning at the end of a run whose optimizer steps DeepSpeed skipped more than half of on inf/NaN gradients
    (it trained on few of its batches), naming the likely cause and what to change (``lr_flag``: the model's
    learning-rate flag). ``no_token_skips``: steps of those that step 3 skipped for no token in the loss
    (--mask_truncated_answers), which DeepSpeed counts alike: neither a skip on inf/NaN nor a step it could apply."""
    skipped, steps = skipped_steps(engine) - no_token_skips, steps - no_token_skips
    if skipped * 2 <= steps:
        return
    trained = "none" if skipped >= steps else f"only {steps - skipped}"
    print_rank_0(f"warning: [{name}] DeepSpeed skipped {skipped} of the run's {steps} optimizer steps on inf/NaN "
                 f"gradients: it applied {trained} of them. {_skipped_steps_cause(engine, lr_flag)}")


def _skipped_steps_cause(engine, lr_flag):
    if not engine.fp16_enabled():
        return f"The gradients themselves were not finite: lower {lr_flag}, or train in --dtype fp32."
    if not engine.dynamic_loss_scale():
        scale = engine.loss_scale()
        scale = int(scale) if float(scale).is_integer() else scale
        return (f"fp16's loss scale is fixed at {scale} (fp16.loss_scale in the DeepSpeed config): every step whose "
                f"scaled gradients overflow is skipped. Lower it (0: DeepSpeed's dynamic scale), lower {lr_flag}, or "
                "train in --dtype bf16 (or fp32).")
    return (f"fp16's loss scaler skips each step whose scaled gradients overflow, and lowers its scale: lower "
            f"{lr_flag}, train in --dtype bf16 (or fp32), or start from a lower scale (fp16.initial_scale_power in a "
            "--deepspeed_config file; DeepSpeed's default is 16, a scale of 2**16).")


def _scalars(writer, prefix, values, step):
    if writer is None:
        return
    for key, value in values.items():
        if isinstance(value, (int, float)):
            writer.add_scalar(f"{prefix}/{key}", value, step)
    writer.flush()


def format_metrics(metrics):
    return ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())



@dataclass
class StepRecipe:
    """What differs between steps 1 and 2; ``run_supervised_step`` does the rest the same way."""

    name: str
    phase: int
    build_model: Callable  # (args, tokenizer, ds_config) -> model (LoRA applied)
    collator: Callable  # (tokenizer, pad_to_multiple_of, max_length) -> collate_fn
    loss_fn: Callable  # (engine, batch) -> (loss, tokens)
    evaluate_fn: Callable  # (engine, loader, device) -> metrics dict over the whole loader
    save_fn: Callable  # (engine, tokenizer, output_dir) -> None
    rows_per_record: int = 1  # a batch's rows per record: 2 for preference pairs (chosen rows, then rejected)
    reads_margins: bool = False  # phase 2: its loss subtracts each pair's margin (step 2's; DPO's reads none)
    # --model_name_or_path is a policy (steps 1 and DPO), refused as a reward model before the data loads; step 2's
    # reward model may start from any model
    trains_policy: bool = True
    # (batch) -> the tokens loss_fn's mean is over (step 1's labelled ones; DPO's RPO NLL term's chosen answer tokens,
    # its loss a ``RecordAndTokenMeans``): --loss_agg global_token_mean weighs them alike over each optimizer step's
    # micro-batches and ranks (``step_loss_tokens``); None: a loss of records that all weigh alike (step 2's and plain
    # DPO's pairs), each micro-batch's mean
    loss_tokens: Callable = None


def require_training_records(dataset, args, step):
    """A step left with no training records stops here, saying which data and split and why (the skip counts, which
    rank 0 alone printed, maybe after another rank's error), rather than in torch's sampler."""
    if len(dataset) == 0:
        paths = [args.data_path] if isinstance(args.data_path, str) else args.data_path
        skipped = getattr(dataset, "skipped", None)
        total = sum(skipped.values()) if skipped else 0
        share = "the 1 record of its share was" if total == 1 else f"all {total} records of its share were"
        why = (f"{share} skipped: " + ", ".join(f"{count} {reason}" for reason, count in
                                               sorted(skipped.items(), key=lambda i: -i[1]))
               if skipped else "leaves this step none")
        raise UsageError(f"{step}: no training records: --data_path {' '.join(paths)} with --data_split "
                         f"{args.data_split}: {why}")


def load_step_data(args, tokenizer, phase, read_margins=False):
    """The tokenized train/eval datasets of one phase, from the data flags every step shares; ``read_margins``: phase
    2's pairs carry their margins (``StepRecipe.reads_margins``)."""
    from dschat.data import create_prompt_dataset, get_eot_token

    take_data_files(args, phase)

    train, eval_ = create_prompt_dataset(
        args.local_rank, args.data_path, args.data_split, args.data_output_path, phase, args.seed, tokenizer,
        args.max_seq_len, end_of_conversation_token=get_eot_token(tokenizer),
        sft_only_data_path=args.sft_only_data_path if phase == 1 else (), reload=args.reload_data,
        include_prompt_in_loss=getattr(args, "include_prompt_in_loss", False), data_fields=args.data_fields or None,
        multiturn=getattr(args, "multiturn", False) and phase == 1, read_margins=read_margins)
    take_hub_data(args, train)
    return train, eval_


def check_supervised_settings(args, phase, name=None, quiet=True, model_architecture=None):
    """The DeepSpeed config of steps 1, 2 and DPO (``supervised_ds_config``), after the checks that make flags that
    contradict each other or leave the step no data, and a config file at odds with them, fail here: before the step
    loads anything, and in train.py before the first step runs. ``model_architecture``: where the model's config is
    read, when not from --model_name_or_path (train.py, before step 1 writes the folder DPO's step 2 starts from,
    which may hold an earlier run's model: the model step 1 starts from)."""
    from dschat.data.raw_datasets import check_data_paths
    from dschat.data.splits import check_phase_share
    from dschat.models.lora import check_only_optimize_lora

    check_only_optimize_lora(getattr(args, "only_optimize_lora", False), getattr(args, "lora_dim", 0))
    check_schedule_reaches_its_end(args.lr_scheduler_type, {"--learning_rate": args.learning_rate})
    sft_only = getattr(args, "sft_only_data_path", ()) if phase == 1 else ()
    check_phase_share(args.data_split, phase, other_data=bool(sft_only))
    check_data_paths(args.data_path, sft_only)
    from dschat.data.fields import as_data_fields
    from dschat.data.pipeline import as_list

    # (as_data_fields: a notebook's dict too, which the data pipeline reads; parsed as text it failed here. as_list: a
    # notebook's one dataset as a string, which unpacked was its characters)
    as_data_fields(args.data_fields).check_names([*as_list(args.data_path), *as_list(sft_only)],
                                                 "--data_path or --sft_only_data_path")
    ds_config = supervised_ds_config(args, name or f"step{phase}", quiet=quiet)
    check_supervised_forwards_alike(args, ds_config, model_architecture or args.model_name_or_path)
    return ds_config


def check_supervised_forwards_alike(args, ds_config, model_path):
    """The model of steps 1, 2 and DPO (and DPO's reference, sharded like it on several ranks) refused from its config
    before its weights load where its every forward would gather other weights on the ranks
    (``layers.check_config_forwards_alike``: DeepSeek-V4 under ZeRO-3 with --zero3_fetch module); the engine's own
    check stopped it only after the model had loaded. A model not written yet (train.py's step 2 reads step 1's) is
    checked when it loads. ``model_path``: the model whose config is read (``check_supervised_settings``)."""
    from dschat.models.layers import check_config_forwards_alike
    from dschat.rlhf.engine import model_config_or_none

    check_config_forwards_alike(functools.partial(model_config_or_none, model_path, local_only=True),
                                ds_config["zero_optimization"]["stage"], args.zero3_fetch, get_world_size(),
                                "--model_name_or_path's")


def supervised_ds_config(args, name, quiet=False):
    """The training config of steps 1, 2 and DPO: built from the flags, with the user's config file (if any) merged
    over it; its hybrid engine block is step 3's and not read here. ``quiet``: no notes (a check before the step)."""
    from dschat.utils.ds_config import apply_user_ds_config, get_train_ds_config, owned_key_flags, user_ds_config_path

    generated = get_train_ds_config(
        offload=args.offload, dtype=args.dtype, stage=args.zero_stage,
        micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, world_size=get_world_size(),
        enable_tensorboard=args.enable_tensorboard, tb_path=args.tensorboard_path, tb_name=f"{name}_model",
        check_grad_overflow=args.check_grad_overflow)
    return apply_user_ds_config(generated, user_ds_config_path(args),
                                owned_key_flags("--per_device_train_batch_size", "--zero_stage"),
                                ignore=("hybrid_engine",), quiet=quiet)


def say_a_changed_schedule(name, checkpoint, total, unit, split_said=""):
    """A resumed run longer or shorter than its checkpoint's run (``checkpoint``'s "total"): DeepSpeed restores the
    learning-rate scheduler's position, and the rates from there follow this run's schedule length; said, with why
    (``split_said``: the other split of a step's samples that may change it too, ``resume.split_said``)."""
    saved = (checkpoint or {}).get("total")
    if saved is not None and saved != total:
        print_rank_0(f"[{name}] this run spans {total} {unit}, its checkpoint's run {saved} "
                     f"({schedule_length_flags(checkpoint, split_said)}): the learning rates from here follow this "
                     "run's schedule")


def schedule_length_flags(checkpoint, split_said=""):
    """What makes a resumed run's length other than its checkpoint's run's: --max_steps, --num_train_epochs, and on
    another number of ranks (or with ``split_said``, another split of a step's samples) the epochs' last batches."""
    ranks = (checkpoint or {}).get("world_size", get_world_size())
    said = "--max_steps, --num_train_epochs"
    if ranks != get_world_size():
        said += f", or its epochs' last batches on {get_world_size()} rank(s) instead of {ranks}"
    return said + (f", {split_said}" if split_said else "")


def seconds_so_far(started, checkpoint=None):
    """A step's seconds over every process that ran it: this one's since ``started``, plus those counted up to the
    checkpoint it resumed from (its "seconds"; the work lost after that checkpoint is not counted)."""
    return (checkpoint or {}).get("seconds", 0.0) + time.time() - started


def step_loss_tokens(args, recipe):
    """``recipe.loss_tokens`` where --loss_agg global_token_mean (the default of step 1 and of DPO's --rpo_alpha term)
    makes each optimizer step's loss (term) of tokens the mean over its tokens; None where each micro-batch's own mean
    is (--loss_agg token_mean, DeepSpeed-Chat's; steps without the flag or without a loss of tokens)."""
    return recipe.loss_tokens if getattr(args, "loss_agg", None) == "global_token_mean" else None


def run_supervised_step(args, recipe):
    """Train one model on one phase's data with DeepSpeed, evaluate, save; returns the final metrics. Its engines
    are released when it ends (``released_engines``)."""
    with released_engines():
        return _train_evaluate_save(args, recipe)


def _train_evaluate_save(args, recipe):
    from dschat.args import (resolve_pad_to_multiple_of, step1_parser, supervised_conditional_flags,
                             unread_conditional_flags)
    from dschat.models.loading import (check_model_path, check_not_a_reward_model, check_sequence_fits,
                                       load_tokenizer)
    from dschat.steps.resume import (STEP_NAME, check_resumed_step, plan_resume, resume_or_start,
                                     save_step_checkpoint)

    started = time.time()
    device = setup_run(args)
    warn_of_unfinished_inputs(loaded_model_paths(args))
    tag = f"[{recipe.name}]"
    ds_config = check_supervised_settings(args, recipe.phase, recipe.name, quiet=False)
    unread = unread_conditional_flags(args, step1_parser(), supervised_conditional_flags(recipe.phase))
    if unread:
        print_rank_0(f"{tag} {'; '.join(unread)}: ignored")
    check_output_dir(args.output_dir, device)
    check_resumed_step(args, recipe.name)  # (another step's checkpoint: refused before the models load)
    check_model_path(args.model_name_or_path, "--model_name_or_path")
    if recipe.trains_policy:
        check_not_a_reward_model(args.model_name_or_path, "--model_name_or_path")
    tokenizer = load_tokenizer(args.model_name_or_path, add_eot_token=args.add_eot_token,
                               eot_token=args.eot_token)
    model = recipe.build_model(args, tokenizer, ds_config)
    check_sequence_fits(model, args.max_seq_len, "--max_seq_len")
    train_data, eval_data = load_step_data(args, tokenizer, recipe.phase, recipe.reads_margins)
    require_training_records(train_data, args, recipe.name)
    collator = recipe.collator(tokenizer, resolve_pad_to_multiple_of(args.pad_to_multiple_of), args.max_seq_len)
    evaluated = evaluated_records(eval_data, args.eval_iters, args.per_device_eval_batch_size)
    train_loader, eval_loader = build_dataloaders(train_data, evaluated, collator,
                                                  args.per_device_train_batch_size,
                                                  args.per_device_eval_batch_size, args.seed)
    total_steps = num_update_steps(len(train_loader), args.gradient_accumulation_steps, args.num_train_epochs,
                                   args.max_steps)
    # (before the engine: a checkpoint of another number of ranks sets DeepSpeed's universal loading in ds_config)
    plan = plan_resume(args, recipe.name, ds_config, train_loader, tokenizer)
    engine = initialize_engine(model, ds_config, args.learning_rate, args.weight_decay,
                               args.lora_learning_rate if args.lora_dim else None,
                               args.lr_scheduler_type, args.num_warmup_steps, total_steps,
                               args.gradient_checkpointing, args.zero3_fetch)
    print_rank_0(f"{tag} {len(train_data)} train / {counted(len(eval_data), 'eval record')}, "
                 f"{counted(total_steps, 'step')}, {count_params(model) / 1e6:.2f}M parameters, "
                 f"ZeRO-{args.zero_stage}, {args.dtype}")

    def evaluate():
        return recipe.evaluate_fn(engine, eval_loader, device)  # (all of it: --eval_iters made it)

    position = resume_or_start(engine, args, recipe.name, total_steps, plan)
    clear_results(args, recipe.name, resumed=position is not None)
    if position is None:
        print_rank_0(f"{tag} before training: {format_metrics(evaluate())}")
    throughput = Throughput(count_params(model), args.gradient_checkpointing, recipe.rows_per_record, device)
    tokenizer_said = tokenizer_record(tokenizer)  # (a checkpoint's, compared on --resume: check_same_tokenizer)
    # a re-run's curves replace the earlier run's; a resumed run's, those after its checkpoint
    writer = tensorboard_writer(args, recipe.name, purge_step=position["step"] + 1 if position else 0)
    if position is None:
        restart_deepspeed_tensorboard(engine)
    train_loss = run_training(engine, train_loader, recipe.loss_fn, evaluate, args, device, recipe.name,
                              total_steps, writer, throughput, position,
                              save=lambda at: save_step_checkpoint(
                                  engine, args, {**at, "seconds": seconds_so_far(started, position),
                                                 "total": total_steps, STEP_NAME: recipe.name,
                                                 TOKENIZER_KEY: tokenizer_said}),
                              loss_tokens=step_loss_tokens(args, recipe))
    rates = throughput.summary()  # the training's: before the final evaluation, whose time is none of it
    final_eval = evaluate()
    metrics = {**final_eval, "train_loss": rank_mean(train_loss, device), **rates, "steps": total_steps,
               "skipped_steps": skipped_steps(engine), "seconds": seconds_so_far(started, position)}
    if recipe.reads_margins:  # (the data report's count, kept with the step's results rather than in its log alone)
        metrics["train_margin_pairs"] = getattr(train_data, "margin_records", 0)
    print_rank_0(f"{tag} after training: {format_metrics(metrics)}")
    warn_of_skipped_steps(engine, recipe.name, total_steps)
    if args.eval_interval:  # the run's last evaluation ends the --eval_interval curve (run_training leaves it to this)
        _scalars(writer, f"{recipe.name}/eval", final_eval, total_steps)
    _scalars(writer, f"{recipe.name}/final", metrics, total_steps)
    recipe.save_fn(engine, tokenizer, args.output_dir)  # the engine: see checkpoint.settled_module
    write_results(args, metrics, recipe.name)
    return metrics
