"""The one-command pipeline behind ``train.py``: steps 1, 2, 3 in-process, then the report.

Under the deepspeed launcher every rank runs this same function; nothing here starts processes except the
single re-launch of a plain ``python train.py`` for multi-GPU deployment types (see ``train.py``).
"""
import contextlib
import functools
import os
import re
import shlex
import time

from dschat.errors import MissingInputError, UsageError
from dschat.models.loading import resolve_model_path
from dschat.pipeline_resume import (FRESH, RESUME, SKIP, Decision, describe, outdated_outputs, plan_steps,
                                    refused_under_train_py)
from dschat.run_layout import (ACTOR_DIR, ACTOR_EMA_DIR, DPO_DIR, PPO_DIR, RECIPE_STEP_FOLDERS, REPORT_FILE, RM_DIR,
                               RUN_ARGS_FILE, SFT_DIR, unfinished_reason)
from dschat.utils.dist import ensure_distributed, is_rank_0, local_device, print_rank_0, rank_0_decides
from dschat.utils.files import check_writable_folder

# Settings that make the embedded tiny default train well in minutes on a CPU. Hub models get the step
# scripts' own defaults (DeepSpeed-Chat's main.py's) plus HUB_RECIPE; --stepN-args override either.
TINY_RECIPE = {
    1: ["--data_split", "4,4,2", "--max_seq_len", "96", "--per_device_train_batch_size", "16",
        "--per_device_eval_batch_size", "32", "--learning_rate", "2e-3", "--num_train_epochs", "5",
        "--num_warmup_steps", "10", "--dtype", "fp32"],
    2: ["--data_split", "4,4,2", "--max_seq_len", "96", "--per_device_train_batch_size", "16",
        "--per_device_eval_batch_size", "32", "--learning_rate", "1e-3", "--num_train_epochs", "4",
        "--num_warmup_steps", "10", "--dtype", "fp32"],
    3: ["--data_split", "4,4,2", "--max_prompt_seq_len", "48", "--max_answer_seq_len", "32",
        "--per_device_generation_batch_size", "32", "--per_device_training_batch_size", "32",
        "--actor_learning_rate", "5e-5", "--critic_learning_rate", "5e-4", "--num_warmup_steps", "2",
        "--dtype", "fp32", "--enable_hybrid_engine", "--num_train_epochs", "2", "--eval_prompts", "256"],
}


# `train.py --recipe grpo`: critic-free GRPO rewarded by the bundled rule scorer, no reward model (steps 1 and 3);
# step_argv drops its scorer flags when a trained --reward-model rewards it instead.
GRPO_RECIPE = ["--advantage_estimator", "grpo", "--n_samples_per_prompt", "4", "--per_device_generation_batch_size",
               "8", "--reward_fn", "tiny", "--reward_model_weight", "0", "--actor_learning_rate", "1e-4"]

# `train.py --recipe dpo`: step 1, then DPO on the step-2 pairs (training/step2_dpo) instead of steps 2 and 3.
# DeepSpeed-Chat's beta 0.1 plus an SFT term on the chosen answers (--rpo_alpha 1.0): plain DPO raised the held-out
# preference accuracy but lowered the greedy answers' rule score in every setting measured (docs/tiny_default.md).
TINY_DPO_RECIPE = ["--data_split", "4,4,2", "--max_seq_len", "96", "--per_device_train_batch_size", "16",
                   "--per_device_eval_batch_size", "32", "--learning_rate", "1e-3", "--num_train_epochs", "2",
                   "--num_warmup_steps", "10", "--dtype", "fp32", "--beta", "0.1", "--rpo_alpha", "1.0"]


# Dropout off where DeepSpeed-Chat's training scripts (which its train.py runs) turn it off: the reward model and
# DPO (--disable_dropout, --dropout 0.0) and the PPO actor (--actor_dropout 0.0), whose ratio would otherwise measure
# dropout noise against the rollout's eval-mode log-probs; the critic too here (a --reward-model's config may have
# some). Step 1 keeps the model's own, as there. For every model; --stepN-args may set another.
NO_DROPOUT = {2: ["--dropout", "0.0"], 3: ["--actor_dropout", "0.0", "--critic_dropout", "0.0"]}
GRPO_NO_DROPOUT = ["--actor_dropout", "0.0"]  # (no critic)

# The other flags those scripts give whatever the model's size (opt/ and llama2/, single_gpu and single_node): weight
# decay 0.1 for the reward model and DPO, and step 3 through the hybrid engine. Their size-specific settings (LoRA,
# gradient accumulation, batch sizes, learning rates, epochs) are not taken: README "Real models" lists them.
HUB_RECIPE = {2: ["--weight_decay", "0.1"], 3: ["--enable_hybrid_engine"]}

# What train.py trains real models on without --data-path: DeepSpeed-Chat's steps' default dataset.
DEEPSPEED_CHAT_DATA = "Dahoas/rm-static"


def is_tiny_run(args):
    """A tiny preset's actor with a tiny preset's reward model, or with a trained reward model step 3 scores with
    (``ready_reward_model``): the tiny recipe and data apply. A run without step 3 is judged as with it: ``--step 1``
    then ``--step 3`` trains step 1 as ``--step 1 3`` does."""
    import copy

    from dschat.tiny.presets import is_tiny_preset

    with_step_3 = copy.copy(args)
    with_step_3.step = sorted({*getattr(args, "step", (1, 2, 3)), 3})
    return is_tiny_preset(args.actor_model) and (is_tiny_preset(args.reward_model)
                                                 or ready_reward_model(with_step_3) is not None)


def reward_model_from_sft(args, tiny):
    """Whether step 2 starts the reward model from the SFT model: on the tiny default, unless --reward-model names
    another model than the actor. (As InstructGPT's did: a 0.5M-parameter model trained from scratch in seconds only
    sees an answer's form; the SFT model also knows its content.)"""
    return tiny and args.reward_model == args.actor_model


def ready_reward_model(args):
    """``--reward-model`` when step 3 scores with it as it is: a trained reward model (a folder or a hub name: step
    2's output, DeepSpeed-Chat's, TRL's or OpenRLHF's) given to a PPO run without step 2, whose critic starts from it,
    or to a GRPO run. Else None: step 2 trains from ``--reward-model``, and step 3 reads step 2's folder; GRPO is
    rewarded by its --reward_fn."""
    from dschat.models.reward_model import holds_reward_model

    recipe = getattr(args, "recipe", "ppo")
    steps = recipe_steps(recipe, getattr(args, "step", (1, 2, 3)))[0]
    path = args.reward_model
    if recipe == "dpo" or 3 not in steps or 2 in steps or path == getattr(args, "actor_model", None):
        return None
    if os.path.isdir(path):
        return path if holds_reward_model(path) else None
    return path if _hub_holds_reward_model(path) else None


# ``hub_lookup_key_of_every_rank`` (name, hub cache, offline by the user's choice) -> whether it is a reward model (a
# lookup that failed, in part too, is asked again)
_HUB_REWARD_MODELS = {}


def _hub_holds_reward_model(name):
    """``hub_holds_reward_model`` decided on rank 0 (a lookup failing on one rank would give the ranks other steps),
    once per name, hub cache and offline mode as the user set it (``hub_lookup_key_of_every_rank``); False for a local
    path or a tiny preset."""
    from dschat.models.loading import hub_lookup_key_of_every_rank, looks_local
    from dschat.models.reward_model import hub_holds_reward_model
    from dschat.tiny.presets import is_tiny_preset

    if looks_local(name) or is_tiny_preset(name):
        return False
    key = hub_lookup_key_of_every_rank(name)  # (a miss is a collective: every rank must miss alike)
    if key not in _HUB_REWARD_MODELS:
        found = rank_0_decides(lambda: hub_holds_reward_model(name))
        if found is None:
            return False
        _HUB_REWARD_MODELS[key] = found
    return _HUB_REWARD_MODELS[key]


