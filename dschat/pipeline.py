"""The one-command pipeline behind ``train.py``: steps 1, 2, 3 in-process, then the report.

Under the deepspeed launcher every rank runs this same function; nothing here starts processes except the
single re-launch of a plain ``python train.py`` for multi-GPU deployment types (see ``train.py``).
"""
import os
import shlex
import time

from dschat.models.loading import resolve_model_path
from dschat.utils.dist import ensure_distributed, is_rank_0, print_rank_0

# Settings that make the embedded tiny default train well in minutes on a CPU. Hub models get the step
# scripts' own defaults (DeepSpeed-Chat's), which the --stepN-args strings can override.
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


# `train.py --recipe grpo`: critic-free GRPO rewarded by the bundled rule scorer, no reward model (steps 1 and 3).
GRPO_RECIPE = ["--advantage_estimator", "grpo", "--n_samples_per_prompt", "4", "--per_device_generation_batch_size",
               "8", "--reward_fn", "tiny", "--reward_model_weight", "0", "--actor_learning_rate", "1e-4"]


def is_tiny_run(actor_model, reward_model):
    from dschat.tiny.presets import is_tiny_preset

    return is_tiny_preset(actor_model) and is_tiny_preset(reward_model)


def step_argv(step, args, tiny):
    """The argument list of one step, from train.py's flags (its own extra args last, so they win)."""
    out = args.output_dir
    common = ["--data_path", *args.data_path] if args.data_path else []
    if step == 1:
        argv = ["--model_name_or_path", args.actor_model, "--zero_stage", str(args.actor_zero_stage),
                "--output_dir", os.path.join(out, "step1_sft")]
    elif step == 2:
        # The tiny default starts its reward model from the SFT model (as InstructGPT did): a 0.5M-parameter
        # model trained from scratch in seconds only sees an answer's form, the SFT model also knows content.
        base = os.path.join(out, "step1_sft") if tiny else args.reward_model
        argv = ["--model_name_or_path", base, "--zero_stage", str(args.reward_zero_stage),
                "--output_dir", os.path.join(out, "step2_rm")]
    else:
        argv = ["--actor_model_name_or_path", os.path.join(out, "step1_sft"),
                "--critic_model_name_or_path", os.path.join(out, "step2_rm"),
                "--actor_zero_stage", str(args.actor_zero_stage), "--critic_zero_stage", str(args.reward_zero_stage),
                "--output_dir", os.path.join(out, "step3_ppo")]
    recipe = TINY_RECIPE[step] if tiny else []
    if step == 3 and getattr(args, "recipe", "ppo") == "grpo":
        recipe = recipe + GRPO_RECIPE
    extra = shlex.split(getattr(args, f"step{step}_args") or "")
    return common + argv + recipe + ["--data_output_path", os.path.join(out, "data_cache")] + extra


def run_pipeline(args):
    """Run the requested steps in order and write the report; returns the report dict."""
    from dschat.report import summary_lines, write_report
    from dschat.steps import ppo, reward, sft

    ensure_distributed()
    tiny = is_tiny_run(args.actor_model, args.reward_model)
    if tiny:
        # build the presets once, before any step, so every step loads them with from_pretrained
        resolve_model_path(args.actor_model)
        resolve_model_path(args.reward_model)
    parsers = {1: (sft.main, "step1"), 2: (reward.main, "step2"), 3: (ppo.main, "step3")}
    timings = {}
    steps = sorted(args.step)
    if getattr(args, "recipe", "ppo") == "grpo" and 2 in steps:
        steps.remove(2)  # GRPO with a reward function needs no reward model
    for step in steps:
        main, name = parsers[step]
        argv = step_argv(step, args, tiny)
        print_rank_0(f"==== {name}: {' '.join(shlex.quote(a) for a in argv)}")
        started = time.time()
        main(argv)
        timings[name] = time.time() - started
    if not is_rank_0():
        return None
    report = write_report(args.output_dir, timings)
    for line in summary_lines(report):
        print(line, flush=True)
    print(f"report: {os.path.join(args.output_dir, 'report.json')}", flush=True)
    return report
