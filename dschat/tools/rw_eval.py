"""Step-2 check: reward-model scores of answers, and accuracy on chosen/rejected pairs.

Each answer is scored on exactly the tokens step 2 trained on and step 3 rewards: the ``format_prompt`` ids,
then the ``format_answer`` ids (cut to ``--max_seq_len``), then the eot token, read at its last token.
"""
import os
from collections import Counter

import torch

from dschat.args import (DEFAULT_SEED, HintingParser, add_hidden_local_rank, non_negative_int, positive_int,
                         seed_int)
from dschat.data.collators import pad_sequences
from dschat.data.formatting import get_eot_token, render_human_assistant
from dschat.data import pipeline
from dschat.data.errors import SkipRecord
from dschat.data.pipeline import EncodeSettings, Example, tokenize_examples
from dschat.errors import UsageError
from dschat.report import counted
from dschat.rlhf.dpo import preference_accuracy, preference_ties
from dschat.tools.common import (add_loading_args, check_stdout_open, check_utf8, find_reward_model_path,
                                 flag_path_and_report, load_scoring_reward_model, non_empty_path, one_process,
                                 parse_with_model_run_defaults, tool_prompt)
from dschat.data.raw_datasets import TINY_NAME
from dschat.data.splits import parse_data_split
from dschat.tools.records import (check_count_read, check_data_fields_read, load_phase_held_out, load_records,
                                  prompt_record, recorded_seed, seed_holds_out, tiny_held_out_records)

RULE = "=" * 30


def reward_sequences(tokenizer, messages_and_answers, max_seq_len, skip_long=False):
    """Per (prompt messages, answer): (the token ids of ``prompt + answer + eot``, built by step 2's tokenizer code; its
    cut: (answer tokens scored, answer tokens) where --max_seq_len cut the answer, as step 2 cuts it, else None). A
    prompt that leaves no room for an answer is an error, or None with ``skip_long`` (step 2 skips it)."""
    settings = EncodeSettings(train_phase=2, max_seq_len=max_seq_len, max_prompt_len=None,
                              include_prompt_in_loss=False, eot_token=get_eot_token(tokenizer))
    examples = [Example(messages, chosen=answer, prompt_text=tool_prompt(messages, tokenizer, "the reward model"))
                for messages, answer in messages_and_answers]
    sequences = []
    for tokens in tokenize_examples(examples, tokenizer, settings):
        try:
            sequences.append(scored_sequence(tokens, max_seq_len))
        except UsageError:
            if not skip_long:
                raise
            sequences.append(None)
    return sequences


def scored_sequence(tokens, max_seq_len):
    """(step 2's sequence of the answer, ``pipeline.scored_sequence``; its cut, as ``reward_sequences``); no room for
    the answer is an error here."""
    prompt, answer, eot = tokens["prompt"], tokens["chosen"], tokens["eot"]
    try:
        ids, cut = pipeline.scored_sequence(prompt, answer, eot, max_seq_len)
    except SkipRecord:
        raise UsageError(f"a prompt of {len(prompt)} tokens leaves no room for an answer in --max_seq_len "
                         f"{max_seq_len}") from None
    return ids, (len(ids) - len(prompt) - len(eot), len(answer)) if cut else None


def prompt_answer_sequences(tokenizer, messages, answers, max_seq_len):
    """``reward_sequences`` of --prompt's ``messages`` with each --answer; a prompt too long is an error naming it."""
    try:
        return reward_sequences(tokenizer, [(messages, answer) for answer in answers], max_seq_len)
    except UsageError as error:
        raise UsageError(f"--prompt: {error}") from None


@torch.no_grad()
def score_sequences(model, tokenizer, id_lists, batch_size=16):
    """The reward model's end score of each token-id list."""
    sequences = [torch.tensor(ids) for ids in id_lists]
    device = next(model.parameters()).device
    scores = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        ids = pad_sequences(chunk, tokenizer.pad_token_id).to(device)
        mask = pad_sequences([torch.ones_like(seq) for seq in chunk], 0).to(device)
        scores += model.end_scores(ids, mask).float().tolist()
    return scores