def step_argv(step, args, tiny):
    """The argument list of one step, from train.py's flags and its ``--stepN-args``, each flag once (``run_steps``
    prints it: run as the step's script, a flag given twice is refused): a flag the ``--stepN-args`` give replaces
    train.py's (as does a later default an earlier one: the GRPO recipe's batch size, the tiny recipe's), rather than
    following it for argparse's last-wins; one given twice in the ``--stepN-args`` is the user's, refused
    (``check_step_args``)."""
    out = args.output_dir
    extra = step_extra_args(step, args)
    common = ["--data_path", *args.data_path] if args.data_path else []
    common += [] if reads_own_data_without_fields(step, args) else ["--data_fields", step_data_fields(step, args)]
    dpo = step == 2 and getattr(args, "recipe", "ppo") == "dpo"
    if dpo:
        # the policy and its frozen reference both start from the SFT model, sharded like the actor
        argv = ["--model_name_or_path", os.path.join(out, SFT_DIR), "--zero_stage", str(args.actor_zero_stage),
                "--output_dir", os.path.join(out, DPO_DIR)]
    elif step == 1:
        argv = ["--model_name_or_path", args.actor_model, "--zero_stage", str(args.actor_zero_stage),
                "--output_dir", os.path.join(out, SFT_DIR)]
    elif step == 2:
        base = os.path.join(out, SFT_DIR) if reward_model_from_sft(args, tiny) else args.reward_model
        argv = ["--model_name_or_path", base, "--zero_stage", str(args.reward_zero_stage),
                "--output_dir", os.path.join(out, RM_DIR)]
    else:
        # a --zero_stage in --step3-args sets both models: the per-model stages would outrank it
        gives_stage = any(token.split("=", 1)[0] == "--zero_stage" for token in extra)
        ready = ready_reward_model(args)
        grpo = getattr(args, "recipe", "ppo") == "grpo"
        # (--critic_zero_stage shards the critic, or a critic-free run's reward model: GRPO rewarded by its
        # --reward_fn has neither, and train.py refuses a --reward-zero-stage for it)
        critic_stage = [] if grpo and not ready else ["--critic_zero_stage", str(args.reward_zero_stage)]
        stages = [] if gives_stage else ["--actor_zero_stage", str(args.actor_zero_stage), *critic_stage]
        if grpo:  # no critic, no step 2: its run record names no step-2 folder
            scorers = ["--reward_model_name_or_path", ready] if ready else []
        else:
            scorers = ["--critic_model_name_or_path", ready or os.path.join(out, RM_DIR)]
        argv = ["--actor_model_name_or_path", os.path.join(out, SFT_DIR), *scorers, *stages,
                "--output_dir", os.path.join(out, PPO_DIR)]
    grpo_step = step == 3 and getattr(args, "recipe", "ppo") == "grpo"
    argv += GRPO_NO_DROPOUT if grpo_step else NO_DROPOUT.get(step, [])
    recipe = (TINY_DPO_RECIPE if dpo else TINY_RECIPE[step]) if tiny else HUB_RECIPE.get(step, [])
    if grpo_step:
        # (with a trained --reward-model, GRPO is rewarded by it instead of the rule scorer)
        grpo = (_without(_without(GRPO_RECIPE, "--reward_fn"), "--reward_model_weight") if ready_reward_model(args)
                else GRPO_RECIPE)
        recipe = _without(recipe, "--critic_learning_rate") + grpo
    # the run's TensorBoard events (with --enable_tensorboard) under its folder, one subfolder per step, as its
    # models: the steps' own defaults are folders in the working directory, which other runs would share
    from dschat.args import without_flags_given_in

    defaults = common + argv + recipe + ["--data_output_path", os.path.join(out, "data_cache"),
                                         "--tensorboard_path", os.path.join(out, "tensorboard")]
    return without_flags_given_in(step_parser(step, getattr(args, "recipe", "ppo"))(), defaults, extra) + extra


def reads_own_data_without_fields(step, args):
    """Whether train.py's --data-fields stay out of ``step``'s flags: none were given, or its ``--stepN-args`` give
    the step its own --data_path, not all of --data-path's files, but no --data_fields. Field names go with the files
    they were given for (as ppo_eval's run defaults do): train.py's named the columns of --data-path's files, and
    applied to other files they renamed columns those files may not have (or had under their own names), unsaid."""
    if not getattr(args, "data_fields", None):
        return True
    from dschat.args import flag_groups

    parser = step_parser(step, getattr(args, "recipe", "ppo"))()
    extra = step_extra_args(step, args)
    given = {dest for dest, _ in flag_groups(parser, extra)}
    if "data_path" not in given or "data_fields" in given:
        return False
    from dschat.data.fields import all_among, parse_data_fields

    if parse_data_fields(args.data_fields).by_dataset:  # (given per dataset: those of its own data go to it)
        return not step_data_fields(step, args)
    own = parser.parse_known_args(extra)[0].data_path
    return not all_among(own, args.data_path or [])  # (./qa.jsonl is --data-path's jsonl:qa.jsonl)


def step_data_fields(step, args):
    """train.py's --data-fields for ``step``; given per dataset, the mappings of the datasets the step reads alone (its
    --data_path, --data-path's or its ``--stepN-args``' own, and step 1's --sft_only_data_path): another dataset named
    there is not one of the step's, an error in it (train.py's check sees them all,
    ``check_data_fields_name_the_steps_datasets``); the mapping of no dataset only where the step reads
    --data-path's files (it named their columns, ``reads_own_data_without_fields``)."""
    from dschat.data.fields import DataFields, all_among, parse_data_fields

    fields = parse_data_fields(args.data_fields)
    if not fields.by_dataset:
        return args.data_fields
    own = step_parser(step, getattr(args, "recipe", "ppo"))().parse_known_args(step_extra_args(step, args))[0]
    data_path = own.data_path if _gives_flag(step, args, "data_path") else args.data_path or []
    mine = fields.of_datasets([*data_path, *getattr(own, "sft_only_data_path", [])])
    if not all_among(data_path, args.data_path or []):
        mine = DataFields({}, mine.by_dataset)
    return mine.as_text()


def _gives_flag(step, args, dest):
    from dschat.args import flag_groups

    parser = step_parser(step, getattr(args, "recipe", "ppo"))()
    return dest in {given for given, _ in flag_groups(parser, step_extra_args(step, args))}


def check_data_fields_name_the_steps_datasets(args, step_flags):
    """Every dataset train.py's --data-fields give a mapping of is read by a step (``step_flags``: the steps' parsed
    flags): a typo, or a path written otherwise than in the flags, renamed nothing, unsaid."""
    from dschat.data.fields import parse_data_fields

    read = [spec for flags in step_flags for spec in [*flags.data_path, *getattr(flags, "sft_only_data_path", [])]]
    parse_data_fields(getattr(args, "data_fields", "")).check_names(
        list(dict.fromkeys(read)), "--data-path or a step's --data_path or --sft_only_data_path", "--data-fields")


def step_parser(step, recipe):
    """The parser factory of ``step`` of ``recipe`` (DPO's step 2 is its own)."""
    from dschat.args import step1_parser, step2_dpo_parser, step2_parser, step3_parser

    if step == 2 and recipe == "dpo":
        return step2_dpo_parser
    return {1: step1_parser, 2: step2_parser, 3: step3_parser}[step]


def _without(argv, flag):
    """``argv`` less ``flag`` and its value."""
    at = argv.index(flag) if flag in argv else None
    return argv if at is None else argv[:at] + argv[at + 2:]


def step_extra_args(step, args):
    """The ``--stepN-args`` string as an argument list."""
    try:
        return shlex.split(getattr(args, f"step{step}_args") or "")
    except ValueError as error:  # e.g. "No closing quotation"
        raise UsageError(f"--step{step}-args {getattr(args, f'step{step}_args')!r}: {error}") from None


# Steps a recipe does not have, and why.
RECIPE_SKIPS = {"grpo": {2: "step 2 (GRPO is rewarded by --reward_fn, or by a trained --reward-model)"},
                "dpo": {3: "step 3 (DPO replaces the reward model and PPO)"}}


def recipe_steps(recipe, steps):
    """(the asked-for steps that ``recipe`` has, in order; notes naming the others)."""
    skips = RECIPE_SKIPS.get(recipe, {})
    return [s for s in sorted(set(steps)) if s not in skips], [skips[s] for s in sorted(set(steps)) if s in skips]


# Step flags whose value train.py sets from one of its own (step 1's --model_name_or_path from --actor-model, step
# 2's from --reward-model). The one table of these names: FOLDER_DESTS takes its folder flags from here.
TRAIN_PY_NAMES = {"--actor_model_name_or_path": "--actor-model",
                  "--model_name_or_path": "--actor-model / --reward-model",
                  "--critic_model_name_or_path": "--reward-model", "--reward_model_name_or_path": "--reward-model",
                  "--actor_zero_stage": "--actor-zero-stage", "--critic_zero_stage": "--reward-zero-stage",
                  "--zero_stage": "--actor-zero-stage / --reward-zero-stage", "--data_path": "--data-path",
                  "--data_fields": "--data-fields", "--output_dir": "--output-dir"}


