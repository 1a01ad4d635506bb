"""Step 2 (DPO): direct preference optimization of the SFT model, DeepSpeed-Chat's alternative to steps 2+3.

The policy trains like step 1 (same flags: LoRA, ZeRO 0-3, gradient checkpointing, ...) on phase 2's
chosen/rejected pairs; a frozen copy of the starting model is the reference (ZeRO-3 when the policy is on several
ranks or it is offloaded, ``build_reference_model``). Log-probs are summed over the answer tokens only. The final
model is an HF causal LM like step 1's, so it is loaded, chatted with and evaluated the same way.
"""
import math

import torch

from dschat.args import DPO_REFUSED_STEP1_FLAGS, step2_dpo_parser, step_settings
from dschat.data.collators import first_answer_position
from dschat.data.samplers import eval_weights
from dschat.errors import UsageError
from dschat.hybrid_engine.decode import forward_spec
from dschat.models.checkpoint import save_causal_lm
from dschat.models.loading import load_causal_lm
from dschat.models.training_engine import initialize_frozen
from dschat.rlhf.dpo import (IMPLICIT_REWARD_TIE_NATS, answer_nll, check_dpo_params, dpo_loss, preference_accuracy,
                              preference_ties, response_log_probs)
from dschat.steps.common import RecordAndTokenMeans, StepRecipe, run_supervised_step, to_device
from dschat.steps.sft import build_sft_model
from dschat.utils.dist import all_reduce, get_world_size, print_rank_0
from dschat.utils.ds_config import frozen_copy_stage, get_eval_ds_config

# summed over all ranks in evaluation; the means divide by "pairs", but the chosen answers' NLL by their tokens, and
# the tie counts of the three accuracies (a tie counts half: preference_accuracy) stay counts
EVAL_SUMS = ("loss", "chosen_reward", "rejected_reward", "reward_accuracy", "chosen_logp", "rejected_logp",
             "logp_accuracy", "reference_logp_accuracy", "chosen_nll", "chosen_tokens", "pairs")
TIE_COUNTS = ("reward_ties", "logp_ties", "reference_logp_ties")


def dpo_collator(tokenizer, pad_to_multiple_of=1, max_length=None):
    from dschat.data import DataCollatorDPO

    return DataCollatorDPO(tokenizer.pad_token_id, pad_to_multiple_of=pad_to_multiple_of,
                           max_length=max_length)


def build_reference_model(args, tokenizer):
    """The frozen reference: the starting weights, sharded when the policy is ZeRO-3 on several ranks (a full copy
    per rank would defeat ZeRO-3) or offloaded, a plain copy otherwise."""
    stage = frozen_copy_stage(args.zero_stage, get_world_size(), args.offload_reference_model)
    offload = args.offload_reference_model and stage == 3  # parameter offload is a ZeRO-3 feature
    ds_config = get_eval_ds_config(offload=offload, dtype=args.dtype, stage=stage,
                                   micro_batch_size=args.per_device_train_batch_size, world_size=get_world_size())
    model = load_causal_lm(args.model_name_or_path, tokenizer, ds_config)
    note = ", parameters offloaded to CPU" if offload else (
        " (--offload_reference_model needs --zero_stage 3: not offloaded)" if args.offload_reference_model else "")
    print_rank_0(f"[step2_dpo] reference model {args.model_name_or_path}: frozen, ZeRO-{stage}{note}")
    return initialize_frozen(model, ds_config, args.zero3_fetch)


def sequence_log_probs(model, batch):
    """(2B,) answer log-probs of a DPO batch (chosen rows first, then rejected).

    Where the model takes ``logits_to_keep``, its LM head runs only from the position before the batch's earliest
    answer token on: the prompts' logits are never computed (as step 3's forwards do)."""
    ids, response_mask = batch["input_ids"], batch["response_mask"]
    start = batch.get("answer_start")
    if start is None:  # a batch not built by DataCollatorDPO
        start = first_answer_position(response_mask)
    keep = ids.shape[1] - max(start - 1, 0)
    extra = {"logits_to_keep": keep} if forward_spec(getattr(model, "module", model)).takes_logits_to_keep else {}
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False, **extra).logits
    return response_log_probs(logits[:, -keep:], ids[:, -keep:], response_mask[:, -keep:])


def split_pairs(logps):
    half = logps.shape[0] // 2
    return logps[:half], logps[half:]


def chosen_answer_mask(batch):
    """(B, T) 1 on the chosen answers' tokens of a DPO batch (its first half of rows)."""
    return split_pairs(batch["response_mask"])[0]


def chosen_answer_tokens(batch):
    """The tokens --rpo_alpha's NLL term is a mean over (``answer_nll``'s: the chosen answers' predicted ones)."""
    return int(chosen_answer_mask(batch)[:, 1:].sum())


def check_dpo_flags(args):
    """DPO's flags, and step 1's it shares a parser with but cannot use (train.py checks them before step 1 runs)."""
    check_dpo_params(args.beta, args.label_smoothing)
    for flag in DPO_REFUSED_STEP1_FLAGS:
        if getattr(args, flag, False):
            raise UsageError(f"--{flag} is a step-1 flag: DPO compares the final answers, so its log-probs "
                             "cover their tokens only")
    if not (args.rpo_alpha >= 0 and math.isfinite(args.rpo_alpha)):  # (nan, inf: the first loss is not finite)
        raise UsageError(f"--rpo_alpha must be a finite number >= 0, got {args.rpo_alpha}")


