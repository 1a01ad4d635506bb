"""Command-line flags of the three steps, with DeepSpeed-Chat's names and meanings.

Defaults point at the embedded tiny default (data ``tiny``, model ``tiny-llama``) so every step runs offline
with no arguments; every flag of DeepSpeed-Chat's step scripts is accepted.
"""
import argparse
import functools
import itertools
import math
import os
import re
import shlex
import sys

from dschat.errors import UsageError

SCHEDULERS = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"]
AUTO_PAD_TO_MULTIPLE_OF = 64  # --pad_to_multiple_of on CUDA when not given


# torch.compile modes for the decode step (compile_decode_step): those without CUDA graphs of their own, since the step
# runs inside dschat's graph ("reduce-overhead" and "max-autotune" capture their own).
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


def check_compile_mode(mode, name="compile_decode_step"):
    """``mode`` if it is None or one of ``COMPILE_MODES``; else a ValueError naming them (torch said "Unrecognized
    mode=..." only at the first generation, after the models had loaded)."""
    if mode is not None and mode not in COMPILE_MODES:
        raise ValueError(f"{name}: {mode!r} is not a torch.compile mode for the decode step: one of "
                         f"{', '.join(COMPILE_MODES)}")
    return mode


def resolve_pad_to_multiple_of(value):
    """The padding multiple that --pad_to_multiple_of ``value`` means: None (or "auto") is 64 on CUDA, where
    SDPA's cuDNN backend builds a plan per new input shape, and 1 elsewhere (no such cost: today's shapes)."""
    if value is None or value == "auto":
        import torch

        return AUTO_PAD_TO_MULTIPLE_OF if torch.cuda.is_available() else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--pad_to_multiple_of must be a positive integer or None (auto), got {value!r}")
    return value