# Step flags (dests) that are train.py's own options to its user (TRAIN_PY_NAMES spells them) where the step's
# --stepN-args give none of the group: the step reads --data-path (or train.py's default data), named by --data-fields
# (given or not: an error asking for field names asks for train.py's); a step given its own --data_path there takes
# its field names there too.
PASSED_AS_TYPED = {"data_path": {"data_path"}, "data_fields": {"data_fields", "data_path"}}


# The train.py option each step's model flag takes its model from, where it does (``set_from_train_py_options``):
# step 2's is otherwise the SFT model (the tiny default), step 3's critic otherwise step 2's folder.
MODEL_OPTIONS = {1: {"model_name_or_path": "--actor-model"}, 2: {"model_name_or_path": "--reward-model"},
                 3: {"critic_model_name_or_path": "--reward-model", "reward_model_name_or_path": "--reward-model"}}


def model_options_of(step, recipe):
    """``MODEL_OPTIONS`` of ``step`` of ``recipe``: DPO's model is always the SFT folder, never a train.py option's
    (an --actor-model naming that folder, which --reward-model then defaults to, holds the same value: it was said as
    --reward-model, which DPO takes none of)."""
    return {} if step == 2 and recipe == "dpo" else MODEL_OPTIONS[step]


def set_from_train_py_options(step, args, argv):
    """{a flag (dest) of ``step``'s command line ``argv`` that train.py set from an option of its own: that option}:
    its --output_dir (a folder under --output-dir, said so where named with it: ``flag_in_message``), its ZeRO stages
    (``stage_flags_of``'s of one option: step 3's --zero_stage is not train.py's), and a model flag holding that
    option's model (not an earlier step's folder); none that its --stepN-args give, which the user typed in the step's
    spelling."""
    from dschat.args import flag_groups

    recipe = getattr(args, "recipe", "ppo")
    parser = step_parser(step, recipe)()
    own = {dest for dest, _ in flag_groups(parser, step_extra_args(step, args))}
    passed = {dest: tokens[1:] for dest, tokens in flag_groups(parser, argv) if dest is not None and dest not in own}
    stages = {dest: options[0] for dest, options in stage_flags_of(step, recipe).items() if len(options) == 1}
    models = {dest: option for dest, option in model_options_of(step, recipe).items()
              if passed.get(dest) == [getattr(args, option[2:].replace("-", "_"), None)]}
    return {dest: option for dest, option in {"output_dir": "--output-dir", **stages, **models}.items()
            if dest in passed}


def in_train_py_spelling(message, step, args, argv=None):
    """``message`` (``step``'s error) naming train.py's flags where they are train.py's to the user: the data flags
    (PASSED_AS_TYPED: a step names its own --data_fields, and the user had typed --data-fields), and, given the step's
    command line ``argv``, the others train.py set (``set_from_train_py_options``: --actor_zero_stage is
    --actor-zero-stage, step 1's --model_name_or_path --actor-model); flags from its --stepN-args keep the step's
    spelling."""
    from dschat.args import flag_groups

    parser = step_parser(step, getattr(args, "recipe", "ppo"))()
    given = {dest for dest, _ in flag_groups(parser, step_extra_args(step, args))}
    options = {dest: TRAIN_PY_NAMES[f"--{dest}"] for dest, group in PASSED_AS_TYPED.items() if not group & given}
    options.update(set_from_train_py_options(step, args, argv) if argv is not None else {})
    for dest, option in options.items():
        message = re.sub(flag_in_message(dest, argv), option, message)
    return message


def flag_in_message(dest, argv):
    """The pattern of step flag ``dest`` in a message where train.py's option stands for it. --output_dir only where
    it names the step's folder (its value in the step's command line ``argv``): named alone it is advice about a step
    script's flag (an interrupted save's "a step's start with it as its --output_dir"), which train.py's
    --output-dir, the run's folder above the step's, does not do."""
    if dest != "output_dir":
        return rf"--{dest}(?![\w-])"
    folder = argv[argv.index("--output_dir") + 1]
    return rf"--output_dir(?= {re.escape(folder)}(?![\w./-]))"


@contextlib.contextmanager
def says_train_py_flags(step, args, argv=None):
    """Run ``step``'s code (its checks, or the step itself in train.py's process; ``argv``: its command line, once
    built): a UsageError it raises names the flags the user gave train.py as train.py spells them
    (``in_train_py_spelling``); its type and traceback kept. Its notices (``say_once``'s) are spelled so too."""
    from dschat.utils.cli import notices_spelled

    try:
        with notices_spelled(lambda notice: in_train_py_spelling(notice, step, args, argv)):
            yield
    except UsageError as error:
        error.args = (in_train_py_spelling(str(error), step, args, argv), *error.args[1:])
        raise


def step_flag_hint(flag):
    """For a flag train.py does not take: train.py's option for it, or the steps that take it and how to pass it to
    them, in words; else None. (The launcher's --local_rank is no flag to pass to a step: train.py takes it itself.)"""
    from dschat.args import LOCAL_RANK_FLAGS, scripts_taking

    if flag in LOCAL_RANK_FLAGS:
        return None
    if flag in TRAIN_PY_NAMES:
        return f"{flag}: train.py's {TRAIN_PY_NAMES[flag]}"
    steps_spelling = "--" + flag[2:].replace("-", "_")  # (train.py's --lora-dim: the steps spell it --lora_dim)
    taking = scripts_taking(flag)
    spelled = ""
    if not taking and steps_spelling != flag:
        taking, spelled = scripts_taking(steps_spelling), f" (spelled {steps_spelling} there)"
    if not taking:
        return None
    steps, where = _steps_and_options(taking)
    return (f"{flag}: a flag of step {steps}{spelled}; give it to train.py inside {where} (one quoted string each), "
            "or run the step's training/.../main.py")


def close_step_flags_hint(flag):
    """For a flag train.py does not take, nor a step, nor is it close to one of train.py's: the step flags it may have
    meant (``close_names``, as a step's own parser finds its flags: ``--entropy_coeff`` for step 3's --entropy_coef),
    with where they go, in words; else None."""
    from dschat.args import LOCAL_RANK_FLAGS, close_names, one_spelling_each, step_flag_spellings

    spellings = step_flag_spellings()
    # (the launcher's --local_rank is no flag to pass to a step: train.py takes it itself; an option's other spelling
    # is the same flag, named once)
    meant = one_spelling_each(close_names(flag, [name for name in spellings if name not in LOCAL_RANK_FLAGS]),
                              spellings.__getitem__)
    if not meant:
        return None
    places = {}  # (flags going to the same place are said together, in close_names' order)
    for name in meant:
        places.setdefault(_where_step_flag_goes(name), []).append(name)
    return f"{flag}: did you mean {' or '.join(_flags_and_place(names, place) for place, names in places.items())}?"


def _where_step_flag_goes(flag):
    """Where a step's ``flag`` goes from train.py: train.py's option for it (``TRAIN_PY_NAMES``), else (the steps that
    take it, their --stepN-args) as ``_steps_and_options`` says them."""
    from dschat.args import scripts_taking

    return TRAIN_PY_NAMES.get(flag) or _steps_and_options(scripts_taking(flag))


def _flags_and_place(names, place):
    """Step flags ``names`` and where they go (``_where_step_flag_goes``), in words."""
    flags = " or ".join(names)
    if isinstance(place, str):
        return f"{flags} (train.py's {place})"
    steps, where = place
    a_flag, it = ("a flag", "it") if len(names) == 1 else ("flags", "them")
    return f"{flags} ({a_flag} of step {steps}: give {it} to train.py inside {where})"


def _steps_and_options(taking):
    """``scripts_taking``'s answer as the step numbers ("1, 2") and train.py's options passing the flag to them."""
    steps = ", ".join(map(str, dict.fromkeys(step for _, step, _, _ in taking)))
    return steps, " / ".join(option for _, _, _, option in taking)


