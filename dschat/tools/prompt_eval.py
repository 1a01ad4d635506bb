"""Step-1 check: a baseline's and a fine-tuned model's answers to the same prompts, side by side.

Prompts come from ``--prompts``, from ``--prompts_file`` (any data training accepts: a local file, a hub dataset's
name), or by
default from the embedded held-out data (also ``--prompts_file tiny``), whose answers are also scored with the
bundled rule scorer.
"""

from dschat.args import DEFAULT_SEED, HintingParser, add_hidden_local_rank, positive_int
from dschat.data.formatting import render_human_assistant
from dschat.errors import UsageError
from dschat.models.positions import context_limit
from dschat.report import counted
from dschat.tools.common import (add_generation_args, add_loading_args, check_generation_flags,
                                 check_room_for_a_prompt, check_stdout_open, config_before_loading, empty_answer_note,
                                 find_policy_path, flag_path, generation_kwargs, load_policy, model_run_record,
                                 non_empty_path, one_process, tool_prompt)
from dschat.tools.generation import encode_prompts, generate_answers_and_cuts
from dschat.tools.records import (check_count_read, check_data_fields_read, is_tiny_held_out, load_records,
                                  prompt_record, recorded_seed, seed_holds_out, tiny_held_out_records)

ROLES = ("baseline", "finetune")
RULE = "=" * 30


def select_records(args, seed=None):
    """(records, whether they are the tiny held-out data and so rule-scorable); ``seed``: the training --seed whose
    held-out share of a hub dataset without an eval split is read (``held_out_seed``; None: the steps' default)."""
    if args.prompts:
        return [prompt_record(p, "--prompts") for p in args.prompts], False
    if args.prompts_file:
        # the embedded held-out data named as a file ("tiny" or its path) is scored as when it is the default
        records = load_records(args.prompts_file, args.data_fields, args.num_prompts, "--prompts_file", seed)
        return records, is_tiny_held_out(args.prompts_file)
    return tiny_held_out_records(args.num_prompts), True


def held_out_seed(args, finetune_path):
    """The training --seed whose held-out 10% of --prompts_file is read where it is a hub dataset without an eval split
    (``seed_holds_out``), else None: --seed where given, else the seed the fine-tuned model's run recorded (said),
    else None (``load_records``: the steps' default, said). The default 1234 alone held out other rows than a run
    trained with another --seed did: prompts it trained on were compared as held-out ones."""
    if not (args.prompts_file and seed_holds_out(args.prompts_file)):
        return None
    if args.seed is not None:
        return args.seed
    run, source = model_run_record(finetune_path)
    seed = recorded_seed(run)
    if seed is not None:
        print(f"[prompt_eval] --seed {seed}: the fine-tuned model's run's (from {source}), the seed that held out "
              f"the share of {args.prompts_file} read here")
    return seed


def prompts_source(args):
    """Where the prompts come from, in words, for an error about one of them."""
    if args.prompts:
        return "--prompts"
    return f"--prompts_file {args.prompts_file}" if args.prompts_file else "the embedded held-out data"


def model_prompts(path, records, args, config=None, role="the model"):
    """The prompts as the model at ``path`` reads them: formatted with its own tokenizer (its chat template or not).
    Both models' are formatted before either loads: a prompt one template refuses is said at once, as is one that
    leaves no room for --max_new_tokens in the context of the model's ``config``."""
    from dschat.models.loading import load_tokenizer

    tokenizer = load_tokenizer(path, add_eot_token=args.add_eot_token)
    prompts = [tool_prompt(record.messages, tokenizer, path) for record in records]
    check_prompts_fit(prompts, tokenizer, config, args, role)
    return prompts


def check_prompts_fit(prompts, tokenizer, config, args, role):
    """Each prompt + --max_new_tokens within the context of the model of ``config``, as chat.py refuses a message that
    is not: past a learned position table it was an error naming no prompt once the model had loaded (and answered the
    earlier batches), past rotary positions a warning, and answers from positions the model never learned."""
    limit = context_limit(config) if config is not None else None
    if not limit:
        return
    room = limit - args.max_new_tokens
    for index, ids in enumerate(encode_prompts(tokenizer, prompts)):
        if len(ids) > room:
            raise UsageError(f"{prompts_source(args)}: prompt {index + 1} takes {len(ids)} tokens for the {role} "
                             f"model; with --max_new_tokens {args.max_new_tokens} its context of {limit} tokens leaves "
                             f"room for {room}")


def model_answers(path, prompts, args):
    """(one model's answers to its ``prompts``, whether each reached --max_new_tokens before the model ended it).
    Models are loaded one at a time, so the two need not fit in memory together."""
    model, tokenizer = load_policy(path, dtype=args.dtype, add_eot_token=args.add_eot_token)
    # generation_kwargs re-seeds: with --seed both models sample from the same random stream
    return generate_answers_and_cuts(model, tokenizer, prompts, generation_kwargs(args), args.batch_size)


def rule_scores(records, answers):
    from dschat.tiny.scorer import rule_score

    return [rule_score(record.user_message, answer) for record, answer in zip(records, answers)]


def print_comparison(records, paths, answers, scores, cuts=None, max_new_tokens=None):
    """``cuts``: {role: whether each answer reached --max_new_tokens before the model ended it}, said beside it (an
    answer cut short read as the model's whole answer, and its rule score as that answer's)."""
    for index, record in enumerate(records):
        print(f"{RULE} prompt {index + 1}/{len(records)} {RULE}")
        # shown in the "Human:/Assistant:" form whatever the models' chat templates are
        print(render_human_assistant(record.messages).strip())
        for role in ROLES:
            suffix = f"   [rule score {scores[role][index]:.2f}]" if scores else ""
            cut = bool(cuts and cuts[role][index])
            suffix += f"   [cut at --max_new_tokens {max_new_tokens}]" if cut else ""
            empty = empty_answer_note(answers[role][index], cut)
            suffix += f"   [{empty}]" if empty else ""  # (else a blank line)
            print(f"--- {role} ({paths[role]}):{suffix}\n{answers[role][index]}")
    if scores:
        means = ", ".join(f"{role} {_mean(scores[role]):.3f}" for role in ROLES)
        print(f"{RULE}\nmean rule score over {counted(len(records), 'prompt')}: {means}")


