"""Step-3 check: held-out reward (and rule score, on the embedded data) of a policy and of a baseline.

The held-out prompts, their loader and the scoring are step 3's own (``prompt_loaders``, ``evaluate_policy``):
with step 3's data flags (``--data_path --data_split --seed --max_prompt_seq_len --pad_to_multiple_of``, batch size,
``--num_prompts`` = ``--eval_prompts`` and the answer length) the same prompts are scored the same way as step 3's
before/after-PPO evaluation, here in one plain process (HF ``generate``, the reward model under a trivial engine
wrapper). Those flags default to the values of the step-3 run that trained the policy (its ``training_args.json``).
"""
import argparse
import json
import os
from types import SimpleNamespace

from dschat.args import (DEFAULT_SEED, HintingParser, add_data_args, add_hidden_local_rank, non_negative_int,
                         positive_int, resolve_pad_to_multiple_of, seed_int)
from dschat.data.pipeline import as_list
from dschat.data.raw_datasets import anchored_data_path, is_tiny_data
from dschat.models.loading import (check_sequence_fits, embedding_rows, grow_embeddings_for, load_tokenizer,
                                   resolve_model_path, stop_token_ids)
from dschat.errors import UsageError
from dschat.rlhf.engine import check_scores_actor_text
from dschat.rlhf.evaluation import evaluate_policy, hf_generate, rule_scorer_for
from dschat.rlhf.reward_fn import load_reward_fn
from dschat.report import counted
from dschat.run_layout import DPO_DIR, PPO_DIR, REPORT_FILE, SFT_DIR
from dschat.steps.common import RUN_ARGS_FILE, among_inputs, read_run_args, record_cwd
from dschat.steps.ppo import held_out_loader_once, step3_eval_prompts
from dschat.tools.common import (add_loading_args, check_stdout_open, default_device, find_policy_path,
                                 find_reward_model_path, flag_path, flag_path_and_report, load_policy,
                                 load_scoring_reward_model, non_empty_path, one_process, parse_with_model_run_defaults,
                                 reported_policy, run_report)
from dschat.utils.files import path_under


def evaluate_model(path, reward_model_path, args, reward_model=None, held_out_by_tokenizer=None, reward_fn=None):
    """(metrics of the policy at ``path``, the reward model used): greedy answers to the held-out prompts, scored by
    the reward model (if any; a critic-free run with --reward_model_weight 0 has none), ``reward_fn`` (--reward_fn's
    function, if given) and the rule scorer of the embedded data.

    The reward model is loaded with the first policy's tokenizer (as step 3 loads it with the actor's) and
    passed back so the next policy reuses it. ``held_out_by_tokenizer`` (a dict) keeps the tokenized prompts for the
    next policy: one whose tokenizer encodes as this one's reuses them (the data report is said once).
    """
    device = default_device()
    model, tokenizer = load_policy(path, device, args.dtype, args.add_eot_token)
    checked = {path: model}
    if reward_model is None and reward_model_path:  # (checked once, when it loads: not again with each policy)
        reward_model = checked[reward_model_path] = load_scoring_reward_model(reward_model_path, tokenizer, device,
                                                                              args.dtype)
    if reward_model is not None:  # every id the policy answers with has a row (step 3 grows it to the actor's too)
        grow_embeddings_for(reward_model.rwtransformer, tokenizer, embedding_rows(model))
    for name, each in checked.items():  # as step 3 checks its models: not an IndexError mid-generation
        # (each named: the same warning was said for the policy, the reward model and the baseline alike)
        check_sequence_fits(each, args.max_prompt_seq_len + args.max_new_tokens,
                            f"--max_prompt_seq_len + --max_new_tokens for {name}")
    # tokenized with this policy's tokenizer, as in step 3
    held_out = held_out_prompts(args, tokenizer, {} if held_out_by_tokenizer is None else held_out_by_tokenizer)
    held_out = first_rows(held_out, args.num_prompts) if args.num_prompts else held_out
    # evaluate_policy expects DeepSpeed engines; for the reward model that is only the ``.module`` attribute
    scoring = SimpleNamespace(module=reward_model) if reward_model is not None else None
    result = evaluate_policy(hf_generate(model, tokenizer), scoring, tokenizer, held_out, device, args.max_new_tokens,
                             rule_scorer_for(args.data_path), None, args.num_examples,
                             pad_to_multiple_of=resolve_pad_to_multiple_of(args.pad_to_multiple_of),
                             reward_fn=reward_fn, padded_forwards=args.padded_forwards,  # (as its step 3 scored)
                             eos_token_id=stop_token_ids(model, tokenizer))  # (as step 3 and the other tools stop)
    return {"path": path, **result}, reward_model