def check_step_args(steps, args, tiny, parsers):
    """Every step's arguments parsed (``parsers``: step -> its parser factory), and its DeepSpeed config built with
    any config file, before the first step runs: a typo in ``--step3-args`` or a config file at odds with a step's
    flags stops train.py at once, not after steps 1 and 2 have trained (and overwritten their outputs)."""
    from dschat.data.raw_datasets import LOCAL_FILES, reads_kept

    with reads_kept(LOCAL_FILES):  # (each step's data check reads the files the others read: once, let go after)
        return _check_step_args(steps, args, tiny, parsers)


def _check_step_args(steps, args, tiny, parsers):
    parsed, argvs = {}, {}  # step -> (its flags, its parser); step -> its command line
    for step in steps:  # every step's flags first: a typo is the first thing to hear about
        parser = parsers[step]()
        parser.prog = f"train.py --step{step}-args"  # argparse's error names the flag that was wrong
        parser.check_given_once(step_extra_args(step, args))  # (the user's: train.py's own are replaced by them)
        with says_train_py_flags(step, args):
            argvs[step] = step_argv(step, args, tiny)
        with says_train_py_flags(step, args, argvs[step]):
            parsed[step] = parser.parse_args(argvs[step]), parser
    check_data_fields_name_the_steps_datasets(args, [flags for flags, _ in parsed.values()])
    steps_flags = {step: flags for step, (flags, _) in parsed.items()}
    for step, (flags, parser) in parsed.items():
        with says_train_py_flags(step, args, argvs[step]):
            check_one_steps_flags(step, steps, args, tiny, flags, parser, steps_flags)
    for step, (flags, _) in parsed.items():
        check_earlier_outputs(step, steps, args, flags)
    say_splits_that_differ(steps_flags)
    check_reward_model_tokenizer(steps, args, tiny)
    check_sequence_lengths(args, steps_flags)
    check_hub_data_at_hand(args, steps_flags)  # (last: it may load a dataset; the checks above read flags and files)
    return steps_flags


def check_one_steps_flags(step, steps, args, tiny, flags, parser, steps_flags):
    """``check_step_args``'s checks of one step's parsed ``flags`` (its data's too, where no earlier step runs);
    ``steps_flags``: every step's (step -> its flags), for the model an earlier step's output folder will hold."""
    from dschat.data.fields import parse_data_fields
    from dschat.data.unsupervised import check_unsupervised_file
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.engine import check_step3_settings
    from dschat.steps.common import check_supervised_settings
    from dschat.utils.dist import get_world_size

    check_folders_are_train_pys(step, args, tiny, flags, parser)
    check_stage_flags_agree(step, args, flags, parser)
    # (a step reads it with its data: after train.py has reset the report)
    parse_data_fields(flags.data_fields).check_names(
        [*flags.data_path, *getattr(flags, "sft_only_data_path", [])], f"step {step}'s --data_path")
    if step == 3:
        check_grpo_reads_no_step2_folder(flags, args)
        # before step 1 runs, its output folder may hold an earlier run's model: read the one it starts from (and
        # step 2's may hold an earlier run's reward model: the critic's checks read the model step 2 starts from)
        check_step3_settings(step3_args(flags), get_world_size(), args.actor_model if 1 in steps else None,
                             critic_made_later=2 in steps,
                             critic_architecture=_model_to_read(flags.critic_model_name_or_path, args, steps_flags))
        if steps != [3]:  # step 3 alone counts its prompts at once; after other steps, it would count them late
            check_step3_prompts(step3_args(flags), get_world_size())
            check_unsupervised_file(getattr(flags, "unsupervised_dataset_name", None),
                                    getattr(flags, "unsupervised_dataset_config_name", None))
    else:
        # (DPO's step 2 reads step 1's folder, which may hold an earlier run's model: the one step 1 starts from)
        check_supervised_settings(flags, phase=step,
                                  model_architecture=_model_to_read(flags.model_name_or_path, args, steps_flags))
        if step == 2 and getattr(args, "recipe", "ppo") == "dpo":
            from dschat.steps.dpo import check_dpo_flags

            check_dpo_flags(flags)
        if step == 1 and steps != [1]:  # step 1 alone reads its data at once; a longer run's recipe is said first
            check_step1_answers(flags)
        if step == 2 and steps != [2]:  # step 2 alone reads its pairs at once; after step 1, it would be late
            check_step2_pairs(flags, getattr(args, "recipe", "ppo"))


def check_hub_data_at_hand(args, parsed):
    """Each hub dataset the steps read (``parsed``: step -> its flags; step 3's --unsupervised_dataset_name too) is
    loaded before step 1 runs (rank 0), as its step loads it, where that needs no hub: a local copy under its name
    (./Dahoas/rm-static) always, and, where the hub cannot be reached (HF_HUB_OFFLINE, or dschat's probe), the others
    from the caches. A copy without its reader's splits, or a dataset the caches lacked, was an error only once a
    step reached its data, after the earlier steps had trained, naming the step's --data_path rather than the flag
    that gave it (train.py's --data-path, or --step3-args --unsupervised_dataset_name). With the hub at hand no hub
    read is made here: a step downloads what it reads as it starts."""
    from dschat.data import unsupervised
    from dschat.data.raw_datasets import get_raw_dataset, is_local_hub_copy, reads_the_hub
    from dschat.models.loading import hub_unavailable

    # hub dataset (and config) -> how its step loads it, its error naming the flag that gave it (the first step's)
    loads, copies = {}, {}  # (copies: those under the name's path, read with the hub at hand too)
    for step, flags in parsed.items():
        for dest in ("data_path", "sft_only_data_path"):
            for spec in getattr(flags, dest, None) or []:
                # (as its step loads it: the copy, else datasets' cache, else a download in the hub cache)
                load = functools.partial(get_raw_dataset, spec, None, 0, -1, flag=data_flag_of(step, args, dest))
                if is_local_hub_copy(spec):
                    copies.setdefault(spec, load)
                elif reads_the_hub(spec):
                    loads.setdefault((spec,), load)
        name = getattr(flags, "unsupervised_dataset_name", None)  # (step 3's PPO-ptx data)
        if unsupervised.reads_the_hub(name):
            config = flags.unsupervised_dataset_config_name
            loads.setdefault((name, config), functools.partial(unsupervised.load_hub_train, name, config,
                                                               f"--step{step}-args --unsupervised_dataset_name"))

    def read(load):
        load()  # (its error names the flag)
        return True  # (not the data: rank_0_decides sends what it returns to every rank)

    for load in copies.values():
        rank_0_decides(lambda: read(load))
    if loads and rank_0_decides(hub_unavailable):
        for load in loads.values():
            rank_0_decides(lambda: read(load))


def data_flag_of(step, args, dest):
    """The flag that gave ``step`` its --data_path (``dest``; or step 1's --sft_only_data_path, which only its
    --step1-args give), as train.py's errors name it: train.py's --data-path, else the step's own in its
    --stepN-args."""
    if dest == "data_path" and not _gives_flag(step, args, dest):
        return "--data-path (not given: DeepSpeed-Chat's default)" if getattr(args, "data_path_defaulted", False) \
            else "--data-path"
    return f"--step{step}-args --{dest}"


def check_grpo_reads_no_step2_folder(flags, args):
    """--recipe grpo has no step 2, and train.py gives its step 3 no critic folder: --step3-args asking for a critic
    (--advantage_estimator gae) or a reward model besides --reward-model's (--reward_model_weight) had step 3 read its
    default, output/step2_rm of the working directory: another run's (or nothing, found after step 1 had trained)."""
    if getattr(args, "recipe", "ppo") != "grpo":
        return
    wants = []
    if flags.advantage_estimator == "gae":
        wants.append("--advantage_estimator gae trains a critic")
    if flags.reward_model_weight and not ready_reward_model(args):
        wants.append(f"--reward_model_weight {flags.reward_model_weight} scores with a reward model")
    if wants:
        raise UsageError(f"--recipe grpo --step3-args: {' and '.join(wants)}, which step 3 would start from "
                         f"{flags.critic_model_name_or_path} of the working directory (the recipe has no step 2): use "
                         "--recipe ppo for a critic and step 2's reward model, or give --reward-model a trained "
                         "reward model for GRPO to be rewarded by")


