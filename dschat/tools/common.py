"""What the tools share: finding a run's models, the device, loading a policy or reward model, CLI flags."""
import argparse
import functools
import os
import sys

import torch

from dschat.args import check_sampling_flags, positive_int, seed_int, top_k_flag
from dschat.errors import MissingInputError, UsageError
from dschat.models.loading import (check_no_interrupted_save, check_not_a_file, check_not_a_reward_model, looks_local,
                                   missing_folder_message, not_a_model_folder, unfetchable_hub_name,
                                   unknown_tiny_preset)
from dschat.models.positions import context_limit
from dschat.run_layout import (ACTOR_DIR, DPO_DIR, PPO_ACTOR_DIR, PPO_DIR, REPORT_FILE, RM_DIR, SFT_DIR,
                               unfinished_reason)
from dschat.tiny.presets import is_tiny_preset
from dschat.utils.cli import say_once

# Where ``train.py`` puts each step's policy under its output folder, best first. One output folder may hold a PPO
# actor and a DPO policy trained after it (train.py --recipe dpo), or the reverse: the last run's report.json names
# its policy ("policy"), and that one is taken when it is there.
POLICY_SUBFOLDERS = (PPO_ACTOR_DIR, ACTOR_DIR, DPO_DIR, SFT_DIR)
REWARD_SUBFOLDERS = (RM_DIR,)
# what chat.py and prompt_eval say of an answer with no text, which they printed as a blank line
EMPTY_ANSWER = "an empty answer: the model ended it before any text"


def empty_answer_note(answer, cut):
    """``EMPTY_ANSWER`` for an ``answer`` with no text that the model ended; None for one with text, or one ``cut`` at
    --max_new_tokens (whitespace alone so far): the model did not end that one, which the cut note says."""
    return EMPTY_ANSWER if not answer.strip() and not cut else None


def one_process(main):
    """A tool's ``main``, refused under a launcher of several ranks (``deepspeed --num_gpus 2 eval.py``): the tools do
    not split their work over ranks, so each rank ran the whole tool and printed (and wrote) its results again."""
    @functools.wraps(main)
    def in_one_process(argv=None):
        from dschat.utils.dist import launched_ranks

        ranks = launched_ranks()  # (mpirun's and srun's ranks have no WORLD_SIZE: each ran the tool whole)
        if ranks > 1:
            raise UsageError(f"{os.path.basename(sys.argv[0])} runs in one process: start it with python, not a "
                             f"launcher of {ranks} ranks (each would run it whole)")
        return main(argv)
    return in_one_process


def check_stdout_open(results, instead=""):
    """A tool started with its standard output closed (`>&-`) is refused before any model loads: Python then has no
    ``sys.stdout`` and ``print`` writes nowhere, so ``results`` were lost with exit status 0 (interactive chat ended in
    "RuntimeError: input(): lost sys.stdout"). ``instead``: what else the tool can do, said after."""
    if sys.stdout is None:
        raise UsageError(f"no standard output to print {results} to (it is closed): send it to a terminal, file or "
                         f"pipe{instead}")


def run_report(path):
    """The report the last train.py run wrote in the folder ``path`` ({}: none, or ``path`` is no folder)."""
    from dschat.utils.files import read_json_object

    # (a damaged or hand-edited file: an error naming it, not json's traceback)
    return read_json_object(os.path.join(os.path.expanduser(path), REPORT_FILE)) or {}


def reported_policy(path, report=None):
    """The policy subfolder the last train.py run in ``path`` reported as its result, if any; ``report``: its
    ``run_report``, where the caller has read it already."""
    return _policy_in(run_report(path) if report is None else report)


def _policy_in(report):
    """The policy subfolder a run's ``report`` names as its result, if it is one of ``POLICY_SUBFOLDERS``."""
    policy = report.get("policy")
    return policy if policy in POLICY_SUBFOLDERS else None


