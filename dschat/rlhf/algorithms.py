"""RLHF math as small pure functions over tensors and masks.

Shaped like verl's ``trainer/ppo/core_algos.py``: KL estimators, advantage estimators, policy/value
losses and KL controllers are registered by name, so code of one's own can add one and call it by name
(``compute_advantages``, ``kl_estimate``); step 3's flags choose among the built-in ones.

Conventions used throughout
---------------------------
* Per-token tensors are ``(B, T)`` over the **response** tokens only: the trainer slices
  log-probs/values to the response part before calling in here.
* ``mask`` is ``(B, T)`` bool or float, 1 on real response tokens and 0 after the answer's end and
  on padding. A row whose mask is all zero (e.g. an empty answer) never produces NaN or an error.
* Computations run in at least fp32: bf16/fp16 inputs are upcast, fp64 inputs stay fp64.
* With the default arguments the results are DeepSpeed-Chat's step-3 math
  (``training/step3_rlhf_finetuning/ppo_trainer.py``: ``gather_log_probs``, ``compute_rewards``,
  ``get_advantages_and_returns``, ``actor_loss_fn``, ``critic_loss_fn``; kl_ctl=0.1,
  clip_reward_value=5, cliprange=0.2, cliprange_value=0.2, gamma=1.0, lam=0.95), with one difference: the score
  lands on the answer's last real token (its end token), as in OpenRLHF and verl. DeepSpeed-Chat's
  ``compute_rewards`` takes ``ends = start + n + 1`` and puts it one position further, on padding for an answer
  that stopped before the length limit (DeepSpeedExamples PR #672), where GAE then reads it one token late.
"""
from __future__ import annotations

import inspect
import math
from typing import Callable, Dict, Optional, Tuple

import torch

from dschat.args import GRPO_STD_SCOPES, grpo_std_scope  # (the flag's reading of 1/0: one place)

__all__ = [
    "masked_sum", "masked_mean", "masked_mean_var", "masked_whiten",
    "gather_log_probs", "entropy_from_logits",
    "KL_ESTIMATORS", "register_kl_estimator", "kl_estimate", "last_token_index", "kl_penalized_rewards",
    "kl_loss_term", "kl_token_mean",
    "ADVANTAGE_ESTIMATORS", "register_adv_estimator", "get_adv_estimator", "compute_advantages",
    "gae_advantages", "grpo_advantages", "rloo_advantages", "reinforce_pp_advantages",
    "zero_std_fraction", "group_reward_std", "STD_SCOPES", "std_scope",
    "LOSS_AGG_MODES", "agg_loss",
    "POLICY_LOSS_FNS", "VALUE_LOSS_FNS", "register_policy_loss", "register_value_loss",
    "policy_loss_clipped", "value_loss_clipped", "entropy_bonus",
    "FixedKLController", "AdaptiveKLController", "KL_CONTROLLERS", "get_kl_controller",
    "check_finite",
]

# --------------------------------------------------------------------------------------------
# helpers


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Promoted floating dtype of the inputs, at least fp32."""
    dt = torch.float32
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            dt = torch.promote_types(dt, t.dtype)
    return dt


def _up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _fmask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Mask as a float tensor of ``like``'s dtype/device."""
    return mask.to(device=like.device, dtype=like.dtype)


