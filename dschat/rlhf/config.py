"""Step-3 settings: the parsed namespace, a dict or any object, completed with the defaults of every flag."""
import argparse
import math
import os

from dschat.errors import MissingInputError, UsageError


def step3_args(args=None):
    from dschat.args import namespace_with_defaults, step3_parser
    from dschat.steps.common import data_flags_read

    if isinstance(args, argparse.Namespace) and getattr(args, "_dschat_complete", False):
        return args
    completed = namespace_with_defaults(step3_parser(), args)
    resolve_zero_stages(completed)
    # step 3 reads --data_path alone, also where its prompts were read through another copy of its settings (a
    # notebook's prompt_loaders(args, ...) and its engine's, which ``take_data_files`` never saw): a step-3
    # checkpoint's load from a notebook was refused for --data_files_flags ['data_path'] -> [..., 'sft_only_data_path']
    completed._data_flags = data_flags_read(3)
    completed._dschat_complete = True
    return completed


GROUP_ESTIMATORS = ("grpo", "rloo")  # an answer's advantage is its score against the other answers to its prompt


def check_freezing_actor_steps(args):
    if args.freezing_actor_steps and args.advantage_estimator != "gae":
        raise UsageError(f"--freezing_actor_steps trains the critic alone first, and --advantage_estimator "
                         f"{args.advantage_estimator} has no critic (GAE's has)")


def check_ema_beta(args):
    """--ema_beta is the EMA's decay, in [0, 1]: outside it each update extrapolates away from the actor (1.5 makes
    1.5 x EMA - 0.5 x actor) and the saved actor_ema drifts without bound; NaN makes every weight NaN."""
    if args.enable_ema and not 0.0 <= args.ema_beta <= 1.0:
        raise UsageError(f"--ema_beta {args.ema_beta}: the EMA's decay per optimizer step must be in [0, 1] "
                         "(DeepSpeed-Chat's and OpenRLHF's default 0.992)")


def check_advantage_estimator(args):
    """GRPO and RLOO compare each answer with the other answers to its prompt: a group of one answer has none (RLOO
    would fail in the first PPO update, after every model has loaded; GRPO would silently train on raw scores, as
    TRL refuses it), and greedy answers to one prompt (--greedy, or --top_k 1) are all the same text (every advantage
    0: nothing trains)."""
    estimator = args.advantage_estimator
    if estimator not in GROUP_ESTIMATORS:
        return
    if args.n_samples_per_prompt < 2:
        raise UsageError(f"--advantage_estimator {estimator} compares each answer with the other answers to its "
                         f"prompt: it needs --n_samples_per_prompt 2 or more, not {args.n_samples_per_prompt} (one "
                         f"answer per prompt: --advantage_estimator reinforce_pp)")
    if getattr(args, "greedy", False):
        raise UsageError(f"--greedy with --advantage_estimator {estimator}: the {args.n_samples_per_prompt} answers to "
                         f"a prompt are the same text, so every advantage is 0 and nothing trains; sample them")
    if getattr(args, "top_k", 0) == 1:  # (sampling among one token is greedy decoding)
        raise UsageError(f"--top_k 1 with --advantage_estimator {estimator}: sampling from the one likeliest token is "
                         f"greedy, so the {args.n_samples_per_prompt} answers to a prompt are the same text and every "
                         f"advantage is 0; give a --top_k above 1 (0: no top-k filtering)")


def kl_in_loss(args):
    """Whether the KL penalty is a term of the actor's loss (GRPO and RLOO always: their advantages ignore per-token
    rewards; the others with --kl_in_reward 0) rather than part of the per-token reward."""
    return args.advantage_estimator in GROUP_ESTIMATORS or not args.kl_in_reward


def _changed(args, name):
    """Whether step 3's flag ``name`` has a value other than its default (so it was given)."""
    from dschat.args import step3_parser

    return getattr(args, name) != step3_parser().get_default(name)