def _pad_multiple_flag(text):
    """argparse type of --pad_to_multiple_of: "auto" (None) or a positive integer."""
    if text == "auto":
        return None
    try:
        return resolve_pad_to_multiple_of(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None


def positive_int(text):
    """argparse type: an integer >= 1 (a batch size, a length, a count of epochs), so that 0 or a negative value is
    an error naming the flag rather than a ZeroDivisionError or a sampler's error later."""
    return _bounded_int(text, 1, "a positive integer")


def non_negative_int(text):
    """argparse type: an integer >= 0 (flags where 0 means off or no limit)."""
    return _bounded_int(text, 0, "an integer >= 0")


SEED_RANGE = 2 ** 32  # numpy's, which transformers' set_seed and the data shares seed (torch's is wider)
DEFAULT_SEED = 1234  # the steps' --seed, which holds out the eval share of data without an eval split


def seed_int(text):
    """argparse type: a seed, an integer in [0, 2**32 - 1], so -1 or 2**32 is an error naming the flag rather than
    numpy's "Seed must be between 0 and 2**32 - 1" traceback (or torch's "Overflow when unpacking long long" in the
    tools, once the model had loaded)."""
    what = f"a seed in [0, {SEED_RANGE - 1}]"
    value = _bounded_int(text, 0, what)
    if value >= SEED_RANGE:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def non_negative_float(text):
    """argparse type: a finite number >= 0 (a learning rate; 0 freezes the weights, as torch's optimizers allow; a
    weight decay, which torch's AdamW refuses below 0 and DeepSpeed's Adam took), so a negative or infinite value is an
    error naming the flag rather than the optimizer's traceback, or a loss gone nan, later."""
    return _bounded_float(text, lambda value: value >= 0 and math.isfinite(value), "a number >= 0")


def positive_float(text):
    """argparse type: a finite number > 0 (LoRA's alpha: at 0 the adapters' update is scaled to nothing, so they and,
    with --only_optimize_lora, the whole model train nothing; nan made the first loss nan)."""
    return _bounded_float(text, lambda value: value > 0 and math.isfinite(value), "a number > 0")


GRPO_STD_SCOPES = ("group", "batch", "none")  # (dschat.rlhf.algorithms.grpo_advantages' norm_by_std too)


def grpo_std_scope(value):
    """argparse type of --grpo_norm_by_std: group, batch or none, with the flag's older values 1 (group) and 0
    (none) read as those, so a command line, recipe, notebook (1/0, True/False) or record of before the batch scope
    runs as it did."""
    if isinstance(value, int) and value in (0, 1):  # (True and False among them)
        value = str(int(value))
    return {"1": "group", "0": "none"}.get(value, value)


# A flag added with a new default that trains otherwise, by step: the value a run recorded before it trained with
# (step 1's --loss_agg: each micro-batch's own mean, today's token_mean). Left out, such a record was compared as
# unchanged, and the run's output or checkpoint taken as the new default's. (An output of no step version trains again
# anyway: the rule is at ``steps.common.STEP_VERSIONS``.)
FLAGS_BEFORE_RECORDED = {"step1": {"loss_agg": "token_mean"}}


def recorded_flags_now(flags, step=None):
    """A run's recorded flags (its training_args.json, a checkpoint's) with the values an older dschat recorded as
    this one names them: --grpo_norm_by_std 1 or 0 (before the batch scope) is group or none, the same run; and those
    of ``step`` ("step1", ...) that it predates, the values it trained with (``FLAGS_BEFORE_RECORDED``). No flags (a
    record that stored none, which is not compared): none."""
    if flags:
        flags = {**FLAGS_BEFORE_RECORDED.get(step, {}), **flags}
    if "grpo_norm_by_std" in flags:
        flags = {**flags, "grpo_norm_by_std": grpo_std_scope(flags["grpo_norm_by_std"])}
    return flags


def finite_float(text):
    """argparse type: a finite number, any sign (step 3's reward weights: negative flips a source, 0 leaves it out).
    nan or inf made every reward of the first rollout nan, found after every model had loaded as "reward scores is
    not finite", which names neither flag."""
    return _bounded_float(text, math.isfinite, "a finite number")


def clip_range(text):
    """argparse type of step 3's clip flags (--clip_reward_value, --cliprange, --cliprange_high, --cliprange_value): a
    number > 0, inf for no clipping. torch.clamp with bounds crossed does not clip but flattens: --clip_reward_value -5
    clamped every score to [5, -5], i.e. made each one -5 (0: each 0), so PPO trained on the KL penalty alone; a
    --cliprange or --cliprange_value of 0 or below held the ratio or the value at the old one's edge, where the tokens
    with a positive advantage (the values below their return) took no gradient."""
    return _bounded_float(text, lambda value: value > 0, "a number > 0 (inf: no clipping)")  # (nan fails too)


def unit_interval(text):
    """argparse type of step 3's --gamma and --lam: a number in [0, 1], the range a discount and GAE's lambda have
    meaning in. Outside it the returns grow or flip sign along the answer: --lam 9.5 (0.95 mistyped) made the first
    token's advantage of an 8-token answer scored 1 (values 0) 9.5^7 = 6983373 instead of 0.95^7 = 0.698, and
    --gamma -1 gave REINFORCE++'s tokens returns of -1, 1, -1, ... for a score of 1 (every other token trained
    against the reward)."""
    return _bounded_float(text, lambda value: 0 <= value <= 1, "a number in [0, 1]")  # (nan fails too)


def dropout_probability(text):
    """argparse type of the dropout flags: a number in [0, 1), so that 1.5 or nan is an error naming the flag rather
    than torch's "dropout probability has to be between 0 and 1" traceback at the first forward (1 drops everything:
    the model would train on zeros)."""
    return _bounded_float(text, lambda value: 0 <= value < 1, "a dropout probability in [0, 1)")  # (nan fails too)


def _bounded_float(text, within, what):
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not within(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
    return value


# the argparse types whose range a notebook's value is checked against too
BOUNDED_TYPES = (positive_int, non_negative_int, seed_int, non_negative_float, positive_float, finite_float,
                 clip_range, unit_interval, dropout_probability)
# the argparse types a notebook's value of any kind goes through, as a command line's string does
CONVERTED_TYPES = BOUNDED_TYPES + (grpo_std_scope,)  # (--grpo_norm_by_std's older 1/0, True/False)


def _bounded_int(text, low, what):
    if isinstance(text, float) and not text.is_integer():  # a notebook's 8.5: int() would cut it to 8
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


# The flag a launcher appends to each rank's command line: deepspeed's launcher --local_rank=N, torch.distributed.launch
# (torch 2) --local-rank=N. (A rank's device is read from LOCAL_RANK, which both set too.)
LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")


def add_hidden_local_rank(parser):
    """``LOCAL_RANK_FLAGS`` taken and left out of --help, for a script that reads no rank from it (train.py, the
    tools): ``deepspeed chat.py ...`` passed --local_rank=0, refused as an unrecognized argument."""
    parser.add_argument(*LOCAL_RANK_FLAGS, type=int, default=-1, help=argparse.SUPPRESS)


def add_data_args(parser, default_split="2,4,4"):
    g = parser.add_argument_group("data")
    g.add_argument("--data_path", nargs="*", default=["tiny"],
                   help="Dataset names (e.g. Dahoas/rm-static) or local files as TYPE:PATH "
                        "(jsonl:, json:, parquet:, csv:, disk:); several are blended. 'tiny' = embedded data.")
    g.add_argument("--data_split", type=str, default=default_split,
                   help="Shares of each dataset for steps 1,2,3, e.g. 2,4,4 (disjoint).")
    g.add_argument("--sft_only_data_path", nargs="*", default=[], help="Datasets used only in step 1.")
    g.add_argument("--data_output_path", type=str, default="/tmp/dschat_data_files/",
                   help="Where tokenized datasets are cached (default: %(default)s; DeepSpeed-Chat's is "
                        "/tmp/data_files/; storage every node sees for multi-node).")
    g.add_argument("--data_fields", type=str, default="",
                   help="Field names of local data, e.g. prompt=question,chosen=good,rejected=bad (also messages=, "
                        "label= for TRL's unpaired-preference labels, tools= for the tool schemas, margin= for the "
                        "margin step 2 subtracts (TRL's), system= for a "
                        "system-prompt column, input= and history= for Alpaca's input and history; these three are "
                        "read beside renamed record fields only where named). One mapping per dataset: "
                        "'jsonl:a.jsonl:prompt=question;jsonl:b.jsonl:prompt=instruction' (each after its "
                        "--data_path spec and ':', ';' between them).")
    g.add_argument("--reload_data", action="store_true", help="Rebuild the tokenized data cache.")
    g.add_argument("--pad_to_multiple_of", type=_pad_multiple_flag, default=None, metavar="N",
                   help="Pad every batch's length up to a multiple of N (step 3: prompts, never past "
                        "--max_prompt_seq_len, and prompt + answer sequences). Default auto: 64 on CUDA, 1 (no "
                        "rounding) elsewhere. Why: on CUDA, SDPA's cuDNN attention builds an execution plan for "
                        "each new input shape (0.1-1.7 s of host time per shape on an H200, against ms per step), "
                        "and padding to the batch's longest row makes nearly every batch a new shape. The cost: up "
                        "to N-1 padding tokens per row.")
    return g


def add_model_args(parser, default_model="tiny-llama"):
    g = parser.add_argument_group("model")
    g.add_argument("--model_name_or_path", type=str, default=default_model,
                   help="Hub name, local folder, or a tiny preset (tiny-llama, tiny-opt, tiny-gpt2, ...).")
    g.add_argument("--dropout", type=dropout_probability, default=None,
                   help="Override every dropout of the model config.")
    g.add_argument("--disable_dropout", dest="dropout", action="store_const", const=0.0,
                   help="DeepSpeed-Chat's older spelling of --dropout 0.0.")
    add_tokenizer_args(g)
    return g


def add_tokenizer_args(g):
    """The flags every step reads its tokenizer (and the sequence ends) with."""
    g.add_argument("--num_padding_at_beginning", type=int, default=1,
                   help="Accepted for DeepSpeed-Chat compatibility; dschat finds sequence ends from the "
                        "attention mask, so it has no effect.")
    g.add_argument("--add_eot_token", action="store_true",
                   help="Add --eot_token as the end-of-conversation (EOS) token when the tokenizer has none; answers "
                        "always end with the tokenizer's EOS token.")
    g.add_argument("--eot_token", type=str, default="<|endoftext|>",
                   help="The end-of-conversation token --add_eot_token adds to a tokenizer without an EOS token "
                        "(DeepSpeed-Chat appended it to every answer; dschat ends answers with the tokenizer's EOS).")


def add_precision_args(g):
    g.add_argument("--dtype", type=str, default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="Training precision (default bf16; DeepSpeed-Chat's default was fp16).")
    g.add_argument("--compute_fp32_loss", action="store_true",
                   help="The value head of the reward model and critic computes in fp32 (steps 2 and 3; "
                        "DeepSpeed-Chat's flag). The losses and log-probs are computed in fp32 in any case.")


def add_tensorboard_args(g, path):
    g.add_argument("--enable_tensorboard", action="store_true",
                   help="Write TensorBoard scalars (loss, learning rate, throughput, evaluation).")
    g.add_argument("--tensorboard_path", type=str, default=path,
                   help="TensorBoard log folder (default: %(default)s, in the working directory, as DeepSpeed-Chat's; "
                        "train.py puts it inside its --output-dir).")


def add_lora_scaling_args(g):
    """How LoRA adapts a model, whichever models the step adapts."""
    g.add_argument("--lora_alpha", type=positive_float, default=None,
                   help="LoRA alpha: the update is scaled by alpha / lora_dim. Default 1, i.e. 1 / lora_dim, "
                        "DeepSpeed-Chat's scaling (PEFT's own default is 8).")
    g.add_argument("--only_optimize_lora", action="store_true",
                   help="Freeze the base weights: train only the LoRA adapters.")


def add_training_args(parser, lr=1e-3, batch=16, max_seq_len=512, eval_batch=16):
    g = parser.add_argument_group("training")
    g.add_argument("--per_device_train_batch_size", type=positive_int, default=batch,
                   help="Micro-batch size per GPU (rank).")
    g.add_argument("--per_device_eval_batch_size", type=positive_int, default=eval_batch,
                   help="Evaluation batch size per GPU (rank).")
    g.add_argument("--max_seq_len", type=positive_int, default=max_seq_len,
                   help="Longest tokenized sequence (prompt + answer); longer ones are cut, or skipped when nothing of "
                        "the answer is left.")
    g.add_argument("--learning_rate", type=non_negative_float, default=lr, help="Peak learning rate.")
    g.add_argument("--weight_decay", type=non_negative_float, default=0.0,
                   help="AdamW weight decay (not on biases and norms).")
    g.add_argument("--num_train_epochs", type=positive_int, default=1, help="Passes over the training data.")
    g.add_argument("--gradient_accumulation_steps", type=positive_int, default=1,
                   help="Micro-batches per optimizer step.")
    g.add_argument("--lr_scheduler_type", type=str, default="cosine", choices=SCHEDULERS,
                   help="Learning-rate schedule after the warmup.")
    g.add_argument("--num_warmup_steps", type=non_negative_int, default=0, help="Optimizer steps of linear warmup.")
    g.add_argument("--output_dir", type=str, default=None, help="Where the trained model is saved.")
    g.add_argument("--seed", type=seed_int, default=DEFAULT_SEED,
                   help="Seed of the data order, the data shares and the model's random initialisations.")
    g.add_argument(*LOCAL_RANK_FLAGS, type=int, default=-1, help="Set by the deepspeed launcher.")
    g.add_argument("--gradient_checkpointing", action="store_true",
                   help="Activation checkpointing: less memory, one more forward per step.")
    g.add_argument("--eval_interval", type=non_negative_int, default=0,
                   help="Evaluate every N steps (0: at the end only).")
    g.add_argument("--eval_iters", type=non_negative_int, default=100,
                   help="At most this many eval batches (of --per_device_eval_batch_size) at each evaluation, "
                        "counted over all ranks: the first N x per_device_eval_batch_size eval records, shared among "
                        "the ranks, so any number of ranks scores the same ones; 0: the whole eval split.")
    g.add_argument("--print_loss", action="store_true",
                   help="Print the loss of every step: the mean of its micro-batches' losses; on several ranks, rank "
                        "0's (its line says so). Step 1's (--loss_agg global_token_mean): the token mean over all "
                        "its micro-batches and ranks.")
    g.add_argument("--max_steps", type=non_negative_int, default=0, help="Stop after N optimizer steps (0: no limit).")
    g.add_argument("--save_interval", type=non_negative_int, default=None,
                   help="Checkpoint every N optimizer steps into <output_dir>/checkpoints, the last two kept (0: off; "
                        "not given: off, and with --resume the interval of the run resumed).")
    g.add_argument("--resume", action="store_true",
                   help="Continue from the last checkpoint in <output_dir>/checkpoints (without it, a run removes an "
                        "earlier run's checkpoints there).")
    return g


def add_zero_tuning_args(g):
    """DeepSpeed knobs that cost host time on every step (shared by all steps)."""
    from dschat.models.layers import DEFAULT_ZERO3_FETCH, ZERO3_FETCH_UNITS

    g.add_argument("--check_grad_overflow", action="store_true",
                   help="bf16 at ZeRO-1/2: check every gradient tensor for inf/NaN before each optimizer step and "
                        "skip the step if one has any (DeepSpeed 0.19's default). Off in dschat: the check runs a few "
                        "small kernels per parameter tensor from Python (0.28 s of host time per PPO iteration of an "
                        "OPT-1.3B actor and OPT-350m critic, docs/benchmarks.md); instead dschat stops with an error "
                        "after a step that applied an inf/NaN gradient norm. ZeRO-0, ZeRO-3, fp16 and fp32 at "
                        "ZeRO-1/2 skip such steps in any case.")
    g.add_argument("--zero3_fetch", default=DEFAULT_ZERO3_FETCH, choices=ZERO3_FETCH_UNITS,
                   help="ZeRO-3: the unit whose parameters DeepSpeed gathers and releases with one hook. layer: each "
                        "decoder layer (dschat's default: a tenth of the hooks, so less host time per forward and "
                        "backward); module: every submodule (DeepSpeed's default). Same numbers either way (to fp32 "
                        "rounding); measurements in docs/benchmarks.md. Falls back to module, with a message, when "
                        "the largest ModuleList is not clearly the decoder stack or the model drops layers "
                        "(layerdrop).")


def add_deepspeed_args(parser):
    g = parser.add_argument_group("deepspeed")
    g.add_argument("--offload", action="store_true", help="Offload optimizer (and ZeRO-3 parameters) to CPU.")
    add_precision_args(g)
    g.add_argument("--zero_stage", type=int, default=0, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage.")
    add_tensorboard_args(g, None)
    add_zero_tuning_args(g)
    add_deepspeed_config_args(g)
    return g


def add_deepspeed_config_args(g):
    """DeepSpeed's config-file flags (what ``deepspeed.add_config_arguments`` adds), with ``--deepspeed`` also taking
    the file, as HF Trainer and many DeepSpeed-Chat walk-throughs write it (``--deepspeed ds_config.json``)."""
    g.add_argument("--deepspeed_config", "--deepscale_config", dest="deepspeed_config", default=None, metavar="JSON",
                   help="A DeepSpeed config file merged over the one dschat builds from its flags: the file wins "
                        "(e.g. zero_optimization tuning, offload, gradient clipping, communication), except "
                        "for the batch sizes, accumulation, ZeRO stage, precision and hybrid-engine switch, which it "
                        "may only repeat or leave \"auto\" (set those with their flags). dschat builds the optimizer "
                        "and scheduler from the flags: such blocks only with \"auto\" parameters (HF's files).")
    g.add_argument("--deepspeed", nargs="?", const=True, default=False, metavar="JSON",
                   help="Accepted as DeepSpeed's launcher convention; with a file, the same as --deepspeed_config.")
    g.add_argument("--deepscale", action="store_true", help=argparse.SUPPRESS)  # DeepSpeed's old name


def add_lora_args(parser):
    g = parser.add_argument_group("lora")
    g.add_argument("--lora_dim", type=non_negative_int, default=0, help="LoRA rank (0: no LoRA).")
    g.add_argument("--lora_module_name", type=str, default="",
                   help="Adapt Linear modules whose path contains this (empty: all but output heads).")
    add_lora_scaling_args(g)
    g.add_argument("--lora_learning_rate", type=non_negative_float, default=5e-4,
                   help="Learning rate of the LoRA adapters.")
    return g


class SaidOnceParser(argparse.ArgumentParser):
    """argparse's usage and error, said once on a machine where several ranks parse the same flags (the steps', and
    train.py's under ``deepspeed train.py``)."""

    def error(self, message):
        from dschat.utils.cli import first_to_say

        if first_to_say(message):
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


# Actions a flag may be given several times for, each adding to the last (none of the steps' flags is one now).
REPEATABLE_ACTIONS = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction,
                      argparse._ExtendAction)


def flag_groups(parser, argv):
    """``argv`` as [(dest, tokens)]: each flag of ``parser`` with the values after it; dest None for tokens before the
    first flag, a flag ``parser`` lacks (with its values: argparse says it is unrecognized) and all from a ``--`` on.
    (allow_abbrev is off in the parsers this reads: a flag is one of its option strings exactly.)"""
    groups = []
    for index, token in enumerate(argv):
        text = token if isinstance(token, str) else ""  # (a value may be a Path in a list from Python)
        if text == "--":
            groups.append((None, list(argv[index:])))
            break
        action = parser._option_string_actions.get(text.split("=", 1)[0]) if text.startswith("-") else None
        if action is not None or names_a_flag(text) or not groups:
            groups.append((action.dest if action is not None else None, [token]))
        else:
            groups[-1][1].append(token)
    return groups


def names_a_flag(text):
    """Whether argparse reads the token ``text`` as a flag (a known one or not), not a value: ``--name``, but not
    one with a space (``--prompts "Hi" "-- and you?"``: argparse takes it for a prompt)."""
    return text.startswith("--") and " " not in text


def repeated_flags(parser, argv):
    """The flags of ``parser`` that ``argv`` gives more than once (by what they set: ``--dropout 0.1 --disable_dropout``
    too), each as "--flag (N times)": argparse keeps the last one's value and drops the others', unsaid."""
    spellings, counts = {}, {}
    for dest, tokens in flag_groups(parser, argv):
        action = parser._option_string_actions.get(tokens[0].split("=", 1)[0])
        if dest is None or isinstance(action, (argparse._HelpAction, *REPEATABLE_ACTIONS)):
            continue
        counts[dest] = counts.get(dest, 0) + 1
        spellings.setdefault(dest, []).append(tokens[0].split("=", 1)[0])
    return [f"{' / '.join(dict.fromkeys(spellings[dest]))} ({count} times)" for dest, count in counts.items()
            if count > 1]


def without_flags_given_in(parser, argv, later):
    """``argv`` less each flag of ``parser`` (with its values) that a later one of ``argv`` or ``later`` sets again:
    defaults that later settings replace, so that the merged command line gives each flag once."""
    groups = flag_groups(parser, argv)
    set_later = {dest for dest, _ in flag_groups(parser, later)}
    kept = []
    for index, (dest, tokens) in enumerate(groups):
        if dest is not None and (dest in set_later or any(d == dest for d, _ in groups[index + 1:])):
            continue
        kept += tokens
    return kept


# A token argparse reads as a negative number (a value) rather than a flag: "-" and a digit, or "-." and a digit, in any
# float spelling (-1e-3, -1E+2, -.5e-1), Python 3.14's rule. Before it, argparse took only -1 and -.5 forms, so
# ``--entropy_coef -1e-3`` said "expected one argument" unless given as ``--entropy_coef=-1e-3``.
NEGATIVE_NUMBER = re.compile(r"-\.?\d")


class HintingParser(SaidOnceParser):
    """An unrecognized flag is the first error said, with the flags it may have meant (``flags_meant``): argparse
    named no flag for ``chat.py --max-new-tokens 5`` or train.py's ``--actor_model`` (its flags are spelled with
    "-", the steps' with "_"), and told ``rw_eval.py --model X`` only that --model_name_or_path is required. A
    negative number in any float spelling is a value (``NEGATIVE_NUMBER``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (a private attribute of argparse's: a Python without it keeps its own rule; argparse still reads such a
        # token as a flag where the parser has an option that looks like a negative number, -1)
        if hasattr(self, "_negative_number_matcher"):
            self._negative_number_matcher = NEGATIVE_NUMBER

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else args
        self.refuse_unknown_flags(argv)
        self.refuse_misdashed_values(argv)
        self.refuse_misdashed_before_required(argv)
        parsed, extras = self.parse_known_args(argv, namespace)
        self.refuse_extras(extras)
        return parsed

    def refuse_extras(self, extras):
        """argparse's error for the tokens ``extras`` it did not take, with the hints (a flag typed with a pasted dash
        is a value to argparse, one with one "-" an unknown short flag)."""
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self.hint(extras)}")

    def refuse_misdashed_before_required(self, argv):
        """A flag typed with one "-" or a pasted dash (``misdashed_flag``) that argparse leaves over is said before a
        missing required flag: ``rw_eval -model_name_or_path x`` was told only that --model_name_or_path is required,
        though the user had typed it. argparse checks the required flags before it returns what it left over, so
        this parses once with none required (an error of another flag's value comes first in both); it only changes
        which error a command line that fails anyway is told."""
        required = [action for action in self._actions if action.required] + \
            [group for group in self._mutually_exclusive_groups if group.required]
        if not required or not any(misdashed_flag(str(token)) for token in argv):
            return
        for each in required:
            each.required = False
        try:
            _, extras = self.parse_known_args(argv)
        finally:
            for each in required:
                each.required = True
        if any(misdashed_flag(token) for token in extras):
            self.refuse_extras(extras)

    def refuse_misdashed_values(self, argv):
        """A flag typed with a pasted dash where argparse reads it as a flag's value is an error with its hint
        (``misdashed_hint``), after a flag of several values (``--data_path a b \u2014learning_rate 1e-3``: more
        datasets, "unknown dataset" said of the first) or one of a value (``--output_dir \u2014learning_rate 1e-3``:
        "unrecognized arguments: 1e-3" and no more), where after a switch it is left over and hinted
        (``refuse_extras``). A value so typed that names no flag it could mean (a prompt "\u2014Hi") is a value."""
        taken = [(str(tokens[0]), values) for _, tokens in flag_groups(self, argv)
                 if (values := self.misdashed_values(tokens))]
        if taken:
            self.error("; ".join(f"argument {option}: {' '.join(values)} read as its value{'s' * (len(values) > 1)}"
                                 for option, values in taken)
                       + self.hint([value for _, values in taken for value in values if typed_dashes_as_flag(value)]))

    def misdashed_values(self, tokens):
        """The values argparse reads for the flag of a ``flag_groups`` group (``values_read``), from the first typed
        with a pasted dash that a hint names a flag for (``misdashed_hint``) on; else []."""
        action = self._option_string_actions.get(str(tokens[0]))  # (``--data_path=a b``: one value; b left over)
        values = values_read(action, tokens[1:]) if action is not None else []
        cut = next((index for index, value in enumerate(values)
                    if typed_dashes_as_flag(value) and self.misdashed_hint(value)), len(values))
        return values[cut:]

    def refuse_unknown_flags(self, argv):
        """Each ``--flag`` of ``argv`` this parser lacks (with the values after it) is an error, before argparse's
        own checks, which say a missing required flag first. One right after a flag that wants a value is left to
        argparse: ``--prompt --hi`` "expected one argument" (give ``--prompt=--hi``). With -h/--help, argparse's help
        and status 0 (``chat.py --max-new-tokens 5 --help``: help, as argparse gives it before any unknown flag)."""
        groups = flag_groups(self, argv)
        if any(dest == "help" for dest, _ in groups):
            return
        unknown, wants_value = [], False
        for dest, tokens in groups:
            text = str(tokens[0])
            if dest is None and names_a_flag(text) and text != "--" and not wants_value:
                unknown += map(str, tokens)
            action = self._option_string_actions.get(text.split("=", 1)[0]) if dest is not None else None
            wants_value = action is not None and action.nargs in (None, "+") and "=" not in text and len(tokens) == 1
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}{self.hint(unknown)}")

    def hint(self, unknown):
        """What the unrecognized tokens ``unknown`` may be, a line each under argparse's error (the one layout of
        the steps', the tools' and train.py's): "" if nothing is known of any."""
        return "".join(f"\n  {said}" for said in map(self.token_hint, unknown) if said)

    def token_hint(self, token):
        """What the unrecognized token ``token`` may be, in words, or None."""
        return self.flag_hint(token.split("=", 1)[0]) if token.startswith("--") else self.misdashed_hint(token)

    def misdashed_hint(self, token):
        """A flag typed with a typographic dash (``–learning_rate``: "--" as a web page or word processor shows it,
        which argparse takes for a value) or with one "-" (``-learning_rate``) (``misdashed_flag``): the flag it spells
        or may have meant, else what ``flag_hint`` says of that flag (another step's, train.py's step flags:
        ``–entropy_coef`` to train.py said nothing more), in words, or None."""
        found = misdashed_flag(token)
        if found is None:
            return None
        flag, how = found
        typed = f"{token.split('=', 1)[0]}: {how}"
        meant = [flag] if flag in self.long_flags() else self.flags_meant(flag)
        if meant:
            return f"{typed}; did you mean {' or '.join(meant)}?"
        said = self.flag_hint(flag)
        return f"{typed}; {said}" if said else None

    def flag_hint(self, given):
        """What the unknown flag ``given`` may be, in words, or None."""
        meant = self.flags_meant(given)
        return f"{given}: did you mean {' or '.join(meant)}?" if meant else None

    def flags_meant(self, given):
        return one_spelling_each(close_names(given, self.long_flags()), self._option_string_actions.__getitem__)

    def long_flags(self):
        """The long flags a hint may name, the one rule of every hint: not those --help hides (a tool's refused flags:
        ppo_eval's --sft_only_data_path, not named for --sft_only_data_pth nor for a pasted dash's
        –sft_only_data_path)."""
        return [option for action in self._actions if action.help is not argparse.SUPPRESS
                for option in action.option_strings if option.startswith("--")]


# Dashes a web page or word processor shows for "-" or "--" (hyphen, non-breaking hyphen, figure dash, en dash, em
# dash, horizontal bar, minus sign): a command line pasted from one has them.
TYPOGRAPHIC_DASHES = "\u2010\u2011\u2012\u2013\u2014\u2015\u2212"


def read_as_a_value(token):
    """Whether argparse reads ``token`` as a value where a flag takes one, not as a flag: no "-" first, or a
    negative number (``NEGATIVE_NUMBER``), a lone "-" or a token with a space (a prompt "-- and you?")."""
    return not token.startswith("-") or token == "-" or " " in token or bool(NEGATIVE_NUMBER.match(token))


def values_read(action, tokens):
    """The ``tokens`` after a flag (of ``action``, given without "=") that argparse reads as its values: those it
    reads as values (``read_as_a_value``), as many as the flag takes."""
    readable = list(itertools.takewhile(read_as_a_value, map(str, tokens)))
    takes = {None: 1, "?": 1}.get(action.nargs, action.nargs)
    return readable[:takes] if isinstance(takes, int) else readable


def typed_dashes_as_flag(token):
    """``token``'s flag (before any "=") with the dashes it begins with as "--", where the first is a typographic one
    (``–lr`` is ``--lr``); else None."""
    name = token.split("=", 1)[0].lstrip(TYPOGRAPHIC_DASHES + "-")
    if not token or token[0] not in TYPOGRAPHIC_DASHES or not name or " " in name:
        return None
    return f"--{name}"


# A long flag's name typed after one "-" (``-learning_rate``, ``-output-dir``): two characters or more, as "-h" is a
# short flag's spelling; a letter first, as "-1e-3" is a number.
SINGLE_DASH_NAME = re.compile(r"-[A-Za-z][\w-]+")


def misdashed_flag(token):
    """``token``'s flag (before any "=") as typed with "--", and how it was typed instead, in words, where it begins
    with a typographic dash (``typed_dashes_as_flag``) or with one "-" and a long flag's name (``SINGLE_DASH_NAME``);
    else None."""
    if (flag := typed_dashes_as_flag(token)) is not None:
        return flag, "begins with a typographic dash, not '--'"
    typed = token.split("=", 1)[0]
    return (f"-{typed}", "begins with one '-', not '--'") if SINGLE_DASH_NAME.fullmatch(typed) else None


def one_spelling_each(flags, action_of):
    """``flags`` less the other spellings of one already among them (``action_of``: a flag's action, the same for
    each of its spellings): "--local_rank or --local-rank" named one flag twice."""
    first = {}
    for flag in flags:
        first.setdefault(action_of(flag), flag)
    return list(first.values())


def close_names(given, flags):
    """The names among ``flags`` (a parser's flags, or any names: the known datasets') that ``given`` may have meant:
    one spelled with the other separator ("-" for "_"), else those it begins (the parsers take no abbreviations; at
    most three), else the closest spellings."""
    import difflib

    def plain(flag):
        return flag.replace("-", "_")

    same = [flag for flag in flags if plain(flag) == plain(given)]
    begun = [flag for flag in flags if plain(flag).startswith(plain(given))]
    by_plain = {plain(flag): flag for flag in flags}
    return same or (begun if len(begun) <= 3 else []) or \
        [by_plain[name] for name in difflib.get_close_matches(plain(given), by_plain, n=2, cutoff=0.8)]


class StepParser(HintingParser):
    """An unrecognized flag's error names the step's flags it may have meant: the role's flags of another step's
    (step 3's ``--actor_lora_dim`` and ``--critic_lora_dim`` for ``--lora_dim``; step 1's ``--lora_dim`` for
    ``--actor_lora_dim``), else the closest spellings (``close_names``), else the steps that take it. On the command
    line (``sys.argv``) a flag given twice is an error, as in train.py (``check_given_once``)."""

    def parse_args(self, args=None, namespace=None):
        if args is None:  # (a list from Python, a notebook's or a test's, keeps argparse's last-wins)
            args = sys.argv[1:]
            self.check_given_once(args)
        return super().parse_args(args, namespace)

    def check_given_once(self, argv):
        """A user's flag given twice (``repeated_flags``) is an error: argparse kept the last one's value, unsaid
        (``--learning_rate 1e-4 ... --learning_rate 1e-3`` trained at 1e-3)."""
        if repeated := repeated_flags(self, argv):
            self.error(f"given more than once: {', '.join(repeated)}; give each once")

    def flags_meant(self, given):
        return [flag for flag in self.long_flags() if _with_role(flag, given) or _with_role(given, flag)] or \
            super().flags_meant(given)

    def flag_hint(self, given):
        """Else another step's flag (step 3's --print_answers given to step 1) names the steps that take it."""
        if said := super().flag_hint(given):
            return said
        steps = steps_taking(given, under_train_py=self.prog.startswith("train.py"))
        return f"{given}: a flag of {' and '.join(steps)}" if steps else None


class TrainPyParser(HintingParser):
    """train.py's parser: an unrecognized flag that a step takes, or that train.py spells otherwise, says how to pass
    it (``pipeline.step_flag_hint``); else the train.py flags it may have meant; else the step flags it may have meant
    and how to pass them (``pipeline.close_step_flags_hint``: ``--entropy_coeff`` for step 3's --entropy_coef)."""

    def flag_hint(self, given):
        from dschat.pipeline import close_step_flags_hint, step_flag_hint

        return step_flag_hint(given) or super().flag_hint(given) or close_step_flags_hint(given)

    def misdashed_values(self, tokens):
        """As the steps' (``HintingParser.misdashed_values``), but none for a --stepN-args: its value is the step's
        flags, where a pasted dash is the step's to tell (``pipeline.check_step_args``, before any step runs).
        ``--step3-args "\u2014enable_ema"`` was told "read as its value" and to give --enable_ema inside --step3-args,
        where it was."""
        return [] if str(tokens[0]) in STEP_ARGS else super().misdashed_values(tokens)

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else args
        self.refuse_unquoted_step_args(argv)
        return super().parse_args(argv, namespace)

    def refuse_unquoted_step_args(self, argv):
        """A step's flags given to its --stepN-args unquoted (``--step3-args --entropy_coef 0.01``: the shell splits
        them, --step3-args takes the first and the others are left over) are an error that says to give them as one
        quoted string, and which: argparse said only "unrecognized arguments: 0.01". (With -h/--help, the help.) A
        flag typed with one "-" or a pasted dash (``misdashed_flag``) ends them: it is told as argparse's other hints
        tell it (``--step3-args --enable_ema -recipe grpo`` was told to give '--enable_ema -recipe grpo' to step 3);
        one that train.py takes by another name is told so too (``train_py_spelt``). Each --stepN-args given so is
        told in the one error, a line each: the first one's alone left the user a second error to meet."""
        groups = flag_groups(self, argv)
        if any(dest == "help" for dest, _ in groups):
            return
        fixes = [fix for index in range(len(groups)) if (fix := unquoted_step_args(groups, index))]
        if fixes:
            unknown = [token for spilled, misdashed, _ in fixes for token in spilled + misdashed]
            self.error(f"unrecognized arguments: {' '.join(unknown)}" + "".join(
                f"\n  {quoted}{self.hint(train_py_spelt(spilled) + misdashed)}" for spilled, misdashed, quoted in fixes))


def unquoted_step_args(groups, index):
    """Where ``flag_groups``' group ``index`` is a --stepN-args given its step's flags unquoted: (the tokens left over
    after its string, those from a flag typed with one "-" or a pasted dash on, and the quoted form to give), else
    None."""
    option, value, tokens_left = step_args_value(groups[index][1])
    step = STEP_ARGS.get(option)
    if step is None:
        return None
    left, misdashed = split_at_misdashed(tokens_left)
    spilled = left + (step_flags_after(step, groups[index + 1:]) if not misdashed else [])
    # (tokens left after a string that is a flag: that flag's value; or this step's flags after the string)
    if not spilled or not (value is None or value.startswith("-") or len(spilled) > len(left)):
        return None
    whole, repeated = step_string_of(step, value, spilled)
    kept = f", each flag once (the last of {', '.join(repeated)} kept)" if repeated else ""
    return spilled, misdashed, (f"{option} takes step {step}'s flags as one string{kept}: give them quoted, "
                                f"{option} {shlex.quote(whole)}")


def step_string_of(step, value, spilled):
    """The one --stepN-args string of ``step``'s flags that a string ``value`` (or None) and the tokens ``spilled``
    after it give, each token quoted as the shell needs (``--step3-args --enable_ema --data_path "my file.json"`` was
    advised '--enable_ema --data_path my file.json': two datasets) and each flag once (``last_of_each_step_flag``),
    and the flags it gave more than once; a value shlex cannot split is kept as typed (the step says what is wrong
    with it)."""
    try:
        tokens = shlex.split(value or "") + spilled
    except ValueError:
        return " ".join(part for part in (value, *spilled) if part), []
    tokens, repeated = last_of_each_step_flag(step, tokens)
    return shlex.join(tokens), repeated


def last_of_each_step_flag(step, tokens):
    """``tokens`` (step ``step``'s flags) with each flag once, the last one given (as argparse keeps it), and those
    given more than once (``repeated_flags``), by each step script of that number (step 2's: the reward model's and
    DPO's): the step refuses a flag given twice, and ``--step1-args "--lora_dim 2" --lora_dim 3`` was advised
    '--lora_dim 2 --lora_dim 3'."""
    repeated = []
    for _, number, parser, _, _ in step_scripts():
        if number == step:
            built = parser()
            repeated += [flag for flag in repeated_flags(built, tokens) if flag not in repeated]
            tokens = without_flags_given_in(built, tokens, [])
    return tokens, repeated


# train.py's --stepN-args options, each step N's flags as one string: option -> N. The one table of them: train.py
# adds them and joins a lone flag after one to it (``step_args_as_values``); ``unquoted_step_args`` reads them.
STEP_ARGS = {f"--step{step}-args": step for step in (1, 2, 3)}


def step_args_value(tokens):
    """A --stepN-args option's tokens (``flag_groups``) as the option, its value (None where the next token was a
    flag) and the tokens left after that value."""
    option, sep, value = str(tokens[0]).partition("=")
    if sep:
        return option, value, list(map(str, tokens[1:]))
    return option, (str(tokens[1]) if len(tokens) > 1 else None), list(map(str, tokens[2:]))


def train_py_spelt(tokens):
    """The flags among ``tokens`` that train.py takes by another name (``pipeline.TRAIN_PY_NAMES``: --output_dir for
    its --output-dir): after a --stepN-args, a step's or train.py's, so told both ways."""
    from dschat.pipeline import TRAIN_PY_NAMES

    return [token for token in tokens if token.split("=", 1)[0] in TRAIN_PY_NAMES]


def split_at_misdashed(tokens):
    """``tokens`` before the first flag typed with one "-" or a pasted dash (``misdashed_flag``), and from it on."""
    cut = next((index for index, token in enumerate(tokens) if misdashed_flag(token)), len(tokens))
    return tokens[:cut], tokens[cut:]


def step_flags_after(step, groups):
    """The tokens of the unknown flags (``flag_groups``' groups) that follow a --stepN-args and that step ``step``
    takes, up to the first that is not: step N's flags given after its string, outside it."""
    taken = []
    for dest, tokens in groups:
        flag = str(tokens[0]).split("=", 1)[0]
        if dest is not None or not any(taking == step for _, taking, _, _ in scripts_taking(flag)):
            break
        taken += map(str, tokens)
    return taken


def step_scripts():
    """(name, step number, parser factory, folder under training/, train.py's option passing it) of each step
    script."""
    return (("step 1", 1, step1_parser, "step1_sft", "--step1-args"),
            ("step 2", 2, step2_parser, "step2_rm", "--step2-args"),
            ("DPO", 2, step2_dpo_parser, "step2_dpo", "--step2-args with --recipe dpo"),
            ("step 3", 3, step3_parser, "step3_ppo", "--step3-args"))


def scripts_taking(flag):
    """(name, step number, folder under training/, train.py's option passing it) of each step script whose parser
    takes ``flag``: the one place that works out which steps take a flag (``steps_taking``, train.py's
    ``pipeline.step_flag_hint``)."""
    return [(name, step, folder, option) for name, step, parser, folder, option in step_scripts()
            if flag in parser()._option_string_actions]


def step_flag_spellings():
    """{long flag of the step scripts that a hint may name (``long_flags``): all the spellings of its option, as the
    first step script taking it has them}, in the steps' order (train.py's ``pipeline.close_step_flags_hint``, naming
    each option once by ``one_spelling_each``: step 3's --generation_batches and --generation_batch_numbers are one)."""
    spellings = {}
    for _, _, parser, _, _ in step_scripts():
        built = parser()
        for flag in built.long_flags():
            spellings.setdefault(flag, tuple(built._option_string_actions[flag].option_strings))
    return spellings


def steps_taking(flag, under_train_py=False):
    """The step scripts whose parsers take ``flag``, each as "step 3 (training/step3_ppo/main.py)", or, for a flag
    given in train.py's --stepN-args, with the --stepN-args that passes it: "step 3 (--step3-args)"."""
    return [f"{name} ({option if under_train_py else f'training/{folder}/main.py'})"
            for name, _, folder, option in scripts_taking(flag)]


def _with_role(flag, plain):
    """``flag`` is ``plain`` for one role: ``--actor_lora_dim`` of ``--lora_dim``."""
    role, sep, rest = flag[2:].partition("_")
    return bool(sep) and rest == plain[2:] and role in ("actor", "critic")


class DefaultSayingFormatter(argparse.HelpFormatter):
    """--help with each flag's default where its help does not give it: the steps' --learning_rate, --seed,
    --output_dir, ... printed none. (A switch's default, off, goes unsaid.)"""

    def _get_help_string(self, action):
        text, default = action.help or "", action.default
        if (default is None or default is argparse.SUPPRESS or isinstance(default, bool) or default in ("", [])
                or not action.option_strings or "default" in text.lower()):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})" if text else f"Default: {shown.replace('%', '%%')}."