def check_reward_model_reads(paths, reward_model_path, args):
    """The reward model reads each policy's text (``check_scores_actor_text``), checked on their tokenizers before
    any model loads: a baseline of another family was refused only after the policy had answered every prompt."""
    reward_tokenizer = load_tokenizer(resolve_model_path(reward_model_path), add_eot_token=args.add_eot_token)
    for path in paths.values():
        check_scores_actor_text(load_tokenizer(resolve_model_path(path), add_eot_token=args.add_eot_token), path,
                                reward_tokenizer, reward_model_path, "the reward model")


def held_out_prompts(args, tokenizer, by_tokenizer):
    """Step 3's held-out prompt batches in ``tokenizer``'s ids, built once per encoding (``held_out_loader_once``)."""
    loader, built = held_out_loader_once(step3_settings(args), tokenizer, by_tokenizer)
    if built:
        say_fewer_prompts_than_asked(args.num_prompts, len(loader.dataset))
    return loader


def say_fewer_prompts_than_asked(num_prompts, held_out):
    """--num_prompts above the ``held_out`` prompts there are, said: the run's step-3 count (its --eval_prompts in
    whole batches) or the flag's went unqualified into the "from training_args.json" line, which then said
    --num_prompts 256 where the summary said 120 prompts."""
    if num_prompts > held_out > 0:  # (none: the summary says so)
        print(f"[ppo_eval] --num_prompts {num_prompts}: there are {counted(held_out, 'held-out prompt')}, all scored")


def first_rows(loader, count):
    """The batches of ``loader`` cut after its first ``count`` rows: the same prompts whatever the batch size (step 3
    scores whole batches; its count, ``step3_eval_prompts``, is a whole number of its batches)."""
    seen = 0
    for batch in loader:
        if seen >= count:
            return
        keep = count - seen
        batch = {key: value[:keep] if hasattr(value, "__getitem__") and not isinstance(value, str) else value
                 for key, value in batch.items()}
        seen += len(batch["prompt"])
        yield batch


def step3_settings(args):
    """The flags of ``args`` that step 3 has (data flags, seed, batch size, ...), which ``prompt_loaders`` reads; the
    tool's own (--policy, --max_new_tokens, ...) would be reported there as flags "not used by dschat"."""
    from dschat.args import flag_dests, step3_parser

    step3_flags = flag_dests(step3_parser())
    return {key: value for key, value in vars(args).items() if key in step3_flags}


def summary_line(role, result):
    if not result["prompts"]:
        return f"{role:8s} no held-out prompts, so no score ({result['path']})"
    scores = [f"{key} {result[key]:+.4f}" if key != "rule_score_mean" else f"{key} {result[key]:.4f}"
              for key in ("reward_mean", "reward_fn_mean", "rule_score_mean") if result.get(key) is not None]
    from dschat.report import empty_answers_said

    empty = empty_answers_said(result.get("empty_answers"), result["prompts"])
    return (f"{role:8s} {', '.join(scores)} over {counted(result['prompts'], 'prompt')}"
            f"{', ' + empty if empty else ''} ({result['path']})")