def check_kl_settings(args):
    """A KL flag that the chosen place of the KL penalty does not read is an error, not a run with another KL than
    asked for (or none)."""
    if not args.adaptive_kl:
        for name in ("kl_target", "kl_horizon"):
            if _changed(args, name):
                raise UsageError(f"--{name} {getattr(args, name)} sets the adaptive KL controller, which runs only "
                                 "with --adaptive_kl")
    if kl_in_loss(args):
        _check_kl_loss_term(args)
    elif args.kl_loss_coef:  # (0: no loss term, which is what the reward's KL means)
        raise UsageError(f"--kl_loss_coef weighs a KL loss term, and --advantage_estimator {args.advantage_estimator} "
                         "with --kl_in_reward 1 puts the KL in the per-token reward instead (weighted by --kl_ctl); "
                         "--kl_in_reward 0 makes it a loss term")
    elif args.adaptive_kl and not args.kl_ctl:
        raise UsageError("--adaptive_kl with --kl_ctl 0: the controller scales the coefficient, which stays 0; give "
                         "the starting coefficient (e.g. --kl_ctl 0.1)")


def _check_kl_loss_term(args):
    """Where the KL is a loss term: the reward penalty's flags are not read; k1 is warned."""
    if args.kl_estimator == "k1" and args.kl_loss_coef != 0:
        from dschat.utils.dist import print_rank_0

        print_rank_0("warning: --kl_estimator k1 as the KL loss term: its gradient over the sampled answers is 0 in "
                     "expectation, so it pulls the policy nowhere; k3 (the default there) or k2 regularise")
    where = ("--kl_in_reward 0" if args.advantage_estimator not in GROUP_ESTIMATORS
             else f"--advantage_estimator {args.advantage_estimator}")
    if args.adaptive_kl:
        raise UsageError(f"--adaptive_kl adapts the per-token reward's KL coefficient (--kl_ctl), which {where} does "
                         "not use: the KL is a loss term weighted by --kl_loss_coef")
    if _changed(args, "kl_ctl"):
        raise UsageError(f"--kl_ctl {args.kl_ctl} weighs the per-token reward's KL, which {where} does not use: the "
                         "KL is a loss term weighted by --kl_loss_coef")


def resolve_zero_stages(args):
    """--actor_zero_stage / --critic_zero_stage left unset take --zero_stage (DeepSpeed-Chat's steps 1 and 2 name),
    else 0."""
    from dschat.args import zero_stage_of

    for name in ("actor_zero_stage", "critic_zero_stage"):
        setattr(args, name, zero_stage_of(args, name))


def check_earlier_step_outputs(args, actor_path=None, critic_path=None, reward_path=None):
    """A model path left at its default (an earlier step's output folder) that does not exist fails here, naming the
    step that writes it, and a local path that is not there names its flag: before any data or model loads, instead
    of as a hub lookup of "output/step2_rm" after the actor has loaded; an actor that is a reward model is refused
    naming its flag too. The paths: the flags', or those a notebook gave ``DeepSpeedRLHFEngine``."""
    from dschat.args import step3_parser
    from dschat.models.loading import check_model_path, check_not_a_reward_model

    parser = step3_parser()
    paths = {"actor_model_name_or_path": actor_path or args.actor_model_name_or_path,
             "critic_model_name_or_path": critic_path or args.critic_model_name_or_path}
    reward_path = reward_path or args.reward_model_name_or_path
    if args.reward_model_weight and reward_path:
        check_model_path(reward_path, "--reward_model_name_or_path")
    needed = [("actor_model_name_or_path", "the actor", "step 1")]
    if args.advantage_estimator == "gae":
        needed.append(("critic_model_name_or_path", "the critic", "step 2"))
    if args.reward_model_weight and not reward_path:
        needed.append(("critic_model_name_or_path", "the reward model", "step 2"))
    for flag, role, step in needed:
        path = paths[flag]
        if path != parser.get_default(flag) or os.path.isdir(path):
            check_model_path(path, f"--{flag}")
            if role == "the actor":  # (else refused by the actor's loading, after the prompts had loaded)
                check_not_a_reward_model(path, f"--{flag}")
            continue
        hint = ""
        if role == "the reward model":
            hint = ", or with --reward_fn give --reward_model_weight 0 (the function alone)"
        elif not args.reward_model_weight:  # (rewarded by the function alone: step 2 is no step of this run)
            hint = (f" (a critic may start from the actor, --{flag} {paths['actor_model_name_or_path']}, with a new "
                    f"value head), or use a critic-free --advantage_estimator (grpo, rloo, reinforce_pp)")
        raise MissingInputError(f"step3: {role} loads from --{flag} {path}, the default ({step}'s output), which "
                                f"does not exist; run {step} first or give --{flag}{hint}")
    if args.reward_model_weight:
        check_reward_model_trained(reward_path or paths["critic_model_name_or_path"], by_default=not reward_path)