def new_parser(description):
    """A step's parser. No abbreviations (``--zero_s 3`` for ``--zero_stage``): flags travel between train.py and the
    steps, where a prefix would quietly become whichever flag it happens to start."""
    return StepParser(description=description, allow_abbrev=False, formatter_class=DefaultSayingFormatter)


def step1_parser():
    p = new_parser("Step 1: supervised fine-tuning of a causal LM.")
    add_data_args(p)
    add_model_args(p)
    add_training_args(p, lr=1e-3, batch=16, max_seq_len=512)
    add_deepspeed_args(p)
    add_lora_args(p)
    p.add_argument("--include_prompt_in_loss", action="store_true",
                   help="Train on prompt tokens too (DeepSpeed-Chat did); default: answer tokens only.")
    p.add_argument("--multiturn", action="store_true",
                   help="Train on every assistant turn of a messages record (OpenRLHF's flag); default: the last "
                        "one, the earlier turns are prompt.")
    p.add_argument("--loss_agg", type=str, default="global_token_mean", choices=["global_token_mean", "token_mean"],
                   help="How the trained tokens' losses make an optimizer step's loss (step 3's --loss_agg names). "
                        "global_token_mean: their mean over all the step's micro-batches "
                        "(--gradient_accumulation_steps) on all ranks, every token weighing alike (TRL's SFTTrainer, "
                        "HF's Trainer since transformers 4.46); token_mean (DeepSpeed-Chat's, OpenRLHF's): the mean of "
                        "each micro-batch's own token mean, so a token of a micro-batch of few tokens weighs more. "
                        "DPO: the same for its --rpo_alpha NLL term (its pairs' loss is per pair).")
    p.set_defaults(tensorboard_path="step1_tensorboard", output_dir="output/step1_sft")
    return p