def print_results(results):
    for role, result in results.items():
        if result["examples"]:  # (--num_examples 0: a header over nothing, for each model)
            print(f"=== {role} ({result['path']}): examples")
        for example in result["examples"]:
            scores = [f"{name} {example[key]:{form}}" for key, name, form in (
                ("reward", "reward", "+.3f"), ("reward_fn", "reward_fn", "+.3f"),
                ("rule_score", "rule", ".3f"))  # (a rule score lies in [0, 1]: no sign, as in the summary)
                if example.get(key) is not None]
            print(f"[{', '.join(scores)}] {example['prompt'].strip()!r}")
            print(f"    -> {example['answer']!r}")
    for role, result in results.items():
        print(summary_line(role, result))


def write_json(path, payload):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def check_output_json(path):
    """``--output_json``'s path, checked before any model loads: a folder, or a path through a file, failed with
    IsADirectoryError / FileExistsError after the whole evaluation, its results unsaved."""
    if os.path.isdir(path):
        raise UsageError(f"--output_json {path}: a folder; give a file to write, e.g. "
                         f"{os.path.join(path, 'step3_eval.json')}")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):  # (write_json makes the missing folders)
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"--output_json {path}: {parent} is a file, not a folder")
    if not os.access(parent if not os.path.exists(path) else path, os.W_OK):
        raise UsageError(f"--output_json {path}: not writable here")


# --help's default of a flag that parse_args takes from the policy's step-3 (or DPO) run (step3_run_defaults)
RUN_DEFAULT = "the policy's run's, else %(default)s"


def build_parser():
    parser = HintingParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--policy", required=True,
                        help="The policy to score, e.g. the PPO actor: a model folder, or a run's output folder, "
                             "which uses the policy its last train.py run reported (else step3_ppo/actor, "
                             "step2_dpo, step1_sft; an unfinished run's step1_sft first), as chat.py picks it.")
    parser.add_argument("--baseline", default=None, help="A policy to compare with, e.g. output/step1_sft.")
    parser.add_argument("--reward_model", default=None,
                        help="The reward model, a folder or hub name (a run's output folder uses the one its step 3 "
                             "scored with: train.py's --reward-model, else step2_rm); default: the one the policy's "
                             "step-3 run trained against, none if it had none (--reward_model_weight 0).")
    parser.add_argument("--reward_fn", default="",
                        help="Also score with this reward function (step 3's --reward_fn; default: the run's).")
    add_data_args(parser)
    hide_flag(parser, "--sft_only_data_path")  # (refused: check_data_flags)
    parser._option_string_actions["--data_output_path"].help = (
        "Where tokenized datasets are cached (default: the policy's run's cache, train.py's <output>/data_cache, where "
        "this tool may write it; else %(default)s).")
    for flag, default in (("--data_path", "the policy's run's, else tiny"), ("--data_split", RUN_DEFAULT)):
        parser._option_string_actions[flag].help += f" Default: {default}."  # (the steps' help says none)
    parser.add_argument("--num_prompts", type=non_negative_int, default=64,
                        help=f"Held-out prompts scored: the first this many (0: all; default: {RUN_DEFAULT}).")
    parser.add_argument("--max_new_tokens", type=positive_int, default=256,
                        help="Greedy answer length (step 3: --eval_max_new_tokens, else --max_answer_seq_len; "
                             f"default: {RUN_DEFAULT}).")
    parser.add_argument("--max_prompt_seq_len", type=positive_int, default=256,
                        help=f"As in step 3 (longer prompts skipped; default: {RUN_DEFAULT}).")
    parser.add_argument("--per_device_generation_batch_size", type=positive_int, default=16,
                        help=f"Prompts per generation batch (default: {RUN_DEFAULT}).")
    parser.add_argument("--seed", type=seed_int, default=DEFAULT_SEED,
                        help=f"Step 3's seed (it chooses the held-out share; default: {RUN_DEFAULT}).")
    parser.add_argument("--padded_forwards", action=argparse.BooleanOptionalAction, default=False,
                        help="Score the reward model over the left-padded rows with an attention mask, as step 3 with "
                             "--padded_forwards scores its held-out answers; else each row shifted to start at its "
                             "first token, as step 3's default (they differ for LEFT_PADDING_MOVES_SCORES' families: "
                             f"RWKV, xLSTM, ...; default: {RUN_DEFAULT}).")
    parser.add_argument("--num_examples", type=non_negative_int, default=3,
                        help="Example answers printed and saved per policy (default: %(default)s).")
    parser.add_argument("--output_json", default=None, type=non_empty_path, help="Write the results here.")
    add_hidden_local_rank(parser)
    add_loading_args(parser)
    return parser