class DPOStep:
    """The DPO loss and evaluation against a reference model that is built together with the policy."""

    def __init__(self, args):
        check_dpo_flags(args)
        self.beta, self.label_smoothing, self.rpo_alpha = args.beta, args.label_smoothing, args.rpo_alpha
        self.reference = None

    def build_model(self, args, tokenizer, ds_config):
        policy = build_sft_model(args, tokenizer, ds_config)
        self.reference = build_reference_model(args, tokenizer)
        return policy

    def pair_log_probs(self, engine, batch):
        """(policy chosen, policy rejected, reference chosen, reference rejected), each (B,)."""
        with torch.no_grad():
            reference = split_pairs(sequence_log_probs(self.reference, batch))
        return (*split_pairs(sequence_log_probs(engine, batch)), *reference)

    def loss(self, engine, batch):
        """The micro-batch's DPO loss, the mean over its pairs; with --rpo_alpha, a ``RecordAndTokenMeans`` of that and
        rpo_alpha x the chosen answers' NLL per token, which --loss_agg global_token_mean makes the mean over the chosen
        tokens of the whole optimizer step (all micro-batches and ranks: ``recipe``'s loss_tokens), so a token weighs
        the same however the step's pairs are split (TRL's mean over its batch's tokens, the batch being the step's),
        and token_mean each micro-batch's own mean."""
        logps = self.pair_log_probs(engine, batch)
        losses, _, _ = dpo_loss(*logps, self.beta, self.label_smoothing)
        loss = losses.mean()
        tokens = int(batch["attention_mask"].sum())
        if not self.rpo_alpha:
            return loss, tokens
        return RecordAndTokenMeans(loss, self.rpo_alpha * answer_nll(logps[0], chosen_answer_mask(batch))), tokens

    @torch.no_grad()
    def evaluate(self, engine, eval_loader, device):
        """Held-out means over all ranks: DPO loss, implicit rewards and their margin, the implicit-reward
        accuracy, how often the policy and the reference give the chosen answer the higher log-prob (a tie counting
        half, and the ties of each counted: "reward_ties", "logp_ties", "reference_logp_ties"), and the chosen
        answers' NLL per token (``chosen_nll``, TRL's nll_loss: the term --rpo_alpha adds to the training loss, so
        ``eval_loss + rpo_alpha * chosen_nll`` is the held-out value of what train_loss measures)."""
        engine.eval()
        totals = torch.zeros(len(EVAL_SUMS) + len(TIE_COUNTS), dtype=torch.float64, device=device)
        for batch in eval_loader:
            totals += self.batch_sums(engine, to_device(batch, device))
        all_reduce(totals)
        sums = dict(zip(EVAL_SUMS + TIE_COUNTS, totals.tolist()))
        ties = {key: int(sums.pop(key)) for key in TIE_COUNTS}
        pairs, nll, tokens = sums.pop("pairs"), sums.pop("chosen_nll"), sums.pop("chosen_tokens")
        metrics = {("eval_loss" if key == "loss" else key): value / pairs if pairs else None  # no pairs: no score
                   for key, value in sums.items()}
        metrics["chosen_nll"] = nll / tokens if tokens else None
        metrics["reward_margin"] = metrics["chosen_reward"] - metrics["rejected_reward"] if pairs else None
        metrics["eval_pairs"] = int(pairs)
        return {**metrics, **ties}

    def batch_sums(self, engine, batch):
        policy_chosen, policy_rejected, ref_chosen, ref_rejected = logps = self.pair_log_probs(engine, batch)
        losses, chosen_rewards, rejected_rewards = dpo_loss(*logps, self.beta, self.label_smoothing)
        tie = self.beta * IMPLICIT_REWARD_TIE_NATS  # (rewards are beta x the log-ratio)
        chosen_mask = chosen_answer_mask(batch)  # (the NLL's tokens, as answer_nll counts them)
        compared = ((chosen_rewards, rejected_rewards, tie), (policy_chosen, policy_rejected, 0.0),
                    (ref_chosen, ref_rejected, 0.0))  # (the reward, logp and reference_logp accuracies)
        accuracy = [preference_accuracy(*scores) for scores in compared]
        values = (losses, chosen_rewards, rejected_rewards, accuracy[0], policy_chosen, policy_rejected, accuracy[1],
                  accuracy[2], -policy_chosen, chosen_mask[:, 1:].sum(-1).to(losses.device), torch.ones_like(losses),
                  *(preference_ties(*scores) for scores in compared))
        w = eval_weights(batch, losses.shape[0], losses.device)  # 0 for a rank's padding repeats
        return torch.stack([(v.double() * w).sum() for v in values])

    def recipe(self):
        return StepRecipe(name="step2_dpo", phase=2, build_model=self.build_model, collator=dpo_collator,
                          loss_fn=self.loss, evaluate_fn=self.evaluate, save_fn=save_causal_lm, rows_per_record=2,
                          loss_tokens=chosen_answer_tokens if self.rpo_alpha else None)  # (plain DPO: pairs alone)


def main(args=None):
    """Train the policy with DPO; returns the final held-out metrics (see ``DPOStep.evaluate``)."""
    args = step_settings(step2_dpo_parser(), args)  # (a notebook's dict too)
    return run_supervised_step(args, DPOStep(args).recipe())