def step2_parser():
    p = new_parser("Step 2: reward-model training on preference pairs.")
    add_data_args(p)
    add_model_args(p)
    add_training_args(p, lr=5e-5, batch=16, max_seq_len=512)
    add_deepspeed_args(p)
    add_lora_args(p)
    p.set_defaults(tensorboard_path="step2_tensorboard", output_dir="output/step2_rm")
    return p


# Step 1's flags that DPO's parser keeps (so their error says why) but refuses: its log-probs cover the answers only
DPO_REFUSED_STEP1_FLAGS = ("include_prompt_in_loss", "multiturn")


def step2_dpo_parser():
    """DeepSpeed-Chat's step2_dpo_finetuning: step 1's flags (the policy trains like the SFT model) plus DPO's."""
    p = step1_parser()
    p.description = "Step 2 (DPO): direct preference optimization of the SFT model on preference pairs."
    for action in p._actions:  # (their step-1 help said they train more tokens; DPO's --help listed that)
        if action.dest in DPO_REFUSED_STEP1_FLAGS:
            action.help = ("Step 1's flag, an error here: DPO compares the final answers, so its log-probs cover "
                           "their tokens only.")
    g = p.add_argument_group("DPO")
    g.add_argument("--beta", type=float, default=0.1,
                   help="Temperature of the implicit reward beta * (log pi - log pi_ref); higher keeps the "
                        "policy closer to the reference.")
    g.add_argument("--label_smoothing", type=float, default=0.0,
                   help="cDPO: the probability that a preference label is flipped, in [0, 0.5).")
    g.add_argument("--rpo_alpha", type=float, default=0.0,
                   help="Weight of an SFT (negative log-likelihood) term on the chosen answers added to the DPO "
                        "loss (RPO, TRL's rpo_alpha), per chosen token (--loss_agg says over what); 0 = plain DPO.")
    g.add_argument("--offload_reference_model", action="store_true",
                   help="Offload the frozen reference model's parameters to CPU (under ZeRO-3, "
                        "where the reference is sharded like the policy).")
    p.set_defaults(tensorboard_path="step2_dpo_tensorboard", output_dir="output/step2_dpo")
    return p