def hide_flag(parser, flag):
    """``flag`` left out of ``--help``: a flag of the steps' shared group that this tool refuses."""
    parser._option_string_actions[flag].help = argparse.SUPPRESS


# Step 3's flags that choose and shape its held-out prompts and how their answers are scored (--padded_forwards: a
# left-padding-sensitive reward model scores left-padded rows otherwise), taken as this tool's defaults from the run
# that trained the policy (with --num_prompts and --max_new_tokens, from step 3's evaluation flags:
# step3_run_defaults). (--data_output_path: the run's cache where it is now, ``run_data_cache``.)
STEP3_DATA_FLAGS = ("data_path", "data_split", "data_fields", "pad_to_multiple_of", "seed", "max_prompt_seq_len",
                    "per_device_generation_batch_size", "add_eot_token", "padded_forwards")


def step3_run_defaults(args, policy_lookup=None):
    """(this tool's defaults from the step-3 run that wrote the policy, the training_args.json they come from), else
    ({}, None); ``policy_lookup``: --policy's (path, report), ``flag_path_and_report``'s, where already looked up. A
    run folder's SFT model takes the step 3's or DPO step's beside it that started from it
    (``sft_comparison_run``), as the same prompts are what it is compared on (train.py --recipe dpo's report scores it
    beside the DPO policy); a DPO policy takes its DPO run's (``dpo_run_defaults``)."""
    policy_path, report = policy_lookup or flag_path_and_report("--policy", find_policy_path, args.policy)
    if not os.path.isdir(policy_path):  # a hub name: no run of ours
        return {}, None
    policy = os.path.abspath(policy_path)
    # (the report read is that of the run folder holding the policy where --policy named that folder: not read again)
    given = os.path.abspath(os.path.expanduser(args.policy))
    run_folder_report = report if os.path.dirname(policy) == given else None
    run, folder = policy_run(policy, run_folder_report)
    if run is None:
        # e.g. a notebook's save_causal_lm: the prompts scored may not be the run's held-out ones
        print(f"[ppo_eval] no step-3 {RUN_ARGS_FILE} with {policy_path}: the held-out prompts are those of this tool's "
              f"flags (--data_path {' '.join(as_list(args.data_path))} --data_split {args.data_split} --seed "
              f"{args.seed}); give step 3's to score its held-out prompts")
        return {}, None
    if run.get("step") == DPO_DIR:
        return dpo_run_defaults(run, folder, args, run_folder_report)
    flags = run["flags"]
    defaults = run_data_defaults(run, folder, STEP3_DATA_FLAGS)
    defaults.update(run_data_cache(run, folder))
    defaults.update(run_reward_sources(flags, record_cwd(run, folder), args.reward_fn, folder, run.get("inputs")))
    defaults["num_prompts"] = step3_eval_prompts(flags.get("eval_prompts", 64),
                                                 flags.get("per_device_generation_batch_size", 16),
                                                 run.get("world_size", 1))
    defaults["max_new_tokens"] = flags.get("eval_max_new_tokens") or flags.get("max_answer_seq_len", 256)
    return defaults, os.path.join(folder, RUN_ARGS_FILE)


