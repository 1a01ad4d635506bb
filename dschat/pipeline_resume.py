"""``train.py --resume``: continue an interrupted run of the pipeline in its output folder.

Steps run one after another, so an interruption stops one step: the steps before it finished, and whatever the steps
after it hold comes from an earlier run on older inputs. So a step is skipped when its folder holds a finished output
of the same flags, written after the step before it finished; the first step that is not skipped resumes from its last
checkpoint (its own ``--resume``) if that checkpoint was written after the step before it finished; every later step
starts afresh.
"""
import json
import os

from dschat.run_layout import RECIPE_STEP_FOLDERS
from dschat.utils.checkpoints import LATEST

SKIP, RESUME, FRESH = "skip", "resume", "fresh"

# Flags that do not change what a finished step made: the resume switches (a step's save interval is rewritten by a
# resumed run), where it logs and how much it prints.
NOT_COMPARED = frozenset({"resume", "save_interval", "local_rank", "enable_tensorboard", "tensorboard_path",
                          "print_answers", "print_answers_interval", "deepspeed", "deepscale"})


def plan_steps(steps, recipe, output_dir, parsed):
    """{step: SKIP | RESUME | FRESH} for ``steps`` (in order); ``parsed``: step -> its parsed flags now."""
    plan, before = {}, None  # before: when the step before this one finished (None: it is not in this run's chain)
    chain_broken = False
    for step in steps:
        folder = os.path.join(output_dir, RECIPE_STEP_FOLDERS[recipe][step])
        finished = finished_at(folder, parsed[step])
        if not chain_broken and finished is not None and (before is None or finished > before):
            plan[step], before = SKIP, finished
            continue
        saved = checkpoint_saved_at(folder)
        plan[step] = RESUME if not chain_broken and saved is not None and (before is None or saved > before) else FRESH
        chain_broken = True
    return plan


def finished_at(folder, flags):
    """When the step's output in ``folder`` was finished with ``flags`` (its metrics.json's time), else None."""
    from dschat.steps.common import RUN_ARGS_FILE

    metrics, record = os.path.join(folder, "metrics.json"), os.path.join(folder, RUN_ARGS_FILE)
    if not (os.path.isfile(metrics) and os.path.isfile(record)):
        return None
    with open(record) as f:
        recorded = json.load(f).get("flags", {})
    return os.path.getmtime(metrics) if changed_flags(recorded, flags) == [] else None


def changed_flags(recorded, flags):
    """The flags whose value now differs from the one the finished step recorded (as its training_args.json wrote
    them: through JSON, anything else as a string)."""
    now = json.loads(json.dumps(vars(flags), default=str))
    return sorted(name for name, value in now.items()
                  if name not in NOT_COMPARED and not name.startswith("_") and recorded.get(name, value) != value)


def checkpoint_saved_at(folder):
    """When the step's last checkpoint in ``folder`` was saved (its ``latest`` pointer's time), else None."""
    path = os.path.join(folder, "checkpoints", LATEST)
    return os.path.getmtime(path) if os.path.isfile(path) else None


def describe(step, plan, folder):
    """The line that says what ``plan`` does with ``step``."""
    if plan[step] == SKIP:
        return f"step {step}: finished earlier in {folder} with the same flags; skipped (--resume)"
    if plan[step] == RESUME:
        return f"step {step}: resumes from its last checkpoint in {os.path.join(folder, 'checkpoints')} (--resume)"
    if any(plan[earlier] != SKIP for earlier in plan if earlier < step):
        return f"step {step}: starts afresh, from the new output of the step before it"
    return (f"step {step}: starts afresh: {folder} holds no output finished with these flags, nor a checkpoint, "
            "written after the step before it")