def _masked(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x * m`` with an exact 0 where ``m`` is 0, even where ``x`` is inf or NaN there (a padding position's extreme
    log-prob: ``inf * 0`` is NaN, and one NaN makes the whole loss NaN); no gradient flows to those positions."""
    return torch.where(m != 0, x * m, torch.zeros((), dtype=x.dtype, device=x.device))


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den with 0 where den == 0 (no NaN in the value nor in the gradient)."""
    safe = torch.where(den != 0, den, torch.ones_like(den))
    return torch.where(den != 0, num / safe, torch.zeros_like(num))


# --------------------------------------------------------------------------------------------
# masked reductions / whitening


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of ``x * mask`` over ``dim`` (all elements when None). ``x``, ``mask``: same shape."""
    m = _fmask(mask, x)
    return _masked(x, m).sum() if dim is None else _masked(x, m).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """``sum(x * mask) / sum(mask)`` over ``dim`` (all elements when None).

    Where the mask sums to 0 the result is 0 (not NaN), value and gradient alike.
    """
    m = _fmask(mask, x)
    if dim is None:
        return _safe_div(_masked(x, m).sum(), m.sum())
    return _safe_div(_masked(x, m).sum(dim=dim), m.sum(dim=dim))


def _shared_reference(x: torch.Tensor, m: torch.Tensor, process_group=None) -> torch.Tensor:
    """The largest masked-in element of ``x`` (of every rank of ``process_group``; 0 if there is none), to subtract
    before the statistics. Elements all alike then deviate from it by exactly 0: their mean in floating point may
    round off their value (0.7 forty times: by 6e-8), and whitening's division by sqrt(var + eps) scaled that
    rounding up to 1e-3 (REINFORCE++'s advantages of a batch scored alike, all of one sign)."""
    inside = torch.where(m != 0, x, float("-inf")).reshape(-1)
    ref = torch.cat([inside, inside.new_full((1,), float("-inf"))]).amax()
    if process_group is not None:
        torch.distributed.all_reduce(ref, op=torch.distributed.ReduceOp.MAX, group=process_group)
    return torch.where(torch.isfinite(ref), ref, torch.zeros_like(ref))


def masked_mean_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True,
                    process_group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Masked mean and variance of all elements of ``x`` (any shape; ``mask`` same shape).

    Two-pass (mean, then mean squared deviation), in at least fp32, over the elements less the largest of them
    (``_shared_reference``): elements all alike give exactly their value as the mean and exactly 0 as the variance.
    ``unbiased`` applies Bessel's correction n/(n-1) as TRL/verl's ``masked_var`` do (skipped when n <= 1). With
    ``process_group`` (e.g. ``torch.distributed.group.WORLD``) the sums and counts are all-reduced so every rank
    gets the statistics of the union of all ranks' elements; every rank of the group must call it. With no
    masked-in element at all, mean = var = 0.
    """
    dt = _compute_dtype(x)
    x = _up(x.detach(), dt)
    m = _fmask(mask, x)
    ref = _shared_reference(x, m, process_group)
    shifted = x - ref
    s = torch.stack([_masked(shifted, m).sum(), m.sum()])
    if process_group is not None:
        torch.distributed.all_reduce(s, group=process_group)
    total, count = s[0], s[1]
    shifted_mean = _safe_div(total, count)
    mean = ref + shifted_mean
    sq = _masked((shifted - shifted_mean) ** 2, m).sum()
    if process_group is not None:
        torch.distributed.all_reduce(sq, group=process_group)
    var = _safe_div(sq, count)
    if unbiased:
        var = torch.where(count > 1, var * count / torch.clamp(count - 1, min=1), var)
    return mean, var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  stats: Optional[Tuple] = None, process_group=None, eps: float = 1e-8,
                  alike_rtol: Optional[float] = None) -> torch.Tensor:
    """Whiten ``x`` with the masked mean/variance: ``(x - mean) / sqrt(var + eps)``.

    ``x``, ``mask``: same shape, typically advantages ``(B, T)``. ``shift_mean=False`` adds the mean
    back (TRL/verl semantics). Statistics come, in that order of preference, from ``stats`` =
    pre-computed ``(mean, var)`` (e.g. over the global batch), from an all-reduce over
    ``process_group`` (so several ranks whiten identically), or from the local tensor
    (unbiased variance, like TRL/verl). Masked-out positions are set to 0 in the output.
    The statistics are treated as constants (no gradient through them).

    Values alike but for rounding (``_spread_is_rounding``: a std within ``alike_rtol`` of their size; None: 8 units
    in the last place of the dtype the statistics are computed in, ~1e-6 in float32, as GRPO's groups scored alike)
    whiten to 0 (to the mean with ``shift_mean=False``): ``eps`` (TRL's, OpenRLHF's and verl's 1e-8, absolute) bounds
    the scale-up of a tiny spread by 1e4, which made float32 rounding of values near 100 (std 1e-5) advantages of
    +-0.4.
    """
    dt = _compute_dtype(x)
    if stats is not None:
        mean, var = (torch.as_tensor(v, dtype=dt, device=x.device) for v in stats)
    else:
        mean, var = masked_mean_var(x, mask, unbiased=True, process_group=process_group)
    xx = _up(x, dt)
    out = (xx - mean) * torch.rsqrt(var + eps)
    rtol = 8 * torch.finfo(dt).eps if alike_rtol is None else alike_rtol
    out = torch.where(_spread_is_rounding(mean, var, rtol), torch.zeros((), dtype=dt, device=out.device), out)
    if not shift_mean:
        out = out + mean
    return _masked(out, _fmask(mask, out))


def _spread_is_rounding(mean: torch.Tensor, var: torch.Tensor, rtol: float) -> torch.Tensor:
    """Bool: values of this ``mean`` and ``var`` are alike but for rounding, their std within ``rtol`` of their size
    (``|mean|``, at least 1): float32 values differ in their last bits, ~1e-7 of the value (``_scored_alike``'s)."""
    return var.clamp(min=0).sqrt() <= rtol * mean.abs().clamp(min=1)


# --------------------------------------------------------------------------------------------
# log-probs / entropy from logits, chunked along the sequence


DEFAULT_CHUNK_ELEMENTS = 1 << 25  # fp32 elements per chunk when chunk_size is None (128 MiB)


def _chunk_len(logits: torch.Tensor, chunk_size: Optional[int]) -> int:
    T = logits.shape[-2]
    if chunk_size is None:
        rows = max(1, logits[..., 0, 0].numel()) * logits.shape[-1]
        chunk_size = max(1, DEFAULT_CHUNK_ELEMENTS // rows)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return max(1, min(int(chunk_size), T))


def _chunk_at(logits: torch.Tensor, start: int, chunk: int, dt: torch.dtype, temperature: float) -> torch.Tensor:
    """Positions ``start:start + chunk`` of ``logits`` in ``dt``, divided by ``temperature`` (1: as they are)."""
    x = logits[..., start:start + chunk, :].to(dt)
    return x / temperature if temperature != 1.0 else x


def _checked_temperature(temperature) -> float:
    """A scoring temperature as a float: finite and > 0 (0 or NaN made every log-prob NaN without a word)."""
    temperature = float(temperature)
    if not 0.0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return temperature


class _GatherLogProbs(torch.autograd.Function):
    """log_softmax(logits)[label], fp32 per chunk; backward recomputes softmax chunk by chunk.

    Saved for backward: the logits themselves (already alive in the graph) and the (.., T) logsumexp,
    so no (.., T, V) fp32 tensor is kept between forward and backward.
    """

    @staticmethod
    def forward(ctx, logits, labels, chunk, temperature):
        dt = _compute_dtype(logits)
        T = logits.shape[-2]
        out = torch.empty(labels.shape, dtype=dt, device=logits.device)
        lse = torch.empty(labels.shape, dtype=dt, device=logits.device)
        for s in range(0, T, chunk):
            x = _chunk_at(logits, s, chunk, dt, temperature)
            l = torch.logsumexp(x, dim=-1)
            picked = x.gather(-1, labels[..., s:s + chunk].unsqueeze(-1)).squeeze(-1)
            out[..., s:s + chunk] = picked - l
            lse[..., s:s + chunk] = l
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk, ctx.temperature = chunk, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, labels, lse = ctx.saved_tensors
        chunk, dt, temperature = ctx.chunk, lse.dtype, ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for s in range(0, logits.shape[-2], chunk):
            x = _chunk_at(logits, s, chunk, dt, temperature)
            g = grad_out[..., s:s + chunk].to(dt).unsqueeze(-1) / temperature  # (d(l / T) / dl)
            p = torch.exp(x - lse[..., s:s + chunk].unsqueeze(-1))
            gl = p.mul_(-g)
            gl.scatter_add_(-1, labels[..., s:s + chunk].unsqueeze(-1), g)
            grad[..., s:s + chunk, :] = gl
        return grad, None, None, None


class _EntropyFromLogits(torch.autograd.Function):
    """H = -sum_v p log p per position, fp32 per chunk; dH/dl = -p (log p + H)."""

    @staticmethod
    def forward(ctx, logits, chunk, temperature):
        dt = _compute_dtype(logits)
        T = logits.shape[-2]
        H = torch.empty(logits.shape[:-1], dtype=dt, device=logits.device)
        lse = torch.empty_like(H)
        for s in range(0, T, chunk):
            x = _chunk_at(logits, s, chunk, dt, temperature)
            l = torch.logsumexp(x, dim=-1, keepdim=True)
            logp = x - l
            p = torch.exp(logp)
            plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
            H[..., s:s + chunk] = -plogp.sum(-1)
            lse[..., s:s + chunk] = l.squeeze(-1)
        ctx.save_for_backward(logits, lse, H)
        ctx.chunk, ctx.temperature = chunk, temperature
        return H

    @staticmethod
    def backward(ctx, grad_out):
        logits, lse, H = ctx.saved_tensors
        chunk, dt, temperature = ctx.chunk, H.dtype, ctx.temperature
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for s in range(0, logits.shape[-2], chunk):
            x = _chunk_at(logits, s, chunk, dt, temperature)
            logp = x - lse[..., s:s + chunk].unsqueeze(-1)
            p = torch.exp(logp)
            d = torch.where(p > 0, p * (logp + H[..., s:s + chunk].unsqueeze(-1)), torch.zeros_like(p))
            grad[..., s:s + chunk, :] = -d * (grad_out[..., s:s + chunk].to(dt) / temperature).unsqueeze(-1)
        return grad, None, None


def gather_log_probs(logits: torch.Tensor, labels: torch.Tensor, chunk_size: Optional[int] = None,
                     temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature, -1)`` gathered at ``labels``.

    ``logits``: ``(B, T, V)`` (any leading dims; the sequence is dim -2), any float dtype, may be a
    non-contiguous view such as ``logits[:, :-1]``; ``labels``: ``(B, T)`` int64. Returns ``(B, T)`` in
    fp32 (fp64 if the logits are fp64). Worked ``chunk_size`` positions at a time, each chunk upcast to
    fp32, so the full fp32 ``(B, T, V)`` tensor never exists, neither in forward nor in backward
    (custom autograd function; the gradient w.r.t. ``logits`` is ``g * (onehot - softmax)`` in the
    logits' dtype). ``chunk_size=None`` picks a chunk of about ``DEFAULT_CHUNK_ELEMENTS`` elements.
    Equals the naive ``log_softmax(logits.float() / temperature).gather(...)``. ``temperature``: the distribution
    step 3 samples its answers from (TRL's, OpenRLHF's and verl's PPO/GRPO score them at it too).
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} != logits shape[:-1] {tuple(logits.shape[:-1])}")
    temperature = _checked_temperature(temperature)
    if logits.shape[-2] == 0:
        return torch.empty(labels.shape, dtype=_compute_dtype(logits), device=logits.device)
    return _GatherLogProbs.apply(logits, labels.long(), _chunk_len(logits, chunk_size), temperature)


def entropy_from_logits(logits: torch.Tensor, chunk_size: Optional[int] = None,
                        temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position: ``(B, T, V)`` -> ``(B, T)`` in fp32 (fp64 for fp64).

    Chunked and fp32 per chunk exactly like :func:`gather_log_probs`; differentiable.
    """
    temperature = _checked_temperature(temperature)
    if logits.shape[-2] == 0:
        return torch.empty(logits.shape[:-1], dtype=_compute_dtype(logits), device=logits.device)
    return _EntropyFromLogits.apply(logits, _chunk_len(logits, chunk_size), temperature)


# --------------------------------------------------------------------------------------------
# KL estimators, KL-penalised rewards, KL loss term

KL_ESTIMATORS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}


def register_kl_estimator(*names):
    def deco(fn):
        for n in names:
            KL_ESTIMATORS[n] = fn
        return fn
    return deco


@register_kl_estimator("k1", "kl")
def _kl_k1(logp, ref_logp):
    return logp - ref_logp


@register_kl_estimator("abs")
def _kl_abs(logp, ref_logp):
    return (logp - ref_logp).abs()


@register_kl_estimator("k2", "mse")
def _kl_k2(logp, ref_logp):
    return 0.5 * (logp - ref_logp).square()


@register_kl_estimator("k3")
def _kl_k3(logp, ref_logp):
    d = ref_logp - logp
    return torch.exp(d) - d - 1


MAX_LOG_RATIO = 20.0  # verl's bound on the policy's log-ratio (to the rollout policy; low_var_kl's to the reference)


@register_kl_estimator("low_var_kl")
def _kl_low_var(logp, ref_logp):
    # k3 with verl's clamps for numerical safety (log-ratio to +-20, result to +-10)
    d = torch.clamp(ref_logp - logp, min=-MAX_LOG_RATIO, max=MAX_LOG_RATIO)
    return torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from sampled-token log-probs, elementwise.

    ``logp``, ``ref_logp``: ``(B, T)``. ``kind``: "k1"/"kl" = logp - ref (DeepSpeed-Chat);
    "k2"/"mse" = 0.5 (logp - ref)^2; "k3" = exp(ref - logp) - (ref - logp) - 1 (Schulman's unbiased,
    low-variance, always >= 0); "low_var_kl" = k3 clamped like verl; "abs" = |logp - ref|.
    Computed in at least fp32. Not masked (see :func:`kl_loss_term` / :func:`masked_mean`).
    """
    try:
        fn = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; choose from {sorted(KL_ESTIMATORS)}") from None
    dt = _compute_dtype(logp, ref_logp)
    return fn(_up(logp, dt), _up(ref_logp, dt))


def last_token_index(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """For ``mask`` ``(B, T)``: (index of the last nonzero entry per row, bool "row has any")."""
    m = mask != 0
    T = m.shape[-1]
    has = m.any(dim=-1)
    idx = T - 1 - torch.flip(m, dims=[-1]).to(torch.int8).argmax(dim=-1)
    return torch.where(has, idx, torch.zeros_like(idx)), has


def kl_penalized_rewards(logp: torch.Tensor, ref_logp: torch.Tensor, reward_score: torch.Tensor,
                         mask: torch.Tensor, kl_coef: float = 0.1, clip_reward_value: Optional[float] = 5.0,
                         kl_kind: str = "k1") -> torch.Tensor:
    """Per-token rewards: ``-kl_coef * kl`` on each response token, plus the clipped score at the end.

    ``logp``, ``ref_logp``, ``mask``: ``(B, T)``; ``reward_score``: ``(B,)`` reward-model score per
    answer. The score is clamped to ``[-clip_reward_value, clip_reward_value]`` (None = no clamp) and
    added at the LAST position where ``mask`` is nonzero in each row; a row with an all-zero mask gets
    no score. Positions where ``mask`` is 0 get reward 0. Returns ``(B, T)``, detached, >= fp32.
    DeepSpeed-Chat ``compute_rewards`` with kl_ctl=0.1, clip_reward_value=5 and the k1 estimator, but for where
    the score lands (the module's docstring: on the end token, not one past it).
    """
    with torch.no_grad():
        kl = kl_estimate(logp.detach(), ref_logp.detach(), kl_kind)
        dt = _compute_dtype(kl, reward_score)
        rewards = -float(kl_coef) * _up(kl, dt)
        rewards = _masked(rewards, _fmask(mask, rewards))
        score = _up(reward_score.detach().reshape(-1), dt).to(rewards.device)
        if score.shape[0] != rewards.shape[0]:
            raise ValueError(f"reward_score has {score.shape[0]} entries for a batch of {rewards.shape[0]}")
        if clip_reward_value is not None:
            score = torch.clamp(score, -clip_reward_value, clip_reward_value)
        idx, has = last_token_index(mask.to(rewards.device))
        score = torch.where(has, score, torch.zeros_like(score))
        rewards.scatter_add_(-1, idx.unsqueeze(-1), score.unsqueeze(-1))
    return rewards


# --------------------------------------------------------------------------------------------
# loss aggregation

LOSS_AGG_MODES = ("token_mean", "global_token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def agg_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_agg: str = "token_mean",
             num_tokens_global=None, accum_steps: int = 1, world_size: int = 1,
             max_length: Optional[int] = None, num_seqs_global=None) -> torch.Tensor:
    """Reduce a ``(B, T)`` per-token loss to the scalar that is handed to ``engine.backward``.

    * ``"token_mean"`` (DeepSpeed-Chat): ``sum(loss * mask) / sum(mask)`` over this micro-batch
      (0 if the micro-batch has no response token).
    * ``"global_token_mean"``: ``sum(loss * mask) * (accum_steps * world_size) / num_tokens_global``.
      ``num_tokens_global`` is the number of response tokens (``mask.sum()``) in the whole global batch,
      i.e. summed over the ``accum_steps`` gradient-accumulation micro-batches of every one of the
      ``world_size`` data-parallel ranks (the trainer all-reduces it). DeepSpeed's ``engine.backward``
      divides each micro-batch loss by ``gradient_accumulation_steps`` and the gradient all-reduce
      averages over ranks, so the applied gradient is
      ``1/(W*G) * sum_{rank,micro} grad(loss_micro) = grad(sum of all token losses) / num_tokens_global``,
      exactly the gradient of the token mean over the concatenated global batch. Plain ``token_mean``
      instead weights every micro-batch equally, whatever its token count.
    * ``"seq_mean_token_mean"`` (TRL's ``loss_type="grpo"``, verl's "seq-mean-token-mean", OpenRLHF's loss when not
      token-level; the GRPO paper's): each answer's token mean, then the mean over the answers (below). Every
      answer weighs alike whatever its length, so a short answer's tokens weigh more than a long one's (where the
      token means weigh every token alike: TRL's "bnpo" is ``token_mean``, its "dapo" ``global_token_mean``). An
      answer without a token counts as 0.
    * ``"seq_mean_token_sum_norm"`` (Dr. GRPO; TRL's ``loss_type="dr_grpo"``, verl's "seq-mean-token-sum-norm"): each
      answer's token sum over the constant ``max_length`` (step 3: --max_answer_seq_len), then the mean over the
      answers (below): every token weighs alike, in every batch, whatever the answers' lengths.

    The mean over answers is over the global batch's answers with ``num_seqs_global``: the answers (rows, empty ones
    included) of the ``accum_steps`` micro-batches of all ``world_size`` ranks, scaled as ``global_token_mean`` is, so
    that DeepSpeed's averaging makes it the mean over the concatenated global batch (verl's global_batch_size
    normalisation). Without it, the micro-batch's own mean: the same where every micro-batch holds as many answers,
    but a micro-batch of fewer answers (a generation batch that is not a multiple of the training batch) weighed each
    of them more.
    """
    if loss_agg == "token_mean":
        return masked_mean(per_token, mask)
    if loss_agg == "seq_mean_token_mean":
        return _mean_over_answers(masked_mean(per_token, mask, dim=-1), num_seqs_global, accum_steps, world_size)
    if loss_agg == "seq_mean_token_sum_norm":
        if max_length is None or max_length <= 0:
            raise ValueError(f"loss_agg='seq_mean_token_sum_norm' needs max_length > 0, got {max_length}")
        return _mean_over_answers(masked_sum(per_token, mask, dim=-1), num_seqs_global, accum_steps,
                                  world_size) / float(max_length)
    if loss_agg == "global_token_mean":
        if num_tokens_global is None:
            raise ValueError("loss_agg='global_token_mean' needs num_tokens_global")
        n = float(num_tokens_global)
        if n <= 0:
            return masked_sum(per_token, mask) * 0.0
        return masked_sum(per_token, mask) * (float(accum_steps) * float(world_size) / n)
    raise ValueError(f"unknown loss_agg {loss_agg!r}; choose from {LOSS_AGG_MODES}")


def _mean_over_answers(per_answer: torch.Tensor, num_seqs_global, accum_steps: int, world_size: int) -> torch.Tensor:
    """``(B,)`` per-answer losses to the micro-batch's share of the mean over the global batch's ``num_seqs_global``
    answers (``agg_loss``), or to their own mean where it is None."""
    if num_seqs_global is None:
        return per_answer.mean()
    n = float(num_seqs_global)
    if n <= 0:
        return per_answer.sum() * 0.0
    return per_answer.sum() * (float(accum_steps) * float(world_size) / n)


def kl_loss_term(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str = "k3",
                 loss_agg: str = "token_mean", num_tokens_global=None, accum_steps: int = 1,
                 world_size: int = 1, max_length: Optional[int] = None, num_seqs_global=None) -> torch.Tensor:
    """KL(policy || ref) as a loss term ("KL in the loss" mode, GRPO-style) - scalar, differentiable
    w.r.t. ``logp``. ``logp``, ``ref_logp``, ``mask``: ``(B, T)``. The caller adds
    ``kl_loss_coef * kl_loss_term(...)`` to the policy loss (and then usually uses kl_coef=0 in
    :func:`kl_penalized_rewards`). Aggregated like :func:`agg_loss`.
    """
    ref_logp = ref_logp.detach()
    # A masked position gets the reference's log-prob, so KL 0: an extreme log-prob there (padding after the end)
    # overflows k3's exp, and its inf gradient times the mask's 0 is NaN.
    logp = torch.where(mask.to(logp.device) != 0, logp, ref_logp.to(logp.dtype))
    kl = kl_estimate(logp, ref_logp, kind)
    return agg_loss(kl, mask, loss_agg, num_tokens_global, accum_steps, world_size, max_length, num_seqs_global)


def kl_token_mean(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, kind: str = "k3") -> float:
    """The answer tokens' mean of ``kind``'s KL estimate of the policy to the reference (no gradient): what
    :func:`kl_loss_term` penalises per token, whatever the loss's aggregation (verl's ``actor/kl_loss``, TRL's GRPO
    ``kl``). k3's is >= 0, where the k1 mean of a few answers can fall below 0."""
    with torch.no_grad():
        return masked_mean(kl_estimate(logp.detach(), ref_logp.detach(), kind), mask).item()


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, entropy_coef: float, loss_agg: str = "token_mean",
                  num_tokens_global=None, accum_steps: int = 1, world_size: int = 1,
                  max_length: Optional[int] = None, num_seqs_global=None) -> torch.Tensor:
    """``entropy_coef * masked_mean(entropy)`` (scalar); the caller SUBTRACTS it from the policy loss:
    ``loss = pg_loss - entropy_bonus(entropy, mask, coef)``. ``entropy``, ``mask``: ``(B, T)``, e.g.
    ``entropy_from_logits(logits)`` sliced to the response. Aggregated like :func:`agg_loss`.
    """
    return float(entropy_coef) * agg_loss(entropy, mask, loss_agg, num_tokens_global, accum_steps, world_size,
                                          max_length, num_seqs_global)


# --------------------------------------------------------------------------------------------
# policy / value losses

POLICY_LOSS_FNS: Dict[str, Callable] = {}
VALUE_LOSS_FNS: Dict[str, Callable] = {}


def register_policy_loss(name):
    def deco(fn):
        POLICY_LOSS_FNS[name] = fn
        return fn
    return deco


def register_value_loss(name):
    def deco(fn):
        VALUE_LOSS_FNS[name] = fn
        return fn
    return deco




@register_policy_loss("clipped")
def policy_loss_clipped(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        clip_range: float = 0.2, loss_agg: str = "token_mean", num_tokens_global=None,
                        accum_steps: int = 1, world_size: int = 1,
                        max_length: Optional[int] = None,
                        num_seqs_global=None,
                        clip_range_high: Optional[float] = None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """PPO clipped surrogate (DeepSpeed-Chat ``actor_loss_fn``).

    ``logp`` (current policy, with grad), ``old_logp`` (rollout policy), ``advantages``, ``mask``: all
    ``(B, T)``. ``ratio = exp((logp - old_logp) * mask)``, its exponent clamped to +-``MAX_LOG_RATIO`` (verl's 20); per token
    ``max(-A * ratio, -A * clamp(ratio, 1 - clip_range, 1 + clip_range_high))``; aggregated by
    :func:`agg_loss` (``token_mean`` = DeepSpeed-Chat). ``old_logp`` and ``advantages`` are detached.
    ``clip_range_high`` None: ``clip_range`` (symmetric, DeepSpeed-Chat's); another: DAPO's clip-higher (TRL's
    ``epsilon_high``, verl's ``clip_ratio_high``), a wider upper side that lets unlikely tokens with a positive
    advantage grow further.

    Returns ``(loss, stats)``; stats (detached 0-dim tensors, masked means over this micro-batch):
    ``pg_clipfrac`` (fraction of tokens where the clipped term is the active one; ``pg_clipfrac_low``: those clipped at
    ``1 - clip_range`` with a negative advantage, ``pg_clipfrac_high``: at the upper side with a positive one, TRL's
    clip_ratio/low_mean and high_mean; they add up to ``pg_clipfrac``), ``ppo_kl``
    (k1 estimate of KL(old || new) = mean(old_logp - logp)), ``approx_kl`` (k3 estimate of the same,
    >= 0), ``ratio_mean``, ``ratio_max``.
    """
    dt = _compute_dtype(logp, old_logp, advantages)
    logp = _up(logp, dt)
    old_logp = _up(old_logp.detach(), dt)
    adv = _up(advantages.detach(), dt)
    m = _fmask(mask, logp)
    log_ratio = _masked(logp - old_logp, m)
    # verl's clamp: past e^88 the fp32 ratio is inf, and a negative advantage made the loss inf (the run stopped on a
    # non-finite loss); a token 20 nats off the rollout policy gets no gradient instead
    ratio = torch.exp(torch.clamp(log_ratio, min=-MAX_LOG_RATIO, max=MAX_LOG_RATIO))
    pg1 = -adv * ratio
    high = clip_range if clip_range_high is None else clip_range_high
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + high)
    per_token = torch.max(pg1, pg2)
    loss = agg_loss(per_token, m, loss_agg, num_tokens_global, accum_steps, world_size, max_length, num_seqs_global)
    with torch.no_grad():
        lr = log_ratio.detach()
        r = ratio.detach()
        stats = {
            "pg_clipfrac": masked_mean((pg2 > pg1).to(dt), m),
            "pg_clipfrac_low": masked_mean(((pg2 > pg1) & (adv < 0)).to(dt), m),
            "pg_clipfrac_high": masked_mean(((pg2 > pg1) & (adv > 0)).to(dt), m),
            "ppo_kl": masked_mean(-lr, m),
            "approx_kl": masked_mean(r - 1 - lr.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), m),  # (finite, as the loss)
            "ratio_mean": masked_mean(r, m),
            "ratio_max": torch.where(m > 0, r, torch.full_like(r, -math.inf)).max() if m.sum() > 0
            else torch.zeros((), dtype=dt, device=r.device),
        }
    return loss, stats


@register_value_loss("clipped")
def value_loss_clipped(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       clip_range_value: Optional[float] = 0.2, loss_agg: str = "token_mean",
                       num_tokens_global=None, accum_steps: int = 1, world_size: int = 1,
                       max_length: Optional[int] = None,
                       num_seqs_global=None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Clipped value loss (DeepSpeed-Chat ``critic_loss_fn``).

    ``values`` (current critic, with grad), ``old_values`` (rollout critic), ``returns``, ``mask``:
    ``(B, T)``. ``v_clip = clamp(values, old - c, old + c)``; per token
    ``0.5 * max((values - R)^2, (v_clip - R)^2)`` (``clip_range_value=None``: ``0.5 (values - R)^2``);
    aggregated by :func:`agg_loss`. Returns ``(loss, stats)`` with ``vf_clipfrac`` (fraction of tokens
    where the clipped square is the larger), ``vpred_mean``, ``returns_mean`` (detached).
    """
    dt = _compute_dtype(values, old_values, returns)
    m = _fmask(mask, _up(values, dt))
    # A masked position predicts its return exactly (loss 0): an inf value there (fp16 overflow on padding) has an
    # inf gradient, which times the mask's 0 is NaN.
    R = _masked(_up(returns.detach(), dt), m)
    v = torch.where(m != 0, _up(values, dt), R)
    old = torch.where(m != 0, _up(old_values.detach(), dt), R)
    vf1 = (v - R).square()
    if clip_range_value is None:
        vf2 = vf1
    else:
        vclip = torch.clamp(v, old - clip_range_value, old + clip_range_value)
        vf2 = (vclip - R).square()
    per_token = 0.5 * torch.max(vf1, vf2)
    loss = agg_loss(per_token, m, loss_agg, num_tokens_global, accum_steps, world_size, max_length, num_seqs_global)
    with torch.no_grad():
        stats = {
            "vf_clipfrac": masked_mean((vf2 > vf1).to(dt), m),
            "vpred_mean": masked_mean(v.detach(), m),
            "returns_mean": masked_mean(R, m),
        }
    return loss, stats


# --------------------------------------------------------------------------------------------
# advantage estimators

ADVANTAGE_ESTIMATORS: Dict[str, Callable] = {}


def register_adv_estimator(name):
    def deco(fn):
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return deco


def get_adv_estimator(name: str) -> Callable:
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; choose from {sorted(ADVANTAGE_ESTIMATORS)}") from None


@register_adv_estimator("gae")
def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                   lam: float = 0.95) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens.

    ``rewards`` (per-token, e.g. from :func:`kl_penalized_rewards`), ``values`` (rollout critic),
    ``mask``: ``(B, T)``. Returns ``(advantages, returns)``, both ``(B, T)``, detached, 0 where
    ``mask`` is 0; ``returns = advantages + values`` on real tokens.

    Rewards and values at masked positions are ignored, so nothing past a row's end leaks back: after
    the last real token the bootstrap value is 0 (the answer is terminal), exactly DeepSpeed-Chat's
    ``get_advantages_and_returns`` after its "zero out the reward and value after the end" step.
    A masked gap inside a row is skipped (value and advantage carried over it, verl-style); with a
    contiguous mask this changes nothing. Not whitened (DeepSpeed-Chat does not whiten); use
    :func:`masked_whiten` if wanted.
    """
    with torch.no_grad():
        dt = _compute_dtype(rewards, values)
        m = _fmask(mask, _up(rewards, dt))
        real = m > 0
        # masked entries are set to 0 (not multiplied by it): an inf/NaN there must not reach the real tokens
        r = torch.where(real, _up(rewards.detach(), dt) * m, 0.0)
        v = torch.where(real, _up(values.detach(), dt) * m, 0.0)
        is_real = real.to(dt)
        # The value of the next real token (0 after the last): carried leftwards over masked positions.
        next_real_value = reverse_linear_scan(1 - is_real, v)
        following = torch.cat([next_real_value[:, 1:], torch.zeros_like(next_real_value[:, :1])], dim=1)
        delta = r + gamma * following - v
        # gae_t = delta_t + gamma*lam*gae_{next real token}; masked positions carry the state unchanged
        gae = reverse_linear_scan(is_real * (gamma * lam) + (1 - is_real), torch.where(real, delta, 0.0))
        adv = torch.where(real, gae * m, 0.0)
        returns = torch.where(real, (adv + v) * m, 0.0)
    return adv, returns


def reverse_linear_scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x_t = a_t * x_{t+1} + b_t`` along dim 1, with ``x`` past the end 0, for ``(B, T)`` tensors.

    In log2(T) doubling steps (Hillis-Steele over the affine maps ``x -> a_t x + b_t``) instead of a Python loop
    over T: a loop launches a few kernels per token (thousands for 256-token answers) and leaves the GPU waiting
    on the host; the doubling launches a few per step. Same result up to the order of the floating-point sums.
    """
    T = a.shape[1]
    step = 1
    while step < T:
        # (a_t, b_t) becomes the composition of maps t .. t + 2*step - 1 (those past the end are the zero map's)
        b = torch.cat([b[:, :T - step] + a[:, :T - step] * b[:, step:], b[:, T - step:]], dim=1)
        if 2 * step < T:  # the last step needs no a
            a = torch.cat([a[:, :T - step] * a[:, step:], a[:, T - step:]], dim=1)
        step *= 2
    return b


def _check_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    scores = scores.reshape(-1)
    if group_size < 1 or scores.shape[0] % group_size != 0:
        raise ValueError(f"batch of {scores.shape[0]} scores is not a multiple of group_size={group_size}")
    return scores.view(-1, group_size)


def _from_first(groups: torch.Tensor) -> torch.Tensor:
    """``(G, n)`` groups of scores less each group's first: the same deviations from the group's mean and the same
    std, but a group whose scores are all alike becomes exactly 0. Its mean in floating point may round off the
    common score (0.7 eight times: by 6e-8), and GRPO's division by std + eps scales that rounding up to an
    advantage of 0.06 to 0.8 for every answer of the group, all of one sign."""
    return groups - groups[:, :1]


def _scored_alike(groups: torch.Tensor, eps: float) -> torch.Tensor:
    """``(G, 1)`` bool: the groups whose scores' std is within ``eps`` of 0, relative to the scores' size (at least
    1): a reward model's fp32 scores of like answers differ in their last bits, ~1e-7 of the score (6e-5 at 1000)."""
    scale = groups.abs().amax(dim=1, keepdim=True).clamp(min=1)
    return _from_first(groups).std(dim=1, keepdim=True) <= eps * scale


def zero_std_fraction(scores: torch.Tensor, group_size: int, eps: float = 1e-6) -> float:
    """The fraction of groups (consecutive runs of ``group_size`` scores, one prompt's answers) whose answers all
    scored the same (``_scored_alike``): their group-relative advantages are 0, so they train nothing (TRL's
    ``frac_reward_zero_std``)."""
    return _scored_alike(_check_groups(scores.detach().float(), group_size), eps).float().mean().item()


def group_reward_std(scores: torch.Tensor, group_size: int) -> float:
    """The mean over the groups (consecutive runs of ``group_size`` scores, one prompt's answers) of each group's
    score std (Bessel-corrected, as GRPO's): how far one prompt's answers are told apart, TRL's ``reward_std``."""
    return _from_first(_check_groups(scores.detach().float(), group_size)).std(dim=1).mean().item()


# GRPO's division of each answer's score less its group's mean (TRL's scale_rewards): by its group's std, by the std
# of the whole batch's scores over every rank (Lite PPO's "group mean, batch std"), or by nothing (Dr. GRPO)
STD_SCOPES = GRPO_STD_SCOPES


def std_scope(norm_by_std) -> str:
    """``norm_by_std`` as one of ``STD_SCOPES``: a scope's name, or True/1 ("group") and False/0 ("none"), the values
    --grpo_norm_by_std and ``grpo_advantages`` took before the batch scope (read as the flag reads them)."""
    scope = grpo_std_scope(norm_by_std)
    if scope not in STD_SCOPES:
        raise ValueError(f"norm_by_std={norm_by_std!r}: expected one of {', '.join(STD_SCOPES)} (or 1/0)")
    return scope


def batch_reward_std(scores: torch.Tensor, process_group=None) -> torch.Tensor:
    """The std (Bessel-corrected) of all the scores, over every rank of ``process_group`` (every rank must call it):
    GRPO's "batch" scale, as TRL's ``scale_rewards="batch"`` takes it over the rewards gathered from all processes."""
    _, var = masked_mean_var(scores, torch.ones_like(scores), unbiased=True, process_group=process_group)
    return var.sqrt()


@register_adv_estimator("grpo")
def grpo_advantages(scores: torch.Tensor, group_size: int, mask: torch.Tensor, norm_by_std=True,
                    eps: float = 1e-6, process_group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages (critic-free).

    ``scores``: ``(B,)`` one scalar reward per answer, where consecutive runs of ``group_size`` answers
    belong to the same prompt (B % group_size == 0); ``mask``: ``(B, T)``. Per answer
    ``(s - mean_group) / (std + eps)``, ``norm_by_std`` (``std_scope``) naming the std: "group" (True; its group's,
    Bessel-corrected like ``torch.std``, as in verl), "batch" (all the scores', over every rank of
    ``process_group``, each of which must call this) or "none" (False: ``s - mean_group`` only, Dr. GRPO's advantage),
    broadcast over that answer's tokens and zeroed where ``mask`` is 0. A group scored alike (within ``eps``) gets 0.
    ``group_size == 1``: the advantage is the raw score (verl's convention).
    Returns ``(advantages, returns)`` with ``returns = advantages`` (no critic), both ``(B, T)``.
    """
    scope = std_scope(norm_by_std)
    with torch.no_grad():
        dt = _compute_dtype(scores)
        g = _up(_check_groups(scores.detach(), group_size), dt)
        if group_size == 1:
            a = g
        else:
            alike = _scored_alike(g, eps)
            std = batch_reward_std(g, process_group) if scope == "batch" else None
            g = _from_first(g)  # (a group scored alike: exactly 0, not its mean's rounding over std + eps)
            a = g - g.mean(dim=1, keepdim=True)
            if scope != "none":
                std = g.std(dim=1, keepdim=True) if std is None else std
                # A group scored alike but for its last bits trains nothing, as zero_std_fraction counts it: the
                # division by std + eps would scale that noise to advantages of 0.05-1.5.
                a = torch.where(alike, 0.0, a / (std + eps))
        adv = a.reshape(-1, 1).to(mask.device) * _fmask(mask, a)
    return adv, adv.clone()


@register_adv_estimator("rloo")
def rloo_advantages(scores: torch.Tensor, group_size: int, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """RLOO (REINFORCE leave-one-out) advantages (critic-free).

    ``scores``: ``(B,)`` per-answer reward, consecutive runs of ``group_size`` (>= 2) answers per prompt;
    ``mask``: ``(B, T)``. ``A_i = s_i - mean_{j != i} s_j`` (= G/(G-1) (s_i - mean_group)), broadcast over
    the answer's tokens, 0 where ``mask`` is 0. Returns ``(advantages, returns = advantages)``.
    """
    if group_size < 2:
        raise ValueError("rloo_advantages needs group_size >= 2")
    with torch.no_grad():
        dt = _compute_dtype(scores)
        g = _from_first(_up(_check_groups(scores.detach(), group_size), dt))  # (alike: exactly 0, as in GRPO)
        baseline = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
        a = g - baseline
        adv = a.reshape(-1, 1).to(mask.device) * _fmask(mask, a)
    return adv, adv.clone()


@register_adv_estimator("reinforce_pp")
def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                            process_group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantages (critic-free).

    ``token_rewards``: ``(B, T)`` per-token rewards (score at the last token minus the per-token KL
    penalty, i.e. :func:`kl_penalized_rewards`); ``mask``: ``(B, T)``. The discounted return-to-go
    ``G_t = r_t + gamma * G_{t+1}`` (rewards past the end ignored) is whitened over the batch with
    :func:`masked_whiten` (over all ranks of ``process_group`` when given). Returns
    ``(advantages, returns)`` where ``returns`` is the un-whitened return-to-go (as in verl); both 0
    where ``mask`` is 0.
    """
    with torch.no_grad():
        dt = _compute_dtype(token_rewards)
        m = _fmask(mask, _up(token_rewards, dt))
        r = torch.where(m > 0, _up(token_rewards.detach(), dt) * m, 0.0)  # an inf/NaN past the end stays there
        returns = reverse_linear_scan(torch.full_like(r, gamma), r) * m
        adv = masked_whiten(returns, m, shift_mean=True, process_group=process_group)
    return adv, returns


def compute_advantages(estimator: str, *, mask: torch.Tensor, token_rewards: Optional[torch.Tensor] = None,
                       values: Optional[torch.Tensor] = None, scores: Optional[torch.Tensor] = None,
                       group_size: Optional[int] = None, **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as ``estimator`` with whatever inputs it takes.

    Pass everything the trainer has; each estimator receives only the arguments in its signature
    (``token_rewards`` is passed as ``rewards`` to "gae"). Extra keyword args (``gamma``, ``lam``,
    ``norm_by_std``, ``eps``, ``process_group`` ...) go through the same filter. Raises if an input the
    estimator requires is missing. Returns ``(advantages, returns)``, ``(B, T)`` each.
    """
    fn = get_adv_estimator(estimator)
    avail = dict(kwargs, mask=mask, token_rewards=token_rewards, rewards=token_rewards, values=values,
                 scores=scores, group_size=group_size)
    call = {}
    for name, p in inspect.signature(fn).parameters.items():
        val = avail.get(name)
        if val is None:
            if p.default is inspect.Parameter.empty:
                raise ValueError(f"advantage estimator {estimator!r} needs {name!r}")
            continue
        call[name] = val
    return fn(**call)


# --------------------------------------------------------------------------------------------
# KL controllers


class FixedKLController:
    """Constant KL coefficient (DeepSpeed-Chat: kl_ctl = 0.1)."""

    def __init__(self, kl_coef: float = 0.1):
        self.value = float(kl_coef)

    def update(self, current_kl, n_steps) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])

    def __repr__(self):  # (as it is made: the errors that name an assigned controller read it)
        return f"FixedKLController({self.value!r})"


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593; TRL/verl update rule).

    ``update(current_kl, n_steps)``: ``e = clip(current_kl / target - 1, -0.2, 0.2)``;
    ``value *= 1 + e * n_steps / horizon``. The coefficient grows when the measured KL is above
    ``target`` and shrinks when below.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError("target and horizon must be positive")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl, n_steps) -> None:
        current_kl = float(current_kl)
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * float(n_steps) / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))

    def __repr__(self):
        return f"AdaptiveKLController({self.value!r}, target={self.target!r}, horizon={self.horizon!r})"


KL_CONTROLLERS = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}


def get_kl_controller(kind: str = "fixed", kl_coef: float = 0.1, target: Optional[float] = None,
                      horizon: Optional[float] = None):
    """``"fixed"`` -> FixedKLController(kl_coef); ``"adaptive"`` -> AdaptiveKLController(kl_coef, target, horizon)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target is None or horizon is None:
            raise ValueError("adaptive KL controller needs target and horizon")
        return AdaptiveKLController(kl_coef, target, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; choose from {sorted(KL_CONTROLLERS)}")


# --------------------------------------------------------------------------------------------
# finiteness check


def check_finite(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor`` if every element is finite, else raise ``FloatingPointError`` naming it.

    The message says how many NaN / +-inf of how many elements, and which rows (indices along dim 0,
    first 16) hold them. Forces a device sync; meant for losses/rewards once per step.
    """
    t = torch.as_tensor(tensor).detach()
    if not (t.is_floating_point() or t.is_complex()):
        return tensor
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return tensor
    n_nan = int(torch.isnan(t).sum())
    n_inf = int(torch.isinf(t).sum())
    msg = f"{name} is not finite: {n_nan} NaN, {n_inf} inf of {t.numel()} values"
    if t.dim() >= 1:
        bad_rows = (~finite).reshape(t.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        more = ", ..." if len(bad_rows) > 16 else ""
        msg += f" in {len(bad_rows)} row(s) [{', '.join(map(str, bad_rows[:16]))}{more}] of shape {tuple(t.shape)}"
    raise FloatingPointError(msg)
