"""Step 3: PPO of the SFT actor against the step-2 reward model, with held-out evaluation and resume."""
import copy
import json
import os
import time
from dataclasses import dataclass

import torch

from dschat.args import resolve_pad_to_multiple_of, step3_parser
from dschat.errors import UsageError
from dschat.models.checkpoint import save_causal_lm, save_reward_model
from dschat.models.loading import TORCH_DTYPES, load_tokenizer
from dschat.models.training_engine import released_engines
from dschat.report import ALGORITHM_NAMES, counted
from dschat.rlhf.checkpointing import load_checkpoint, plan_resume, save_checkpoint
from dschat.rlhf.config import (check_earlier_step_outputs, optimizer_steps_per_iteration, step3_args,
                                whole_iterations)
from dschat.rlhf.engine import DeepSpeedRLHFEngine, check_step3_settings
from dschat.rlhf.evaluation import held_out_eval, rule_scorer_for
from dschat.rlhf.trainer import (PPO_STEP_STATS, DeepSpeedPPOTrainer, DeepSpeedPPOTrainerUnsupervised,
                                 first_answer_text)
from dschat.run_layout import ACTOR_DIR, ACTOR_EMA_DIR, CHECKPOINTS_DIR, CRITIC_DIR
from dschat.steps.common import (build_dataloaders, check_output_dir, clear_results, eval_loader_of_first,
                                 format_metrics, progress, require_training_records, reseed_epoch,
                                 restart_deepspeed_tensorboard, say_max_steps_past_the_epochs, seconds_so_far,
                                 setup_run, take_data_files, take_hub_data, take_unsupervised_data, tensorboard_writer,
                                 to_device, warn_of_skipped_steps, write_results)
from dschat.steps.resume import resume_or_afresh
from dschat.utils.dist import all_reduce, barrier, get_world_size, is_rank_0, local_device, print_rank_0, rank_mean
from dschat.utils.files import atomic_file
from dschat.utils.optim import skipped_steps


def prompt_loaders(args, tokenizer, held_out_only=False):
    """Phase-3 prompts (train, and held-out for evaluation), left-padded; ``args`` as for the RLHF engine.
    ``held_out_only``: no train loader (None), and no training prompts needed (an evaluation tool's)."""
    from dschat.data import DataCollatorRLHF, create_prompt_dataset, get_eot_token

    args = step3_args(args)
    setup_run(args, trains=not held_out_only)  # (eval.py --dtype fp16 on a CPU, bf16 on a V100: it only generates)
    take_data_files(args, 3)
    train, held_out = create_prompt_dataset(
        args.local_rank, args.data_path, args.data_split, args.data_output_path, 3, args.seed, tokenizer,
        args.max_prompt_seq_len, end_of_conversation_token=get_eot_token(tokenizer), reload=args.reload_data,
        max_prompt_len=args.max_prompt_seq_len, data_fields=args.data_fields or None)
    take_hub_data(args, train)
    if not held_out_only:
        require_training_records(train, args, "step3")
    check_reward_fn_takes_the_columns(args, None if held_out_only else train, held_out)
    collator = DataCollatorRLHF(args.max_prompt_seq_len, pad_token_id=tokenizer.pad_token_id,
                                pad_to_multiple_of=resolve_pad_to_multiple_of(args.pad_to_multiple_of))
    batch = args.per_device_generation_batch_size
    # drop_last keeps every rank's iteration count equal, so collectives line up; on several ranks every rank runs
    # as many eval batches (generation may be collective) and the repeats weigh 0 in the scores
    return build_dataloaders(None if held_out_only else train, held_out, collator, batch, batch, args.seed,
                             drop_last=True)


def held_out_loader_once(args, tokenizer, built):
    """Step 3's held-out prompt loader (``prompt_loaders``, ``held_out_only``) in ``tokenizer``'s ids, built once per
    encoding: ``built`` (a dict kept across calls) holds those made, keyed by the tokenizer's fingerprint less its
    folder, so the next policy of the same tokenizer (the SFT model's beside DPO's or PPO's) reuses the prompts and
    the data report is said once. Returns (the loader, whether it was built now)."""
    from dschat.data.cache import tokenizer_fingerprint

    key = json.dumps({k: v for k, v in tokenizer_fingerprint(tokenizer).items() if k != "name_or_path"},
                     sort_keys=True)
    if key in built:
        return built[key], False
    built[key] = prompt_loaders(args, tokenizer, held_out_only=True)[1]
    return built[key], True


def check_reward_fn_takes_the_columns(args, train, held_out):
    """--reward_fn can be called on the prompts' columns (``check_takes_columns``), before the models load; a split
    without prompts is not scored."""
    if not args.reward_fn:
        return
    from dschat.rlhf.reward_fn import check_takes_columns, load_reward_fn

    fn = load_reward_fn(args.reward_fn)
    for dataset, where in ((train, "training prompts"), (held_out, "held-out prompts")):
        if dataset is not None and len(dataset):
            check_takes_columns(fn, dataset.columns, where, dataset.item_columns_by_source())