def say_splits_that_differ(parsed):
    """Steps that read the same --data_path but split it with another --data_split or --seed (one given in a single
    --stepN-args): each step takes its phase's share of its own split, so a later step may train on the records an
    earlier one trained on, which the shares of one split keep apart (DeepSpeed-Chat's scripts give every step the
    same). Said, not refused: a step may take all the data on purpose (--data_split 10,0,0 for step 1)."""
    from dschat.data.fields import dataset_identity

    split = {step: (flags.data_split, flags.seed) for step, flags in parsed.items()}
    datasets = {step: {dataset_identity(spec) for spec in flags.data_path} for step, flags in parsed.items()}
    steps = sorted(parsed)
    for index, step in enumerate(steps):
        for later in steps[index + 1:]:  # (the same files, however spelt: ./a.jsonl is jsonl:a.jsonl)
            shared = [path for path in parsed[step].data_path if dataset_identity(path) in datasets[later]]
            if shared and split[step] != split[later]:
                said = "; ".join(f"step {s}: --data_split {split[s][0]} --seed {split[s][1]}" for s in (step, later))
                print_rank_0(f"note: steps {step} and {later} split --data_path {' '.join(shared)} differently ({said}): "
                             f"each takes its phase's share of its own split, so step {later} may train on records "
                             f"step {step} trained on; give both the same --data_split and --seed (--stepN-args) to "
                             "keep their shares apart")


def check_sequence_lengths(args, parsed):
    """Each step's longest sequence against the learned position table of the models it trains or scores with, before
    step 1 runs (each step checks its own when its models load: step 3's, after steps 1 and 2 had trained)."""
    from dschat.models.loading import check_sequence_fits, model_skeleton
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.engine import LONGEST_SEQUENCE_FLAGS, longest_sequence

    checks = []  # (the model's path as the step reads it, length, flags)
    for step, flags in parsed.items():
        if step == 3:
            step3 = step3_args(flags)
            models = [step3.actor_model_name_or_path]
            if step3.advantage_estimator == "gae":
                models.append(step3.critic_model_name_or_path)
            if step3.reward_model_name_or_path:
                models.append(step3.reward_model_name_or_path)
            checks += [(model, longest_sequence(step3), f"--step3-args {LONGEST_SEQUENCE_FLAGS}") for model in models]
        else:
            checks.append((flags.model_name_or_path, flags.max_seq_len, f"--step{step}-args --max_seq_len"))
    skeletons = {}
    for path, length, flags in checks:
        model = _model_to_read(path, args, parsed)
        if model is not None and model not in skeletons:
            skeletons[model] = model_skeleton(model)
        if skeletons.get(model) is not None:
            check_sequence_fits(skeletons[model], length, f"{flags} (for {model})", warn=False)


def _model_to_read(path, args, parsed):
    """The model whose layout a step reading ``path`` gets: an earlier step's output folder that this run writes first
    has the layout of the model that step starts from; None when the folder is not there yet."""
    step = {os.path.join(args.output_dir, SFT_DIR): 1, os.path.join(args.output_dir, RM_DIR): 2}.get(path)
    if step in parsed and parsed[step].model_name_or_path != path:
        return _model_to_read(parsed[step].model_name_or_path, args, parsed)
    return None if step is not None and not os.path.isdir(path) else path


# Where each step reads and writes: train.py sets these from its own flags; the later steps and the report read the
# folders train.py chose, so --stepN-args may not move them. (Step 3's reward model too: the report and the tools name
# --reward-model's, or step 2's, as the one it scored with.)
FOLDER_FLAGS = ("--output_dir", "--model_name_or_path", "--actor_model_name_or_path", "--critic_model_name_or_path",
                "--reward_model_name_or_path")
FOLDER_DESTS = {flag[2:]: TRAIN_PY_NAMES[flag] for flag in FOLDER_FLAGS}


def check_folders_are_train_pys(step, args, tiny, parsed, parser):
    """A folder flag inside ``--stepN-args`` would make the later steps and the report read other folders than the
    step wrote: refused (an abbreviation of one is already an unrecognized argument)."""
    from dschat.args import flag_dests

    dests = flag_dests(parser)
    defaults = parser.parse_args(step_argv(step, _without_extra(args, step), tiny))
    for dest, train_py_flag in FOLDER_DESTS.items():
        if dest in dests and getattr(parsed, dest) != getattr(defaults, dest):
            raise UsageError(f"--step{step}-args sets --{dest}, which train.py sets itself from {train_py_flag} (the "
                             f"later steps and the report read train.py's folders): use {train_py_flag}, or run "
                             "the step's training/.../main.py")


def stage_flags_of(step, recipe):
    """{a ZeRO-stage flag of ``step``: the train.py flags that set the same model's stage}."""
    if step == 3:  # (--zero_stage: both models' where their own flags are not given)
        return {"actor_zero_stage": ("--actor-zero-stage",), "critic_zero_stage": ("--reward-zero-stage",),
                "zero_stage": ("--actor-zero-stage", "--reward-zero-stage")}
    return {"zero_stage": ("--actor-zero-stage" if step == 1 or recipe == "dpo" else "--reward-zero-stage",)}


def check_stage_flags_agree(step, args, parsed, parser):
    """A ZeRO stage in ``--stepN-args`` replaces the one train.py gives the step, which is the deployment's default
    unless --actor-zero-stage / --reward-zero-stage was given: both given with other values is an error naming both
    (the step's won, and the train.py flag was dropped unsaid)."""
    from dschat.args import flag_groups

    given = getattr(args, "given_zero_stages", {})
    in_step = {dest for dest, _ in flag_groups(parser, step_extra_args(step, args))}
    for dest, train_py_flags in stage_flags_of(step, getattr(args, "recipe", "ppo")).items():
        for flag in train_py_flags:
            if step == 3 and dest == "zero_stage" and STEP3_OWN_STAGE[flag] in in_step:
                continue  # (step 3's own per-model stage outranks its --zero_stage for that model)
            if dest in in_step and flag in given and getattr(parsed, dest) != given[flag]:
                raise UsageError(f"{flag} {given[flag]} and --step{step}-args --{dest} {getattr(parsed, dest)} both "
                                 f"set step {step}'s ZeRO stage: give one ({flag} sets "
                                 f"{TRAIN_PY_STAGE_MODELS[flag]}; --step{step}-args, step {step}'s alone)")


# Step 3's flag of the model each of train.py's ZeRO-stage flags sets.
STEP3_OWN_STAGE = {"--actor-zero-stage": "actor_zero_stage", "--reward-zero-stage": "critic_zero_stage"}
# What each of train.py's ZeRO-stage flags sets (its --help's words).
TRAIN_PY_STAGE_MODELS = {"--actor-zero-stage": "steps 1 and 3's actor (and DPO's models)",
                         "--reward-zero-stage": "step 2's reward model and step 3's critic"}


def _without_extra(args, step):
    import copy

    plain = copy.copy(args)
    setattr(plain, f"step{step}_args", "")
    return plain


def check_step1_answers(flags):
    """Step 1 trains on answers: local data of prompts alone (step 3's) is an error before train.py's run starts,
    said as step 1 says it when it reads its data."""
    from dschat.data.pipeline import check_local_sources_usable

    rank_0_decides(lambda: check_local_sources_usable(flags.data_path, getattr(flags, "sft_only_data_path", []),
                                                      flags.data_split, flags.seed, 1, flags.data_fields or None))


def check_step2_pairs(flags, recipe="ppo"):
    """Step 2 (or DPO) trains on preference pairs: local data with no rejected answers is an error before step 1
    trains, not after."""
    from dschat.data.pipeline import has_no_pairs

    if rank_0_decides(lambda: has_no_pairs(flags.data_path, flags.seed, flags.data_fields or None)):
        what = "DPO" if recipe == "dpo" else "step 2"
        other = "" if recipe == "dpo" else ", or train without it: --recipe grpo"
        raise UsageError(f"{what} trains on preference pairs, and --data_path {' '.join(flags.data_path)} has no "
                         "rejected answers (prompt/completion, messages or unpaired records): give step 2 pairs data "
                         f"(--step2-args \"--data_path ...\"){other}")


def check_step3_prompts(flags, world_size):
    """Step 3's local data makes at least one iteration, read before step 1 trains (its phase-3 share, counted
    before the encoding skips any record: a bound; hub data is counted by step 3)."""
    from dschat.data.pipeline import phase_share_bound
    from dschat.steps.ppo import check_prompts_make_an_iteration

    bound = rank_0_decides(lambda: phase_share_bound(flags.data_path, flags.data_split, flags.seed, 3,
                                                     flags.data_fields or None))  # (read once, not on every rank)
    if bound is not None:
        check_prompts_make_an_iteration(bound, flags, world_size, bound=True)


