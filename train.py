#!/usr/bin/env python
"""One command for all three RLHF steps (DeepSpeed-Chat's train.py, run in-process).

    python train.py                                   # the embedded tiny default, offline, CPU or GPU
    python train.py --recipe dpo                      # step 1, then DPO instead of steps 2 and 3
    python train.py --actor-model facebook/opt-1.3b --reward-model facebook/opt-350m --deployment-type single_gpu
    deepspeed train.py --actor-model Qwen/Qwen2.5-1.5B --reward-model Qwen/Qwen2.5-0.5B \\
        --deployment-type single_node --actor-zero-stage 3 --reward-zero-stage 3

The reward model shares the actor's tokenizer (one family): step 3 scores the actor's token ids with it. (A
``deepspeed`` launcher started by hand reads /job/hostfile where there is one and starts the nodes it lists;
``python train.py --deployment-type single_node`` starts it with no hostfile: this node's GPUs.)
"""
import argparse
import os
import re
import shlex
import subprocess
import sys


def model_name(text):
    """A hub name, folder or preset; a bare OPT size ("1.3b", "350m": DeepSpeed-Chat's train.py took only those)
    means facebook/opt-SIZE. An empty one (an unset shell variable) is an error: it was looked up on the hub after
    the report was reset (--actor-model), or silently became the actor's (--reward-model)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a hub name, local folder or tiny preset, got ''")
    return f"facebook/opt-{text}" if re.fullmatch(r"\d+(\.\d+)?[mb]", text) else text


def zero_stage(text):
    """0-3, or "" (DeepSpeed-Chat's "the default for this deployment")."""
    if text == "":
        return None
    if text not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"expected 0, 1, 2, 3 or '', got {text!r}")
    return int(text)