def _model_folder(path, subfolders, reported=None):
    """``path``'s ``reported`` subfolder, else the first of ``subfolders`` that holds a model; ``path`` itself when
    it is a model folder or a hub name."""
    path = os.path.expanduser(path)  # a --path=~/x the shell left as it is
    check_not_a_file(path)
    for sub in ([reported] if reported else []) + list(subfolders):
        candidate = os.path.join(path, sub)
        # (a save killed between the renames of its folder swap leaves no folder there, its model whole beside it:
        # the next of the run's folders was taken in its place, unsaid, e.g. the SFT model for the PPO actor)
        check_no_interrupted_save(candidate)
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return candidate
    if os.path.isdir(path) and not_a_model_folder(path):
        raise MissingInputError(not_a_model_folder(path, "a model folder (config.json) or a train.py output folder "
                                                         f"holding one of {', '.join(subfolders)}")
                                + steps_without_a_model_yet(path, subfolders))
    if not os.path.exists(path) and looks_local(path):
        raise MissingInputError(missing_folder_message(path))  # ("did you mean ...?" for a mistyped step folder)
    if unknown := unknown_tiny_preset(path):  # (not a minute of hub retries offline, then the hub's error)
        raise MissingInputError(unknown)
    if unfetchable := unfetchable_hub_name(path):  # (a mistyped hub name, the hub unreachable: likewise)
        raise MissingInputError(unfetchable)
    return path


def steps_without_a_model_yet(path, subfolders):
    """"; ..." naming each step folder, ``path`` itself or the one of each of ``subfolders``, that a step's
    unfinished first run left without a model (its training_args.json, no model saved yet), else "": an interrupted
    train.py's run folder was said to hold none of them while its step1_sft stood there."""
    step_folders = [path] + [os.path.join(path, sub.split("/")[0]) for sub in subfolders if sub != ACTOR_DIR]
    waiting = [folder for folder in dict.fromkeys(step_folders) if unfinished_reason(folder)]
    return "".join(f"; {folder} holds no model yet: its step was interrupted, or is still training (--resume, "
                   "train.py's or the step's, continues it from its last checkpoint where it saved one)"
                   for folder in waiting)


def find_policy_path(path, report=None):
    """A run's output folder -> the policy its last train.py run reported, else its PPO actor, DPO policy or SFT
    model, in that order (an unfinished run's SFT model first: ``policy_fallbacks``); a model folder or hub name as
    is. A reward model is refused here, before any model loads:
    ppo_eval and prompt_eval refused one given as their second model only after the first one's answers.
    ``report``: ``path``'s ``run_report``, where the caller has read it already (``flag_path_and_report``)."""
    if report is None:
        report = run_report(path)  # (read once, for the three uses below)
    reported, unfinished = _policy_in(report), bool(report.get("unfinished"))
    check_reported_policy_there(path, reported, unfinished)
    found = _model_folder(path, policy_fallbacks(reported, unfinished), reported)
    check_not_a_reward_model(found)
    return found


def model_run_record(path):
    """(the training_args.json record of the step run that saved the model folder ``path``, that file's path), else
    (None, None): the folder's own (step 1's, step 2's, DPO's), else, for step 3's actor or its EMA copy, the step-3
    folder's above it. A hub name or a notebook's save has none."""
    from dschat.run_layout import ACTOR_EMA_DIR, RUN_ARGS_FILE
    from dschat.steps.common import read_run_args

    folder = os.path.abspath(os.path.expanduser(path))
    step_folder = [os.path.dirname(folder)] if os.path.basename(folder) in (ACTOR_DIR, ACTOR_EMA_DIR) else []
    for each in (folder, *step_folder):
        if (run := read_run_args(each)) is not None:
            return run, os.path.join(each, RUN_ARGS_FILE)
    return None, None


def policy_fallbacks(reported, unfinished):
    """The subfolders of a run folder taken, in order, where its ``reported`` policy holds no model: an
    ``unfinished`` train.py run's (not written yet) falls back to its SFT model, which every recipe starts from, first;
    the fixed order took another recipe's policy there, an earlier run's (a PPO actor made from the SFT model that a
    --recipe dpo run's step 1 had since replaced), where its report named its own policy to keep the tools off those.
    (An earlier run's policy is still taken, warned of, where the SFT model holds none either.)"""
    if reported and unfinished:
        return (SFT_DIR, *(sub for sub in POLICY_SUBFOLDERS if sub != SFT_DIR))
    return POLICY_SUBFOLDERS


