"""Where a run keeps its models: ``train.py``'s folder per step under ``--output_dir``, and step 3's own subfolders.
The pipeline writes these, and the report, ``chat.py`` and the eval tools find a run's models through them."""
import os

SFT_DIR = "step1_sft"
RM_DIR = "step2_rm"
DPO_DIR = "step2_dpo"
PPO_DIR = "step3_ppo"

# Each recipe's steps and the folder each writes (the DPO recipe's step 2 writes DPO_DIR).
RECIPE_STEP_FOLDERS = {"ppo": {1: SFT_DIR, 2: RM_DIR, 3: PPO_DIR}, "grpo": {1: SFT_DIR, 3: PPO_DIR},
                       "dpo": {1: SFT_DIR, 2: DPO_DIR}}

# under step 3's --output_dir
ACTOR_DIR = "actor"
CRITIC_DIR = "critic"
ACTOR_EMA_DIR = "actor_ema"

PPO_ACTOR_DIR = f"{PPO_DIR}/{ACTOR_DIR}"  # the PPO/GRPO policy under train.py's --output_dir

# The steps' folders: a model path through one ("out/step1_sft", "step3_ppo/actor") is a run's, never a hub name.
STEP_FOLDER_NAMES = frozenset({SFT_DIR, RM_DIR, DPO_DIR, PPO_DIR})

# Beside a step's models: its flags and run id, and its metrics. A step that starts training removes its metrics.json
# and writes it last when it finishes: the mark of a finished output.
RUN_ARGS_FILE = "training_args.json"
CHECKPOINTS_DIR = "checkpoints"  # a step's --save_interval checkpoints, in its --output_dir
FINISHED_MARK = "metrics.json"
REPORT_FILE = "report.json"  # train.py's, in its --output_dir (marked "unfinished" while its steps run)


def unfinished_reason(model_path):
    """Why the model in ``model_path`` (a step's folder, or step 3's actor or critic in it) may not be a finished
    step's output: that step ran again there and did not finish (its training_args.json is there, its metrics.json
    is not), so its model files may be the earlier run's or part of the interrupted one's. None otherwise (a folder
    no step wrote too)."""
    path = os.path.abspath(model_path)  # (a folder given as ".": its parent is then the step's)
    folders = [path] + ([os.path.dirname(path)] if os.path.basename(path) in (ACTOR_DIR, CRITIC_DIR, ACTOR_EMA_DIR)
                        else [])
    for folder in folders:
        if os.path.isfile(os.path.join(folder, RUN_ARGS_FILE)):
            if os.path.isfile(os.path.join(folder, FINISHED_MARK)):
                return None
            return (f"{folder} is an unfinished step output: its last training run was interrupted, or is still "
                    f"running ({RUN_ARGS_FILE} but no {FINISHED_MARK}), so its model files may be an earlier run's or "
                    "part of that one's" + "".join(f"; {leftover}" for leftover in save_leftovers(path)))
    return None


def save_staging_prefix(model_path):
    """The name prefix of the temporary folder a save of ``model_path`` writes before it moves in."""
    return f".{os.path.basename(os.path.abspath(model_path))}.tmp-"


def save_swap_paths(model_path):
    """(new, old): where a save of an existing model folder puts its finished copy, then the earlier folder, while it
    swaps them by renames (``checkpoint.install_folder``): beside the folder (the one a link to it points to)."""
    parent, name = os.path.split(os.path.realpath(model_path))
    return os.path.join(parent, f".{name}.save-new"), os.path.join(parent, f".{name}.save-old")


def save_moving_path(model_path):
    """Where a save of an existing model folder that cannot be swapped (``checkpoint.install_folder``) puts its finished
    copy, in the folder, while it moves the files in one by one: a kill part-way leaves it there, with the rest."""
    folder = os.path.realpath(model_path)
    return os.path.join(folder, f".{os.path.basename(folder)}.save-moving")


def python_str(path):
    """``path`` as a Python string literal, for a message's call to copy: a ``pathlib.Path``'s repr would be
    ``PosixPath('...')``, which that call's reader has not imported."""
    return repr(os.fspath(path))


def interrupted_move_message(model_path):
    """What a save killed while it moved its files into ``model_path`` one by one left (``save_moving_path``), else
    None: the folder then mixes the new save's files with the earlier one's, and loads as neither model."""
    moving = save_moving_path(model_path)
    if not os.path.isdir(moving):
        return None
    return (f"{model_path} holds part of a save interrupted while it moved its files in one by one (the folder "
            f"could not be swapped: a mount point, or the working directory), so its model files mix the new save's "
            f"with the earlier one's; {moving} holds the rest: the next save there, a step's start with it as "
            f"its --output_dir, or dschat.models.checkpoint.finish_interrupted_save({python_str(model_path)}) finishes "
            "moving it in (unless that save is still running there: then wait for it)")


def interrupted_swap_message(model_path):
    """What a save killed between the two renames that swap its finished copy in for ``model_path`` left: no folder
    there, the new model whole beside it (``save_swap_paths``); else None."""
    new = save_swap_paths(model_path)[0]
    if os.path.lexists(model_path) or not os.path.isdir(new):
        return None
    return (f"{model_path}: no folder there now: a save that replaced it was interrupted between its renames, and its "
            f"finished copy is {new}: the next save there, a step's start with it as its --output_dir (or in its "
            f"--output_dir), or dschat.models.checkpoint.finish_interrupted_save({python_str(model_path)}) moves it in")


def interrupted_save_message(model_path):
    """Why ``model_path`` cannot load as a model because a save there was killed part-way (``interrupted_move_message``,
    ``interrupted_swap_message``), else None: what every dschat load of a model checks first
    (``loading.check_no_interrupted_save``)."""
    return interrupted_move_message(model_path) or interrupted_swap_message(model_path)


def save_leftovers(model_path):
    """The unfinished copy a save of ``model_path`` killed before it moved in left (``checkpoint.atomic_folder``
    stages it as ``.NAME.tmp-*`` in the model folder, else beside it), said with its size. No reader takes it for the
    model (it is a subfolder); it only holds disk space until the next save there removes it."""
    prefix = save_staging_prefix(model_path)
    said = []
    for parent in dict.fromkeys((model_path, os.path.dirname(os.path.abspath(model_path)))):
        found = sorted(os.listdir(parent)) if os.path.isdir(parent) else []
        for leftover in (os.path.join(parent, n) for n in found if n.startswith(prefix)):
            if os.path.isdir(leftover):
                said.append(f"{leftover} ({_size(leftover)}) is an unfinished save's copy, interrupted or still being "
                            "written: it only takes disk space, and the next save there removes it")
    if moving := interrupted_move_message(model_path):
        said.append(moving)
    new, old = save_swap_paths(model_path)
    if os.path.isdir(new):
        said.append(f"{new} is the finished copy of a save interrupted while it replaced the folder: the next run or "
                    "save there moves it in")
    if os.path.isdir(old):
        said.append(f"{old} is the folder a save replaced, interrupted before it moved the files that are no model's "
                    "(logs, checkpoints) back: the next run or save there moves them and removes it")
    return said


def _size(folder):
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # (a save still writing there)
                pass
    return f"{total / 2**30:.1f} GiB" if total >= 2**30 else f"{total / 2**20:.1f} MiB"