def flag_dests(parser):
    """The attribute names a parser's flags set (``parser._actions``: argparse has no public list)."""
    return {action.dest for action in parser._actions}


@functools.cache
def step_flag_dests():
    """The attribute names every step's flags set, but ``local_rank`` (each rank's own): what the ranks of a launch
    must agree on (a notebook's namespace may hold other attributes, such as DeepSpeed-Chat's per-rank
    ``global_rank``)."""
    parsers = (step1_parser(), step2_parser(), step2_dpo_parser(), step3_parser())
    return frozenset().union(*map(flag_dests, parsers)) - {"local_rank", "help"}


def step_settings(parser, args=None):
    """A step's settings: parsed from a command line (a list; None: ``sys.argv``), or a dict or any object completed
    with every default (``namespace_with_defaults``), as step 3 takes them; a complete namespace as it is."""
    if args is None or isinstance(args, (list, tuple)):
        return parser.parse_args(args)
    if isinstance(args, argparse.Namespace) and flag_dests(parser) <= set(vars(args)):
        return args
    return namespace_with_defaults(parser, args)


def namespace_with_defaults(parser, overrides=None):
    """A parsed namespace with every default, updated from a dict or any object (the notebook-friendly form).

    A key is a flag's destination or any of its option names (DeepSpeed-Chat's older ones too) and means what the flag
    means on the command line: ``disable_actor_dropout=True`` sets ``actor_dropout`` to 0.0 (False leaves it),
    ``no-enable_cuda_graph=True`` turns graphs off, strings are converted and the flags' checks apply
    (``ppo_epochs=0`` is an error); a switch (``enable_hybrid_engine``, ``disable_actor_dropout``,
    ``no-enable_cuda_graph``, ...) takes a bool or one of "true"/"1"/"yes"/"on" and "false"/"0"/"no"/"off" in any
    case, and any other string is an error. An object's attributes are read by those names, class attributes included.
    Destinations are applied first, then other names that carry a value other than None or the default (a
    DeepSpeed-Chat namespace holds both ``deepspeed_config=None`` and ``deepscale_config="ds.json"``). Keys that
    name no flag are an error in a dict (a typo would otherwise be a silent default; those starting with "_",
    dschat's own attributes of a namespace copied with ``vars``, are left out); an object's are kept and
    listed once (a DeepSpeed-Chat namespace carries its own, e.g. ``global_rank``). A dict that gives one flag other
    values under two of its names is an error too (``check_one_value_per_flag``). A None for a flag with a default,
    a dict's or an object's, leaves the default (``_none_for_a_default``)."""
    args = parser.parse_args([])
    if overrides is None:
        return args
    if isinstance(overrides, (str, bytes, int, float, list, tuple)):  # an object without the flags' attributes
        raise UsageError(f"args is a {type(overrides).__name__}: give a dict of settings (flag names as keys), an "
                         "object with them as attributes, or the step's parsed namespace")
    # an option name means its own flag: "actor_dropout" is --actor_dropout, not --disable_actor_dropout (same dest)
    by_name = {action.dest: action for action in parser._actions if action.option_strings}
    by_name.update({option.lstrip("-"): action for action in parser._actions for option in action.option_strings})
    items = _dict_settings(overrides) if isinstance(overrides, dict) else _attributes(overrides, by_name)
    unknown = sorted(key for key in items if key not in by_name)
    if unknown and isinstance(overrides, dict):
        raise UsageError(f"unknown setting(s) {unknown}: they name no flag (see the step's --help)")
    if isinstance(overrides, dict):
        check_one_value_per_flag(parser, by_name, items)
    if unknown and tuple(unknown) not in _REPORTED_UNKNOWN:
        _REPORTED_UNKNOWN.add(tuple(unknown))
        print(f"[dschat] args: {unknown} name no flag; kept as attributes, not used by dschat")
    for key in sorted(items, key=lambda k: k in by_name and by_name[k].dest != k):  # destinations first
        action, value = by_name.get(key), items[key]
        if _none_for_a_default(parser, action, value):
            continue
        if action is None:
            setattr(args, key, value)
        elif action.dest == key or (value is not None and value != parser.get_default(action.dest)):
            _set_from_option(args, action, key, value)
    return args


_REPORTED_UNKNOWN = set()


def check_one_value_per_flag(parser, by_name, settings):
    """A dict of ``settings`` that gives one flag other values under two of its names, neither its default
    (``per_device_generation_batch_size=4`` and DeepSpeed-Chat's ``per_device_train_batch_size=8``; ``actor_dropout``
    and ``disable_actor_dropout``) is an error, as the command line refuses a flag given twice: one of them won,
    unsaid. (One left at its default, as a copy of ``vars(engine.args)`` holds them, leaves the other to win.)"""
    values, defaults = {}, vars(parser.parse_args([]))
    for key, value in settings.items():
        action = by_name[key]
        if _none_for_a_default(parser, action, value):  # (unset: the default)
            continue
        trial = argparse.Namespace(**defaults)
        _set_from_option(trial, action, key, value)
        if getattr(trial, action.dest) != parser.get_default(action.dest):
            values.setdefault(action.dest, {})[key] = getattr(trial, action.dest)
    for keys in values.values():
        if len({repr(value) for value in keys.values()}) > 1:
            given = ", ".join(f"{key}={settings[key]!r}" for key in keys)
            raise UsageError(f"{given}: one setting given other values under {len(keys)} of its names; give it once")


def _none_for_a_default(parser, action, value):
    """A None for a flag that takes a value and has one by default (a dict's ``temperature=None``, a tool's unset
    ``dtype``; DeepSpeed-Chat's step-3 namespace, whose --seed and --output_dir default to None): unset, so the
    default, as None means in HF's configs (set, it reached the checks or the run and failed there with a TypeError:
    ``set_seed(None)`` as the engine set up). Flags whose default is None (``actor_dropout``) keep it."""
    return value is None and type(action) is argparse._StoreAction and parser.get_default(action.dest) is not None


def _dict_settings(settings):
    """A dict's settings: its keys but those starting with "_", which name no flag and are the attributes dschat keeps
    on a completed namespace (``_data_files``, ...), so that ``{**vars(engine.args), "ppo_epochs": 2}`` reads as the
    settings it copies, as the namespace itself does (``_attributes``); the step takes them anew."""
    return {key: value for key, value in settings.items() if not (isinstance(key, str) and key.startswith("_"))}


def _attributes(obj, by_name):
    """An object's settings: its instance attributes and whatever flag names it answers (class attributes,
    properties, slots)."""
    names = set(getattr(obj, "__dict__", {})) | {name for name in by_name if hasattr(obj, name)}
    return {name: getattr(obj, name) for name in sorted(names) if not name.startswith("_")}


def _set_from_option(args, action, name, value):
    """Set ``action``'s destination as giving option ``name`` with ``value`` would on the command line."""
    switch = isinstance(action, argparse._StoreConstAction) and name != action.dest
    negated = isinstance(action, argparse.BooleanOptionalAction) and name.startswith("no-")
    if isinstance(value, str) and isinstance(action, (argparse._StoreConstAction, argparse.BooleanOptionalAction)):
        value = _switch_value(name, value)  # "false" is a truthy string: it would act as the flag
        if type(action) is argparse._StoreConstAction and not switch:  # a store_const's destination: const or default
            value = action.const if value else action.default
    if switch or negated:
        if value:  # disable_actor_dropout / no-enable_cuda_graph: True acts as the flag, False changes nothing
            setattr(args, action.dest, False if negated else action.const)
        return
    value = _as_given_on_a_command_line(name, value)
    if action.type is int and isinstance(value, float):
        if not value.is_integer():
            raise UsageError(f"{name}: expected an integer, got {value!r}")
        value = int(value)  # (2.0 is 2)
    # as on the command line: "3" for an int flag, and the range checks of the bounded ones
    converted = action.type in CONVERTED_TYPES and value is not None
    if action.type not in (None, str) and (isinstance(value, str) or converted):
        value = _converted(action, name, value)
    if action.choices is not None and value is not None and value not in action.choices:
        raise UsageError(f"{name}: {value!r} is not one of {list(action.choices)}")
    setattr(args, action.dest, value)


def _as_given_on_a_command_line(name, value):
    """A notebook's ``pathlib.Path`` (also in a list) as the string a command line gives; a datasets object (TRL's
    ``train_dataset=`` habit) is an error saying how to pass it."""
    items = value if isinstance(value, (list, tuple)) else [value]
    datasets = [item for item in items if hasattr(item, "save_to_disk")]
    if datasets:
        raise UsageError(f"{name}: a {type(datasets[0]).__name__} object; the steps read data by name or path: save "
                         f"it with .save_to_disk(FOLDER) and give the folder (or jsonl:PATH, ...)")
    plain = [os.fspath(item) if isinstance(item, os.PathLike) else item for item in items]
    return plain if isinstance(value, (list, tuple)) else plain[0]