def check_reported_policy_there(path, reported, unfinished):
    """The policy a finished train.py run reported (``reported``: its subfolder of ``path``) holds a model. Where it was
    gone (removed, copied in part), the next of the run's folders was taken in its place, said by its path alone:
    chat.py and eval.py answered with step1_sft as the run's result, as find_reward_model_path refuses to do for a
    reported reward model. (An unfinished run's policy may not be written yet: its SFT model is taken
    first (``policy_fallbacks``), warned of: ``unfinished``, as its report says.)"""
    folder = os.path.expanduser(path)
    if not reported or unfinished or os.path.isfile(os.path.join(folder, reported, "config.json")):
        return
    check_no_interrupted_save(os.path.join(path, reported))  # (why it holds none: a save killed mid-swap)
    raise MissingInputError(f"{path}: its last train.py run's policy, {os.path.join(path, reported)} ({REPORT_FILE}), "
                            "holds no model now: restore it, or give the model folder to load")


def flag_path(flag, find, value):
    """``find(value)`` (``find_policy_path``, ``find_reward_model_path``); a model it refuses (missing, a reward model
    for a policy) is said with its flag, an unfinished step's (``unfinished_reason``) is warned of."""
    return flag_path_and_report(flag, find, value)[0]


def flag_path_and_report(flag, find, value):
    """(``flag_path``, ``value``'s ``run_report``): the report read once, for ``find``, the warning of an unfinished
    run and the caller (ppo_eval's choice of the run whose flags it takes)."""
    if not value.strip():  # (e.g. --path "$OUT" with OUT unset: a hub lookup of '' that named no flag)
        raise UsageError(f"{flag} {value!r}: an empty path (an unset shell variable?): give a model folder, a run's "
                         "output folder or a hub name")
    try:
        report = run_report(value)
        path = find(value, report)
    except UsageError as err:  # (a missing folder, a reward model given as a policy, a damaged report.json, ...)
        raise type(err)(f"{flag} {err}") from err
    if reason := unfinished_reason(path):
        say_once(f"warning: {flag} {path}: {reason}")  # (once: --baseline may name --policy's model again)
    elif report.get("unfinished"):  # (a run folder's: a model folder or hub name has no report)
        say_once(f"warning: {flag} {value}: its last train.py run did not finish ({REPORT_FILE} says so): {path} may "
                 "be from before it")
    return path, report


def find_reward_model_path(path, report=None):
    """A run's output folder -> the reward model its step 3 scored with (the one train.py was given, else its step-2
    folder); a model folder or a hub name as is (a hub model's value head is checked once it has loaded).
    ``report``: ``path``'s ``run_report``, where the caller has read it already (``flag_path_and_report``)."""
    if report is None:
        report = run_report(path)
    given = report.get("reward_model")  # (a folder's absolute path, or a hub name)
    if given is not None and not isinstance(given, str):  # (a hand-edited file: not os.path's TypeError)
        raise UsageError(f"{os.path.join(path, REPORT_FILE)}: its \"reward_model\" is {given!r}, not a path or hub "
                         "name: mend it, or give the reward model's folder")
    if given and os.path.isabs(given) and not os.path.isfile(os.path.join(given, "config.json")):
        raise MissingInputError(f"{path}: its step 3 scored with the reward model {given} (report.json), which holds "
                                "no model now: give a reward model folder")
    found = given or _run_reward_model_folder(path)
    # (a hub model's head is checked once it has loaded; a tiny preset has no head, said here with the flag, before
    # ppo_eval's policy loads and answers)
    if os.path.isdir(os.path.expanduser(found)) or is_tiny_preset(found):
        check_reward_model(found)
    return found


def _run_reward_model_folder(path):
    """``path``'s step2_rm, else ``path`` itself (``_model_folder``); a run whose step 3 was rewarded by a reward
    function alone (GRPO's recipe: --reward_model_weight 0) is said to have none, not to lack a step2_rm, and step 3's
    own output folder names what its step 3 scored with."""
    try:
        return _model_folder(path, REWARD_SUBFOLDERS)
    except MissingInputError:
        folder = os.path.expanduser(path)
        if (step3 := _step3_run(folder)) is not None and (said := _step3_folders_scoring(path, step3)):
            raise MissingInputError(said) from None
        function = _reward_fn_alone(_step3_run(os.path.join(folder, PPO_DIR)))
        if function is None:
            raise
        raise MissingInputError(f"{path}: {_no_reward_model(function)}") from None