def earlier_outputs_read(step, steps, args, parsed):
    """(producer, folder) of each model folder of this run that ``step`` reads and an earlier step not run now
    (``steps``) writes."""
    paths = [getattr(parsed, name, None) for name in ("model_name_or_path", "actor_model_name_or_path")]
    if step == 3 and (parsed.advantage_estimator == "gae" or parsed.reward_model_weight):
        paths.append(parsed.critic_model_name_or_path)
    return [(producer, path) for path in filter(None, paths)
            for producer, folder in RECIPE_STEP_FOLDERS[getattr(args, "recipe", "ppo")].items()
            if path == os.path.join(args.output_dir, folder) and producer not in steps]


def check_earlier_outputs(step, steps, args, parsed):
    """A model folder an earlier step writes, when that step is not run now, must already be there and finished:
    otherwise the step would look the folder up on the hub and end in a traceback, or train from the model files an
    interrupted run of that step left."""
    read = earlier_outputs_read(step, steps, args, parsed)
    # (the hint names every earlier step that has no model here: `--step 3` in a new folder lacks steps 1 and 2, and
    # a hint of `--step 1 3` only led to the next error)
    absent = sorted({producer for producer, path in read if not os.path.isfile(os.path.join(path, "config.json"))})
    for producer, path in read:
        together = " ".join(map(str, sorted({producer, *steps})))
        if producer in absent:
            state = "holds no model (no config.json)" if os.path.isdir(path) else "does not exist"
            run = (f"run step{'s' if len(absent) > 1 else ''} {' and '.join(map(str, absent))} too "
                   f"(--step {' '.join(map(str, sorted({*absent, *steps})))}) or first")
        elif reason := unfinished_reason(path):
            state, run = "did not finish", (f"{reason}. Run step {producer} again (--step {together}; with "
                                            "--resume it goes on from its last checkpoint)")
        else:
            say_an_older_dschats_output(step, producer, path, together)
            continue
        raise MissingInputError(f"step {step} reads {path}, step {producer}'s output, which {state}: {run}"
                                + _other_ways(step, producer, args))


def say_an_older_dschats_output(step, producer, path, together):
    """Step ``producer``'s finished output in ``path``, which ``step`` reads as asked (``--step`` without it): one of
    an older dschat, whose step may have trained it otherwise (``older_step_version``), is used, said in one line; one
    of a newer dschat is the error ``train.py --resume`` gives it (``pipeline_resume.older_step_output``)."""
    from dschat.steps.common import STEP_VERSION, older_step_version, read_run_args

    record = read_run_args(path)
    if record is None:  # (a model no step of dschat wrote, as finished: nothing recorded of how it trained)
        return
    older = older_step_version(record.get(STEP_VERSION), record.get("step"), os.path.join(path, RUN_ARGS_FILE),
                               "output", f"Run step {step} with that dschat, or train step {producer} again with this "
                                         f"one (--step {together})", record, path)
    if older:
        print_rank_0(f"note: step {step} reads {path}, step {producer}'s output, as asked: it is {older}, which may "
                     f"have trained it otherwise (--step {together} trains step {producer} again with this dschat)")


def _other_ways(step, producer, args):
    """What else gives a PPO run's step the model an earlier step would have written."""
    if getattr(args, "recipe", "ppo") != "ppo":
        return ""
    if step == 2:  # (step 2 reads step 1's output only on the tiny default: reward_model_from_sft)
        return (" (the tiny default's reward model starts from the SFT model; --reward-model naming another model "
                "than --actor-model starts it from that one)")
    if producer != 2:
        return ""
    from dschat.tiny.presets import is_tiny_preset

    said = ", or give --reward-model a trained reward model folder to score with"
    named = args.reward_model != args.actor_model and not is_tiny_preset(args.reward_model)
    if named:  # (the folder the user gave is no reward model: said what it is)
        what = no_reward_model_said(args.reward_model) if os.path.exists(args.reward_model) else NOT_A_HUB_REWARD_MODEL
        said += f" (--reward-model {args.reward_model} {what})"
    return said


# step 3's policies, by the step that saved them (its training_args.json's "step")
POLICY_OUTPUTS = {"step1": "step 1's output, an SFT policy", "step2_dpo": "DPO's output, a policy",
                  "step3": "step 3's actor, a policy"}


def no_reward_model_said(path):
    """What the folder ``path``, given as --reward-model but no trained reward model, is: a step's policy (step 1's,
    DPO's, step 3's actor) named as such, which a user may give believing it scores."""
    from dschat.steps.common import read_run_args

    folder = os.path.abspath(path)
    record = read_run_args(folder) or (read_run_args(os.path.dirname(folder), "step3")
                                       if os.path.basename(folder) in (ACTOR_DIR, ACTOR_EMA_DIR) else None)
    policy = POLICY_OUTPUTS.get((record or {}).get("step"))
    return f"is {policy}, no trained reward model (no value head)" if policy else \
        "is no trained reward model (no value head)"


# (said of a --reward-model that is no folder here)
NOT_A_HUB_REWARD_MODEL = ("is no folder here, and no hub reward model by its config.json (TRL's one-label "
                          "*ForSequenceClassification, OpenRLHF's, dschat's; DeepSpeed-Chat's is read from a folder: "
                          "download it first; offline, only the hub cache is read)")


def read_hub_cache_only_if_unreachable_for(args):
    """Before train.py starts the launcher: where --actor-model, --reward-model or --data-path names the hub and the
    hub cannot be reached, offline mode (``read_hub_cache_only_if_unreachable``) for the ranks too, which inherit
    it, instead of a probe and a message of each rank's."""
    from dschat.data.raw_datasets import reads_the_hub
    from dschat.models.loading import is_hub_name, read_hub_cache_only_if_unreachable

    # (without --data-path a run of real models trains on DeepSpeed-Chat's hub default: run_pipeline's)
    data_path = args.data_path or ([] if is_tiny_run(args) else [DEEPSPEED_CHAT_DATA])
    hub_data = any(reads_the_hub(spec) for spec in data_path)
    if hub_data or is_hub_name(args.actor_model) or is_hub_name(args.reward_model):
        read_hub_cache_only_if_unreachable()


def check_model_folders(steps, args):
    """--actor-model (step 1 starts from it) and --reward-model (step 2's, recipe ppo; or, named for step 3 without
    step 2, a trained reward model) that cannot load (``check_model_path``): an error naming the flag before step 1
    runs, not a hub lookup's traceback. Also an error: --reward-model with --recipe dpo, or one that is no trained
    reward model with --recipe grpo; PPO's step 3 alone says it scores with step 2's output instead."""
    from dschat.models.loading import check_model_path, check_not_a_reward_model, check_tokenizer_files

    if 1 in steps:
        check_model_path(args.actor_model, "--actor-model")
        check_tokenizer_files(args.actor_model, "--actor-model")  # (step 1 would fail on it after reading the data)
        check_not_a_reward_model(args.actor_model, "--actor-model")  # (step 1's refusal came after loading its data)
    recipe, named = getattr(args, "recipe", "ppo"), args.reward_model != args.actor_model
    if recipe == "dpo" and named:  # (it would turn the tiny recipe off, or load DeepSpeed-Chat's hub data)
        raise UsageError(f"--reward-model {args.reward_model}: --recipe dpo scores with no reward model (DPO learns "
                         "from the preference pairs); leave it out")
    if recipe == "grpo":
        if named and 3 in steps:
            check_model_path(args.reward_model, "--reward-model")
            if not ready_reward_model(args):
                why = no_reward_model_said(args.reward_model) if os.path.exists(args.reward_model) else \
                    NOT_A_HUB_REWARD_MODEL
                raise UsageError(f"--reward-model {args.reward_model} {why}, and --recipe grpo has no step 2 to train "
                                 "one: give a trained one (a folder or a hub name), or leave it out to reward with "
                                 "--reward_fn")
        return
    if 2 in steps:
        check_model_path(args.reward_model, reward_model_flag(args))
    elif 3 in steps and args.reward_model != args.actor_model:  # (a tiny preset too: untrained, it is said)
        check_model_path(args.reward_model, "--reward-model")  # (a mistyped folder would leave step 2's in use)
        if not ready_reward_model(args):  # DeepSpeed-Chat's train.py --step 3 with the full run's flags
            print_rank_0(f"--reward-model {args.reward_model} {no_reward_model_said(args.reward_model)}: "
                         f"step 3 scores with {os.path.join(args.output_dir, RM_DIR)}, step 2's output")