def check_prompts_make_an_iteration(prompts, args, world_size, bound=False):
    """Each rank's share of ``prompts`` (padded to equal shares, as DistributedSampler does) must fill
    --generation_batches whole batches (drop_last), or step 3 trains nothing. ``bound``: ``prompts`` is an upper bound
    read before the data was encoded (train.py's pre-flight, before step 1)."""
    per_rank = -(-prompts // world_size)
    if per_rank // args.per_device_generation_batch_size // args.generation_batches == 0:
        raise UsageError(
            f"step3: {'at most ' if bound else ''}{prompts} training prompts make no iteration: one takes "
            f"--per_device_generation_batch_size {args.per_device_generation_batch_size} x --generation_batches "
            f"{args.generation_batches} x {world_size} rank(s); give more prompts (for step 3: --data_split) or a "
            "smaller batch" + (" (found before the first step runs, from the phase-3 share of --data_path)"
                               if bound else ""))


def unsupervised_loader(args, tokenizer):
    if not args.unsupervised_dataset_name:
        return None
    from dschat.data import DataCollatorSFT, get_unsupervised_data

    data = get_unsupervised_data(args, tokenizer)
    take_unsupervised_data(args, data)
    # no --pad_to_multiple_of here: the blocks have one length (but for a short last one of a map batch that held less
    # than a block), so rounding it up would mostly add padding
    loader, _ = build_dataloaders(data, data, DataCollatorSFT(tokenizer.pad_token_id),
                                  args.per_device_generation_batch_size, 1, args.seed, drop_last=True)
    if len(loader) == 0:  # cycle() would never yield
        block = args.max_prompt_seq_len + args.max_answer_seq_len
        ranks, batch = get_world_size(), args.per_device_generation_batch_size
        raise UsageError(f"--unsupervised_dataset_name {args.unsupervised_dataset_name}: its text makes {len(data)} "
                         f"block(s) of {block} tokens (--max_prompt_seq_len + --max_answer_seq_len), fewer than one "
                         f"batch of --per_device_generation_batch_size {batch} on each of {ranks} rank(s) "
                         f"({counted(batch * ranks, 'block')}): give more text")
    print_rank_0(f"[step3] unsupervised data {args.unsupervised_dataset_name}: {counted(len(data), 'block')} of "
                 f"{args.max_prompt_seq_len + args.max_answer_seq_len} tokens, "
                 f"{counted(len(loader), 'batch', 'batches')} per rank")
    return loader


def cycle(loader, seed, start=0):
    """Endless batches of the unsupervised data, a new epoch (and order) whenever it runs out, from the
    ``start``-th batch on (a resumed run skips the ones it consumed: the order depends on the seed only)."""
    epoch, skip = divmod(start, len(loader))
    while True:
        reseed_epoch(loader, seed, epoch)
        for index, batch in enumerate(loader):
            if index >= skip:
                yield batch
        skip = 0
        epoch += 1


def step3_eval_prompts(eval_prompts, batch, world_size):
    """How many held-out prompts step 3 scores (``held_out_eval``): each of its ranks its share of ``eval_prompts`` in
    whole batches, the ranks interleaved over the prompts in order; so the first that many prompts, in one process
    (0: all)."""
    if not eval_prompts:
        return 0
    per_rank = -(-eval_prompts // world_size)
    return -(-per_rank // batch) * batch * world_size


def held_out_as_before(eval_loader, before, args, world_size):
    """(loader, flags) for a resumed run's held-out evaluation after PPO, on the prompts its checkpoint's scores
    ``before`` PPO are of. Each rank scores its share of --eval_prompts in whole generation batches, so a checkpoint of
    another number of ranks scored another count of the held-out prompts (the first that many, in order): this run
    then scores that first count (said), not set beside them as if comparable. Else ``eval_loader`` and ``args``."""
    saved, prompts = (before or {}).get("prompts"), len(eval_loader.dataset)
    now = min(step3_eval_prompts(args.eval_prompts, eval_loader.batch_size, world_size) or prompts, prompts)
    if not isinstance(saved, int) or not 0 < saved <= prompts or saved == now:
        return eval_loader, args
    algorithm = ALGORITHM_NAMES[args.advantage_estimator]
    print_rank_0(f"[step3] held-out after {algorithm}: the first {saved} held-out prompts, as the checkpoint's run "
                 f"scored before {algorithm} on its ranks (--eval_prompts {args.eval_prompts} on {world_size} "
                 f"rank(s) would score {now})")
    every = copy.copy(args)
    every.eval_prompts = 0  # (every prompt of the loader)
    return eval_loader_of_first(eval_loader, saved, args.seed), every


@dataclass(frozen=True)
class Schedule:
    """How many PPO iterations the run trains: ``usable_batches`` generation batches of an epoch make its
    ``iters_per_epoch`` iterations; ``total`` over the run (the learning-rate schedule's); ``stop_at``: where the run
    stops (test mode stops early without changing the schedule: it simulates an interrupted run)."""
    iters_per_epoch: int
    usable_batches: int
    total: int
    stop_at: int
    optimizer_steps: int
    actor_optimizer_steps: int  # (--freezing_actor_steps: the actor's schedule spans the iterations it trains)


def plan_iterations(args, train_loader):
    """The run's ``Schedule``; the prompts of no whole iteration, --max_steps past the epochs and a --test_stop_step
    without test mode are said."""
    check_prompts_make_an_iteration(len(train_loader.dataset), args, get_world_size())
    iters_per_epoch, usable_batches = whole_iterations(len(train_loader), args.generation_batches)
    # the prompts of no whole iteration (batches of the last one, and those short of a batch): said, not generated
    prompts, used = len(train_loader.dataset), usable_batches * args.per_device_generation_batch_size * get_world_size()
    if used < prompts:
        print_rank_0(f"[step3] each epoch trains on {used} of its {prompts} training prompts (an iteration takes "
                     f"--generation_batches {args.generation_batches} x --per_device_generation_batch_size "
                     f"{args.per_device_generation_batch_size} x {get_world_size()} rank(s)); "
                     + ("the other one, drawn anew each epoch, is skipped" if prompts - used == 1 else
                        f"the other {prompts - used}, drawn anew each epoch, are skipped"))
    total = iters_per_epoch * args.num_train_epochs
    say_max_steps_past_the_epochs(args.max_steps, total, args.num_train_epochs, "PPO iteration")
    if args.max_steps:
        total = min(total, args.max_steps)
    stop_at = min(total, args.test_stop_step) if args.enable_test_mode and args.test_stop_step else total
    if args.test_stop_step and not args.enable_test_mode:
        print_rank_0(f"warning: --test_stop_step {args.test_stop_step} has no effect without --enable_test_mode (as in "
                     f"DeepSpeed-Chat): the run trains {counted(total, 'iteration')} (--max_steps stops it and "
                     "shortens its schedule)")
    def optimizer_steps(iterations):
        return max(1, iterations * optimizer_steps_per_iteration(args))

    if args.freezing_actor_steps >= total:
        print_rank_0(f"warning: --freezing_actor_steps {args.freezing_actor_steps} >= this run's "
                     f"{counted(total, 'PPO iteration')}: only the critic trains, and the actor is saved as it started")
    return Schedule(iters_per_epoch, usable_batches, total, stop_at, optimizer_steps(total),
                    optimizer_steps(total - min(args.freezing_actor_steps, total)))


def main(args=None):
    """Run PPO; returns metrics (held-out reward/rule scores before and after, final iteration stats). Its engines
    are released when it ends (``released_engines``)."""
    if args is None or isinstance(args, (list, tuple)):
        args = step3_parser().parse_args(args)
    args = step3_args(args)
    with released_engines():
        return _run(args)


def _run(args):
    started = time.time()
    setup_run(args)
    check_step3_settings(args, get_world_size())  # a config file at odds with the flags fails before data loads
    device = local_device()
    check_output_dir(args.output_dir, device)
    check_earlier_step_outputs(args)
    check_same_reward_fn_on_every_rank(args, device)
    tokenizer = load_tokenizer(args.actor_model_name_or_path, padding_side="left", add_eot_token=args.add_eot_token,
                               eot_token=args.eot_token)
    train_loader, eval_loader = prompt_loaders(args, tokenizer)
    unsup_loader = unsupervised_loader(args, tokenizer)
    schedule = plan_iterations(args, train_loader)
    ckpt_root = os.path.join(args.output_dir, CHECKPOINTS_DIR)
    # (before the engines: a checkpoint of another number of ranks sets DeepSpeed's universal loading in their configs)
    plan = plan_resume(args, ckpt_root, train_loader, unsup_loader, tokenizer)
    engine = DeepSpeedRLHFEngine(args.actor_model_name_or_path, args.critic_model_name_or_path, tokenizer, args,
                                 num_total_iters=schedule.optimizer_steps,
                                 actor_total_iters=schedule.actor_optimizer_steps, load_universal=plan.universal,
                                 lora_from=plan.lora_from)
    trainer_class = DeepSpeedPPOTrainerUnsupervised if unsup_loader is not None else DeepSpeedPPOTrainer
    trainer = trainer_class(engine, args)
    scorer = rule_scorer_for(args.data_path)
    checkpoint = resume_or_afresh(lambda: load_checkpoint(trainer, ckpt_root, plan), ckpt_root, args, "step3",
                                  schedule.total, unit="iteration", plan=plan)
    if checkpoint is None:
        for model in (trainer.actor_model, trainer.critic_model):  # (a resume restarts them at its checkpoint)
            restart_deepspeed_tensorboard(model)
        position = {"iteration": 0, "epoch": 0, "batch": 0, "unsup_batches": 0,
                    "eval_before": held_out_eval(trainer, eval_loader, args, device, scorer),
                    "eval_reward_fn": reward_fn_identity(args)}
    else:
        realign_schedules(trainer, checkpoint, args)
        position = before_scored_alike(checkpoint, args)
        position = reward_model_scored_alike(position, engine.reward_path if args.reward_model_weight else None)
    log_path = os.path.join(args.output_dir, "step3_log.jsonl")
    _keep_log_until(log_path, position["iteration"])  # iterations run after the checkpoint are run again
    clear_results(args, "step3", resumed=checkpoint is not None)
    before = position.get("eval_before")
    algorithm = ALGORITHM_NAMES[args.advantage_estimator]
    print_rank_0(f"[step3] held-out before {algorithm}: {_eval_line(before)}")
    iteration = train_iterations(trainer, args, schedule, (train_loader, unsup_loader), position, log_path,
                                 lambda: seconds_so_far(started, checkpoint))
    after_loader, after_args = (eval_loader, args) if checkpoint is None else \
        held_out_as_before(eval_loader, before, args, get_world_size())
    after = held_out_eval(trainer, after_loader, after_args, device, scorer)
    print_rank_0(f"[step3] held-out after {algorithm}: {_eval_line(after)}")
    warn_of_skipped_ppo_steps(trainer, args, iteration)
    save_models(trainer, args)
    metrics = {"iterations": iteration, "algorithm": algorithm,
               "eval_before": before, "eval_after": after, "seconds": seconds_so_far(started, checkpoint)}
    write_results(args, metrics, "step3")
    return metrics


def warn_of_skipped_ppo_steps(trainer, args, iterations):
    """Steps 1 and 2's warning for the actor and the critic: DeepSpeed skipped more than half of the optimizer steps
    of the ``iterations`` the run has trained (the actor's: those after --freezing_actor_steps)."""
    per_iteration = optimizer_steps_per_iteration(args)
    models = (("actor", trainer.actor_model, iterations - min(args.freezing_actor_steps, iterations)),
              ("critic", trainer.critic_model, iterations))
    for role, model, trained in models:
        if model is not None and trained:
            warn_of_skipped_steps(model, f"step3 {role}", trained * per_iteration, f"--{role}_learning_rate",
                                  no_token_skips=trainer.no_token_skips.get(role, 0))


def train_iterations(trainer, args, schedule, loaders, position, log_path, seconds):
    """The PPO iterations from ``position`` (a checkpoint's, or the start's) to ``schedule.stop_at``: each generates
    ``--generation_batches`` batches of experience (and takes as many unsupervised batches), trains on them, is
    logged, and every ``--save_interval`` iterations checkpointed. Returns the iterations done."""
    train_loader, unsup_loader = loaders
    device = local_device()
    ckpt_root = os.path.join(args.output_dir, CHECKPOINTS_DIR)
    # iterations are logged from 1: a resumed run logs the iterations after its checkpoint's again, a fresh one all
    # (an earlier run's events in the same folder are hidden from there on, as its jsonl log is cut)
    writer = tensorboard_writer(args, "step3", purge_step=position["iteration"] + 1)
    iteration = position["iteration"]
    bar = progress(range(schedule.total), schedule.total, f"step3 {ALGORITHM_NAMES[args.advantage_estimator]}")
    if is_rank_0():
        bar.update(iteration)
    # one unsupervised stream for the whole run; a checkpoint stores how many of its batches were consumed
    unsup_batches = position.get("unsup_batches", 0)
    unsup_iter = cycle(unsup_loader, args.seed, unsup_batches) if unsup_loader is not None else None
    for epoch in range(position["epoch"], args.num_train_epochs):
        reseed_epoch(train_loader, args.seed, epoch)
        buffer, unsup_buffer = [], []
        for batch_index, batch in enumerate(train_loader):
            if epoch == position["epoch"] and batch_index < position["batch"]:
                continue  # consumed before the checkpoint we resumed from
            if iteration >= schedule.stop_at or batch_index >= schedule.usable_batches:
                break
            if not buffer:  # the iteration's clock runs from its first generation batch
                t0, batch_stats = time.time(), []
            # advantages wait for the whole rollout (train_rollout): a generation batch's own would be thrown away
            buffer.append(trainer.generate_experience(batch, step=iteration, advantages=False,
                                                     print_answer=False))  # (printed once per iteration, below)
            batch_stats.append(dict(trainer.stats))  # this generation batch's alone: the next one overwrites them
            # one unsupervised batch per generation batch's prompts, as in DeepSpeed-Chat, and per answer to them:
            # --n_samples_per_prompt n answers make n times the PPO micro-batches, each followed by a language-model
            # micro-step on blocks of its own (a single batch was cycled, each block trained n times per epoch)
            for _ in range(args.n_samples_per_prompt if unsup_iter is not None else 0):
                unsup_buffer.append(to_device(next(unsup_iter), device))
                unsup_batches += 1
            if len(buffer) < args.generation_batches:
                continue
            gen_stats = rollout_generation_stats(batch_stats, [e["input_ids"].shape[0] for e in buffer])
            t1 = time.time()
            # the KL coefficient this rollout's rewards take: train_rollout's --adaptive_kl update sets the next one's
            kl_coef = trainer.kl_coef
            # --freezing_actor_steps: the first iterations train the critic alone
            trained = trainer.train_rollout(buffer, unsup_buffer, train_actor=iteration >= args.freezing_actor_steps)
            train_time = time.time() - t1
            # samples_per_s and the tokens' rates: over the whole iteration, every generation batch's time included
            record = _iteration_record(iteration, buffer, trainer, gen_stats, {**trained, "kl_coef": kl_coef},
                                       train_time, time.time() - t0, device)
            _log_iteration(record, log_path, writer, bar, args, trainer, buffer)
            buffer, unsup_buffer = [], []
            iteration += 1
            if args.save_interval and iteration % args.save_interval == 0:
                save_checkpoint(trainer, ckpt_root, {"iteration": iteration, "epoch": epoch, "batch": batch_index + 1,
                                                     "unsup_batches": unsup_batches,
                                                     "eval_before": position.get("eval_before"),
                                                     "eval_reward_fn": position.get("eval_reward_fn"),
                                                     "save_interval": args.save_interval, "total": schedule.total,
                                                     "steps_per_iteration": optimizer_steps_per_iteration(args),
                                                     "seconds": seconds()})
        if iteration >= schedule.stop_at:
            break
    return iteration


def save_models(trainer, args):
    # the engines, not their modules: under ZeRO-3 they release their parameters before the gather (settled_module)
    save_causal_lm(trainer.actor_model, trainer.tokenizer, os.path.join(args.output_dir, ACTOR_DIR))

    def save_ema(engine, tokenizer, path):  # kept in fp32 while it averages; saved as the actor is
        save_causal_lm(engine, tokenizer, path, dtype=TORCH_DTYPES[args.dtype])

    for folder, engine, save in ((CRITIC_DIR, trainer.critic_model, save_reward_model),
                                 (ACTOR_EMA_DIR, trainer.actor_ema, save_ema)):
        path = os.path.join(args.output_dir, folder)
        if engine is not None:
            save(engine, trainer.tokenizer, path)
        else:
            _remove_earlier_model(path, args)


def _remove_earlier_model(path, args):
    """A critic or EMA actor that an earlier run left in this run's folder (this run trains none): kept beside this
    run's actor, it would pass for this run's. Rank 0 looks and removes (the other ranks may not see the folder:
    node-local storage); every rank waits for it. A folder this run loaded a model from stays."""
    import shutil

    inputs = [getattr(args, name, None) for name in ("actor_model_name_or_path", "critic_model_name_or_path",
                                                     "reward_model_name_or_path")]
    loaded_from = {os.path.abspath(p) for p in inputs if p}
    if is_rank_0() and os.path.isdir(path) and os.path.abspath(path) not in loaded_from:
        try:
            shutil.rmtree(path)
            print_rank_0(f"[step3] removed {path}: an earlier run's model (this run writes none there)")
        except OSError as error:  # said, not raised: the other ranks wait at the barrier below
            print_rank_0(f"[step3] WARNING: {path} holds an earlier run's model (this run writes none there), and "
                         f"removing it failed ({error}); remove it by hand")
    barrier()


SUMMED_GENERATION_STATS = ("generation_time", "experience_time", "empty_answers", "truncated_answers")


def rollout_generation_stats(batch_stats, batch_answers):
    """One rollout's generation stats from its generation batches' (``trainer.stats`` after each, and the batch's
    answer count): times and counts add up over the batches; answer_length, a mean over a batch's answers, becomes
    the mean over all the rollout's answers (each batch weighted by its answers: the rollout's answer tokens over
    its answers)."""
    stats = {key: sum(s[key] for s in batch_stats) for key in SUMMED_GENERATION_STATS}
    weighted = sum(s["answer_length"] * n for s, n in zip(batch_stats, batch_answers))
    stats["answer_length"] = weighted / sum(batch_answers)
    return stats


def _iteration_record(iteration, buffer, trainer, gen_stats, trained, train_time, wall, device):
    """One iteration's log line; ``trained``: what ``train_rollout`` returned (mean losses, the rollout's KL), and the
    "kl_coef" its rewards took."""
    reward = torch.cat([e["rewards"].float() for e in buffer]).mean().item()
    samples = sum(e["input_ids"].shape[0] for e in buffer) * get_world_size()
    # tokens_per_s: prompt + answer tokens (padding not counted), as steps 1 and 2 count theirs and TRL's num_tokens
    # does; answer_tokens_per_s: the answers' alone (what tokens_per_s counted before session 52)
    tokens = rank_mean(sum(int(e["attention_mask"].sum()) for e in buffer), device) * get_world_size()
    answer_tokens = rank_mean(sum(int(e["action_mask"].sum()) for e in buffer), device) * get_world_size()
    record = {"iteration": iteration + 1, "reward": rank_mean(reward, device), "kl": trained["kl"],
              "kl_per_answer": trained["kl_per_answer"], "kl_coef": trained["kl_coef"],
              # every rank answers as many prompts: the mean of the ranks' means is the mean over all answers
              "answer_length": rank_mean(gen_stats["answer_length"], device),
              "empty_answers": round(rank_mean(gen_stats["empty_answers"], device) * get_world_size()),
              # answers that hit --max_answer_seq_len unended (TRL's clipped ratio, as a count like empty_answers)
              "truncated_answers": round(rank_mean(gen_stats["truncated_answers"], device) * get_world_size()),
              "generation_time": gen_stats["generation_time"], "experience_time": gen_stats["experience_time"],
              "training_time": train_time, "samples_per_s": samples / wall, "tokens_per_s": tokens / wall,
              "answer_tokens_per_s": answer_tokens / wall}
    # GRPO / RLOO: the groups whose answers all scored alike, and the mean of the groups' score std (TRL's
    # reward_std: how far a prompt's answers are told apart); every rank holds as many groups
    for key in ("frac_reward_zero_std", "reward_std"):
        if key in trainer.stats:
            record[key] = rank_mean(trainer.stats[key], device)
    if trained["actor_loss"] is None:  # --freezing_actor_steps: the critic alone trained
        record["actor_frozen"] = True
    # none with the actor frozen / without a critic / without ptx data (the same on every rank); means over the
    # iteration's micro-batches, then over the ranks (each rank's own differ; rank 0 writes the record)
    for key in ("actor_loss", "critic_loss", "unsup_loss"):
        if trained.get(key) is not None:
            record[key] = rank_mean(trained[key], device)
    record.update(step_stats_over_ranks(trained, device))
    # (the same on every rank: DeepSpeed agrees on an overflow over the ranks, train_rollout on a group's tokens)
    for key in SKIPPED_STEPS + NO_TOKEN_STEPS:
        if trained.get(key) is not None:
            record[key] = trained[key]
    return record


SKIPPED_STEPS = ("actor_skipped_steps", "critic_skipped_steps")
NO_TOKEN_STEPS = ("actor_no_token_steps", "critic_no_token_steps")  # (--mask_truncated_answers: train_rollout's)


def step_stats_over_ranks(trained, device):
    """The PPO step's stats (``PPO_STEP_STATS``: clip fractions, KL estimates) of the iteration over every rank's
    micro-batches that kept a token: {key: mean} for those that some rank measured. One collective that every rank
    calls alike. A rank may have none of a stat where another has it (--mask_truncated_answers: every one of its
    answers cut, its stats None): a collective per stat it held then paired the ranks' all-reduces apart (one rank
    ahead of the other by those calls: the next collectives mixed other numbers, or hung). Each rank's mean weighs by
    its micro-batches measured (``stats_micro_batches``; a caller's dict without it: 1 each)."""
    counted = trained.get("stats_micro_batches", 1)
    held = [trained.get(key) is not None and counted > 0 for key in PPO_STEP_STATS]
    sums = torch.tensor([float(trained[key]) * counted if has else 0.0 for key, has in zip(PPO_STEP_STATS, held)]
                        + [float(counted) if has else 0.0 for has in held], dtype=torch.float64, device=device)
    all_reduce(sums)
    totals, counts = sums[:len(PPO_STEP_STATS)], sums[len(PPO_STEP_STATS):]
    return {key: (total / count).item() for key, total, count in zip(PPO_STEP_STATS, totals, counts) if count > 0}


def skipped_steps_said(record, args):
    """The iteration's optimizer steps DeepSpeed skipped (fp16's loss scaler skips overflowing steps without a word),
    said where there were any: a run that keeps skipping trains nothing."""
    skipped = steps_of_models(record, SKIPPED_STEPS, args)
    return f" (optimizer steps skipped on inf/NaN gradients: {skipped})" if skipped else ""


def steps_of_models(record, keys, args):
    """"actor 1 of 4, critic 1 of 4": the record's counts of ``keys`` ("<model>_..."), of the iteration's optimizer
    steps, where not 0; "" where none is."""
    return ", ".join(f"{key.split('_')[0]} {record[key]} of {optimizer_steps_per_iteration(args)}" for key in keys
                     if record.get(key))


def truncated_left_out_said(record, args, answers):
    """--mask_truncated_answers: the iteration's truncated_answers are the answers its loss left out (no other count
    to log), said where there were any; ``answers``: the iteration's, all ranks'. Every one of them: the loss and its
    gradient were 0; a line saying "no gradient" alone read as nothing trained, and so did one where the weights still
    moved (an optimizer step on zero gradients: Adam's momentum, weight decay; TRL's steps so). The optimizer steps
    whose accumulation group had no token in the loss are skipped (``NO_TOKEN_STEPS``), said here."""
    left_out = record.get("truncated_answers") if args.mask_truncated_answers else 0
    if not left_out:
        return ""
    skipped = steps_of_models(record, NO_TOKEN_STEPS, args)
    skipped = f"; optimizer steps skipped for no token in the loss: {skipped}" if skipped else ""
    if left_out >= answers:
        return (f" (all {left_out} answers truncated and left out of the loss by --mask_truncated_answers: "
                f"a loss of 0, no gradient{skipped})")
    return f" (truncated answers left out of the loss: --mask_truncated_answers{skipped})"


def _log_iteration(record, log_path, writer, bar, args, trainer, buffer):
    if hasattr(trainer.actor_model, "log_stats"):
        trainer.actor_model.log_stats()
    if not is_rank_0():
        return
    with open(log_path, "a") as f:
        f.write(json.dumps(record) + "\n")
    bar.update(1)
    bar.set_postfix(reward=f"{record['reward']:.3f}", kl=f"{record['kl']:.3f}")
    # --adaptive_kl: what moves the coefficient (the reward penalty's KL per answer, which a k1 "kl" is not under
    # another --kl_estimator) and the coefficient the rollout's rewards took
    adaptive = ("kl_per_answer", "kl_coef") if args.adaptive_kl else ()
    # unsup_loss: PPO-ptx's language-model loss (--unsupervised_dataset_name), which DeepSpeed-Chat's line prints too
    keys = ("reward", "reward_std", "kl", *adaptive, "kl_loss", "actor_loss", "critic_loss", "unsup_loss",
            "answer_length", "empty_answers", "truncated_answers", "frac_reward_zero_std", "generation_time",
            "experience_time", "training_time", "samples_per_s", "tokens_per_s", "answer_tokens_per_s")
    frozen = " (actor frozen: --freezing_actor_steps)" if record.get("actor_frozen") else ""
    alike = " (every group's answers scored alike: every advantage is 0)" \
        if record.get("frac_reward_zero_std") == 1.0 else ""
    bar.write(f"[step3] iter {record['iteration']}: " + format_metrics({k: record[k] for k in keys if k in record})
              + frozen + alike + skipped_steps_said(record, args)
              + truncated_left_out_said(record, args, sum(e["input_ids"].shape[0] for e in buffer) * get_world_size()))
    if writer is not None:
        for k, v in record.items():
            if isinstance(v, (int, float)):
                writer.add_scalar(f"step3/{k}", v, record["iteration"])
        writer.flush()
    if args.print_answers and record["iteration"] % args.print_answers_interval == 0:
        bar.write(first_answer_text(trainer.tokenizer, buffer[0]))


def reward_fn_identity(args):
    """What a held-out reward_fn_mean was scored by: [the function's name, its file's content hash (else its spec)];
    None without --reward_fn, and "unknown" for a function of a notebook or script (``__main__``: no file to hash,
    so a change of it goes unseen)."""
    from dschat.rlhf.reward_fn import ALIASES, recorded_reward_fn, reward_fn_file

    if not args.reward_fn:
        return None
    spec = recorded_reward_fn(args.reward_fn)
    if spec.startswith("<"):  # (recorded_reward_fn's marker of a Python object)
        return "unknown"
    spec = ALIASES.get(spec, spec)  # ("tiny" and its module path are one function)
    found = reward_fn_file(spec)
    return [spec.rpartition(":")[2], found[1] if found else spec]


def check_same_reward_fn_on_every_rank(args, device):
    """A --reward_fn file each node reads from its own disk: copies that differ would reward the ranks' answers by
    different functions, silently (the ranks compare the same flags, not the files). Collective."""
    from dschat.utils.dist import names_differing_between_ranks

    if get_world_size() > 1 and args.reward_fn and \
            names_differing_between_ranks({"reward_fn": reward_fn_identity(args)}, device):
        raise UsageError(f"--reward_fn {args.reward_fn}: its file differs between the ranks (each node's own copy): "
                         "give every node the same file")


def realign_schedules(trainer, checkpoint, args):
    """A resumed run whose iterations take another number of optimizer steps than its checkpoint's run's (--ppo_epochs,
    the training batch size, --gradient_accumulation_steps, --n_samples_per_prompt, --generation_batches): DeepSpeed
    restores each learning-rate scheduler at the step that run had taken, and this run's schedules, sized by its own
    steps per iteration, would then end before the run (a linear one applied 0 for the rest of it, a cosine one rose
    again) or stop short of their end. Each scheduler is moved to the step this run's schedule has at the checkpoint's
    iteration, less the steps its model skipped (``scheduled_steps``), and that is said. (A checkpoint from before
    dschat recorded the steps per iteration: left as it is.)"""
    saved, now = checkpoint.get("steps_per_iteration"), optimizer_steps_per_iteration(args)
    if saved is None or saved == now:
        return
    iteration = checkpoint["iteration"]
    trained = {"actor": iteration - min(args.freezing_actor_steps, iteration), "critic": iteration}
    for name, engine in (("actor", trainer.actor_model), ("critic", trainer.critic_model)):
        if engine is not None:
            move_scheduler(engine.lr_scheduler, scheduled_steps(trained[name] * now, engine))
    print_rank_0(f"[step3] an iteration of this run takes {now} optimizer steps, its checkpoint's run's {saved} "
                 f"(--ppo_epochs, the training batch size, --gradient_accumulation_steps, --n_samples_per_prompt, "
                 f"--generation_batches): the learning-rate schedules continue from where this run's stand at "
                 f"iteration {iteration}")


def scheduled_steps(taken, engine):
    """Where ``engine``'s scheduler stands after ``taken`` optimizer steps: DeepSpeed does not move it on a step it
    skipped (fp16's overflow, --align_overflow's, --mask_truncated_answers' for no token in the loss), so it lags by
    the model's skips (its checkpoint's count, ``skipped_steps``), as a resume of the same steps per iteration keeps
    it. Placed at ``taken`` alone, a resumed model's schedule jumped ahead by its own skips, and the actor's and the
    critic's, which skip apart without --align_overflow, by different amounts."""
    return max(taken - skipped_steps(engine), 0)


def move_scheduler(scheduler, step):
    """A learning-rate scheduler set to ``step`` optimizer steps done, its rates those of that step."""
    scheduler.last_epoch = step - 1
    scheduler.step()


def before_scored_alike(position, args):
    """A checkpoint's ``position`` whose held-out scores before PPO are this run's function's: those of another
    function (a --resume with another or an edited --reward_fn) are left out and said, not set beside this run's
    after PPO as if comparable. (A checkpoint from before dschat kept the identity is taken as it is, and given this
    run's; a notebook's function, "unknown", cannot be compared.)"""
    before, now = position.get("eval_before"), reward_fn_identity(args)
    if "eval_reward_fn" not in position or position["eval_reward_fn"] is None:  # (an older checkpoint: taken as is,
        return {**position, "eval_reward_fn": now}  # and this run's identity saved with its next checkpoints)
    if position["eval_reward_fn"] in (now, "unknown") or now == "unknown" or not before \
            or before.get("reward_fn_mean") is None:
        return position
    print_rank_0("[step3] the held-out reward_fn_mean before PPO was scored by the checkpoint's run's reward function, "
                 "another than this run's --reward_fn (or its file was edited since): left out")
    return {**position, "eval_before": _score_left_out(before, "reward_fn_mean", "reward_fn"), "eval_reward_fn": now}


def reward_model_scored_alike(position, reward_path):
    """A checkpoint's ``position`` whose held-out reward_mean before PPO is this run's reward model's: a --resume
    scored by a reward model folder that none of the checkpoint's run's models were (the run ids, or file stats, of
    ``input_runs``) is said (its rewards train the rest of the run) and that score is left out, not set beside this
    run's after PPO as if comparable. A hub name, or a checkpoint without the record, is taken as it is."""
    from dschat.steps.common import among_inputs

    if not reward_path or among_inputs(reward_path, position.get("inputs")) is not False:
        return position
    before = position.get("eval_before")
    scored = bool(before) and before.get("reward_mean") is not None  # (none without a held-out evaluation)
    print_rank_0(f"[step3] the reward model {reward_path} is none of the models the checkpoint's run loaded: its "
                 "rewards train the rest of the run" + (", and the held-out reward_mean before PPO (the other "
                                                        "model's) is left out" if scored else ""))
    if not scored:
        return position
    return {**position, "eval_before": _score_left_out(before, "reward_mean", "reward")}


def _score_left_out(before, mean, example_key):
    """The held-out scores ``before`` PPO less one source's: its ``mean`` and each example's ``example_key``."""
    return {**before, mean: None,
            "examples": [{k: v for k, v in e.items() if k != example_key} for e in before.get("examples", [])]}


def _eval_line(result):
    if not result:
        return "n/a"
    # (a score no source gave, e.g. a critic-free run's reward_mean, is left out rather than said as None)
    return format_metrics({k: v for k, v in result.items() if k != "examples" and v is not None})


def _keep_log_until(path, iteration):
    """Keep the log's records of iterations 1..``iteration`` (none on a fresh start), rewritten atomically."""
    if not is_rank_0():
        return
    kept, unreadable = [], 0
    if iteration and os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line) if line.strip() else None
                except json.JSONDecodeError:  # the line a killed run was writing
                    unreadable += 1
                    continue
                if isinstance(record, dict) and record.get("iteration", iteration + 1) <= iteration:
                    kept.append(json.dumps(record) + "\n")
    if unreadable:
        print_rank_0(f"[step3] {path}: dropped {unreadable} unreadable line(s) (cut off when the run stopped)")
    with atomic_file(path) as f:
        f.writelines(kept)