def evaluate_pairs(model, tokenizer, records, max_seq_len, batch_size):
    """Per-pair scores and the accuracy step 2 reports (chosen scored above rejected, a tie counting half: "ties" counts
    them; ``preference_accuracy``), over the pairs step 2 keeps: a pair whose prompt leaves no room for an answer, or
    whose two sequences are the same token ids (chosen == rejected, also after truncation: it could only tie, which
    says nothing of the model), is skipped and counted, as is a record without a chosen or a rejected answer (an
    SFT-only record)."""
    missing = Counter("no chosen answer" if r.chosen is None else "no rejected answer"
                      for r in records if r.chosen is None or r.rejected is None)
    records = [r for r in records if r.chosen is not None and r.rejected is not None]
    chosen_seqs, rejected_seqs = (
        reward_sequences(tokenizer, [(r.messages, answer(r)) for r in records], max_seq_len, skip_long=True)
        for answer in (lambda r: r.chosen, lambda r: r.rejected))
    chosen_ids, rejected_ids = ([None if seq is None else seq[0] for seq in seqs]
                                for seqs in (chosen_seqs, rejected_seqs))
    skipped = missing + Counter("prompt too long" if c is None else "chosen==rejected"
                                for c, r in zip(chosen_ids, rejected_ids) if c is None or c == r)
    kept = [i for i, (c, r) in enumerate(zip(chosen_ids, rejected_ids)) if c is not None and c != r]
    chosen = score_sequences(model, tokenizer, [chosen_ids[i] for i in kept], batch_size)
    rejected = score_sequences(model, tokenizer, [rejected_ids[i] for i in kept], batch_size)
    pairs = [{"prompt": records[i].messages, "chosen": records[i].chosen, "rejected": records[i].rejected,
              "chosen_score": c, "rejected_score": s} for i, c, s in zip(kept, chosen, rejected)]
    # (pairs scored with an answer --max_seq_len cut: its end unread, as in step 2, and said)
    cut = sum(1 for i in kept if chosen_seqs[i][1] or rejected_seqs[i][1])
    n = len(pairs)
    if not n:  # every pair skipped: no score, rather than an accuracy of 0 (as step 2 reports no eval pairs)
        return {"pairs": [], "accuracy": None, "chosen_mean_score": None, "rejected_mean_score": None, "ties": 0,
                "skipped": dict(skipped), "cut": 0, "max_seq_len": max_seq_len}
    scores = torch.tensor(chosen, dtype=torch.float64), torch.tensor(rejected, dtype=torch.float64)
    return {"pairs": pairs, "accuracy": preference_accuracy(*scores).double().mean().item(),
            "chosen_mean_score": sum(chosen) / n, "rejected_mean_score": sum(rejected) / n,
            "ties": int(preference_ties(*scores).sum()), "skipped": dict(skipped), "cut": cut,
            "max_seq_len": max_seq_len}


def print_pairs(result):
    pairs = result["pairs"]
    for index, pair in enumerate(pairs):
        higher = ("chosen" if pair["chosen_score"] > pair["rejected_score"] else
                  "rejected" if pair["chosen_score"] < pair["rejected_score"] else "neither (a tie)")
        print(f"{RULE} pair {index + 1}/{len(pairs)} {RULE}\n{render_human_assistant(pair['prompt']).strip()}")
        print(f"chosen   {pair['chosen_score']:+.4f}: {pair['chosen']}")
        print(f"rejected {pair['rejected_score']:+.4f}: {pair['rejected']}")
        print(f"higher: {higher}")
    skipped = ", ".join(f"{count} {reason}" for reason, count in result["skipped"].items())
    if not pairs:
        print(f"{RULE}\nno pairs scored, so no accuracy; skipped as in step 2: {skipped}")
        return
    ties = f" ({result['ties']} tied, each counted half)" if result["ties"] else ""
    cut = (f"; {counted(result['cut'], 'pair')} scored with an answer cut to fit --max_seq_len {result['max_seq_len']}"
           " (as in step 2)") if result["cut"] else ""
    print(f"{RULE}\naccuracy {result['accuracy']:.3f} over {counted(len(pairs), 'pair')}{ties}; mean score chosen "
          f"{result['chosen_mean_score']:+.4f}, rejected {result['rejected_mean_score']:+.4f}"
          + (f"; skipped as in step 2: {skipped}" if skipped else "") + cut)