_SWITCH_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False,
                 "off": False}


def _switch_value(name, value):
    """A switch given as a string (a notebook's or a config file's "false"): its bool, or an error naming it."""
    word = value.strip().lower()
    if word not in _SWITCH_WORDS:
        raise UsageError(f"{name}: {value!r} is not a switch value; give true/false (or 1/0, yes/no, on/off)")
    return _SWITCH_WORDS[word]


def _converted(action, name, value):
    try:
        return action.type(value)
    except (argparse.ArgumentTypeError, TypeError, ValueError) as err:
        raise UsageError(f"{name}: {err}") from None


# The temperatures sampling can take: HF's generate and the hybrid engine scale the logits in fp32 whatever the
# model's dtype, and logits / T (or logits * (1 / T)) overflows fp32 (max 3.4e38) once T is near 1e-36: the softmax
# then held nan ("probability tensor contains inf/nan" mid-generation). Within these bounds logits up to 1e8 scale
# to finite values, and 1 / T is a normal fp32 number (a larger T, e.g. 1e300, was inf in fp32: uniform noise).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-30, 1e30


def check_sampling_flags(temperature, top_p):
    """--temperature and --top_p of a sampled generation (step 3, chat.py, prompt_eval.py), checked before any model
    loads: HF's generate would fail on them in the first generation."""
    if not temperature > 0:
        raise UsageError(f"--temperature {temperature}: sampling needs a temperature > 0; --greedy takes the most "
                         "likely token")
    if not math.isfinite(temperature):
        raise UsageError(f"--temperature {temperature}: an infinite temperature samples every token alike (noise)")
    check_temperature_in_fp32(temperature)
    if not 0 < top_p <= 1:
        raise UsageError(f"--top_p {top_p}: must be in (0, 1] (1: no nucleus filtering)")


def check_temperature_in_fp32(temperature):
    """A temperature the fp32 sampling cannot scale the logits by, refused with the flag's name (HF's generate crashed
    mid-generation; vLLM raises any temperature below 0.01 to 0.01 with a warning, sampling at one not given)."""
    if temperature < MIN_TEMPERATURE:
        raise UsageError(f"--temperature {temperature}: below {MIN_TEMPERATURE:g} the logits / temperature overflow "
                         "the sampling's fp32 (nan mid-generation); --greedy takes the most likely token")
    if temperature > MAX_TEMPERATURE:
        raise UsageError(f"--temperature {temperature}: above {MAX_TEMPERATURE:g} the logits / temperature vanish in "
                         "the sampling's fp32: every token is sampled alike (noise)")


def check_repetition_penalty_flag(penalty):
    """--repetition_penalty: finite and > 0 (HF's generate refuses 0 or less at the first generation)."""
    if not 0 < penalty < math.inf:
        raise UsageError(f"--repetition_penalty {penalty}: must be a finite number > 0 (1: no penalty)")


def top_k_flag(top_k):
    """--top_k as generate takes it: 0 or negative is no top-k filtering, which is 0 for HF's generate (it refuses
    a negative one) and for the hybrid engine (which, as HF's generate, reads None as the generation_config's)."""
    return max(top_k, 0)


HYBRID_ENGINE_GROUP = "hybrid engine"


def hybrid_engine_only_flags(args, parser=None):
    """The flags of step 3's "hybrid engine" group (but --enable_hybrid_engine itself), which only the hybrid engine
    reads, that ``args`` sets to other than the parser's default, as they would be written on the command line
    (``--inference_tp_size 2``, ``--no-enable_cuda_graph``). Defaults given explicitly (DeepSpeed-Chat's scripts
    pass ``--inference_tp_size 1``) are not listed."""
    parser = parser or step3_parser()
    group = next(g for g in parser._action_groups if g.title == HYBRID_ENGINE_GROUP)
    return _changed_flags(args, [a for a in group._group_actions if a.dest != "enable_hybrid_engine"])


# Step 3's flags read only where a critic is trained (--advantage_estimator gae). (--critic_model_name_or_path is
# also the reward model's default path and --critic_zero_stage its stage, so they are not among them.)
CRITIC_ONLY_FLAGS = ("critic_learning_rate", "critic_weight_decay", "critic_gradient_checkpointing", "critic_dropout",
                     "critic_lora_dim", "critic_lora_module_name", "critic_lora_learning_rate")


def critic_only_flags(args, parser=None):
    """``given_flags`` of ``CRITIC_ONLY_FLAGS``."""
    return given_flags(args, CRITIC_ONLY_FLAGS, parser)


# CRITIC_ONLY_FLAGS as a row of the tables below (step 3 says them apart while it runs: ``critic_only_flags``)
CRITIC_ONLY_ROW = (CRITIC_ONLY_FLAGS, lambda a: a.advantage_estimator == "gae", "--advantage_estimator gae")


# A flag every step parses (add_data_args) that only step 1 reads; the other steps' tables list it as never on.
STEP1_ONLY_FLAGS = (("sft_only_data_path",), lambda a: False, "step 1")
# (transformers' "constant" schedule takes no warmup: constant_with_warmup does. Unread under it whatever its value, 0
# too: train.py --resume leaves a finished step's warmup aside where both runs had it, ``unread_in_both``; an explicit
# 0 is not said to be ignored, ``ASKS_NOTHING``.)
WARMUP_FLAGS = (("num_warmup_steps",), lambda a: a.lr_scheduler_type != "constant",
                "--lr_scheduler_type other than constant")
# Values of the tables' flags that ask for nothing (no warmup): given where what reads them is off, they are not said
# to be ignored (step 3's default warmup is 100: a constant schedule's run may give 0 to say it means none).
ASKS_NOTHING = {"num_warmup_steps": 0}


# Step 3's flags read only when another setting is on: (flags, whether it is, the setting said). (A script switched from
# PPO to GRPO keeps GAE's flags; a critic-free run's critic flags are CRITIC_ONLY_FLAGS'. --unsup_coef is not among
# them: a notebook's train_rollout(unsup_batches=...) reads it without --unsupervised_dataset_name.)
CONDITIONAL_FLAGS = (
    (("lam", "cliprange_value", "whiten_advantages"), lambda a: a.advantage_estimator == "gae",
     "--advantage_estimator gae"),
    # (GRPO and RLOO compare each answer's raw score with its group's: no per-token reward, no clip)
    (("gamma", "clip_reward_value"), lambda a: a.advantage_estimator in ("gae", "reinforce_pp"),
     "--advantage_estimator gae or reinforce_pp"),
    (("grpo_norm_by_std",), lambda a: a.advantage_estimator == "grpo", "--advantage_estimator grpo"),
    (("ema_beta",), lambda a: a.enable_ema, "--enable_ema"),
    (("reward_fn_weight",), lambda a: a.reward_fn, "--reward_fn"),
    (("lora_alpha",), lambda a: a.actor_lora_dim or a.critic_lora_dim, "--actor_lora_dim or --critic_lora_dim"),
    (("actor_lora_learning_rate", "actor_lora_module_name"), lambda a: a.actor_lora_dim, "--actor_lora_dim"),
    (("critic_lora_learning_rate",), lambda a: a.critic_lora_dim or a.advantage_estimator != "gae",
     "--critic_lora_dim"),
    (("print_answers_interval",), lambda a: a.print_answers, "--print_answers"),
    # (below ZeRO-3 the actor's weights are whole on every rank: nothing to gather or pin)
    (("unpin_actor_parameters",), lambda a: zero_stage_of(a, "actor_zero_stage") == 3, "--actor_zero_stage 3"),
    # (neither drawn nor scored with: greedy answers are scored at temperature 1, trainer.scoring_temperature)
    (("temperature", "top_k", "top_p"), lambda a: not a.greedy, "sampled answers, not --greedy"),
    STEP1_ONLY_FLAGS,
    WARMUP_FLAGS,
)


# The same for steps 1, 2 and DPO (``supervised_conditional_flags``).
SUPERVISED_CONDITIONAL_FLAGS = (
    (("lora_alpha", "lora_learning_rate", "lora_module_name"), lambda a: a.lora_dim, "--lora_dim"),
    WARMUP_FLAGS,
)


# step 1's --loss_agg, which DPO's parser (step 1's) takes too: DPO's loss is per pair, all alike, and the flag weighs
# only its --rpo_alpha NLL term's tokens (step 3's own --loss_agg is read there, so not among STEP1_ONLY_FLAGS)
STEP1_LOSS_FLAGS = (("loss_agg",), lambda a: getattr(a, "rpo_alpha", 0), "--rpo_alpha")


def supervised_conditional_flags(phase):
    """The table of ``unread_conditional_flags`` for the supervised step of data ``phase``."""
    return SUPERVISED_CONDITIONAL_FLAGS + (() if phase == 1 else (STEP1_ONLY_FLAGS, STEP1_LOSS_FLAGS))


def conditional_flags_of(step):
    """Every flag of step ``step`` (the name it records: "step1", "step2", "step2_dpo", "step3") that it reads only
    while another setting is on, as the rows (flags, whether it is, the setting said) of ``unread_conditional_flags``:
    step 3's ``CONDITIONAL_FLAGS`` and its critic's flags, the supervised steps' ``supervised_conditional_flags``."""
    if step == "step3":
        return CONDITIONAL_FLAGS + (CRITIC_ONLY_ROW,)
    return supervised_conditional_flags(1 if step == "step1" else 2)


def zero_stage_of(args, name):
    """Step 3's ``name`` (actor_zero_stage / critic_zero_stage) as given, else DeepSpeed-Chat's shared --zero_stage,
    else 0: what ``rlhf.config.resolve_zero_stages`` sets it to, readable before it has run."""
    for stage in (getattr(args, name, None), getattr(args, "zero_stage", None)):
        if stage is not None:
            return stage
    return 0


def unread_conditional_flags(args, parser=None, table=CONDITIONAL_FLAGS):
    """The flags of ``table`` (step 3's ``CONDITIONAL_FLAGS`` by default; ``parser``: the step's) that ``args`` sets
    (``given_flags``) while what reads them is off, each as "FLAG (read only with SETTING)"."""
    parser = parser or step3_parser()
    return [f"{flag} (read only with {setting})" for names, on, setting in table if not on(args)
            for flag in given_flags(args, _asking_something(args, names), parser)]


def _asking_something(args, names):
    """The flags of ``names`` whose value in ``args`` is not one that asks for nothing (``ASKS_NOTHING``)."""
    return [name for name in names if name not in ASKS_NOTHING or getattr(args, name, None) != ASKS_NOTHING[name]]


def given_flags(args, names, parser=None):
    """The flags ``names`` (of ``parser``, step 3's by default) that ``args`` sets to other than the parser's default,
    as written on the command line (``--critic_learning_rate 0.0005``)."""
    parser = parser or step3_parser()
    first = {}
    for action in parser._actions:  # (--disable_critic_dropout shares --critic_dropout's value)
        if action.dest in names:
            first.setdefault(action.dest, action)
    return _changed_flags(args, list(first.values()))