def _step3_run(folder):
    """The training_args.json that step 3 wrote in ``folder`` (with its flags), else None; a damaged record too: the
    folder's own error, no model, says enough."""
    from dschat.steps.common import read_run_args

    try:
        run = read_run_args(folder, "step3")
    except UsageError:  # (a damaged record)
        return None
    return run if run is not None and isinstance(run.get("flags"), dict) else None


def _step3_folders_scoring(path, run):
    """What step 3's output folder ``path`` (its training_args.json ``run``) holds and what its step 3 scored with
    instead, else None: rw_eval given step3_ppo said only that it held no step2_rm, a critic-free run's even once a
    critic's named the reward model."""
    from dschat.steps.common import record_cwd
    from dschat.utils.files import path_under

    flags = run["flags"]
    estimator = flags.get("advantage_estimator") or "gae"
    holds = "its actor and critic" if estimator == "gae" else f"its actor: a critic-free {estimator} run"
    here = f"{path}: step 3's output folder ({holds}), not a reward model"
    given = flags.get("reward_model_name_or_path") or flags.get("critic_model_name_or_path")
    if isinstance(given, str) and flags.get("reward_model_weight", 1.0):
        folder = os.path.expanduser(path)  # (the record's: its relative paths read from ``record_cwd``)
        return (f"{here}: its step 3 scored with {path_under(record_cwd(run, folder), given) or given}; give that, "
                f"or the run's output folder {os.path.dirname(os.path.abspath(folder))}")
    function = _reward_fn_alone(run)
    return f"{here}: {_no_reward_model(function)}" if function is not None else None


def _reward_fn_alone(run):
    """The reward function (as recorded) of the step 3 whose training_args.json is ``run`` (None: none) when it scored
    with it and no reward model, else None."""
    flags = (run or {}).get("flags") or {}
    if not flags.get("reward_fn") or flags.get("reward_model_weight", 1.0):
        return None
    return str(flags["reward_fn"]).strip("<>")  # (recorded_reward_fn's marker of a Python object)


def _no_reward_model(function):
    return (f"its step 3 was rewarded by the reward function {function} alone (--reward_model_weight 0), so the run "
            "has no reward model: give a reward model folder (step 2's output); ppo_eval scores the run's policy with "
            "its reward function without one")


def check_reward_model(path):
    """A folder or hub name without a trained value head is an error: its scores, from a new random head, mean
    nothing. Step 3's critic is warned of: saved with a reward model's files, it scored as one, unsaid, though its head
    learned PPO's value estimates rather than step 2's rewards. A hub name's files are fetched once, for the head
    (``hub_model_folder`` keeps them): the critic check reads the same files, no request of its own."""
    from dschat.models.loading import critic_given_as_reward_model
    from dschat.models.reward_model import VALUE_HEAD_FILES, has_trained_value_head

    if not has_trained_value_head(path):
        raise UsageError(f"{path}: not a reward model (no {VALUE_HEAD_FILES}): pass step 2's output folder, "
                         f"e.g. train.py's <output>/step2_rm")
    if critic := critic_given_as_reward_model(path):  # (a hub name's too: its reward_model.json "role")
        say_once(f"warning: {critic}")


def check_room_for_a_prompt(config, max_new_tokens, model="the model"):
    """--max_new_tokens that fill the model's whole context leave no room for any prompt: refused once, before the
    model loads where its config can be read alone (chat.py's interactive mode refused each message in turn, the
    same "leaves room for 0", and prompt_eval said so after loading its models)."""
    limit = context_limit(config) if config is not None else None
    if limit and max_new_tokens >= limit:
        raise UsageError(f"--max_new_tokens {max_new_tokens}: {model}'s context is {limit} tokens, which leaves no "
                         f"room for a message: give well under {limit}")


