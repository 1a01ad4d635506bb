"""PPO iterations of a rollout built by hand (no generation): ``run`` trains each case of ``case_names`` on this rank's
share of the rollout (all of it on one rank, half on each of two) and returns, per case, the gradient each model's
optimizer steps applied (DeepSpeed's averaged over the ranks, before its clipping; whole, gathered from ZeRO's
partitions) and each model's weights after them (the actor's, the critic's, the EMA copy's: whole). Every rank builds
the same tiny model and the same rollout; rank r of W takes rows r*8/W to (r+1)*8/W, whole GRPO/RLOO groups.

Run by tests/test_one_rank_vs_two.py through the deepspeed launcher on 2 ranks, ``one_rank_vs_two.py <out>`` (rank 0
saves ``<out>/results.pt``), and imported by it for the one-rank side.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dschat.utils.dist import barrier, ensure_distributed, get_rank, get_world_size  # noqa: E402

ROWS, PROMPT, ANSWER, EOS, PAD = 8, 4, 6, 0, 1
# answer lengths (EOS included); None: cut at ANSWER tokens with no EOS (--mask_truncated_answers leaves those out)
LENGTHS = [3, None, 6, 1, 2, None, 4, 5]
LEFT_PADS = [0, 2, 1, 0, 3, 0, 1, 2]

COMMON = {"dtype": "fp32", "max_prompt_seq_len": PROMPT, "max_answer_seq_len": ANSWER, "num_warmup_steps": 0,
          "actor_learning_rate": 1e-3, "actor_dropout": 0.0, "max_steps": 1,
          "n_samples_per_prompt": 2, "reward_model_weight": 0.0, "reward_fn": "dschat.tiny.scorer:score_batch",
          "kl_loss_coef": 0.1, "entropy_coef": 0.01}
# the normalisations that are global by design, each with and without gradient accumulation ("accum": one
# optimizer step over the rollout either way)
CASES = {
    "grpo_global_token_mean_batch_std_masked": {"advantage_estimator": "grpo", "loss_agg": "global_token_mean",
                                                "grpo_norm_by_std": "batch", "mask_truncated_answers": True},
    "grpo_seq_mean_token_mean": {"advantage_estimator": "grpo", "loss_agg": "seq_mean_token_mean"},
    "rloo_seq_mean_token_sum_norm_masked": {"advantage_estimator": "rloo", "loss_agg": "seq_mean_token_sum_norm",
                                            "mask_truncated_answers": True},
    "reinforce_pp_global_token_mean": {"advantage_estimator": "reinforce_pp", "loss_agg": "global_token_mean",
                                       "n_samples_per_prompt": 1, "kl_loss_coef": None},
    "gae_whitened_global_token_mean_masked": {"advantage_estimator": "gae", "loss_agg": "global_token_mean",
                                              "whiten_advantages": True, "mask_truncated_answers": True,
                                              "n_samples_per_prompt": 1, "kl_loss_coef": None},
    "gae_whitened_seq_mean_token_mean": {"advantage_estimator": "gae", "loss_agg": "seq_mean_token_mean",
                                         "whiten_advantages": True, "n_samples_per_prompt": 1,
                                         "kl_loss_coef": None},
}
ACCUMULATION = {"": 1, "accum": 2}
# beyond ZeRO-0 and one optimizer step: the PPO case with a critic and a GRPO case at each ZeRO stage (ZeRO-3 shards the
# reference and EMA copies too on two ranks), each with accumulation and two optimizer steps over the rollout
# (--ppo_epochs 2: the second step's gradient taken at the weights the first made), the EMA following each step
SHARDED = ("gae_whitened_global_token_mean_masked", "grpo_global_token_mean_batch_std_masked")
TWO_STEPS = {"ppo_epochs": 2, "enable_ema": True, "ema_beta": 0.5}
# and two optimizer steps of an epoch, each over a mini-batch of each rank's rows ("mini_batches": this script's, not
# a flag: the training batch is that share of the rows; --loss_agg's counts are each step's, over all ranks)
TWO_MINI_BATCHES = {"mini_batches": 2, "enable_ema": True, "ema_beta": 0.5}
STAGES = (0, 1, 2, 3)


def model_folder(root):
    from dschat.tiny import create_tiny_model

    return create_tiny_model("tiny-gpt2", Path(root) / "tiny-gpt2", seed=7)


def whole_rollout(trainer):
    """The rollout of ``ROWS`` answers, the same on every rank: left-padded prompts, answers of ``LENGTHS``, old
    log-probs the actor's own plus fixed noise (some ratios clipped), reference ones further off, fixed scores."""
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(5, 200, (ROWS, PROMPT), generator=g)
    prompt_mask = torch.ones(ROWS, PROMPT, dtype=torch.long)
    for row, pads in enumerate(LEFT_PADS):
        prompts[row, :pads], prompt_mask[row, :pads] = PAD, 0
    answers = torch.randint(5, 200, (ROWS, ANSWER), generator=g)
    action_mask = torch.zeros(ROWS, ANSWER, dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        action_mask[row, :length or ANSWER] = 1
        if length:
            answers[row, length - 1], answers[row, length:] = EOS, PAD
    seq = torch.cat([prompts, answers], 1)
    attention_mask = torch.cat([prompt_mask, action_mask], 1)
    with torch.no_grad():
        logprobs = trainer._logprobs(trainer.actor_model, seq, attention_mask, PROMPT - 1)
    exp = {"prompts": prompts, "input_ids": seq, "attention_mask": attention_mask, "action_mask": action_mask,
           "logprobs": logprobs + 0.1 * torch.randn(ROWS, ANSWER, generator=g),
           "ref_logprobs": logprobs + 0.3 * torch.randn(ROWS, ANSWER, generator=g),
           "rewards": torch.randn(ROWS, generator=g)}
    if trainer.critic_model is not None:
        exp["value"] = torch.randn(ROWS, ANSWER, generator=g)
    return exp


def this_ranks_rows(exp, mini_batches=1):
    """Rank r's share of ``exp``; one rank's all of it, in the order two ranks' optimizer steps take it (each step
    over the next of ``mini_batches`` slices of each rank's rows: rank 0's, then rank 1's)."""
    if get_world_size() == 1:
        return {key: value[rows_in_step_order(mini_batches)] for key, value in exp.items()}
    share = ROWS // get_world_size()
    return {key: value[get_rank() * share:(get_rank() + 1) * share] for key, value in exp.items()}


def rows_in_step_order(mini_batches, ranks=2):
    """The rollout's rows in the order ``ranks`` ranks' ``mini_batches`` optimizer steps of an epoch take them."""
    share = ROWS // ranks
    size = share // mini_batches
    return [rank * share + step * size + row for step in range(mini_batches) for rank in range(ranks)
            for row in range(size)]


def recording_steps(engine, steps):
    """``engine``'s optimizer steps append the gradient they apply to ``steps``: the whole gradient, averaged over the
    ranks, as its last micro-batch's backward left it, before the step clips it (on every rank: at ZeRO-3 the gather
    is a collective)."""
    from deepspeed.utils import safe_get_full_grad

    step = engine.step

    def recorded_step(*args, **kwargs):
        if engine.is_gradient_accumulation_boundary():
            steps.append(torch.cat([safe_get_full_grad(p).detach().flatten().clone()
                                    for p in engine.module.parameters() if p.requires_grad]))
        return step(*args, **kwargs)

    engine.step = recorded_step


def whole_weights(model):
    """``model``'s parameters, whole (gathered from ZeRO-3's partitions), as one flat tensor."""
    from dschat.models.zero3 import gathered

    params = list(model.parameters())
    with gathered(params):
        return torch.cat([p.detach().flatten().clone() for p in params])


def run_case(folder, settings, accum):
    """{model: [the gradient of each optimizer step], "<model> weights": [its weights after them]} of one PPO
    iteration on this rank's rows, with ``settings`` and ``accum`` micro-batches per optimizer step (of as many rows as
    make one step of the whole rollout)."""
    from dschat import DeepSpeedPPOTrainer, DeepSpeedRLHFEngine
    from dschat.tiny import load_tiny_tokenizer

    rows = ROWS // get_world_size()
    settings = dict(settings)
    mini_batches = settings.pop("mini_batches", 1)
    args = {**COMMON, **settings, "gradient_accumulation_steps": accum,
            "per_device_training_batch_size": rows // accum // mini_batches}
    # (the rollout's rows per rank as step 3 sizes them: the learning-rate schedule spans its optimizer steps)
    args["per_device_generation_batch_size"] = rows // args["n_samples_per_prompt"]
    if settings["advantage_estimator"] == "gae":
        args.update(critic_model_name_or_path=str(folder), critic_learning_rate=1e-3, critic_dropout=0.0)
    tokenizer = load_tiny_tokenizer()
    tokenizer.padding_side = "left"
    with DeepSpeedRLHFEngine(actor_model_name_or_path=str(folder), tokenizer=tokenizer, args=args) as engine:
        trainer = DeepSpeedPPOTrainer(engine=engine, args=args)
        trained = {"actor": engine.actor, "critic": engine.critic}
        trained = {name: model for name, model in trained.items() if model is not None}
        steps = {name: [] for name in trained}
        for name, model in trained.items():
            recording_steps(model, steps[name])
        trainer.train_rollout([this_ranks_rows(whole_rollout(trainer), mini_batches)])
        kept = {**trained, "actor_ema": engine.actor_ema}
        return {**steps, **{f"{name} weights": [whole_weights(model.module)] for name, model in kept.items()
                            if model is not None}}


def case_names():
    """{"<case>" or "<case>_accum": (settings, gradient_accumulation_steps)} at ZeRO-0, one optimizer step, and
    {"<case>_zero<stage>_two_steps": ...} of ``SHARDED``'s cases at each of ``STAGES``, and their
    {"<case>_two_mini_batches": ...}."""
    cases = {f"{name}{'_' + tag if tag else ''}": (settings, accum)
             for name, settings in CASES.items() for tag, accum in ACCUMULATION.items()}
    for name in SHARDED:
        for stage in STAGES:
            zero = {"actor_zero_stage": stage, "critic_zero_stage": stage}
            cases[f"{name}_zero{stage}_two_steps"] = ({**CASES[name], **zero, **TWO_STEPS}, ACCUMULATION["accum"])
        cases[f"{name}_two_mini_batches"] = ({**CASES[name], **TWO_MINI_BATCHES}, ACCUMULATION[""])
    return cases


def optimizer_steps(name):
    """The optimizer steps case ``name`` makes over the rollout."""
    settings, _ = case_names()[name]
    return settings.get("ppo_epochs", 1) * settings.get("mini_batches", 1)


def run(folder):
    return {name: run_case(folder, settings, accum) for name, (settings, accum) in case_names().items()}


if __name__ == "__main__":
    ensure_distributed()
    out = Path(sys.argv[-1])  # (after the launcher's --local_rank)
    if get_rank() == 0:
        model_folder(out / "two")
    barrier()
    results = run(model_folder(out / "two"))
    if get_rank() == 0:
        torch.save(results, out / "results.pt")
    from dschat.utils.cli import end_script

    end_script()