def _changed_flags(args, actions):
    given = []
    for action in actions:
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            given.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._StoreConstAction):  # (store_true included)
            given.append(flag)
        else:  # (a list of several values as the command line gives them)
            given.append(f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}")
    return given


def step3_parser():
    p = new_parser("Step 3: PPO (RLHF) of the SFT actor against the reward model.")
    add_data_args(p)
    _add_step3_models_args(p.add_argument_group("models"))
    _add_step3_unsupervised_mixing_args(p.add_argument_group("unsupervised mixing"))
    _add_step3_batching_args(p.add_argument_group("batching and lengths"))
    _add_step3_optimization_args(p.add_argument_group("optimization"))
    _add_step3_generation_args(p.add_argument_group("generation"))
    # every flag of this group but the switch is read by the hybrid engine only
    _add_step3_hybrid_engine_args(p.add_argument_group(HYBRID_ENGINE_GROUP))
    _add_step3_deepspeed_args(p.add_argument_group("deepspeed"))
    _add_step3_lora_args(p.add_argument_group("lora"))
    _add_step3_ppo_args(p.add_argument_group("PPO"))
    _add_step3_critic_free_args(p.add_argument_group("critic-free estimators and reward functions"))
    _add_step3_outputs_args(p.add_argument_group("outputs and logging"))
    return p


def _add_step3_models_args(g):
    g.add_argument("--actor_model_name_or_path", type=str, default="output/step1_sft",
                   help="The actor to train: step 1's output folder, a model folder or a hub name.")
    g.add_argument("--critic_model_name_or_path", type=str, default="output/step2_rm",
                   help="Step-2 folder (value head loaded) or any HF model folder (value head newly made).")
    g.add_argument("--reward_model_name_or_path", type=str, default=None,
                   help="Reward model (default: the critic's path, as DeepSpeed-Chat does; a step-3 critic there is "
                        "warned of: pass step 2's reward model).")
    add_tokenizer_args(g)


def _add_step3_unsupervised_mixing_args(g):
    g.add_argument("--unsupervised_dataset_name", type=str, default=None,
                   help="Pretraining text mixed into the actor's training (DeepSpeed-Chat's PTX): a hub dataset, a "
                        "save_to_disk folder, a .txt/.jsonl/.json/.csv/.parquet file or tiny.")
    g.add_argument("--unsupervised_dataset_config_name", type=str, default=None, help="The hub dataset's config name.")
    # (>= 0: a negative weight trained the actor to unlearn the text, a NaN one made its weights NaN)
    g.add_argument("--unsup_coef", type=non_negative_float, default=27.8,
                   help="Weight of the pretraining loss in the actor's step.")
    g.add_argument("--preprocessing_num_workers", type=int, default=None,
                   help="Processes that tokenize and group the unsupervised data (datasets' num_proc).")


def _add_step3_batching_args(g):
    # The second names are DeepSpeed-Chat's first ones (renamed in 2023), still in many walk-throughs.
    g.add_argument("--per_device_generation_batch_size", "--per_device_train_batch_size", type=positive_int,
                   default=16,
                   help="Prompts per rank per generation batch.")
    g.add_argument("--per_device_training_batch_size", "--per_device_mini_train_batch_size",
                   "--per_device_mini_batch_size", type=positive_int, default=16,
                   help="Rows per rank per PPO training micro-batch.")
    g.add_argument("--generation_batches", "--generation_batch_numbers", type=positive_int, default=1,
                   help="Generation batches collected before each round of PPO training.")
    g.add_argument("--ppo_epochs", type=positive_int, default=1, help="Passes over each rollout's experience.")
    g.add_argument("--freezing_actor_steps", type=non_negative_int, default=0,
                   help="The first N PPO iterations train the critic only (OpenRLHF's flag): a critic started from "
                        "the reward model values every token as the end of an answer, and GAE's first advantages "
                        "with it are mostly its error. The actor's learning-rate schedule starts after them. GAE only.")
    g.add_argument("--max_prompt_seq_len", type=positive_int, default=256,
                   help="Longest prompt in tokens (longer ones are skipped).")
    g.add_argument("--max_answer_seq_len", type=positive_int, default=256, help="Most new tokens generated per answer.")
    g.add_argument("--num_train_epochs", type=positive_int, default=1, help="Passes over the training data.")
    g.add_argument("--gradient_accumulation_steps", type=positive_int, default=1,
                   help="Micro-batches per optimizer step.")
    g.add_argument("--max_steps", type=non_negative_int, default=0, help="Stop after N PPO iterations (0: no limit).")


def _add_step3_optimization_args(g):
    g.add_argument("--actor_learning_rate", type=non_negative_float, default=9.65e-6,
                   help="Peak learning rate of the actor.")
    g.add_argument("--critic_learning_rate", type=non_negative_float, default=5e-6,
                   help="Peak learning rate of the critic.")
    g.add_argument("--actor_weight_decay", type=non_negative_float, default=0.0,
                   help="AdamW weight decay of the actor.")
    g.add_argument("--critic_weight_decay", type=non_negative_float, default=0.0,
                   help="AdamW weight decay of the critic.")
    g.add_argument("--lr_scheduler_type", type=str, default="cosine", choices=SCHEDULERS,
                   help="Learning-rate schedule after the warmup.")
    g.add_argument("--num_warmup_steps", type=non_negative_int, default=100, help="Optimizer steps of linear warmup.")
    g.add_argument("--seed", type=seed_int, default=DEFAULT_SEED,
                   help="Seed of the data order, the data shares and the model's random initialisations.")
    g.add_argument(*LOCAL_RANK_FLAGS, type=int, default=-1, help="Set by the deepspeed launcher.")


def _add_step3_generation_args(g):
    g.add_argument("--temperature", type=float, default=1.0,
                   help="Sampling temperature of the rollouts; the old, new and reference log-probs (and entropy) are "
                        "taken at it too, as in TRL, OpenRLHF and verl.")
    g.add_argument("--top_k", type=int, default=0,
                   help="Top-k filtering of the rollouts (0 or negative: none). Only what is sampled: the log-probs "
                        "PPO trains on are of the unfiltered distribution, as in TRL, OpenRLHF and verl.")
    g.add_argument("--top_p", type=float, default=1.0,
                   help="Nucleus sampling of the rollouts (1: off). Only what is sampled: the log-probs PPO trains on "
                        "are of the unfiltered distribution, as in TRL, OpenRLHF and verl.")
    g.add_argument("--greedy", action="store_true", help="Greedy answers instead of sampling.")
    g.add_argument("--repetition_penalty", type=float, default=1.0,
                   help="HF's repetition penalty of the rollouts (1: off, whatever the actor's generation_config "
                        "asks; > 0). The log-probs PPO trains on do not include it, as in OpenRLHF.")


def _add_step3_hybrid_engine_args(g):
    g.add_argument("--enable_hybrid_engine", action=argparse.BooleanOptionalAction, default=False,
                   help="Generate the rollouts with dschat's hybrid engine (KV cache, CUDA graphs, Triton kernels) "
                        "instead of HF generate (train.py gives it; --no-enable_hybrid_engine there: HF generate).")
    g.add_argument("--unpin_actor_parameters", action="store_true",
                   help="ZeRO-3: gather layer by layer during generation instead of keeping a full copy.")
    g.add_argument("--release_inference_cache", action="store_true",
                   help="Free the hybrid engine's KV cache after each generation (less memory between generations; a "
                        "new cache and graph capture each time).")
    g.add_argument("--inference_tp_size", type=positive_int, default=1,
                   help="Hybrid engine: tensor-parallel ranks that generate together.")
    g.add_argument("--tp_gather_partition_size", type=positive_int, default=8,
                   help="Hybrid engine under ZeRO-3: decoder layers gathered at a time into the inference copy.")
    g.add_argument("--enable_cuda_graph", action=argparse.BooleanOptionalAction, default=None,
                   help="Replay the decode step from CUDA graphs (default: on when training on CUDA; the eager loop "
                        "is bound by Python's kernel launches, 3-7x slower: docs/benchmarks.md).")
    g.add_argument("--compile_decode_step", default=None, choices=COMPILE_MODES,
                   help="torch.compile mode without CUDA graphs of its own (default, max-autotune-no-cudagraphs) "
                        "for the one-token forward inside dschat's CUDA graph and for the prefill: fuses their small "
                        "kernels; the first generation then compiles (20-150 s).")
    g.add_argument("--logprobs_from_generation", action="store_true",
                   help="Take the actor's old log-probs from the hybrid engine's decode step instead of a forward over "
                        "the generated sequences (saves that forward). The decode step runs the inference copy (LoRA "
                        "merged and rounded to the model dtype, tensor-parallel slices, Triton attention), so the two "
                        "differ by rounding: mean |delta logp| 0.0094 measured in bf16 for an OPT-1.3B shape without "
                        "LoRA or TP (docs/benchmarks.md). Needs --enable_hybrid_engine.")
    g.add_argument("--decode_attention", default="auto", choices=["auto", "triton", "sdpa"],
                   help="Decode-step attention: dschat's Triton flash-decoding kernel (auto: on CUDA with triton) or "
                        "the model's SDPA.")
    g.add_argument("--fuse_projections", default="auto", choices=["auto", "on", "off"],
                   help="While generating, run the linears that read the same input (q/k/v; gate/up up to 64 MB) as "
                        "one GEMM (auto: on CUDA; on: also on the CPU). Costs a copy of those weights; "
                        "measurements in docs/benchmarks.md.")


def _add_step3_deepspeed_args(g):
    g.add_argument("--offload", action="store_true",
                   help="ZeRO-Offload of the trained models' optimizer states (and parameters at ZeRO-3) to the CPU.")
    g.add_argument("--offload_reference_model", action="store_true",
                   help="Keep the frozen reference model, and the EMA copy of --enable_ema, on the CPU (ZeRO-3 "
                        "parameter offload; DeepSpeed-Chat's).")
    g.add_argument("--offload_reward_model", action="store_true",
                   help="Keep the frozen reward model on the CPU (ZeRO-3 parameter offload).")
    g.add_argument("--actor_zero_stage", type=int, default=None, choices=[0, 1, 2, 3],
                   help="Default: --zero_stage, else 0.")
    g.add_argument("--critic_zero_stage", type=int, default=None, choices=[0, 1, 2, 3],
                   help="Default: --zero_stage, else 0.")
    g.add_argument("--zero_stage", type=int, default=None, choices=[0, 1, 2, 3],
                   help="The ZeRO stage of actor and critic where --actor_zero_stage / --critic_zero_stage are not "
                        "given (steps 1 and 2 take this name).")
    add_precision_args(g)
    g.add_argument("--actor_gradient_checkpointing", action="store_true", help="Activation checkpointing in the actor.")
    g.add_argument("--critic_gradient_checkpointing", action="store_true",
                   help="Activation checkpointing in the critic.")
    g.add_argument("--actor_dropout", type=dropout_probability, default=None,
                   help="Override every dropout of the actor's config.")
    g.add_argument("--critic_dropout", type=dropout_probability, default=None,
                   help="Override every dropout of the critic's config.")
    g.add_argument("--disable_actor_dropout", dest="actor_dropout", action="store_const", const=0.0,
                   help="DeepSpeed-Chat's older spelling of --actor_dropout 0.0.")
    g.add_argument("--disable_critic_dropout", dest="critic_dropout", action="store_const", const=0.0,
                   help="DeepSpeed-Chat's older spelling of --critic_dropout 0.0.")
    g.add_argument("--enable_mixed_precision_lora", action="store_true",
                   help="Mixed Precision ZeRO++ (DeepSpeed-Chat's): the actor's frozen weights are stored, gathered "
                        "and generated from in int8 (DeepSpeed's zero_quantized_nontrainable_weights; weights of "
                        "500k elements or fewer stay as they are). Needs --actor_lora_dim (LoRA freezes the adapted "
                        "weights), --actor_zero_stage 3, --dtype fp16 (DeepSpeed quantizes fp16 only) and CUDA.")
    g.add_argument("--align_overflow", action="store_true",
                   help="fp16 (DeepSpeed-Chat's flag): when the actor's or the critic's gradients overflow, skip both "
                        "optimizer steps, so the two stay in step; the actor then steps after the critic's backward. "
                        "The model whose gradients were finite keeps its loss scale as it was. Needs "
                        "--dtype fp16 and a critic (--advantage_estimator gae); not with --unsupervised_dataset_name "
                        "(the actor's step follows the language-model micro-step, not aligned).")
    add_zero_tuning_args(g)
    add_deepspeed_config_args(g)