def policy_run(policy, report=None):
    """(the training_args.json record of the run whose flags this tool takes for the policy folder ``policy``, the
    folder it is in), else (None, None): a step 3's (in ``policy``, or beside its actor), else for a run folder's SFT
    model the one its comparison was made with (``sft_comparison_run``), else the DPO step's that wrote ``policy``.
    (Only the SFT model borrows a sibling's: a DPO policy beside an older PPO run was not trained there.)
    ``report``: the ``run_report`` of the folder that holds ``policy``, where the caller has read it already."""
    for folder in (policy, os.path.dirname(policy)):
        if (run := read_run_args(folder, "step3")) is not None:
            return run, folder
    if os.path.basename(policy) == SFT_DIR:
        return sft_comparison_run(policy, report)
    run = read_run_args(policy, DPO_DIR)
    return (run, policy) if run is not None else (None, None)


# The steps that start from a run folder's SFT model and score it beside their own policy, each with its record's
# "step", in the order taken where the records cannot tell which one started from it.
SFT_COMPARISON_STEPS = ((PPO_DIR, "step3"), (DPO_DIR, DPO_DIR))


def sft_comparison_run(sft, report=None):
    """(the record of the step beside the SFT model folder ``sft`` that was trained from it, the folder it is in),
    else (None, None). One output folder may hold a PPO run's step3_ppo and a later train.py --recipe dpo's step2_dpo
    (or the reverse), and the later run's step 1 replaced the SFT model the earlier step started from: the SFT model
    was scored with the flags of that earlier step 3, not those of the DPO run whose report scored it. So a step that
    recorded it started from this model (its "inputs") comes first, then one that recorded nothing; of two alike, the
    last train.py run's (report.json's policy), else step 3's; one trained from another model only where no other
    is, said. ``report``: the run folder's ``run_report``, where the caller has read it already."""
    run_folder = os.path.dirname(sft)
    reported = (reported_policy(run_folder, report) or "").split("/")[0]
    candidates = []
    for order, (name, step) in enumerate(SFT_COMPARISON_STEPS):
        folder = os.path.join(run_folder, name)
        if (run := read_run_args(folder, step)) is not None:
            started_here = among_inputs(sft, run.get("inputs"))  # (None: not recorded, cannot be told)
            rank = {True: 0, None: 1, False: 2}[started_here]
            candidates.append(((rank, name != reported, order), run, folder, started_here))
    if not candidates:
        return None, None
    _, run, folder, started_here = min(candidates, key=lambda candidate: candidate[0])
    if started_here is False:
        print(f"[ppo_eval] {folder} was trained from another model than {sft} (step 1 ran again after it): its "
              f"flags are taken for want of the record of a step that started from {sft}")
    return run, folder


def dpo_run_defaults(dpo_run, dpo_folder, args, report=None):
    """(this tool's defaults from the DPO run ``dpo_run`` (read_run_args') whose model is ``dpo_folder``, where they
    come from): its data flags (``DPO_DATA_FLAGS``) and cache, and the flags train.py --recipe dpo's report scored
    with. ``report``: the ``run_report`` of the run folder that holds ``dpo_folder``, where already read."""
    defaults = run_data_defaults(dpo_run, dpo_folder, DPO_DATA_FLAGS)
    source = os.path.join(dpo_folder, RUN_ARGS_FILE)
    defaults.update(run_data_cache(dpo_run, dpo_folder))
    reported, said = reported_rule_score_defaults(dpo_folder, os.path.dirname(dpo_folder), args,
                                                  defaults.get("data_path"), report)
    defaults.update(reported)
    return defaults, source + said