def _mean(values):
    return sum(values) / max(len(values), 1)


def build_parser():
    parser = HintingParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path_baseline", required=True, help="E.g. the base model.")
    parser.add_argument("--model_name_or_path_finetune", required=True,
                        help="E.g. output/step1_sft, or a run's output folder (its policy, as chat.py picks it).")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompts", nargs="+", help="User messages (or 'Human: ... Assistant: ...' transcripts).")
    source.add_argument("--prompts_file", type=non_empty_path,
                        help="Local data with prompts (any format training accepts; its eval file where it has one, "
                             "else all of it), or a hub dataset's name, read as training reads it (its eval split, "
                             "else the 10%% of its train split --seed holds out); "
                             "tiny: the embedded held-out data. The embedded data's prompts (by name or by its "
                             "files) are rule-scored.")
    parser.add_argument("--data_fields", default="", help="Field names of --prompts_file, e.g. prompt=question.")
    parser.add_argument("--num_prompts", type=positive_int, default=8,
                        help="Prompts taken from a file or the tiny data (default: %(default)s).")
    parser.add_argument("--batch_size", type=positive_int, default=8,
                        help="Prompts answered at once (default: %(default)s).")
    add_loading_args(parser)
    add_generation_args(parser, sample_by_default=False)
    parser._option_string_actions["--seed"].help = (
        "Seed for sampling, and training's --seed, which chooses the 10%% of the train split of a --prompts_file hub "
        "dataset without an eval split that is read (default: unseeded sampling, and the held-out share of the seed "
        f"the fine-tuned model's run recorded in its training_args.json, else of the steps' {DEFAULT_SEED}).")
    compat = parser.add_argument_group(
        "DeepSpeed-Chat's prompt_eval.py flags", "Accepted so that its command lines run; no effect: its comparison "
        "is greedy with one answer per prompt, as here (the other decoding methods are commented out in its script)")
    for flag, kind in (("--num_beams", int), ("--num_beam_groups", int), ("--penalty_alpha", float),
                       ("--num_return_sequences", int)):
        compat.add_argument(flag, type=kind, default=None, help="Accepted, no effect (see above).")
    compat.add_argument("--language", choices=["English", "Chinese", "Japanese"], default=None,
                        help="Its built-in prompts' language: here the prompts are --prompts, --prompts_file or the "
                             "embedded English ones.")
    add_hidden_local_rank(parser)
    return parser


def say_unused_compat_flags(args):
    """DeepSpeed-Chat's decoding flags asking for what this comparison does not do (beams, contrastive search, several
    answers per prompt) and its --language of other built-in prompts were taken without a word: said once, as the
    other tools say their unused flags."""
    from dschat.utils.cli import say_once

    asked = [f"--{name} {getattr(args, name)}" for name in ("num_beams", "num_beam_groups", "num_return_sequences")
             if (getattr(args, name) or 1) > 1]
    asked += [f"--penalty_alpha {args.penalty_alpha}"] if args.penalty_alpha else []
    asked += [f"--language {args.language}"] if args.language not in (None, "English") else []
    if asked:
        say_once(f"warning: {', '.join(asked)}: no effect (DeepSpeed-Chat's prompt_eval.py flags, accepted so its "
                 "command lines run): one answer per prompt, greedy or --do_sample, to --prompts, --prompts_file or "
                 "the embedded English prompts")


@one_process
def main(argv=None):
    """Print the comparison; returns {"prompts", "answers", and "rule_scores"/"rule_score_means" if scored}."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_data_fields_read(parser, args.data_fields, "--prompts_file", args.prompts_file)
    check_count_read(parser, argv, "--num_prompts", "--prompts", args.prompts)
    check_stdout_open("the comparison")
    paths = {role: flag_path(f"--model_name_or_path_{role}", find_policy_path,  # both before either loads
                             getattr(args, f"model_name_or_path_{role}")) for role in ROLES}
    args.held_out_seed = held_out_seed(args, paths["finetune"])  # (read by check_generation_flags too)
    check_generation_flags(args)  # (before either model loads)
    say_unused_compat_flags(args)
    records, scorable = select_records(args, args.held_out_seed)
    configs = {role: config_before_loading(paths[role]) for role in ROLES}
    for role in ROLES:  # (its answers would have no room, said after both models had loaded)
        check_room_for_a_prompt(configs[role], args.max_new_tokens, f"the {role} model")
    prompts = {role: model_prompts(paths[role], records, args, configs[role], role) for role in ROLES}
    answers, cuts = {}, {}
    for role in ROLES:
        answers[role], cuts[role] = model_answers(paths[role], prompts[role], args)
    scores = {role: rule_scores(records, answers[role]) for role in ROLES} if scorable else None
    print_comparison(records, paths, answers, scores, cuts, args.max_new_tokens)
    result = {"prompts": [record.messages for record in records], "answers": answers, "cut": cuts}
    if scores:
        result.update(rule_scores=scores, rule_score_means={role: _mean(scores[role]) for role in ROLES})
    return result


if __name__ == "__main__":  # python -m dschat.tools.prompt_eval, as the script that calls it
    from dschat.utils.cli import run_script

    run_script(main)