def step_args_as_values(argv):
    """``--step1-args --check_grad_overflow`` as ``--step1-args=--check_grad_overflow``: argparse would take a lone
    flag after ``--stepN-args`` for an option of train.py's and say the string is missing."""
    from dschat.args import STEP_ARGS

    argv = list(sys.argv[1:] if argv is None else argv)
    out = []
    i = 0
    while i < len(argv):
        if argv[i] in STEP_ARGS and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def parse_args(argv=None):
    from dschat.args import STEP_ARGS, TrainPyParser, add_hidden_local_rank, repeated_flags

    # whole flag names only, as in the step scripts: a prefix (--output for --output-dir) is an error, not a guess
    p = TrainPyParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--step", type=int, nargs="+", choices=[1, 2, 3], default=[1, 2, 3],
                   help="Which steps to run (e.g. --step 2 3; default: all the recipe has).")
    p.add_argument("--actor-model", type=model_name, default="tiny-llama",
                   help="Hub name, local folder or tiny preset (default: %(default)s, the embedded tiny default); a "
                        "bare OPT size (1.3b) means facebook/opt-1.3b.")
    p.add_argument("--reward-model", type=model_name, default=None,
                   help="Hub name, local folder or tiny preset; a bare OPT size (350m) means facebook/opt-350m. "
                        "Default: the actor model (it must share the actor's tokenizer). Step 2 trains from it (on the "
                        "tiny default, where it is the actor's preset, from the SFT model); a "
                        "trained reward model (a folder: step 2's, DeepSpeed-Chat's, TRL's, OpenRLHF's; or a hub "
                        "name of TRL's, OpenRLHF's or dschat's layout) with --step that leaves step 2 out (e.g. "
                        "--step 1 3) is what step 3 scores with and starts its critic from; with --recipe grpo, what "
                        "GRPO is rewarded by instead of --reward_fn. --recipe dpo takes none.")
    p.add_argument("--actor-zero-stage", type=zero_stage, default=None, metavar="{0,1,2,3}",
                   help="Steps 1 and 3's actor and --recipe dpo's models (default: 0 with single_gpu, else 3; "
                        "a step's own --zero_stage / --actor_zero_stage in its --stepN-args replaces the default, and "
                        "is an error given with this flag at another value).")
    p.add_argument("--reward-zero-stage", type=zero_stage, default=None, metavar="{0,1,2,3}",
                   help="Step 2's reward model and step 3's critic (default: 0 with single_gpu, else 3; a step's "
                        "own --zero_stage / --critic_zero_stage in its --stepN-args replaces the default, and is an "
                        "error given with this flag at another value).")
    p.add_argument("--deployment-type", default="single_gpu", choices=["single_gpu", "single_node", "multi_node"],
                   help="single_gpu: one process (default); single_node: the deepspeed launcher starts a rank per "
                        "GPU of this node; multi_node: a rank per GPU of the nodes --hostfile lists.")
    p.add_argument("--output-dir", default="./output",
                   help="The run's folder (default: %(default)s): a folder per step (step1_sft, step2_rm, "
                        "step3_ppo, ...), report.json, step3_curves.png, data_cache/ and, with --enable_tensorboard in "
                        "a step's args, tensorboard/.")
    # (one or more: an unset shell variable, "--data-path $DATA", trained on the default data, the hub's for real models)
    p.add_argument("--data-path", nargs="+", default=None,
                   help="Datasets for all steps (default: the embedded tiny data with tiny presets, else "
                        "DeepSpeed-Chat's Dahoas/rm-static; a step's own --data_path in its --stepN-args replaces it "
                        "for that step).")
    p.add_argument("--data-fields", default=None,
                   help="Field names of local data files for all steps, e.g. prompt=question,chosen=good,rejected=bad "
                        "(a step's own --data_fields in its --stepN-args wins; a step whose --stepN-args give it other "
                        "files, --data_path, reads them without these).")
    p.add_argument("--recipe", default="ppo", choices=["ppo", "grpo", "dpo"],
                   help="ppo (default): DeepSpeed-Chat's steps 1-3; grpo: step 1, then GRPO rewarded by --reward_fn "
                        "(on the tiny default: the bundled rule scorer) or a trained --reward-model, no step 2 or "
                        "critic; dpo: step 1, "
                        "then DPO on the preference pairs as step 2 (--step2-args are its flags; into "
                        "OUTPUT_DIR/step2_dpo), no step 3.")
    p.add_argument("--resume", action="store_true",
                   help="Continue an interrupted run in --output-dir: steps finished earlier with the same flags are "
                        "skipped, the interrupted one resumes from its last checkpoint (steps save them with "
                        "--save_interval N in their --stepN-args), the later ones run.")
    p.add_argument("--hostfile", help="multi_node: the deepspeed launcher's hostfile (default /job/hostfile).")
    for option, step in STEP_ARGS.items():
        p.add_argument(option, default="", help=f"Extra flags for step {step}, as one string.")
    add_hidden_local_rank(p)
    argv = step_args_as_values(argv)
    repeated = repeated_flags(p, argv)
    if repeated:  # (argparse keeps the last one's values and drops the others', unsaid: --step 2 --step 3 ran step 3
        # alone, a second --step3-args string dropped the first's flags; the steps refuse theirs given twice too)
        p.error(f"given more than once: {', '.join(repeated)}; give each once, with all its values (--step 2 3, "
                "--data-path A B, one --stepN-args string holding all of that step's flags)")
    args = p.parse_args(argv)
    from dschat.pipeline import recipe_steps

    runs, not_run = recipe_steps(args.recipe, args.step)
    if not runs:
        p.error(f"--recipe {args.recipe} --step {' '.join(map(str, args.step))}: nothing to run; the recipe has no "
                + "; no ".join(not_run))
    if not args.output_dir:  # (an unset shell variable: the steps wrote their folders into the working directory)
        p.error("argument --output-dir: expected a folder, got '' (give . for the working directory)")
    if args.hostfile is not None and args.deployment_type != "multi_node":  # (it would go unused: one node's GPUs)
        p.error(f"argument --hostfile: only --deployment-type multi_node reads it (this is {args.deployment_type})")
    if args.reward_zero_stage is not None and args.recipe == "dpo":  # (DPO's two models are sharded like the actor)
        p.error("argument --reward-zero-stage: --recipe dpo has no reward model or critic; its policy and reference "
                "model take --actor-zero-stage")
    if args.reward_zero_stage is not None and args.recipe == "grpo" and args.reward_model is None:
        p.error("argument --reward-zero-stage: --recipe grpo without --reward-model has no reward model or critic "
                "(--reward_fn scores the answers)")
    args.unread_stage_flags = stage_flags_no_step_reads(args, runs)
    # (the stages given, before the deployment's default fills them in: a --stepN-args stage may replace a default,
    # not a stage the user gave too, pipeline.check_stage_flags_agree)
    args.given_zero_stages = {flag: value for flag, value in (("--actor-zero-stage", args.actor_zero_stage),
                                                              ("--reward-zero-stage", args.reward_zero_stage))
                              if value is not None}
    args.hostfile = args.hostfile or "/job/hostfile"
    args.reward_model = args.reward_model or args.actor_model
    # ZeRO-0 on one GPU; sharded (ZeRO-3) when spread over GPUs. DeepSpeed-Chat's scripts pick a stage per model size.
    default_stage = 0 if args.deployment_type == "single_gpu" else 3
    args.actor_zero_stage = default_stage if args.actor_zero_stage is None else args.actor_zero_stage
    args.reward_zero_stage = default_stage if args.reward_zero_stage is None else args.reward_zero_stage
    return args