def print_answers(messages, answers, scores, cuts=None, max_seq_len=None):
    """Each answer's score; one --max_seq_len cut (``reward_sequences``' cut) says so: its score is of its first tokens
    alone (two answers alike up to the cut scored alike, unsaid)."""
    print(render_human_assistant(messages).strip())
    for answer, score, cut in zip(answers, scores, cuts or [None] * len(answers)):
        note = f" (its first {cut[0]} of {cut[1]} tokens: cut to fit --max_seq_len {max_seq_len})" if cut else ""
        print(f"score {score:+.4f}{note}: {answer}")


def build_parser():
    parser = HintingParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", required=True,
                        help="The reward model: step 2's folder, another trained one (a folder or hub name), or a "
                             "run's output folder, which uses the one its step 3 scored with (else its step2_rm).")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--pairs_file", type=non_empty_path,
                        help="Local data with prompt/chosen/rejected (any format training accepts; its eval file "
                             "where it has one, else all of it), or a hub dataset's name, read as training reads it "
                             "(its eval split, else the 10%% of its train split --seed holds out); tiny: the embedded "
                             "held-out pairs. Default: the step-2 run's one --data_path, else tiny.")
    source.add_argument("--prompt", help="Score --answer(s) to this prompt instead of pairs.")
    parser.add_argument("--answer", action="append", default=[], help="An answer to --prompt (repeatable).")
    parser.add_argument("--data_fields", default="", help="Field names of --pairs_file, e.g. chosen=good.")
    parser.add_argument("--data_split", default=None,
                        help="Score step 2's held-out pairs of --pairs_file: phase 2's share by this split (as step "
                             "2's, e.g. 2,4,4) of its eval file, else of the 10%% of the file --seed holds out. "
                             "Default: the step-2 run's, with its --data_path as --pairs_file (its reported accuracy's "
                             "pairs); else none: the eval file, else all of --pairs_file.")
    parser.add_argument("--seed", type=seed_int, default=DEFAULT_SEED,
                        help="Step 2's seed, which holds out 10%% of a file without an eval file (with --data_split) "
                             "and of a hub dataset without an eval split (default: the step-2 run's, else "
                             "%(default)s).")
    parser.add_argument("--num_pairs", type=non_negative_int, default=64,
                        help="At most this many pairs (0: all; default: %(default)s).")
    parser.add_argument("--max_seq_len", type=positive_int, default=None,
                        help="As in step 2: answers are cut to fit (default: the step-2 run's, from the model "
                             "folder's training_args.json, else 512).")
    parser.add_argument("--batch_size", type=positive_int, default=16,
                        help="Pairs scored at once (default: %(default)s).")
    parser.add_argument("--num_padding_at_beginning", type=int, default=1,
                        help="Accepted for DeepSpeed-Chat compatibility (its rw_eval.py flag); the score is read at "
                             "the last real token found from the attention mask, so it has no effect "
                             "(default: %(default)s).")
    add_loading_args(parser)
    add_hidden_local_rank(parser)
    return parser


