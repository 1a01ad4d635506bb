"""``train.py --resume``: continue an interrupted run of the pipeline in its output folder.

Steps run one after another, so an interruption stops one step: the steps it starts from finished, and whatever a
step after it holds was made from older inputs. A step's output or checkpoint therefore counts only when it was
written after every step it starts from finished (their metrics.json) and none of those runs now:
- its finished output of the same flags (metrics.json and training_args.json): the step is skipped;
- else, if it has no finished output, its last checkpoint: the step resumes from it (its own ``--resume``); a
  finished output's checkpoint (its own run's) only when the flags differ in how long to train, to train on;
- else it starts afresh.
A step removes its metrics.json when it starts training, so an interrupted run never looks finished. Which step
finished first is told by the files' times: a run folder copied elsewhere keeps its plan only when copied with them
(``cp -a``, ``rsync -a``).
"""
import json
import os
from typing import NamedTuple

from dschat.run_layout import RECIPE_STEP_FOLDERS
from dschat.utils.checkpoints import LATEST

SKIP, RESUME, FRESH = "skip", "resume", "fresh"

# Flags that do not change what a finished step made: the resume switches (a step's save interval is rewritten by a
# resumed run), where it logs and how much it prints. A flag the record lacks (one added since) is taken as unchanged.
NOT_COMPARED = frozenset({"resume", "save_interval", "local_rank", "enable_tensorboard", "tensorboard_path",
                          "print_answers", "print_answers_interval", "deepspeed", "deepscale"})
# Flags a resumed run may raise to train on past the end of a finished one.
EXTENDING = frozenset({"max_steps", "num_train_epochs"})
# Flags naming files or folders: compared as absolute paths (from the working directory each run had).
PATH_FLAGS = ("output_dir", "data_output_path", "model_name_or_path", "actor_model_name_or_path",
              "critic_model_name_or_path", "sft_only_data_path", "data_path")


class Decision(NamedTuple):
    action: str
    why: str = ""


def step_inputs(recipe, step, rm_from_sft):
    """The earlier steps of ``recipe`` whose outputs ``step`` starts from (see ``pipeline.step_argv``)."""
    earlier = [s for s in RECIPE_STEP_FOLDERS[recipe] if s < step]
    if recipe == "ppo" and step == 2 and not rm_from_sft:
        return []  # the reward model starts from --reward-model
    return earlier


def plan_steps(steps, recipe, output_dir, parsed, rm_from_sft=True):
    """{step: Decision} for ``steps`` (in order); ``parsed``: step -> its parsed flags now."""
    plan = {}
    for step in steps:
        inputs = step_inputs(recipe, step, rm_from_sft)
        rerun = [s for s in inputs if s in plan and plan[s].action != SKIP]
        if rerun:
            plan[step] = Decision(FRESH, f"it starts from step {rerun[-1]}'s new output")
            continue
        # when its inputs were finished (None: unknown, no metrics.json of theirs)
        inputs_done = max(filter(None, (finished_time(_folder(output_dir, recipe, s)) for s in inputs)), default=None)

        def after_inputs(moment):
            return moment is not None and (inputs_done is None or moment > inputs_done)

        folder = _folder(output_dir, recipe, step)
        done, changed = finished_time(folder), changed_flags(folder, parsed[step])
        current = after_inputs(done)
        # a finished output's checkpoints are its own run's (a run that trains removes metrics.json first): they
        # resume only to train on for longer
        if current and not changed:
            plan[step] = Decision(SKIP)
        elif after_inputs(checkpoint_time(folder)) and not current:
            plan[step] = Decision(RESUME, "it was interrupted")
        elif current and checkpoint_time(folder) is not None and set(changed) <= EXTENDING:
            plan[step] = Decision(RESUME, "to train on past its finished output ("
                                          + ", ".join(f"--{name}" for name in changed) + ")")
        elif current:
            plan[step] = Decision(FRESH, f"its finished output in {folder} had other values of "
                                         f"{', '.join('--' + name for name in changed)}")
        elif inputs:
            plan[step] = Decision(FRESH, f"{folder} holds no finished output nor checkpoint written after step "
                                         f"{', '.join(map(str, inputs))} finished")
        else:
            plan[step] = Decision(FRESH, f"{folder} holds no finished output nor checkpoint")
    return plan


def _folder(output_dir, recipe, step):
    return os.path.join(output_dir, RECIPE_STEP_FOLDERS[recipe][step])


def finished_time(folder):
    """When the step's output in ``folder`` was finished (its metrics.json's time), else None."""
    path = os.path.join(folder, "metrics.json")
    return os.path.getmtime(path) if os.path.isfile(path) else None


def changed_flags(folder, flags):
    """The flags whose value now differs from the one the step recorded in ``folder`` (its training_args.json,
    written through JSON, anything else as a string); every flag when there is no record."""
    from dschat.steps.common import RUN_ARGS_FILE

    now = json.loads(json.dumps(vars(flags), default=str))
    names = [name for name in now if name not in NOT_COMPARED and not name.startswith("_")]
    path = os.path.join(folder, RUN_ARGS_FILE)
    if not os.path.isfile(path):
        return names
    with open(path) as f:
        record = json.load(f)
    recorded, then = record.get("flags", {}), record.get("cwd", os.getcwd())
    return sorted(name for name in names if name in recorded
                  and _as_path(name, recorded[name], then) != _as_path(name, now[name], os.getcwd()))


def _as_path(name, value, cwd):
    """A path flag's local path as an absolute one (a hub name stays as it is)."""
    if name not in PATH_FLAGS or value is None:
        return value
    if isinstance(value, list):
        return [_as_path(name, item, cwd) for item in value]
    local = os.path.join(cwd, value)
    return os.path.normpath(local) if os.path.exists(local) or name == "output_dir" else value


def checkpoint_time(folder):
    """When the step's last checkpoint in ``folder`` was saved (its ``latest`` pointer's time), else None."""
    path = os.path.join(folder, "checkpoints", LATEST)
    return os.path.getmtime(path) if os.path.isfile(path) else None


def describe(step, decision, folder):
    """The line that says what the plan does with ``step``."""
    if decision.action == SKIP:
        return f"step {step}: finished earlier in {folder} with the same flags; skipped (--resume)"
    if decision.action == RESUME:
        return (f"step {step}: resumes from its last checkpoint in {os.path.join(folder, 'checkpoints')} (--resume): "
                f"{decision.why}")
    return f"step {step}: starts afresh: {decision.why}"