def reward_model_flag(args):
    """The flag to name with --reward-model's value: without --reward-model it is --actor-model's (train.py's
    default), and an error naming --reward-model alone sent a user who gave only --actor-model to a flag not given."""
    return "--reward-model" if args.reward_model != args.actor_model else "--reward-model (default: --actor-model)"


def check_reward_model_tokenizer(steps, args, tiny):
    """Step 3 feeds the actor's token ids, formatted as the actor formats them, to the reward model (and the critic
    made from it): a reward model of another family or format would be refused there, after steps 1 and 2 have
    trained. Checked before step 1."""
    if getattr(args, "recipe", "ppo") == "dpo" or args.reward_model == args.actor_model:
        return
    # step 2 trains from it (the tiny presets share one tokenizer), or step 3 scores with it
    if not (ready_reward_model(args) or (2 in steps and not reward_model_from_sft(args, tiny))):
        return
    from dschat.models.loading import check_tokenizer_files, load_tokenizer
    from dschat.rlhf.engine import check_scores_actor_text

    check_tokenizer_files(args.reward_model, "--reward-model")
    check_scores_actor_text(load_tokenizer(args.actor_model), args.actor_model, load_tokenizer(args.reward_model),
                            args.reward_model, "train.py: --reward-model")


def resume_plan(steps, args, parsed, tiny):
    """{step: Decision}: with ``train.py --resume``, what each step does (decided on rank 0, said); without it, every
    step runs as asked."""
    if not getattr(args, "resume", False):
        return {step: Decision(FRESH) for step in steps}
    from dschat.rlhf.config import step3_args

    own = [step for step in steps if getattr(parsed[step], "resume", False)]
    if own:
        raise UsageError(f"train.py --resume decides which step resumes: leave --resume out of --step{own[0]}-args")
    recipe = getattr(args, "recipe", "ppo")
    # step 3 records its flags completed with their defaults (its per-model ZeRO stages from --zero_stage)
    parsed = {step: step3_args(flags) if step == 3 else flags for step, flags in parsed.items()}
    ready = ready_reward_model(args) is not None
    # (every rank builds them: step 3's asks whether a hub name is a reward model, a meeting of the ranks where the
    # answer is not kept (a lookup that failed), which rank 0 alone, inside rank_0_decides, would make unpaired)
    argvs = {step: step_argv(step, args, tiny) for step in steps}
    # (a step's refusal names the flags as train.py's user typed them, as the step's own errors do)
    plan = rank_0_decides(lambda: plan_steps(steps, recipe, args.output_dir, parsed,
                                             rm_from_sft=reward_model_from_sft(args, tiny),
                                             ready_reward_model=ready,
                                             errors_of=lambda step: says_train_py_flags(step, args, argvs[step])))
    folders = [os.path.join(args.output_dir, RECIPE_STEP_FOLDERS[recipe][step]) for step in steps]
    if not any(os.path.isdir(folder) for folder in folders):  # (a mistyped --output-dir trains everything again)
        print_rank_0(f"train.py --resume: {args.output_dir} holds no earlier run's steps; every step starts afresh")
    for step, decision in plan.items():  # (its flags as train.py's user typed them, as in a refusal)
        line = describe(step, decision, os.path.join(args.output_dir, RECIPE_STEP_FOLDERS[recipe][step]))
        print_rank_0(in_train_py_spelling(line, step, args, argvs[step]))
    return plan


def run_step(main, argv, step, steps, plan, args):
    """One step (returns its metrics); its errors name the flags the user gave train.py as train.py spells them, and a
    step ``train.py --resume`` resumed that cannot resume (its checkpoint's bound flags differ) says how to start it
    afresh and keep the finished steps before it."""
    try:
        with says_train_py_flags(step, args, argv):
            return main(argv)
    except UsageError as error:
        if plan[step].action != RESUME:
            raise
        raise refused_under_train_py(error, step, steps) from None


def run_pipeline(args):
    """Run the requested steps in order and write the report; returns the report dict."""
    from dschat.data.raw_datasets import HUB_CACHES, HUB_COPIES, reads_kept
    from dschat.report import write_unfinished_report
    from dschat.steps import dpo, ppo, reward, sft

    ensure_distributed()
    check_model_folders(recipe_steps(getattr(args, "recipe", "ppo"), args.step)[0], args)  # (what is_tiny_run reads)
    tiny = is_tiny_run(args)
    if not tiny and not args.data_path:
        args.data_path, args.data_path_defaulted = [DEEPSPEED_CHAT_DATA], True
        print_rank_0(f"--data-path not given: {DEEPSPEED_CHAT_DATA}, DeepSpeed-Chat's default (the embedded tiny data "
                     "is the tiny presets' default; --data-path tiny trains on it)")
    if tiny:
        # build the presets once, before any step, so every step loads them with from_pretrained
        resolve_model_path(args.actor_model)
        resolve_model_path(args.reward_model)
    recipe = getattr(args, "recipe", "ppo")
    parsers = {1: (sft.main, "step1"), 2: (dpo.main, DPO_DIR) if recipe == "dpo" else (reward.main, "step2"),
               3: (ppo.main, "step3")}
    parsers = {step: (*run, step_parser(step, recipe)) for step, run in parsers.items()}  # (step_argv's parsers too)
    steps, not_run = recipe_steps(recipe, args.step)
    say_left_out_steps(args, steps, not_run)
    # the steps run in this process: a local copy under a hub name, or a hub dataset read offline from the caches, that
    # the pre-flight loaded is the steps' too (its Arrow tables are memory-mapped, not held in memory)
    with reads_kept(HUB_COPIES, HUB_CACHES):
        parsed = check_step_args(steps, args, tiny, {step: parser for step, (_, _, parser) in parsers.items()})
        check_writable_folder(args.output_dir, "--output-dir")
        plan = resume_plan(steps, args, parsed, tiny)
        ready = ready_reward_model(args)
        say_recipe_notes(args, recipe, steps, tiny, ready)
        if is_rank_0():
            write_unfinished_report(args.output_dir, recipe, steps, ready)
        timings = run_steps(args, steps, plan, parsers, tiny)
    from dschat.data.raw_datasets import is_tiny_data

    # the rule scorer knows only the embedded data (by its name, or its shipped files' paths): the DPO step's own, as
    # its --step2-args may give it another --data_path than train.py's
    dpo_on_embedded_data = recipe == "dpo" and 2 in steps and tiny and is_tiny_data(parsed[2].data_path)
    rule_scores = held_out_rule_scores(args, parsed[2]) if dpo_on_embedded_data else None
    if not is_rank_0():
        return None
    if rule_scores:
        keep_rule_scores_with_the_dpo_model(args.output_dir, rule_scores)
    return final_report(args, recipe, steps, plan, parsers, timings, tiny, ready, rule_scores)


def say_left_out_steps(args, steps, not_run):
    """What the recipe and --step leave out, and --stepN-args given for a step not run: said, not silently dropped."""
    for note in not_run:
        print_rank_0(f"not run: {note}")
    for step in (1, 2, 3):
        given = getattr(args, f"step{step}_args", "")
        if given and step not in steps:
            print_rank_0(f"--step{step}-args {given!r}: ignored, step {step} is not run (--step, --recipe)")
    for step in steps:
        if getattr(args, "data_fields", None) and reads_own_data_without_fields(step, args):
            print_rank_0(f"--data-fields {args.data_fields}: not given to step {step}, whose --step{step}-args give "
                         "its own --data_path (they name --data-path's fields; give the step's own --data_fields "
                         f"in --step{step}-args if its files need them)")
    for flag in getattr(args, "unread_stage_flags", ()):  # (train.py's parse_args)
        print_rank_0(f"{flag}: ignored, no step this run runs reads it (--step {' '.join(map(str, steps))})")