# A DPO run's flags that choose its data's phases: with them the held-out prompts are phase 3 of its own split, which
# neither its SFT model nor DPO trained on (this tool's --data_split phase 3 would take some of DPO's phase-2 records).
DPO_DATA_FLAGS = ("data_path", "data_split", "data_fields", "pad_to_multiple_of", "seed", "add_eot_token")


def reported_rule_score_defaults(policy, run_folder, args, data_path, report=None):
    """(the flags with which train.py's DPO recipe scored its SFT and DPO policies, ``pipeline.held_out_rule_scores``:
    every held-out prompt, step 3's tiny-recipe lengths; where they come from, as the "from" line says it), read from
    the DPO model's metrics.json, where the recipe keeps them (``keep_rule_scores_with_the_dpo_model``), else, for a
    run from before that, from ``run_folder``'s report.json if it has the score. Neither: ({}, ""), and this tool's own
    defaults are said (64 prompts with 256-token answers, numbers unlike such a report's; a later run's report.json in
    the same folder left them unsaid), where the DPO run's ``data_path`` is the embedded data (the recipe scores no
    other); ``args``: this tool's flags, parsed without the run's; ``report``: ``run_folder``'s ``run_report``, where
    already read."""
    from dschat.pipeline import RULE_SCORE_FLAGS_KEY, held_out_rule_score_eval_flags
    from dschat.run_layout import FINISHED_MARK
    from dschat.utils.files import read_json_object

    metrics = os.path.join(policy, FINISHED_MARK)
    kept = (read_json_object(metrics) or {}).get(RULE_SCORE_FLAGS_KEY)
    if isinstance(kept, dict) and kept:
        return dict(kept), f" and {metrics}'s held-out rule score"
    dpo = (run_report(run_folder) if report is None else report).get("dpo")
    if isinstance(dpo, dict) and dpo.get("held_out_rule_score"):
        return held_out_rule_score_eval_flags(), f" and {os.path.join(run_folder, REPORT_FILE)}'s held-out rule score"
    if is_tiny_data(data_path):
        print(f"[ppo_eval] {policy}: no held-out rule score of train.py --recipe dpo kept with it ({metrics}): scored "
              f"with --num_prompts {args.num_prompts} --max_new_tokens {args.max_new_tokens} --max_prompt_seq_len "
              f"{args.max_prompt_seq_len} --per_device_generation_batch_size {args.per_device_generation_batch_size} "
              "(this tool's defaults where not given), not as such a report scores it")
    return {}, ""


def run_data_defaults(run, record_folder, names):
    """The flags ``names`` that the run recorded in ``run`` (read_run_args', from ``record_folder``), its --data_path
    as paths that name the files it read from whatever folder this tool runs in (read from ``record_cwd``)."""
    defaults, cwd = {name: run["flags"][name] for name in names if name in run["flags"]}, record_cwd(run, record_folder)
    if "data_path" in defaults:
        defaults["data_path"] = anchored_data_path(defaults["data_path"], cwd)
    if defaults.get("data_fields"):  # (a mapping per dataset names each as its --data_path does)
        from dschat.data.fields import as_data_fields

        fields = as_data_fields(defaults["data_fields"])  # (a notebook's run recorded its dict: as its text here)
        if fields.by_dataset:
            defaults["data_fields"] = fields.anchored(lambda spec: anchored_data_path(spec, cwd)).as_text()
        elif not isinstance(defaults["data_fields"], str):
            defaults["data_fields"] = fields.as_text()
    return defaults