def step2_run_defaults(args, model_lookup=None):
    """--max_seq_len and --add_eot_token as the step-2 run that wrote the model trained with (its training_args.json),
    so that pairs are cut and ended as in training; and, with neither --pairs_file nor --prompt, its one --data_path
    (local data, the embedded data, or a hub dataset, read where the run read it: ``check_hub_data_read_here``) with
    its --data_fields, --data_split and --seed: the pairs step 2 held out and reported its accuracy on. (The file
    alone, where it has no eval file, was read whole: pairs step 2 trained on.) A hub dataset the run read from the
    hub, or its download in the hub cache, was not taken: the embedded data's pairs were scored instead.
    ``model_lookup``: --model_name_or_path's (path, report), ``flag_path_and_report``'s, where already looked up."""
    from dschat.data.pipeline import as_list
    from dschat.data.raw_datasets import HUB_DATASETS, anchored_data_path, resolve_dataset_spec
    from dschat.steps.common import RUN_ARGS_FILE, read_run_args, record_cwd

    path, _ = model_lookup or flag_path_and_report("--model_name_or_path", find_reward_model_path,
                                                   args.model_name_or_path)
    run = read_run_args(path, "step2")
    if run is None:
        return {}, None
    trained = run["flags"]
    defaults = {name: trained[name] for name in ("max_seq_len", "add_eot_token") if trained.get(name)}
    cwd = record_cwd(run, path)  # (where the run read its relative paths from)
    data = as_list(anchored_data_path(trained.get("data_path") or [], cwd))
    args_file = os.path.join(path, RUN_ARGS_FILE)
    if args.pairs_file is None and args.prompt is None and len(data) == 1:
        if data[0] in HUB_DATASETS:
            check_hub_data_read_here(data[0], cwd, args_file)
        try:
            resolve_dataset_spec(data[0])
        except UsageError as error:  # (moved or deleted since: said so, not as a flag the user gave)
            raise UsageError(f"{error} (the data of step 2, from {args_file}): give "
                             "--pairs_file, or --prompt and --answer") from None
        defaults["pairs_file"] = data[0]
        # its split and seed go with its file (which pairs step 2 held out)
        defaults.update({name: trained[name] for name in ("data_split", "seed")
                         if trained.get(name) not in (None, "")})  # (a seed of 0 too)
        # its field names go with its file (its own, where given per dataset; a hub dataset's reader has fixed ones)
        if trained.get("data_fields") and data[0] not in HUB_DATASETS:
            from dschat.data.fields import DataFields, as_data_fields

            spec = as_list(trained["data_path"])[0]  # (as_data_fields: a notebook's run recorded its dict)
            defaults["data_fields"] = DataFields(as_data_fields(trained["data_fields"]).for_spec(spec), {}).as_text()
        if data[0] == TINY_NAME and "data_split" not in defaults:  # (the embedded held-out pairs, as before)
            del defaults["pairs_file"]
    if args.data_split is not None and args.pairs_file is None and args.prompt is None and data != [TINY_NAME] \
            and "pairs_file" not in defaults and data:
        # (read_pairs would score the embedded data's share, labelled as step 2's held-out pairs of another file)
        raise UsageError(f"--data_split {args.data_split}: the step-2 run read {' '.join(map(str, data))} (from "
                         f"{args_file}), not one dataset to take as --pairs_file: give "
                         "--pairs_file, the file whose held-out pairs to score")
    if (args.data_split is not None or seed_holds_out(args.pairs_file)) and recorded_seed(run) is not None:
        # (a --data_split given, or a hub dataset without an eval split, chooses step 2's held-out pairs of its
        # --seed: the run's, as its help says, not 1234)
        defaults["seed"] = recorded_seed(run)
    return defaults, os.path.abspath(args_file)


def check_hub_data_read_here(name, run_folder, args_file):
    """The step-2 run's hub-named data ``name`` is read here by that name as the run read it (``tool_raw_dataset``, as
    training resolves it): from a local copy, a folder of that name where it ran (``is_local_hub_copy``), only where it
    is the same folder; from the hub (the datasets cache, its download in the hub cache) only where no folder of that
    name here would be read instead. Else an error saying where the run read it."""
    from dschat.data.raw_datasets import is_local_hub_copy

    copy = os.path.join(run_folder or os.getcwd(), name)
    if not os.path.isdir(copy):
        if is_local_hub_copy(name):
            raise UsageError(f"the step-2 run read {name} from the hub (from {args_file}), and the folder {name} here "
                             f"would be read by that name instead: run rw_eval in {run_folder}, or give --pairs_file")
        return
    if not (is_local_hub_copy(name) and os.path.samefile(name, copy)):
        raise UsageError(f"the step-2 run read {name} from its copy {copy} (from {args_file}), which the tools read by "
                         f"that name only in the folder that holds it: run rw_eval in {run_folder}, or give "
                         "--pairs_file")


def check_message_flags(parser, args):
    if args.prompt is not None and not args.prompt.strip():
        parser.error("--prompt: the prompt is empty")
    if any(not answer.strip() for answer in args.answer):
        parser.error("--answer: an answer is empty")
    for text, flag in [(args.prompt, "--prompt"), *((answer, "--answer") for answer in args.answer)]:
        if text is not None:
            check_utf8(text, flag)
    if (args.prompt is None) != (not args.answer):
        parser.error("--prompt and --answer go together")