def say_recipe_notes(args, recipe, steps, tiny, ready):
    """What a tiny run's recipe does to the user's data, and where step 3's reward model comes from."""
    if tiny and args.data_path and args.data_path != ["tiny"]:
        print_rank_0("tiny run: the tiny recipe (TINY_RECIPE in dschat/pipeline.py: --data_split 4,4,2, fp32, its "
                     "batch sizes and learning rates) applies to your --data-path too; --stepN-args flags replace its "
                     "values (e.g. --step3-args \"--per_device_generation_batch_size 4\" for few prompts)")
    if ready:
        from dschat.models.loading import critic_given_as_reward_model

        # (step 3's critic has a reward model's files, not its training: not called one, but used as given)
        critic = critic_given_as_reward_model(ready)
        said = f"warning: --reward-model {critic}; as given," if critic else \
            f"--reward-model {ready} is a trained reward model:"
        print_rank_0(f"{said} step 3 scores with it" + (" (GRPO: instead of --reward_fn)" if recipe == "grpo" else
                                                       " and starts its critic from it (no step 2 in this run)"))
    if tiny and 2 in steps and recipe == "ppo" and not reward_model_from_sft(args, tiny) and not ready:
        print_rank_0(f"tiny run: step 2 trains --reward-model {args.reward_model} from its own start (without "
                     "--reward-model, as the actor's preset, it starts from the SFT model: docs/tiny_default.md)")


def run_steps(args, steps, plan, parsers, tiny):
    """Each step of the plan not skipped, in order (resumed where the plan says); returns {step name: seconds}."""
    timings = {}
    for step in steps:
        main, name, _ = parsers[step]
        if plan[step].action == SKIP:
            continue
        argv = step_argv(step, args, tiny) + (["--resume"] if plan[step].action == RESUME else [])
        print_rank_0(f"==== {name}: {' '.join(shlex.quote(a) for a in argv)}")
        started = time.time()
        metrics = run_step(main, argv, step, steps, plan, args)
        # a resumed step's own clock counts its interrupted run's time too (up to the checkpoint it resumed from)
        timings[name] = metrics["seconds"] if plan[step].action == RESUME and metrics else time.time() - started
    return timings


def final_report(args, recipe, steps, plan, parsers, timings, tiny, ready, rule_scores):
    """Rank 0: the run's report written and its summary printed; returns the report dict."""
    from dschat.report import summary_lines, write_report

    skipped = [parsers[step][1] for step in steps if plan[step].action == SKIP]  # (finished, so this run's)
    resumed = [parsers[step][1] for step in steps if plan[step].action == RESUME]
    # the steps that trained now leave the later steps' folders an older output's; a skipped step's output is the
    # present one, and a left-out step's folder counts if it was made from the present outputs
    trained = [step for step in steps if plan[step].action != SKIP]
    rm_from_sft = reward_model_from_sft(args, tiny)
    outdated = outdated_outputs(steps, recipe, args.output_dir, rm_from_sft, bool(ready))
    report = write_report(args.output_dir, timings, recipe, trained, rm_from_sft=rm_from_sft, skipped=skipped,
                          resumed=resumed, reward_model=ready, rule_scores=rule_scores, outdated=outdated)
    for line in summary_lines(report):
        print(line, flush=True)
    print(f"report: {os.path.join(args.output_dir, REPORT_FILE)}", flush=True)
    return report


def held_out_rule_score_settings():
    """Step 3's flags (parsed) that ``held_out_rule_scores`` evaluates with: the tiny recipe's data split, prompt and
    answer lengths and generation batch size (ppo_eval takes them to score such a run's policies as its report did)."""
    from dschat.args import step3_parser

    return step3_parser().parse_args(TINY_RECIPE[3])


def held_out_rule_score_eval_flags():
    """eval.py's flags that score a policy as ``held_out_rule_scores`` does: every held-out prompt, with step 3's
    tiny-recipe prompt and answer lengths and generation batch size."""
    step3 = held_out_rule_score_settings()
    return {"num_prompts": 0, "max_prompt_seq_len": step3.max_prompt_seq_len,
            "max_new_tokens": step3.max_answer_seq_len,
            "per_device_generation_batch_size": step3.per_device_generation_batch_size}


# The keys of the DPO model's metrics.json that hold the recipe's held-out rule scores and eval.py's flags for them.
RULE_SCORE_KEY, RULE_SCORE_FLAGS_KEY = "held_out_rule_score", "held_out_rule_score_flags"


def keep_rule_scores_with_the_dpo_model(output_dir, scores):
    """The DPO recipe's held-out rule ``scores``, and the eval.py flags they were taken with, added to the DPO model's
    metrics.json (rank 0): eval.py reads the flags there, with the model, to score it as the report did; report.json
    alone was replaced by a later train.py run in the same folder (a PPO run's --resume), and eval.py then scored the
    DPO policy with its own defaults. (No metrics.json, no finished DPO model: none is written, which would mark
    one.)"""
    from dschat.run_layout import FINISHED_MARK
    from dschat.utils.files import read_json_object, write_json_atomic

    path = os.path.join(output_dir, DPO_DIR, FINISHED_MARK)
    metrics = read_json_object(path)
    if metrics is not None:
        write_json_atomic(path, {**metrics, RULE_SCORE_KEY: scores,
                                 RULE_SCORE_FLAGS_KEY: held_out_rule_score_eval_flags()})


def dpo_data_flags(dpo_flags):
    """The DPO step's flags (``dpo_flags``, parsed) that eval.py takes from a DPO run to choose and read its held-out
    prompts (``DPO_DATA_FLAGS``: its --data_path, the shares of the data DPO's own split keeps apart, its field names,
    padding and --add_eot_token), so that the report scores the prompts eval.py scores. Its --data_path is the step's:
    train.py's --data-path (the embedded data by its files' paths may be only some of them, e.g. its train.jsonl), or
    one its --step2-args give (train.py's was scored then: phase 3 of other data than DPO's, which eval.py does not
    score and which may hold records DPO trained on)."""
    from dschat.tools.ppo_eval import DPO_DATA_FLAGS

    return {name: getattr(dpo_flags, name) for name in DPO_DATA_FLAGS}


def held_out_rule_scores(args, dpo_flags=None):
    """{"sft": scores, "dpo": scores}, each {"rule_score", "prompts", "empty_answers"}: the bundled rule score of
    greedy answers to step 3's held-out prompts (the tiny data only), phase 3 of the DPO step's own --data_path,
    --data_split and --seed, read with its --data_fields, --pad_to_multiple_of and --add_eot_token
    (``dpo_data_flags``; ``dpo_flags``, its parsed flags; default the tiny recipe's), which neither DPO nor its SFT
    model trained on and which eval.py scores a DPO policy on, read as eval.py reads them (the tiny recipe's split with
    another --step2-args split took some of DPO's records, and eval.py other prompts than the report's), so the report
    shows what DPO did to generation, not only to the ranking of given answers, and how many answers are empty (a
    policy that ends them at once scores 0, unexplained by the mean). The prompts are loaded once for both policies
    (DPO keeps its SFT model's tokenizer). Every rank evaluates its share of the prompts (the means are over all
    ranks)."""
    from dschat.models.loading import stop_token_ids
    from dschat.rlhf.evaluation import evaluate_policy, hf_generate, rule_scorer_for
    from dschat.steps.ppo import held_out_loader_once
    from dschat.tools.common import load_policy

    step3 = held_out_rule_score_settings()  # step 3's data split, prompt and answer lengths on the tiny default
    data = dpo_data_flags(dpo_flags or step3)
    add_eot_token = data.pop("add_eot_token")
    scores, loaders = {}, {}
    for name, folder in (("sft", SFT_DIR), ("dpo", DPO_DIR)):
        path = os.path.join(args.output_dir, folder)
        model, tokenizer = load_policy(path, local_device(), add_eot_token=add_eot_token)
        held_out, _ = held_out_loader_once({**data, "max_prompt_seq_len": step3.max_prompt_seq_len,
                                            "per_device_generation_batch_size": step3.per_device_generation_batch_size,
                                            "actor_model_name_or_path": path,
                                            "data_output_path": os.path.join(args.output_dir, "data_cache")},
                                           tokenizer, loaders)
        result = evaluate_policy(hf_generate(model, tokenizer), None, tokenizer, held_out, model.device,
                                 step3.max_answer_seq_len, rule_scorer_for(data["data_path"]),
                                 eos_token_id=stop_token_ids(model, tokenizer))  # (as eval.py and step 3 stop)
        scores[name] = {"rule_score": result["rule_score_mean"], "prompts": result["prompts"],
                        "empty_answers": result["empty_answers"]}
    return scores