def run_data_cache(run, record_folder):
    """{"data_output_path": the tokenized-data cache of the step run ``run`` (read_run_args') that wrote
    ``record_folder``'s training_args.json}, so that this tool reads the prompts the step tokenized there (as the steps
    of one train.py run share <output>/data_cache) rather than tokenizing them again into its own default
    /tmp/dschat_data_files: a cache in the run's folder (the parent of the step's --output_dir; train.py's) where
    that folder is now, moved or copied; another as the step read it from its working directory. {} where the run
    recorded none, or that cache is no folder this tool may write now (another machine's /tmp, a read-only copy)."""
    flags, cwd = run["flags"], record_cwd(run, record_folder)
    if not (flags.get("data_output_path") and flags.get("output_dir")):
        return {}
    then_cache, then_output = (os.path.normpath(os.path.join(cwd, flags[name])) for name in ("data_output_path",
                                                                                            "output_dir"))
    inside = os.path.relpath(then_cache, os.path.dirname(then_output))
    cache = (then_cache if inside.startswith(os.pardir) or os.path.isabs(inside)
             else os.path.join(os.path.dirname(os.path.abspath(record_folder)), inside))
    usable = os.path.isdir(cache) and os.access(cache, os.W_OK)
    own_default = os.path.normpath(build_parser().get_default("data_output_path"))
    return {"data_output_path": cache} if usable and cache != own_default else {}


def run_reward_sources(flags, cwd, given_fn="", record_folder=None, inputs=None):
    """The reward model (``--reward_model``) and function (``--reward_fn``) a step-3 run scored with, as paths usable
    from any folder: the reward model is the critic's path unless given (DeepSpeed-Chat's rule), none with
    --reward_model_weight 0. ``given_fn``: this tool's --reward_fn (then a function not recorded goes unsaid).
    ``record_folder``: where the run's training_args.json is now; a reward model in the run's folder (step 2's,
    beside step 3's --output_dir) is taken from there, so a moved or copied run folder scores with its own (the
    model the run recorded in ``inputs``, {folder: run id}, where it recorded one)."""
    sources = {}
    if flags.get("reward_model_weight", 1.0):
        path = flags.get("reward_model_name_or_path") or flags.get("critic_model_name_or_path")
        if path:
            sources["reward_model"] = (in_moved_run(path, cwd, flags.get("output_dir"), record_folder, inputs)
                                       or path_under(cwd, path) or path)
    if str(flags.get("reward_fn") or "").startswith("<"):  # (recorded_reward_fn's marker)
        if not given_fn:
            print(f"[ppo_eval] the run's reward function was {flags['reward_fn'][1:-1]}, which cannot be loaded "
                  "again: give --reward_fn to score with it")
    elif flags.get("reward_fn"):
        target, sep, name = flags["reward_fn"].rpartition(":")
        anchored = sep and target.endswith(".py")  # a file (a module name stays as given)
        sources["reward_fn"] = f"{path_under(cwd, target) or target}:{name}" if anchored else flags["reward_fn"]
    return sources


def in_moved_run(path, cwd, output_dir, record_folder, inputs=None):
    """``path`` (as the run read it from ``cwd``) where it is now when it was in the run's folder, the parent of
    step 3's ``output_dir`` (then), and that folder is now the parent of ``record_folder``, if that model is there
    (the one the run recorded in ``inputs``); else None."""
    from dschat.steps.common import holds_model

    then_path, then_out = (os.path.normpath(os.path.join(cwd or "", p)) if p else None for p in (path, output_dir))
    if not (then_path and then_out and record_folder and os.path.isabs(then_path) and os.path.isabs(then_out)):
        return None
    inside = os.path.relpath(then_path, os.path.dirname(then_out))
    if inside == os.curdir or inside.startswith(os.pardir):
        return None
    moved = os.path.join(os.path.dirname(os.path.abspath(record_folder)), inside)
    if not os.path.isdir(moved):
        return None
    recorded = (inputs or {}).get(then_path)  # (a run that recorded none: the folder's model cannot be told apart)
    return moved if recorded is not None and holds_model(moved, recorded) else None


def parse_args(argv=None):
    """The flags; those not given default to the policy's step-3 run's (said), so that the same prompts are scored
    the same way as in its before/after-PPO evaluation."""
    # (--policy comes back as the model folder, a run's folder resolved; the run's field names go with its files)
    return parse_with_model_run_defaults(build_parser(), argv, "--policy", find_policy_path, step3_run_defaults,
                                         "ppo_eval", goes_with={"data_fields": "data_path"})