def check_some_pair(records, pairs_file):
    """Records with no chosen/rejected pair at all (prompts, SFT answers) are an error naming the file: argparse's usage
    block said "no records with both a chosen and a rejected answer" without it, a file the step-2 run's
    training_args.json may have chosen."""
    if not any(r.chosen is not None and r.rejected is not None for r in records):
        raise UsageError(f"--pairs_file {pairs_file}: none of its {counted(len(records), 'record')} read has both a "
                         "chosen and a rejected answer (a pair to score): give preference pairs, or --prompt and "
                         "--answer")


def parse_args(argv=None):
    """(the flags, those not given as the model's step-2 run trained, the parser)."""
    parser = build_parser()
    given = parser.parse_args(argv)
    check_message_flags(parser, given)  # before the model folder is looked at
    check_count_read(parser, argv, "--num_pairs", "--prompt and its --answer", given.prompt is not None)
    # (--model_name_or_path comes back as the reward model's path, a run's folder resolved)
    args = parse_with_model_run_defaults(parser, argv, "--model_name_or_path", find_reward_model_path,
                                         step2_run_defaults, "rw_eval")
    check_data_fields_read(parser, args.data_fields, "--pairs_file", args.pairs_file and args.prompt is None)
    if args.prompt is not None and args.data_split is not None:  # (it chooses pairs of a file; none is read)
        parser.error(f"--data_split {args.data_split}: it chooses step 2's held-out pairs of --pairs_file, which is "
                     "not read with --prompt: leave it out")
    if args.data_split is not None and not parse_data_split(args.data_split)[1]:  # (its form: checked there)
        raise UsageError(f"--data_split {args.data_split} gives phase 2 (step 2's pairs) no share of --pairs_file: "
                         "give it a weight > 0, e.g. '2,4,4', as step 2's")
    args.max_seq_len = args.max_seq_len or 512
    return args, parser


def read_pairs(args):
    """The records whose pairs are scored: step 2's held-out share with --data_split (``load_phase_held_out``), else
    --pairs_file's eval part (``eval_records``: all of local data without one), else the embedded held-out pairs."""
    limit = args.num_pairs or None
    if args.data_split is not None:
        return load_phase_held_out(args.pairs_file or TINY_NAME, args.data_fields, args.data_split, args.seed, 2,
                                   limit, "--pairs_file")
    if args.pairs_file:
        return load_records(args.pairs_file, args.data_fields, limit, "--pairs_file", args.seed)
    return tiny_held_out_records(limit)


@one_process
def main(argv=None):
    """Print the scores; returns {"scores"} for --prompt, else the pair results and accuracy."""
    args, _ = parse_args(argv)
    check_stdout_open("the scores")
    from dschat.models.loading import check_fits_before_loading, check_sequence_fits, load_tokenizer

    path = args.model_name_or_path  # (looked up by parse_args)
    records = None if args.prompt else read_pairs(args)  # (read and checked before the model loads)
    if records is not None:
        check_some_pair(records, args.pairs_file)
    tokenizer = load_tokenizer(path, add_eot_token=args.add_eot_token)
    if args.prompt:  # (tokenized before the model loads: a prompt too long for --max_seq_len is said at once)
        messages = prompt_record(args.prompt).messages
        answer_ids, cuts = zip(*prompt_answer_sequences(tokenizer, messages, args.answer, args.max_seq_len))
    check_fits_before_loading(path, args.max_seq_len, "--max_seq_len")  # (and the loaded model's, below)
    model = load_scoring_reward_model(path, tokenizer, dtype=args.dtype)
    check_sequence_fits(model, args.max_seq_len, "--max_seq_len")  # as step 2 checks it: not an IndexError later
    if args.prompt:
        scores = score_sequences(model, tokenizer, answer_ids, args.batch_size)
        print_answers(messages, args.answer, scores, cuts, args.max_seq_len)
        return {"scores": scores, "cut": list(cuts)}
    result = evaluate_pairs(model, tokenizer, records, args.max_seq_len, args.batch_size)
    print_pairs(result)
    return result


if __name__ == "__main__":  # python -m dschat.tools.rw_eval, as the script that calls it
    from dschat.utils.cli import run_script

    run_script(main)