def config_before_loading(path):
    """The HF config of ``path`` (a folder, hub name or tiny preset) before its model loads; None where transformers
    cannot read it alone (the loaded model's is read then)."""
    from transformers import AutoConfig

    from dschat.models.loading import resolve_model_path

    try:
        return AutoConfig.from_pretrained(resolve_model_path(path))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def parse_with_run_defaults(parser, argv, run_defaults, tool, goes_with=None):
    """``argv`` parsed with the settings of the run that wrote the model as the defaults of the flags not given (flags
    given here win), said in one line. ``run_defaults(args)`` gives ({dest: value}, the training_args.json they come
    from) for the arguments parsed without them ({} for none). ``goes_with``: {dest: other dest} whose run value is
    taken only when the other is not given here (the run's --data_fields name the run's --data_path's fields)."""
    args = parser.parse_args(argv)
    defaults, source = run_defaults(args)
    given = given_dests(parser, argv)  # (a flag given with its default's value wins too)
    taken = {name: value for name, value in defaults.items() if name not in given and value != parser.get_default(name)
             and (goes_with or {}).get(name) not in given}
    if not taken:
        return args
    parser.set_defaults(**taken)
    flags = [f"--{name}" if value is True else
             f"--{name} {' '.join(map(str, value)) if isinstance(value, list) else value}"
             for name, value in taken.items()]
    print(f"[{tool}] from {source} (flags given here win): {' '.join(flags)}")
    return parser.parse_args(argv)


def parse_with_model_run_defaults(parser, argv, flag, find, run_defaults, tool, goes_with=None):
    """``parse_with_run_defaults`` where the run is the one that wrote the model ``flag`` names: the model is looked up
    once (``flag_path_and_report`` with ``find``), ``run_defaults(args, (path, report))`` given that lookup, and the
    flag's value returned is the model's path (a run folder resolved). ppo_eval and rw_eval looked it up again after
    their run defaults had, reading its report.json again (and checking a reward model's value head again)."""
    lookups = []

    def defaults_of_the_models_run(args):
        lookups.append(flag_path_and_report(flag, find, getattr(args, flag_dest(parser, flag))))
        return run_defaults(args, lookups[0])

    args = parse_with_run_defaults(parser, argv, defaults_of_the_models_run, tool, goes_with)
    setattr(args, flag_dest(parser, flag), lookups[0][0])
    return args


def flag_dest(parser, flag):
    """The attribute ``parser`` stores ``flag``'s value in."""
    return parser._option_string_actions[flag].dest


def given_dests(parser, argv):
    """The destinations ``argv`` sets, whatever their values: parsed by a copy of ``parser`` that has no defaults."""
    import copy

    bare = copy.deepcopy(parser)
    bare._defaults.clear()  # (those of set_defaults)
    for action in bare._actions:
        action.default = argparse.SUPPRESS
        action.required = False
    return set(vars(bare.parse_args(argv)))


def check_utf8(text, what):
    """``text`` as given (a flag, a line of stdin), checked to be text the tokenizer can take: bytes that are not UTF-8
    (a Latin-1 terminal or file) reach Python as lone surrogates, on which the tokenizer failed with "TypeError:
    TextEncodeInput must be Union[...]" after the model had loaded (ending an interactive chat)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        byte = f" (byte 0x{code - 0xDC00:02x})" if 0xDC80 <= code <= 0xDCFF else ""
        raise UsageError(f"{what} is not UTF-8 text{byte} at character {error.start + 1}: give it in UTF-8 (e.g. "
                         "a file converted with iconv -t UTF-8)") from None
    return text


def tool_prompt(messages, tokenizer, model):
    """``format_prompt`` of a prompt given to a tool; one that ``model``'s chat template refuses (Gemma's "System role
    not supported", roles that do not alternate) is a UsageError naming the prompt, as a training record is named
    (``data.pipeline.rendered_prompt``), not jinja's traceback once the models have loaded (and answered)."""
    from dschat.data.errors import RecordError
    from dschat.data.pipeline import rendered_prompt

    try:
        return rendered_prompt(messages, tokenizer)
    except RecordError as err:
        roles = ", ".join(message["role"] for message in messages)
        raise UsageError(f"the prompt of turns {roles}, for {model}: {err.detail}") from None