def check_data_flags(args):
    """--data_path's files and hub names and --data_split's form and phase-3 share, before any model loads: a missing
    file, a split of two parts or one that gives phase 3 nothing (1,0,0) was an error only after the policy and reward
    model had loaded, and a missing file given with no reward model was "nothing to score the answers with";
    --sft_only_data_path is refused (step 3's flags' group has it)."""
    from dschat.data.raw_datasets import check_data_paths
    from dschat.data.splits import check_phase_share

    if args.sft_only_data_path:  # (step 1's own data: never among step 3's held-out prompts, and it was read by none)
        raise UsageError(f"--sft_only_data_path {' '.join(args.sft_only_data_path)}: ppo_eval scores step 3's held-out "
                         "prompts, phase 3 of --data_path, which step 1's SFT-only data is never part of: leave it out")
    check_phase_share(args.data_split, 3)  # (the held-out prompts are phase 3's, whoever trained the policy)
    check_data_paths(args.data_path)


def check_lengths_before_loading(paths, reward_model_path, args):
    """--max_prompt_seq_len + --max_new_tokens against each model's position table, read from its config before any
    model loads (``model_skeleton``): a policy, baseline or reward model too short for them was refused only once it
    had loaded (and the policy had answered every prompt, for a short baseline). ``evaluate_model`` checks the loaded
    models again, for a config that cannot be read alone."""
    from dschat.models.loading import check_fits_before_loading

    models = {**paths, **({"reward_model": reward_model_path} if reward_model_path else {})}
    for role, path in models.items():
        try:
            check_fits_before_loading(path, args.max_prompt_seq_len + args.max_new_tokens,
                                      "--max_prompt_seq_len + --max_new_tokens")
        except UsageError as error:  # (which model is too short)
            raise UsageError(f"{error} (--{role} {path})") from None


@one_process
def main(argv=None):
    """Print (and optionally save) the results; returns {"policy": ..., ["baseline": ...]}."""
    args = parse_args(argv)
    if args.output_json:
        check_output_json(args.output_json)
    else:  # (the results are printed alone)
        check_stdout_open("the results", ", or give --output_json")
    check_data_flags(args)  # (the scorer is chosen by the data; both were checked only once the models had loaded)
    if not (args.reward_model or args.reward_fn or rule_scorer_for(args.data_path)):
        raise UsageError("nothing to score the answers with: give --reward_model (step 2's folder) or --reward_fn")
    reward_model_path = (None if args.reward_model is None  # (an empty one is an error naming it, not none)
                         else flag_path("--reward_model", find_reward_model_path, args.reward_model))
    paths = {"policy": args.policy}
    if args.baseline is not None:  # (an empty one is an error naming it: it was left out, unsaid)
        paths["baseline"] = flag_path("--baseline", find_policy_path, args.baseline)
    if reward_model_path:
        check_reward_model_reads(paths, reward_model_path, args)
    check_lengths_before_loading(paths, reward_model_path, args)
    # (a missing file or function was said only once the policy and the reward model had loaded)
    reward_fn = load_reward_fn(args.reward_fn) if args.reward_fn else None
    results, reward_model, held_out_by_tokenizer = {}, None, {}
    for role, path in paths.items():
        results[role], reward_model = evaluate_model(path, reward_model_path, args, reward_model,
                                                     held_out_by_tokenizer, reward_fn)
    print_results(results)
    if args.output_json:
        write_json(args.output_json, {**results, "reward_model": reward_model_path, "data_path": args.data_path,
                                      "max_new_tokens": args.max_new_tokens})
    return results


if __name__ == "__main__":  # python -m dschat.tools.ppo_eval, as the script that calls it
    from dschat.utils.cli import run_script

    run_script(main)