def stage_flags_no_step_reads(args, runs):
    """--actor-zero-stage / --reward-zero-stage given where no step of ``runs`` reads them (``--step 1`` trains no
    reward model, ``--step 2`` of the PPO recipe no actor), each as "FLAG VALUE (who reads it)": said when the run
    starts, as a --stepN-args of a step not run is, not dropped unsaid."""
    unread = []
    if args.actor_zero_stage is not None and runs == [2] and args.recipe != "dpo":
        unread.append(f"--actor-zero-stage {args.actor_zero_stage} (steps 1 and 3's actor)")
    if args.reward_zero_stage is not None and not {2, 3} & set(runs):
        unread.append(f"--reward-zero-stage {args.reward_zero_stage} (step 2's reward model and step 3's critic)")
    return unread


def relaunch_with_deepspeed(args, argv):
    """``python train.py --deployment-type single_node|multi_node``: start the ranks once, via the launcher."""
    if args.deployment_type == "multi_node":
        if not os.path.isfile(args.hostfile):  # the launcher would run on this node alone, with a warning
            from dschat.errors import MissingInputError

            raise MissingInputError(f"--hostfile {args.hostfile}: no such file; --deployment-type multi_node starts "
                                    "the ranks of the nodes it lists (single_node: this node's GPUs)")
        # deepspeed's launcher with its pdsh line (read by each node's shell) quoted; dschat importable from any folder
        here = os.path.dirname(os.path.abspath(__file__))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "dschat.utils.launcher", "--hostfile", args.hostfile]
    else:  # the launcher's default hostfile (/job/hostfile) would spread a single_node run over the nodes it lists
        # (no file: this node's GPUs, "Unable to find hostfile ... local resources")
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", os.devnull]
    cmd += [os.path.abspath(__file__), *argv]
    print("launching:", shlex.join(cmd), flush=True)  # (quoted: a --stepN-args string is one argument)
    status = run_launcher(cmd)
    # a launcher killed by a signal (-N here) ends train.py as the shell says it: 128 + N (sys.exit(-9) gave 247)
    return 128 - status if status < 0 else status


# A supervisor's stop (a container's, a job's `kill PID`) reaches train.py alone; the local deepspeed launcher passes
# no signal on to its ranks, which trained on, orphaned. (Ctrl-C and Ctrl-\ reach every process of the terminal's
# process group, the ranks included, so SIGINT and SIGQUIT are left as they are.)
FORWARDED_SIGNALS = ("SIGTERM", "SIGHUP")
RANKS_GRACE_S = 60  # how long the ranks have to end on the forwarded signal before they are killed


def run_launcher(cmd):
    """The launcher's exit status. A SIGTERM or SIGHUP to train.py goes on to the launcher and every process under
    it; train.py waits until they have ended, then ends by that signal itself (a signal train.py ignores, as under
    nohup, stays ignored)."""
    import signal

    running = {}

    def stop(signum, frame):
        if "launcher" in running:
            end_process_tree(running["launcher"].pid, signum, RANKS_GRACE_S)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    previous = {}
    for name in FORWARDED_SIGNALS:  # (before the launcher starts: a signal in between is not lost)
        number = getattr(signal, name)
        if signal.getsignal(number) is not signal.SIG_IGN:
            previous[number] = signal.signal(number, stop)
    try:
        with subprocess.Popen(cmd) as launcher:
            running["launcher"] = launcher
            return launcher.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def end_process_tree(pid, signum, grace_s):
    """``signum`` to process ``pid`` and every process under it; returns once they have all ended (a zombie has),
    killing any still running after ``grace_s`` seconds."""
    import time

    import psutil  # (DeepSpeed's own dependency)

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.send_signal(signum)
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + grace_s
    while (alive := [p for p in processes if _still_running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def _still_running(process):
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from dschat.utils.dist import under_launcher

    if args.deployment_type != "single_gpu" and not under_launcher():
        from dschat.pipeline import read_hub_cache_only_if_unreachable_for

        read_hub_cache_only_if_unreachable_for(args)  # (decided once here: the ranks inherit it)
        sys.exit(relaunch_with_deepspeed(args, argv))
    from dschat.pipeline import run_pipeline

    run_pipeline(args)


if __name__ == "__main__":
    from dschat.utils.cli import run_script

    run_script(main, resumable=True)
