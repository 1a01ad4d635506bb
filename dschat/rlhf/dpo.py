"""DPO (Rafailov et al., 2023) as small pure functions: the sigmoid loss with cDPO label smoothing, the
implicit rewards and the preference accuracy, as DeepSpeed-Chat's step2_dpo_finetuning and TRL define them.

The inputs are per-sequence log-probabilities summed over the answer tokens
(:func:`response_log_probs`), of the policy and of the frozen reference, for the chosen and the rejected
answer of each pair.
"""
import math

import torch
import torch.nn.functional as F

from dschat.errors import UsageError
from dschat.rlhf.algorithms import gather_log_probs


def response_log_probs(logits, input_ids, response_mask, chunk_size=None):
    """``sum_t log p(input_ids[t] | input_ids[:t])`` over the positions where ``response_mask`` is 1.

    ``logits``: (B, T, V) of ``input_ids`` (B, T); ``response_mask``: (B, T), 1 on answer tokens, 0 on the
    prompt and the padding. Token t is predicted at position t - 1, so the mask of the targets is
    ``response_mask[:, 1:]``. Returns (B,) in fp32 (chunked, the fp32 (B, T, V) tensor never exists).
    """
    logp = gather_log_probs(logits[:, :-1], input_ids[:, 1:], chunk_size)
    return (logp * response_mask[:, 1:].to(logp.dtype)).sum(-1)


def check_dpo_params(beta, label_smoothing):
    if not (beta > 0 and math.isfinite(beta)):  # (inf: the first loss is not finite, after every model loaded)
        raise UsageError(f"--beta must be a finite number > 0, got {beta}")
    # at 0.5 the two terms cancel: the loss is constant and nothing is learned
    if not 0.0 <= label_smoothing < 0.5:
        raise UsageError(f"--label_smoothing must be in [0, 0.5) (at 0.5 nothing is learned), got {label_smoothing}")


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=0.1, label_smoothing=0.0):
    """Per-pair DPO losses, chosen rewards and rejected rewards, each (B,).

    ``logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)``;
    ``loss = -(1 - eps) * logsigmoid(beta * logits) - eps * logsigmoid(-beta * logits)`` (cDPO: the label is
    assumed flipped with probability ``eps = label_smoothing``); rewards are ``beta * (policy - ref)``,
    detached (they are reported, not trained on).
    """
    check_dpo_params(beta, label_smoothing)
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
              - F.logsigmoid(-beta * logits) * label_smoothing)
    return losses, implicit_rewards(policy_chosen, ref_chosen, beta), implicit_rewards(policy_rejected,
                                                                                         ref_rejected, beta)


def implicit_rewards(policy_logps, ref_logps, beta):
    """DPO's implicit reward ``beta * (log pi(y|x) - log pi_ref(y|x))``, detached."""
    return beta * (policy_logps - ref_logps).detach()


def answer_nll(answer_logps, response_mask):
    """The negative log-likelihood of the answers per answer token of the batch (TRL's cross-entropy over the chosen
    tokens): the SFT term that RPO (``rpo_alpha``) adds so that DPO does not push the chosen answers down too."""
    tokens = response_mask[:, 1:].sum().clamp(min=1).to(answer_logps.dtype)
    return -answer_logps.sum() / tokens


def preference_accuracy(chosen_scores, rejected_scores, tie=0.0):
    """Per pair 1.0 where the chosen answer scores higher by more than ``tie``, 0.5 for a tie (``preference_ties``),
    else 0.0: a tie is half a win, what breaking it by a coin flip scores on average (as a ranking's AUC counts it).

    TRL's DPO and DeepSpeed-Chat's step 2 count a tie as a miss (``chosen > rejected``), so a model that scores every
    pair alike (a DPO policy before training: its implicit rewards are all 0) reported 0.0, as if it always preferred
    the rejected answer; TRL's reward trainer leaves ties out of its accuracy and warns with their count. Half a win
    keeps the untrained model at chance (0.5) and every pair in the denominator; the steps report the tie count
    beside it. A NaN score is a miss, not a tie."""
    margin = chosen_scores - rejected_scores
    return torch.where(margin > tie, 1.0, torch.where(preference_ties(chosen_scores, rejected_scores, tie), 0.5,
                                                      0.0)).to(torch.float32)


def preference_ties(chosen_scores, rejected_scores, tie=0.0):
    """Per pair True where the two scores are within ``tie`` of each other (equal for ``tie`` 0)."""
    return (chosen_scores - rejected_scores).abs() <= tie


# Implicit rewards closer than this many nats of log-ratio are a tie: the policy and the reference forwards of one
# model differ by rounding, and before training those differences alone decided the "accuracy".
IMPLICIT_REWARD_TIE_NATS = 1e-3