def _add_step3_lora_args(g):
    g.add_argument("--actor_lora_dim", type=non_negative_int, default=0, help="LoRA rank of the actor (0: no LoRA).")
    g.add_argument("--actor_lora_module_name", type=str, default="",
                   help="Adapt the actor's Linear modules whose path contains this (empty: all but output heads).")
    g.add_argument("--critic_lora_dim", type=non_negative_int, default=0, help="LoRA rank of the critic (0: no LoRA).")
    g.add_argument("--critic_lora_module_name", type=str, default="",
                   help="Adapt the critic's Linear modules whose path contains this (empty: all but the value head).")
    add_lora_scaling_args(g)
    g.add_argument("--actor_lora_learning_rate", type=non_negative_float, default=5e-4,
                   help="Learning rate of the actor's LoRA adapters.")
    g.add_argument("--critic_lora_learning_rate", type=non_negative_float, default=5e-4,
                   help="Learning rate of the critic's LoRA adapters.")


def _add_step3_ppo_args(g):
    g.add_argument("--padded_forwards", action="store_true",
                   help="Run the experience and training forwards over the left-padded rows with an attention mask, "
                        "as DeepSpeed-Chat does. Default: each row shifted to start at column 0, so the forwards need "
                        "no mask (causal attention, same results on real tokens; masked kernels are slower, see "
                        "dschat/rlhf/layout.py); prompt masks with holes keep the mask anyway.")
    g.add_argument("--kl_ctl", type=non_negative_float, default=0.1,
                   help="The per-token reward's KL coefficient (initial value if adaptive); where the KL is a loss "
                        "term (grpo/rloo, --kl_in_reward 0) another value is an error: --kl_loss_coef weighs it there.")
    g.add_argument("--kl_estimator", type=str, default=None, choices=["k1", "k2", "k3", "low_var_kl", "abs"],
                   help="Per-token KL estimator, of the reward penalty and of the KL loss term. Default (None): k1 "
                        "for the reward penalty (DeepSpeed-Chat's), k3 for the loss term (k1's gradient is 0 in "
                        "expectation there). low_var_kl: k3 clamped to [-10, 10] (verl's GRPO kl_loss_type). The log's "
                        "kl stays the rollout's k1 per token; kl_per_answer (the reward's, which --adaptive_kl "
                        "tracks) and kl_loss (the loss term's) are this estimator's.")
    g.add_argument("--kl_in_reward", type=int, default=1, choices=[0, 1],
                   help="1: KL penalty in the per-token reward (DeepSpeed-Chat), weighted by --kl_ctl; 0: KL as a "
                        "loss term, weighted by --kl_loss_coef. grpo/rloo always take the loss term (their "
                        "advantages ignore per-token rewards).")
    g.add_argument("--kl_loss_coef", type=non_negative_float, default=None,
                   help="Weight of the KL loss term added to the actor loss, where the KL is a loss term (grpo/rloo, "
                        "or --kl_in_reward 0; an error elsewhere); 0: no KL term. Default (None): 0.001 (k3 unless "
                        "--kl_estimator: the DeepSeekMath/OpenRLHF style, at verl's default weight).")
    g.add_argument("--adaptive_kl", action="store_true",
                   help="Adapt the reward penalty's KL coefficient towards --kl_target (Ziegler et al. 2019, TRL's "
                        "rule), by the KL the reward penalises (--kl_estimator's, logged as kl_per_answer); only where "
                        "the KL is in the reward.")
    g.add_argument("--kl_target", type=positive_float, default=6.0,
                   help="The adaptive controller's KL target in nats per answer (the reward penalty's estimator "
                        "summed over its tokens, averaged over answers: TRL's unit and default); only with "
                        "--adaptive_kl.")
    g.add_argument("--kl_horizon", type=positive_int, default=10000,
                   help="The adaptive controller's horizon, in answers; only with --adaptive_kl.")
    g.add_argument("--clip_reward_value", type=clip_range, default=5.0,
                   help="Clip each answer's score (the reward model's and --reward_fn's, weighted) to "
                        "[-this, this] (inf: no clip); GAE and REINFORCE++ only (GRPO and RLOO compare raw scores).")
    g.add_argument("--cliprange", type=clip_range, default=0.2,
                   help="PPO's policy-ratio clip (inf: none): the ratio is kept in [1 - this, 1 + this], or in "
                        "[1 - this, 1 + --cliprange_high] where that is given.")
    g.add_argument("--cliprange_high", type=clip_range, default=None,
                   help="The ratio clip's upper side where it differs from --cliprange's (DAPO's clip-higher, e.g. "
                        "0.28: TRL's epsilon_high, verl's clip_ratio_high); default: --cliprange.")
    g.add_argument("--cliprange_value", type=clip_range, default=0.2,
                   help="PPO's value clip around the old values (inf: none).")
    g.add_argument("--gamma", type=unit_interval, default=1.0, help="Discount of the returns, in [0, 1].")
    g.add_argument("--lam", type=unit_interval, default=0.95, help="GAE's lambda, in [0, 1].")
    g.add_argument("--whiten_advantages", action="store_true",
                   help="GAE: whiten the advantages over the whole rollout (every rank's), masked to the answers.")
    g.add_argument("--entropy_coef", type=finite_float, default=0.0,
                   help="Weight of an entropy bonus in the actor's loss: loss - this x entropy, so > 0 favours "
                        "entropy (verl's entropy_coeff; 0: none, < 0: a penalty).")
    g.add_argument("--loss_agg", type=str, default="token_mean",
                   choices=["token_mean", "global_token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"],
                   help="How the per-token losses (policy, value, entropy, KL) are averaged (verl's loss_agg_mode). "
                        "token_mean (DeepSpeed-Chat's; TRL's loss_type bnpo): over the micro-batch's answer tokens; "
                        "global_token_mean (TRL's dapo): over all answer tokens of the global batch; "
                        "seq_mean_token_mean (the GRPO paper's; TRL's grpo): each answer's token mean, then the mean "
                        "over answers, so every answer weighs alike whatever its length; seq_mean_token_sum_norm "
                        "(Dr. GRPO; TRL's dr_grpo): each answer's token sum over --max_answer_seq_len, then the mean "
                        "over answers.")
    g.add_argument("--mask_truncated_answers", action="store_true",
                   help="Leave the answers cut at --max_answer_seq_len (no EOS: truncated_answers) out of every loss "
                        "term (policy, value, entropy, KL), as TRL's mask_truncated_completions and DAPO's overlong "
                        "filtering do; any --advantage_estimator. Their scores still count in GRPO/RLOO's group "
                        "statistics and whitening: only the loss leaves them out. An optimizer step whose "
                        "micro-batches keep no token on any rank is skipped (actor_no_token_steps, "
                        "critic_no_token_steps in the log), not taken on zero gradients (Adam's momentum and weight "
                        "decay would move the weights); a PPO-ptx actor steps on its language-model loss.")
    g.add_argument("--logprob_chunk_size", type=positive_int, default=1024,
                   help="Sequence chunk for log-probs, so full fp32 logits are never materialised.")


def _add_step3_critic_free_args(g):
    g.add_argument("--advantage_estimator", type=str, default="gae", choices=["gae", "grpo", "rloo", "reinforce_pp"],
                   help="gae: PPO with a critic (DeepSpeed-Chat); the others build no critic.")
    g.add_argument("--n_samples_per_prompt", type=positive_int, default=1,
                   help="Answers generated per prompt (one group).")
    g.add_argument("--grpo_norm_by_std", type=grpo_std_scope, default="group", choices=GRPO_STD_SCOPES,
                   help="GRPO: divide each answer's score minus its group's mean by the group's std (group, or 1: "
                        "GRPO's paper; a group within 1e-6 of alike gets 0), by the std of the whole batch's scores "
                        "over all ranks (batch: TRL's scale_rewards=\"batch\", Lite PPO's), or not (none, or 0: Dr. "
                        "GRPO's advantage; Dr. GRPO's loss, each answer's token sum over a constant length, is "
                        "--loss_agg seq_mean_token_sum_norm).")
    g.add_argument("--reward_fn", type=str, default="",
                   help="module:function or path.py:function called with (prompts, answers, **extra columns) "
                        "returning one float per answer; 'tiny' = the bundled rule scorer.")
    g.add_argument("--reward_fn_weight", type=finite_float, default=1.0,
                   help="Weight of --reward_fn's score in the reward.")
    g.add_argument("--reward_model_weight", type=finite_float, default=1.0,
                   help="Weight of the reward model's score; 0 builds no reward model (reward function only).")


def _add_step3_outputs_args(g):
    g.add_argument("--output_dir", type=str, default="output/step3_ppo",
                   help="Where the actor (and critic, EMA actor, logs) are saved.")
    g.add_argument("--enable_ema", action="store_true",
                   help="Also keep and save an exponential moving average of the actor (actor_ema).")
    g.add_argument("--ema_beta", type=float, default=0.992,
                   help="The EMA's decay per optimizer step applied (a skipped one leaves the EMA as it was).")
    add_tensorboard_args(g, "step3_tensorboard")
    g.add_argument("--print_answers", action="store_true",
                   help="Print a prompt and its generated answer during training.")
    g.add_argument("--print_answers_interval", type=positive_int, default=1,
                   help="With --print_answers: every this many iterations.")
    g.add_argument("--enable_test_mode", action="store_true",
                   help="DeepSpeed-Chat's: with --test_stop_step, stop after that many PPO iterations.")
    g.add_argument("--test_stop_step", type=non_negative_int, default=0,
                   help="With --enable_test_mode: the iterations to run (0: all).")
    g.add_argument("--save_interval", type=non_negative_int, default=None,
                   help="Checkpoint every N PPO iterations (0: off; not given: off, and with --resume the interval "
                        "of the run resumed).")
    g.add_argument("--resume", action="store_true", help="Continue from the last checkpoint in output_dir.")
    g.add_argument("--eval_prompts", type=non_negative_int, default=64,
                   help="Held-out prompts scored before and after PPO (reward model and rule scorer), counted over "
                        "all ranks, in whole generation batches: rounded up to a multiple of "
                        "--per_device_generation_batch_size x the number of ranks (0: all).")
    g.add_argument("--eval_max_new_tokens", type=positive_int, default=None,
                   help="Greedy answer length of the held-out evaluation (default: --max_answer_seq_len).")