def check_reward_model_trained(path, by_default=False):
    """A reward model without step 2's value head (a step-1 folder, a plain model) is refused before any model
    loads: PPO would maximise a random head's score. A tiny preset is such a folder once built (it was refused after
    the actor and critic had loaded), and a hub name's files are read from its snapshot (they were checked only once
    the actor, the reference, the critic and the reward model itself had loaded)."""
    from dschat.models.reward_model import has_trained_value_head

    if not has_trained_value_head(path):
        raise UsageError(untrained_reward_model_message(path))
    warn_of_a_critic_as_reward_model(path, by_default)


def warn_of_a_critic_as_reward_model(path, by_default=False):
    """Step 3's critic as the reward model is warned of, once (not refused: a user may want it): the reward model
    defaults to --critic_model_name_or_path, so PPO continued from an earlier step 3's critic/ with no reward model
    given was rewarded by that critic's value estimates, unsaid. How to give the reward model apart is said where it
    came ``by_default`` (given as --reward_model_name_or_path, it was asked for). Under train.py the flags are said as
    its user typed them (``pipeline.says_train_py_flags``)."""
    from dschat.models.loading import critic_given_as_reward_model
    from dschat.utils.cli import say_once
    from dschat.utils.dist import is_rank_0

    if is_rank_0() and (critic := critic_given_as_reward_model(path)):
        advice = "; give it with --reward_model_name_or_path, which defaults to --critic_model_name_or_path"
        say_once(f"warning: step3: {critic}{advice if by_default else ''}")


def untrained_reward_model_message(path):
    from dschat.models.reward_model import VALUE_HEAD_FILES

    return (f"step3: the reward model {path} has no trained value head ({VALUE_HEAD_FILES}): it is not step 2's "
            "output, and PPO would maximise a random score; give step 2's output folder "
            "(--reward_model_name_or_path, else --critic_model_name_or_path)")


def whole_iterations(batches, generation_batches):
    """(PPO iterations, the generation batches they take) of an epoch of ``batches`` generation batches, each iteration
    taking ``generation_batches`` (--generation_batches): the batches of no whole iteration are not trained on."""
    iterations = batches // generation_batches
    return iterations, iterations * generation_batches


def micro_batches_per_epoch(args):
    """PPO micro-batches of one PPO epoch over a rollout: each generation batch is sliced on its own."""
    rows = args.per_device_generation_batch_size * args.n_samples_per_prompt
    return math.ceil(rows / args.per_device_training_batch_size) * args.generation_batches


def optimizer_steps_per_iteration(args):
    """Optimizer steps the actor and the critic each take in one PPO iteration: --ppo_epochs passes over the rollout's
    micro-batches, one step per --gradient_accumulation_steps of them (``check_accumulation``: whole groups).
    ``args`` in any form the engine takes (a notebook's dict sizes its engine's num_total_iters with it)."""
    args = step3_args(args)
    return args.ppo_epochs * micro_batches_per_epoch(args) // args.gradient_accumulation_steps


def check_accumulation(args):
    """PPO micro-batches per epoch over the rollout must fill whole accumulation groups, or an optimizer step mixes
    PPO epochs (or iterations) whose losses were scaled for different token counts."""
    micro = micro_batches_per_epoch(args)
    gas = args.gradient_accumulation_steps
    if micro % gas:
        raise UsageError(f"{micro} PPO micro-batches per PPO epoch (generation batch x n_samples_per_prompt / "
                         f"training batch x generation_batches) is not a multiple of --gradient_accumulation_steps "
                         f"{gas} (DeepSpeed-Chat's step 3 lets an optimizer step span rollouts; dschat's does not): "
                         f"{accumulation_fixes(args, micro, gas)}")


def accumulation_fixes(args, micro, gas):
    """Flag values that make ``micro`` PPO micro-batches per epoch fill whole groups of ``gas``."""
    rows = args.per_device_generation_batch_size * args.n_samples_per_prompt
    fixes = [f"--generation_batches {args.generation_batches * gas // math.gcd(micro, gas)}"]
    current = args.per_device_training_batch_size
    fitting = [size for size in range(1, rows + 1)  # even slices of a generation batch, closest to the current
               if rows % size == 0 and rows // size * args.generation_batches % gas == 0]
    if fitting:
        fixes.append(f"--per_device_training_batch_size {min(fitting, key=lambda size: (abs(size - current), -size))}")
    return f"give {' or '.join(fixes)}, or a --gradient_accumulation_steps that divides {micro}"