def default_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def non_empty_path(text):
    """argparse type of a file flag: an empty one (``--prompts_file "$DATA"`` with DATA unset) was taken as not given,
    and the tool read the embedded data (or saved no results), unsaid."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?)")
    return text


def add_loading_args(parser):
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                        help="Weights' dtype (default: as saved).")
    parser.add_argument("--add_eot_token", action="store_true",
                        help="Add <|endoftext|> as EOS for tokenizers without one (as in training).")


def add_generation_args(parser, sample_by_default, max_new_tokens=128):
    """--max_new_tokens, --temperature, --top_k, --top_p and --greedy/--do_sample (one default per tool)."""
    g = parser.add_argument_group("generation")
    g.add_argument("--max_new_tokens", type=positive_int, default=max_new_tokens,
                   help="Answer length in tokens, at most (default: %(default)s).")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="In [1e-30, 1e30] (default: %(default)s; --greedy: argmax decoding).")
    g.add_argument("--top_k", type=int, default=0, help="0 (default) or negative: no top-k filtering.")
    g.add_argument("--top_p", type=float, default=1.0, help="In (0, 1]; 1 (default): no nucleus filtering.")
    # (each says whether it is this tool's default: chat.py samples, prompt_eval is greedy, and neither help said so)
    default = " (default)"
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--greedy", dest="do_sample", action="store_false",
                      help="Greedy decoding" + ("." if sample_by_default else f"{default}."))
    mode.add_argument("--do_sample", dest="do_sample", action="store_true",
                      help="Sample (temperature/top-k/top-p)" + (f"{default}." if sample_by_default else "."))
    g.add_argument("--seed", type=seed_int, default=None, help="Seed for sampling.")
    parser.set_defaults(do_sample=sample_by_default)
    return g


def check_generation_flags(args):
    """The sampling flags checked (a greedy decoding's unused ones said): a tool calls this before any model loads, as
    chat.py's --temperature 0 was refused only once the model had loaded (minutes for a large one)."""
    if args.do_sample:
        check_sampling_flags(args.temperature, args.top_p)
    else:
        say_unused_sampling_flags(args)


def generation_kwargs(args):
    """HF ``generate`` keyword arguments from the generation flags."""
    check_generation_flags(args)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    if args.do_sample:
        kwargs.update(temperature=args.temperature, top_k=top_k_flag(args.top_k), top_p=args.top_p)
    return kwargs


def say_unused_sampling_flags(args):
    """Sampling flags given to a greedy decoding (a tool's default, or --greedy) change nothing: said once. A --top_k
    of 0 or below is no filtering (``top_k_flag``), as is the default: nothing to say. --seed seeds only sampling
    (greedy answers are the same whatever it is): given with --greedy it was taken in silence."""
    # (prompt_eval's --seed also chooses the held-out rows it reads, ``held_out_seed``: not "no effect" there)
    seed_reads_data = getattr(args, "held_out_seed", None) is not None
    sampling = {"temperature": args.temperature != 1.0, "top_k": top_k_flag(args.top_k) != 0,
                "top_p": args.top_p != 1.0, "seed": args.seed is not None and not seed_reads_data}
    given = [f"--{name} {getattr(args, name)}" for name, changes in sampling.items() if changes]
    if given:
        say_once(f"warning: {', '.join(given)}: no effect on greedy decoding (add --do_sample to sample)")


def load_policy(path, device=None, dtype=None, add_eot_token=False):
    """(causal LM in eval mode on ``device``, its left-padding tokenizer) for a folder, hub name or preset.

    Left padding so every row of a batch starts generating at the same column.
    """
    from dschat.models.loading import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(path, padding_side="left", add_eot_token=add_eot_token)
    model = load_causal_lm(path, tokenizer, dtype=dtype)
    return model.to(device or default_device()).eval(), tokenizer


def load_scoring_reward_model(path, tokenizer, device=None, dtype=None):
    """The trained reward model at ``path`` (a folder or hub name of a layout ``is_reward_model_folder`` knows) in
    eval mode, its embeddings grown to ``tokenizer`` as in training; an OpenRLHF model's scores normalized as saved."""
    from dschat.models.reward_model import load_reward_model

    check_reward_model(path)
    model = load_reward_model(path, tokenizer=tokenizer, dtype=dtype)
    if model.score_normalization:
        say_once("[dschat] the reward model {} scores as it was saved (normalized, as OpenRLHF's normalize_reward): (score - {:.4g}) "
                 "/ {:.4g}".format(path, *model.score_normalization))
    return model.to(device or default_device()).eval()

