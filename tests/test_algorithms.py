"""Tests of dschat.rlhf.algorithms against hand-computed numbers and obviously-correct loops."""
import math
import os
import statistics

import pytest
import torch
import torch.nn.functional as F

from dschat.rlhf import algorithms as A
from dschat.utils.dist import free_port

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def close(a, b, atol=1e-9, rtol=1e-7):
    torch.testing.assert_close(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------------------
# DeepSpeed-Chat reference implementations (transcribed from
# training/step3_rlhf_finetuning/ppo_trainer.py, with start = 0 since our tensors are the response part)


def dsc_compute_rewards(log_probs, ref_log_probs, reward_score, action_mask, kl_ctl=0.1, clip_reward_value=5):
    rewards = -kl_ctl * (log_probs - ref_log_probs)
    start = 0
    # (DeepSpeed-Chat adds 1 here, putting the score one past the end token: dschat puts it on the end token, as
    # OpenRLHF and verl do; algorithms.py's docstring)
    ends = start + action_mask[:, start:].sum(1).long()
    reward_clip = torch.clamp(reward_score, -clip_reward_value, clip_reward_value)
    for j in range(log_probs.shape[0]):
        rewards[j, start:ends[j]][-1] += reward_clip[j]
    # train_rlhf then zeroes everything past the end
    for i in range(rewards.shape[0]):
        rewards[i, ends[i]:] = 0
    return rewards


def dsc_advantages_and_returns(values, rewards, gamma=1.0, lam=0.95, start=0):
    lastgaelam = 0
    advantages_reversed = []
    length = rewards.size()[-1]
    for tt in reversed(range(start, length)):
        nextvalues = values[:, tt + 1] if tt < length - 1 else 0.0
        delta = rewards[:, tt] + gamma * nextvalues - values[:, tt]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values[:, start:]
    return advantages, returns


def dsc_actor_loss(logprobs, old_logprobs, advantages, mask, cliprange=0.2):
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return torch.sum(torch.max(pg_loss1, pg_loss2) * mask) / mask.sum()


def dsc_critic_loss(values, old_values, returns, mask, cliprange_value=0.2):
    values_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    vf_loss1 = (values - returns) ** 2
    vf_loss2 = (values_clipped - returns) ** 2
    return 0.5 * torch.sum(torch.max(vf_loss1, vf_loss2) * mask) / mask.sum()


def suffix_mask(lengths, T):
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(D)


# ------------------------------------------------------------------------------------------
# masked reductions


def test_masked_sum_mean():
    x = t([[1., 2., 3.], [4., 5., 6.], [7., 8., 9.]])
    m = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    close(A.masked_sum(x, m), 7.0)
    close(A.masked_mean(x, m), 7.0 / 3)
    close(A.masked_mean(x, m, dim=1), [1.5, 4.0, 0.0])  # all-zero row -> 0, not NaN
    close(A.masked_sum(x, m, dim=0), [5.0, 2.0, 0.0])
    # bool mask works the same
    close(A.masked_mean(x, m.bool()), 7.0 / 3)


def test_masked_mean_all_zero_mask_no_nan_in_grad():
    x = t([[1., 2.]]).requires_grad_()
    m = t([[0., 0.]])
    y = A.masked_mean(x, m)
    y.backward()
    assert y.item() == 0.0
    assert torch.isfinite(x.grad).all() and (x.grad == 0).all()


def test_masked_mean_var_and_whiten():
    x = t([[1., 2., 3., 100.]])
    m = t([[1, 1, 1, 0]])
    mean, var = A.masked_mean_var(x, m)
    close(mean, 2.0)
    close(var, 1.0)  # unbiased: ((1-2)^2 + 0 + (3-2)^2) / (3 - 1)
    _, bvar = A.masked_mean_var(x, m, unbiased=False)
    close(bvar, 2.0 / 3)
    close(A.masked_whiten(x, m), [[-1.0, 0.0, 1.0, 0.0]], atol=1e-7)
    close(A.masked_whiten(x, m, shift_mean=False), [[1.0, 2.0, 3.0, 0.0]], atol=1e-7)
    # pre-computed (mean, var) are used instead of the local statistics
    close(A.masked_whiten(x, m, stats=(0.0, 4.0)), [[0.5, 1.0, 1.5, 0.0]], atol=1e-7)
    # degenerate inputs: no crash, no NaN
    assert torch.isfinite(A.masked_whiten(x, torch.zeros_like(m))).all()
    assert torch.isfinite(A.masked_whiten(x, t([[1, 0, 0, 0]]))).all()


def _whiten_worker(rank, world, port, path):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, 5, generator=g, dtype=D) * 3 + 1
        m = suffix_mask([5, 2, 0, 4], 5)
        rows = slice(0, 1) if rank == 0 else slice(1, 4)  # uneven split of the batch
        out = A.masked_whiten(x[rows], m[rows], process_group=dist.group.WORLD)
        torch.save(out, os.path.join(path, f"r{rank}.pt"))
        # 1e4 + 0.1 where masked in (its float32 mean over the 11 rounds it off), 99 where masked out (not counted)
        alike = torch.where(m.bool(), 1e4 + 0.1, 99.0).float()
        out = A.masked_whiten(alike[rows], m[rows], process_group=dist.group.WORLD)
        torch.save(out, os.path.join(path, f"alike{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_masked_whiten_process_group_matches_whole_batch(tmp_path):
    import torch.multiprocessing as mp
    mp.spawn(_whiten_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    got = torch.cat([torch.load(tmp_path / "r0.pt"), torch.load(tmp_path / "r1.pt")])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=g, dtype=D) * 3 + 1
    m = suffix_mask([5, 2, 0, 4], 5)
    vals = x[m.bool()].tolist()
    mu, sd = statistics.mean(vals), statistics.stdev(vals)
    expected = (x - mu) / math.sqrt(sd ** 2 + 1e-8) * m
    close(got, expected, atol=1e-9)
    # and rank 0 alone (one row) would have whitened differently
    assert not torch.allclose(A.masked_whiten(x[:1], m[:1]), expected[:1])
    # elements all alike over the ranks: exactly 0
    assert torch.all(torch.cat([torch.load(tmp_path / "alike0.pt"), torch.load(tmp_path / "alike1.pt")]) == 0)


# ------------------------------------------------------------------------------------------
# log-probs / entropy


def naive_logprobs(logits, labels):
    return F.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 50, None])
def test_gather_log_probs_equals_naive(chunk):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 7, 11, generator=g) * 4
    labels = torch.randint(0, 11, (2, 7), generator=g)
    got = A.gather_log_probs(logits, labels, chunk_size=chunk)
    assert got.dtype == torch.float32 and got.shape == (2, 7)
    torch.testing.assert_close(got, naive_logprobs(logits, labels), atol=1e-6, rtol=1e-6)
    # bf16 logits: computed in fp32 per chunk -> equals fp32 log_softmax of the bf16 values
    lb = logits.bfloat16()
    torch.testing.assert_close(A.gather_log_probs(lb, labels, chunk), naive_logprobs(lb, labels),
                               atol=1e-6, rtol=1e-6)
    # non-contiguous view (the trainer passes logits[:, :-1])
    full = torch.randn(2, 8, 11, generator=g)
    torch.testing.assert_close(A.gather_log_probs(full[:, :-1], labels, chunk),
                               naive_logprobs(full[:, :-1], labels), atol=1e-6, rtol=1e-6)


def test_gather_log_probs_hand_value():
    logits = torch.log(t([[[1., 2., 5.], [3., 3., 2.]]]))  # probabilities 1/8,2/8,5/8 and 3/8,3/8,2/8
    got = A.gather_log_probs(logits, torch.tensor([[2, 0]]), chunk_size=1)
    close(got, [[math.log(5 / 8), math.log(3 / 8)]])


def test_gather_log_probs_gradient_equals_naive():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 6, generator=g, dtype=D)
    labels = torch.randint(0, 6, (3, 5), generator=g)
    up = torch.randn(3, 5, generator=g, dtype=D)
    a = logits.clone().requires_grad_()
    (A.gather_log_probs(a, labels, chunk_size=2) * up).sum().backward()
    b = logits.clone().requires_grad_()
    (F.log_softmax(b, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1) * up).sum().backward()
    close(a.grad, b.grad, atol=1e-12)
    assert torch.autograd.gradcheck(lambda z: A.gather_log_probs(z, labels, 2), (logits.clone().requires_grad_(),))
    # bf16 logits: gradient comes back in bf16, equal to the fp32 one up to bf16 rounding
    c = logits.bfloat16().requires_grad_()
    (A.gather_log_probs(c, labels, 2) * up.float()).sum().backward()
    assert c.grad.dtype == torch.bfloat16
    torch.testing.assert_close(c.grad.float(), b.grad.float(), atol=2e-2, rtol=2e-2)


def test_log_probs_and_entropy_at_a_temperature_and_their_gradients_equal_naive():
    """Step 3 scores its answers at the temperature it sampled them at: ``softmax(logits / T)``, values and gradients
    (through the chunked backward's own formula, scaled by 1 / T)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, 7, generator=g, dtype=D) * 3
    labels = torch.randint(0, 7, (2, 5), generator=g)
    up = torch.randn(2, 5, generator=g, dtype=D)
    for temperature in (0.6, 1.7):
        a = logits.clone().requires_grad_()
        b = logits.clone().requires_grad_()
        ours = A.gather_log_probs(a, labels, 2, temperature=temperature) + \
            A.entropy_from_logits(a, 3, temperature=temperature)
        naive = F.log_softmax(b / temperature, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1) + \
            naive_entropy(b / temperature)
        close(ours, naive, atol=1e-12)
        (ours * up).sum().backward()
        (naive * up).sum().backward()
        close(a.grad, b.grad, atol=1e-12)
    assert not torch.allclose(A.gather_log_probs(logits, labels, temperature=0.6), A.gather_log_probs(logits, labels))
    assert torch.autograd.gradcheck(lambda z: A.entropy_from_logits(z, 2, temperature=0.6),
                                    (logits.clone().requires_grad_(),))


@pytest.mark.parametrize("temperature", [0.0, -0.7, float("nan"), float("inf")])
def test_log_probs_and_entropy_refuse_a_temperature_that_is_not_finite_and_positive(temperature):
    """0 and NaN gave NaN log-probs, inf a uniform distribution, without a word (public functions: a notebook's own
    temperature reaches them unchecked by step 3's flags)."""
    logits, labels = torch.randn(1, 3, 5, dtype=D), torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        A.gather_log_probs(logits, labels, temperature=temperature)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        A.entropy_from_logits(logits, temperature=temperature)


class _RecordFp32(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in torch.utils._pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.dtype == torch.float32:
                self.largest = max(self.largest, o.numel())
        return out


@pytest.mark.parametrize("fn", ["logprobs", "entropy"])
def test_chunked_never_materialises_full_fp32_logits(fn):
    B, T, V, chunk = 2, 16, 50, 4
    logits = torch.randn(B, T, V).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (B, T))
    rec = _RecordFp32()
    with rec:
        out = A.gather_log_probs(logits, labels, chunk) if fn == "logprobs" else A.entropy_from_logits(logits, chunk)
        out.sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    assert 0 < rec.largest <= B * chunk * V, rec.largest
    # the naive computation would have (sanity check of the recorder)
    rec2 = _RecordFp32()
    with rec2:
        F.log_softmax(logits.float(), -1).sum().backward()
    assert rec2.largest >= B * T * V


def naive_entropy(logits):
    lp = F.log_softmax(logits, -1)
    return -(lp.exp() * lp).sum(-1)


def test_entropy_from_logits():
    # hand values: uniform over 4 -> log 4; a one-hot (other logits -inf) -> 0 with finite gradient
    logits = t([[[0., 0., 0., 0.], [0., -math.inf, -math.inf, -math.inf]]]).requires_grad_()
    h = A.entropy_from_logits(logits, chunk_size=1)
    close(h, [[math.log(4), 0.0]])
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 9, generator=g, dtype=D) * 3
    for chunk in (1, 3, None):
        close(A.entropy_from_logits(x, chunk), naive_entropy(x), atol=1e-12)
    up = torch.randn(2, 7, generator=g, dtype=D)
    a = x.clone().requires_grad_()
    (A.entropy_from_logits(a, 3) * up).sum().backward()
    b = x.clone().requires_grad_()
    (naive_entropy(b) * up).sum().backward()
    close(a.grad, b.grad, atol=1e-12)
    xb = x.bfloat16()
    torch.testing.assert_close(A.entropy_from_logits(xb, 2), naive_entropy(xb.float()), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# KL


def test_kl_estimators_hand_values():
    logp, ref = t([math.log(0.5)]), t([math.log(0.25)])
    close(A.kl_estimate(logp, ref, "k1"), [math.log(2)])
    close(A.kl_estimate(logp, ref, "kl"), [math.log(2)])
    close(A.kl_estimate(logp, ref, "k2"), [0.5 * math.log(2) ** 2])
    close(A.kl_estimate(logp, ref, "k3"), [0.5 + math.log(2) - 1])  # exp(-ln2) - (-ln2) - 1
    close(A.kl_estimate(ref, logp, "k3"), [2 - math.log(2) - 1])
    close(A.kl_estimate(ref, logp, "abs"), [math.log(2)])
    close(A.kl_estimate(ref, logp, "k1"), [-math.log(2)])
    close(A.kl_estimate(t([0.0]), t([50.0]), "low_var_kl"), [10.0])  # clamped
    with pytest.raises(ValueError, match="unknown KL estimator"):
        A.kl_estimate(logp, ref, "k9")


def test_kl_penalized_rewards_hand_values():
    diff = t([[0.1, 0.2, 0.3, 0.4], [1., 2., 3., 4.], [0.5, 0.5, 0.5, 0.5]])
    ref = t([[-1., -2., -3., -4.]] * 3)
    logp = ref + diff
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    score = t([2., -7., 3.])
    r = A.kl_penalized_rewards(logp, ref, score, mask, kl_coef=0.1, clip_reward_value=5)
    close(r, [[-0.01, -0.02, -0.03, -0.04 + 2.0],
              [-0.1, -0.2 - 5.0, 0.0, 0.0],     # score -7 clipped to -5, at the last real token
              [0.0, 0.0, 0.0, 0.0]])            # all-zero mask: no score, no error
    r = A.kl_penalized_rewards(logp, ref, score, mask, kl_coef=0.0, clip_reward_value=None)
    close(r, [[0, 0, 0, 2.], [0, -7., 0, 0], [0, 0, 0, 0]])
    # k2 estimator
    r = A.kl_penalized_rewards(logp, ref, score, mask, kl_coef=1.0, clip_reward_value=5, kl_kind="k2")
    close(r[1], [-0.5, -2.0 - 5.0, 0.0, 0.0])


def test_kl_penalized_rewards_matches_deepspeed_chat():
    g = torch.Generator().manual_seed(4)
    B, T = 5, 9
    logp, ref = -torch.rand(B, T, generator=g, dtype=D) * 3, -torch.rand(B, T, generator=g, dtype=D) * 3
    score = torch.randn(B, generator=g, dtype=D) * 8  # some beyond +-5
    mask = suffix_mask([9, 3, 1, 6, 9], T)
    ours = A.kl_penalized_rewards(logp, ref, score, mask)
    close(ours, dsc_compute_rewards(logp.clone(), ref, score, mask))


def test_kl_loss_term():
    logp = t([[math.log(0.5), math.log(0.25), 0.0]]).requires_grad_()
    ref = t([[math.log(0.25), math.log(0.5), 5.0]])
    mask = t([[1, 1, 0]])
    loss = A.kl_loss_term(logp, ref, mask, kind="k3")
    close(loss, ((0.5 + math.log(2) - 1) + (2 - math.log(2) - 1)) / 2)
    loss.backward()
    # d/dlogp k3 = 1 - exp(ref - logp): token0 -> 1 - 0.5, token1 -> 1 - 2, masked -> 0; divided by 2 tokens
    close(logp.grad, [[0.25, -0.5, 0.0]])
    close(A.kl_loss_term(logp, ref, mask, kind="k1"), (math.log(2) - math.log(2)) / 2)


# ------------------------------------------------------------------------------------------
# GAE


def test_gae_hand_values():
    rewards = t([[0., 0., 1.], [0., 1., 9.], [3., 3., 3.]])
    values = t([[0.5, 0.5, 0.5], [0.5, 0.5, 7.], [1., 1., 1.]])
    mask = t([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    adv, ret = A.gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    # row0: d2 = 1 - .5 = .5; d1 = 0 + .5 - .5 = 0 -> A1 = .25; A0 = .125
    # row1 ends after t=1: the reward 9 / value 7 at t=2 must not leak: A1 = 1 - .5 = .5, A0 = .25
    close(adv, [[0.125, 0.25, 0.5], [0.25, 0.5, 0.0], [0.0, 0.0, 0.0]])
    close(ret, [[0.625, 0.75, 1.0], [0.75, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert not adv.requires_grad and not ret.requires_grad


def test_gae_with_gamma_hand_values():
    rewards, values = t([[1., 2.]]), t([[0.5, 1.0]])
    adv, ret = A.gae_advantages(rewards, values, torch.ones(1, 2), gamma=0.5, lam=0.5)
    # d1 = 2 - 1 = 1 -> A1 = 1; d0 = 1 + .5*1 - .5 = 1 -> A0 = 1 + .25 * 1 = 1.25
    close(adv, [[1.25, 1.0]])
    close(ret, [[1.75, 2.0]])


def python_gae(rewards, values, lengths, gamma, lam):
    """Plain per-row reverse loop over the real tokens only."""
    out = torch.zeros_like(rewards)
    for i, L in enumerate(lengths):
        last = 0.0
        for k in reversed(range(L)):
            nv = values[i, k + 1].item() if k + 1 < L else 0.0
            delta = rewards[i, k].item() + gamma * nv - values[i, k].item()
            last = delta + gamma * lam * last
            out[i, k] = last
    return out


def test_gae_matches_loop_and_deepspeed_chat():
    g = torch.Generator().manual_seed(5)
    B, T = 6, 8
    lengths = [8, 5, 1, 0, 7, 8]
    rewards, values = torch.randn(B, T, generator=g, dtype=D), torch.randn(B, T, generator=g, dtype=D)
    mask = suffix_mask(lengths, T)
    adv, ret = A.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.95)
    exp = python_gae(rewards, values, lengths, 0.9, 0.95)
    close(adv, exp, atol=1e-12)
    close(ret, (exp + values) * mask, atol=1e-12)
    # DeepSpeed-Chat: zero rewards/values past the end, then its loop over the whole row
    dadv, dret = dsc_advantages_and_returns(values * mask, rewards * mask, 0.9, 0.95)
    close(adv, dadv * mask, atol=1e-12)
    close(ret, dret * mask, atol=1e-12)
    # rows without padding: identical to DeepSpeed-Chat's raw loop with the default gamma/lam
    full = torch.ones(B, T, dtype=D)
    adv, ret = A.gae_advantages(rewards, values, full)
    dadv, dret = dsc_advantages_and_returns(values, rewards)
    close(adv, dadv, atol=1e-12)
    close(ret, dret, atol=1e-12)


def test_gae_skips_masked_gap():
    adv, _ = A.gae_advantages(t([[0., 5., 1.]]), t([[0.5, 9., 0.5]]), t([[1, 0, 1]]), gamma=1.0, lam=0.5)
    close(adv, [[0.25, 0.0, 0.5]])  # same as the row [0, 1] / [.5, .5] without the gap token


def loop_gae_with_gaps(rewards, values, mask, gamma, lam):
    """The token-by-token recurrence (masked positions carry the state), as a reference for the doubling scan."""
    r, v, m = rewards * mask, values * mask, mask
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=r.dtype)
    last = torch.zeros(r.shape[0], dtype=r.dtype)
    for k in reversed(range(r.shape[1])):
        gae = r[:, k] + gamma * next_value - v[:, k] + gamma * lam * last
        adv[:, k] = gae * m[:, k]
        next_value = torch.where(m[:, k] > 0, v[:, k], next_value)
        last = torch.where(m[:, k] > 0, gae, last)
    return adv


def test_gae_and_reinforce_pp_scans_equal_the_token_loop_on_long_rows_with_gaps():
    g = torch.Generator().manual_seed(11)
    B, T = 5, 300  # not a power of two: the doubling's last step is partial
    rewards, values = torch.randn(B, T, generator=g, dtype=D), torch.randn(B, T, generator=g, dtype=D)
    mask = (torch.rand(B, T, generator=g) > 0.2).to(D)
    mask[0] = 1
    mask[1, 200:] = 0
    mask[2] = 0
    adv, ret = A.gae_advantages(rewards, values, mask, gamma=0.99, lam=0.95)
    expected = loop_gae_with_gaps(rewards, values, mask, 0.99, 0.95)
    close(adv, expected, atol=1e-10)
    close(ret, (expected + values) * mask, atol=1e-10)
    poisoned = rewards.masked_fill(mask == 0, float("inf")), values.masked_fill(mask == 0, float("nan"))
    close(A.gae_advantages(*poisoned, mask, gamma=0.99, lam=0.95)[0], expected, atol=1e-10)  # masked: never read
    _, returns = A.reinforce_pp_advantages(rewards, mask, gamma=0.9)
    running, want = torch.zeros(B, dtype=D), torch.zeros(B, T, dtype=D)
    for k in reversed(range(T)):
        running = rewards[:, k] * mask[:, k] + 0.9 * running
        want[:, k] = running
    close(returns, want * mask, atol=1e-10)


# ------------------------------------------------------------------------------------------
# losses


def test_policy_loss_clipping_engages_hand_values():
    old = t([[-1.0, -1.0, -1.0, -1.0]])
    logp = (old + torch.log(t([[1.5, 0.5, 1.1, 30.0]]))).requires_grad_()
    adv = t([[1.0, -1.0, 2.0, 100.0]])
    mask = t([[1, 1, 1, 0]])
    loss, stats = A.policy_loss_clipped(logp, old, adv, mask, clip_range=0.2)
    # token0 ratio 1.5, A=1: max(-1.5, -1.2) = -1.2 (clipped); token1 ratio .5, A=-1: max(.5, .8) = .8
    # (clipped); token2 ratio 1.1 within range: -2.2; token3 masked
    close(loss, (-1.2 + 0.8 - 2.2) / 3)
    close(stats["pg_clipfrac"], 2 / 3)
    close(stats["ppo_kl"], -(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3)
    close(stats["approx_kl"], sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1)) / 3)
    close(stats["ratio_max"], 1.5)
    loss.backward()
    close(logp.grad, [[0.0, 0.0, -2.2 / 3, 0.0]])  # clipped tokens carry no gradient
    # without clipping the loss is different
    unclipped, st = A.policy_loss_clipped(logp, old, adv, mask, clip_range=10.0)
    close(unclipped, (-1.5 + 0.5 - 2.2) / 3)
    close(st["pg_clipfrac"], 0.0)
    # pessimism: ratio 1.5 with a negative advantage is NOT clipped (max picks the unclipped 1.5)
    l2, st2 = A.policy_loss_clipped(old + math.log(1.5), old, t([[-1., -1., -1., -1.]]), torch.ones(1, 4))
    close(l2, 1.5)
    close(st2["pg_clipfrac"], 0.0)


def test_policy_loss_clip_higher_widens_the_upper_side_only():
    """DAPO's clip-higher (TRL's epsilon_high, verl's clip_ratio_high): the ratio is clipped to
    [1 - clip_range, 1 + clip_range_high], so a token whose probability grew 25% with a positive advantage still
    takes a gradient, while the lower side stays clip_range's; None is the symmetric clip."""
    old = t([[-1.0, -1.0, -1.0]])
    logp = (old + torch.log(t([[1.25, 1.5, 0.75]]))).requires_grad_()
    adv = t([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, stats = A.policy_loss_clipped(logp, old, adv, mask, clip_range=0.2, clip_range_high=0.28)
    # 1.25 within [0.8, 1.28]: -1.25, not clipped; 1.5 clipped at 1.28; 0.75 with A<0 clipped at the low side's 0.8
    close(loss, (-1.25 - 1.28 + 0.8) / 3)
    close(stats["pg_clipfrac"], 2 / 3)
    # the two sides apart (TRL's clip_ratio/low_mean and high_mean): one token clipped above, one below
    close(stats["pg_clipfrac_high"], 1 / 3)
    close(stats["pg_clipfrac_low"], 1 / 3)
    loss.backward()
    close(logp.grad, [[-1.25 / 3, 0.0, 0.0]])
    symmetric, _ = A.policy_loss_clipped(logp, old, adv, mask, clip_range=0.2, clip_range_high=None)
    close(symmetric, (-1.2 - 1.2 + 0.8) / 3)


def test_policy_loss_matches_deepspeed_chat_and_handles_empty_rows():
    g = torch.Generator().manual_seed(6)
    B, T = 4, 6
    old = -torch.rand(B, T, generator=g, dtype=D) * 2
    logp = old + torch.randn(B, T, generator=g, dtype=D) * 0.4
    adv = torch.randn(B, T, generator=g, dtype=D)
    mask = suffix_mask([6, 2, 0, 4], T)
    loss, _ = A.policy_loss_clipped(logp, old, adv, mask)
    close(loss, dsc_actor_loss(logp, old, adv, mask))
    # whole micro-batch without response tokens: 0, finite gradient
    lp = logp.clone().requires_grad_()
    loss, stats = A.policy_loss_clipped(lp, old, adv, torch.zeros(B, T))
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in stats.values())
    # garbage log-probs on masked positions (exp would overflow) must not turn the loss into NaN
    lp = logp.clone()
    lp[1, 4:] = old[1, 4:] + 1000.0
    lp.requires_grad_()
    loss, stats = A.policy_loss_clipped(lp, old, adv, mask)
    loss.backward()
    close(loss, dsc_actor_loss(logp, old, adv, mask))
    assert torch.isfinite(lp.grad).all() and all(torch.isfinite(v) for v in stats.values())


def test_value_loss_clipping_engages_hand_values():
    values = t([[1.0, 2.0, 0.0, 50.0]]).requires_grad_()
    old = t([[0.5, 2.1, 0.0, 0.0]])
    returns = t([[2.0, 0.0, 1.0, 0.0]])
    mask = t([[1, 1, 1, 0]])
    loss, stats = A.value_loss_clipped(values, old, returns, mask, clip_range_value=0.2)
    # t0: clip(1.0, .3, .7) = .7 -> max((1-2)^2, (.7-2)^2) = 1.69; t1: 4; t2: 1
    close(loss, 0.5 * (1.69 + 4 + 1) / 3)
    close(stats["vf_clipfrac"], 1 / 3)
    loss.backward()
    # t0 clipped -> no gradient; t1: (2-0)/3; t2: (0-1)/3
    close(values.grad, [[0.0, 2.0 / 3, -1.0 / 3, 0.0]])
    unclipped, _ = A.value_loss_clipped(values, old, returns, mask, clip_range_value=None)
    close(unclipped, 0.5 * (1 + 4 + 1) / 3)
    g = torch.Generator().manual_seed(7)
    v, o, r = (torch.randn(3, 5, generator=g, dtype=D) for _ in range(3))
    m = suffix_mask([5, 1, 3], 5)
    close(A.value_loss_clipped(v, o, r, m)[0], dsc_critic_loss(v, o, r, m))


def test_global_token_mean_equals_concatenated_batch_under_accumulation():
    """Simulate DeepSpeed: backward(loss / accum_steps) per micro-batch, gradients averaged over ranks."""
    g = torch.Generator().manual_seed(8)
    W, G, mb, T = 2, 2, 3, 5
    n = W * G * mb
    old = -torch.rand(n, T, generator=g, dtype=D)
    logp0 = old + torch.randn(n, T, generator=g, dtype=D) * 0.3
    adv = torch.randn(n, T, generator=g, dtype=D)
    mask = suffix_mask([5, 1, 2, 0, 5, 3, 1, 1, 4, 5, 2, 1], T)  # very different token counts
    # reference: token mean over the whole concatenated global batch
    ref = logp0.clone().requires_grad_()
    ref_loss, _ = A.policy_loss_clipped(ref, old, adv, mask)
    ref_loss.backward()

    def run(loss_agg):
        logp = logp0.clone().requires_grad_()
        total, rank_grads = 0.0, []
        for r in range(W):
            logp.grad = None
            for k in range(G):
                rows = slice((r * G + k) * mb, (r * G + k + 1) * mb)
                loss, _ = A.policy_loss_clipped(logp[rows], old[rows], adv[rows], mask[rows], loss_agg=loss_agg,
                                                num_tokens_global=mask.sum().item(), accum_steps=G, world_size=W)
                (loss / G).backward()  # DeepSpeed scales by 1 / gradient_accumulation_steps
                total += loss.item() / G / W
            rank_grads.append(logp.grad.clone())
        return total, sum(rank_grads) / W  # data-parallel all-reduce averages

    total, grad = run("global_token_mean")
    close(total, ref_loss.item(), atol=1e-12)
    close(grad, ref.grad, atol=1e-12)
    _, grad_tm = run("token_mean")  # per-micro-batch mean weights micro-batches equally -> differs
    assert not torch.allclose(grad_tm, ref.grad)
    with pytest.raises(ValueError):
        A.agg_loss(adv, mask, "global_token_mean")
    with pytest.raises(ValueError):
        A.agg_loss(adv, mask, "seq_mean")


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_sequence_means_equal_the_concatenated_batchs_under_accumulation_of_unequal_micro_batches(mode):
    """The answer means with num_seqs_global (every rank's answers of the optimizer step): DeepSpeed's 1/accum_steps
    and average over ranks make the gradient the unsplit batch's, for micro-batches of 3 + 1 and 2 + 2 answers (a
    generation batch not a multiple of the training batch). The micro-batch's own mean weighed the lone answer's
    tokens 3 times its neighbours'."""
    g = torch.Generator().manual_seed(9)
    W, G, T = 2, 2, 5
    rows = [[slice(0, 3), slice(3, 4)], [slice(4, 6), slice(6, 8)]]  # [rank][micro-step]
    old = -torch.rand(8, T, generator=g, dtype=D)
    logp0 = old + torch.randn(8, T, generator=g, dtype=D) * 0.3
    adv = torch.randn(8, T, generator=g, dtype=D)
    ref_logp = old + torch.randn(8, T, generator=g, dtype=D) * 0.1
    mask = suffix_mask([5, 1, 2, 0, 5, 3, 1, 4], T)

    def loss_of(logp, r, **agg):
        pg, _ = A.policy_loss_clipped(logp, old[r], adv[r], mask[r], loss_agg=mode, max_length=T, **agg)
        kl = A.kl_loss_term(logp, ref_logp[r], mask[r], "k3", mode, max_length=T, **agg)
        value, _ = A.value_loss_clipped(logp, old[r], adv[r], mask[r], 0.2, loss_agg=mode, max_length=T, **agg)
        return pg + 0.5 * kl + value - A.entropy_bonus(-logp, mask[r], 0.1, mode, max_length=T, **agg)

    whole = logp0.clone().requires_grad_()
    whole_loss = loss_of(whole, slice(None))
    whole_loss.backward()

    def accumulated(**agg):
        logp = logp0.clone().requires_grad_()
        total, rank_grads = 0.0, []
        for rank in range(W):
            logp.grad = None
            for r in rows[rank]:
                loss = loss_of(logp[r], r, **agg)
                (loss / G).backward()  # DeepSpeed scales by 1 / gradient_accumulation_steps
                total += loss.item() / G / W
            rank_grads.append(logp.grad.clone())
        return total, sum(rank_grads) / W  # data-parallel all-reduce averages

    total, grad = accumulated(num_seqs_global=8, accum_steps=G, world_size=W)
    close(total, whole_loss.item(), atol=1e-12)
    close(grad, whole.grad, atol=1e-12)
    _, own_means = accumulated()  # (each micro-batch's own mean: right only where they hold as many answers)
    assert not torch.allclose(own_means, whole.grad)


def test_sequence_mean_aggregations_weigh_answers_alike_and_equal_hand_computations():
    """--loss_agg's answer-level means (TRL's loss_type "grpo" and "dr_grpo") against the token means, on answers of
    1, 4 and 0 tokens: the per-token losses 4 | 1 2 3 6 | (none)."""
    per_token = t([[4., 9., 9., 9.], [1., 2., 3., 6.], [7., 7., 7., 7.]])
    mask = suffix_mask([1, 4, 0], 4)
    close(A.agg_loss(per_token, mask, "token_mean"), 16 / 5)  # every token alike
    close(A.agg_loss(per_token, mask, "global_token_mean", num_tokens_global=5), 16 / 5)
    close(A.agg_loss(per_token, mask, "seq_mean_token_mean"), (4 / 1 + 12 / 4 + 0) / 3)  # every answer alike
    close(A.agg_loss(per_token, mask, "seq_mean_token_sum_norm", max_length=8), (4 + 12 + 0) / 3 / 8)
    assert len({round(float(A.agg_loss(per_token, mask, mode, num_tokens_global=5, max_length=8)), 9)
                for mode in A.LOSS_AGG_MODES}) == 3  # (the two token means agree on one micro-batch)
    with pytest.raises(ValueError, match="max_length"):
        A.agg_loss(per_token, mask, "seq_mean_token_sum_norm")
    # through the losses: the policy loss at ratio 1 is -A per token, the gradient each answer's mean's
    adv = t([[2., 0., 0., 0.], [1., -1., 3., 1.], [5., 5., 5., 5.]])
    logp = torch.zeros(3, 4, dtype=D, requires_grad=True)
    loss, _ = A.policy_loss_clipped(logp, torch.zeros(3, 4, dtype=D), adv, mask, loss_agg="seq_mean_token_mean")
    close(loss, -(2 / 1 + 4 / 4) / 3)
    loss.backward()
    close(logp.grad, -adv * t([[1 / 1] * 4, [1 / 4] * 4, [0.] * 4]) * mask / 3)
    loss, _ = A.policy_loss_clipped(logp, torch.zeros(3, 4, dtype=D), adv, mask, loss_agg="seq_mean_token_sum_norm",
                                    max_length=8)
    close(loss, -(2 + 4) / 3 / 8)
    values = torch.zeros(3, 4, dtype=D)
    vloss, _ = A.value_loss_clipped(values, values, adv, mask, None, loss_agg="seq_mean_token_mean")
    close(vloss, 0.5 * (4 / 1 + (1 + 1 + 9 + 1) / 4) / 3)
    close(A.kl_loss_term(t([[0.5] * 4] * 3), torch.zeros(3, 4, dtype=D), mask, "k1", "seq_mean_token_sum_norm",
                         max_length=2), (0.5 + 2.0) / 3 / 2)
    close(A.entropy_bonus(t([[1., 2., 3., 4.]] * 3), mask, 0.1, "seq_mean_token_mean"), 0.1 * (1 + 2.5) / 3)


def test_entropy_bonus():
    ent = t([[1., 2.], [3., 4.]])
    mask = t([[1, 0], [1, 1]])
    close(A.entropy_bonus(ent, mask, 0.01), 0.01 * 8 / 3)
    close(A.entropy_bonus(ent, mask, 0.01, "global_token_mean", num_tokens_global=6, accum_steps=2),
          0.01 * 8 * 2 / 6)


def test_registries():
    assert A.POLICY_LOSS_FNS["clipped"] is A.policy_loss_clipped
    assert A.VALUE_LOSS_FNS["clipped"] is A.value_loss_clipped
    assert A.ADVANTAGE_ESTIMATORS["gae"] is A.gae_advantages
    assert {"gae", "grpo", "rloo", "reinforce_pp"} <= set(A.ADVANTAGE_ESTIMATORS)
    with pytest.raises(ValueError):
        A.get_adv_estimator("nope")


# ------------------------------------------------------------------------------------------
# KL controllers


def test_kl_controllers():
    f = A.FixedKLController(0.1)
    f.update(100.0, 1000)
    assert f.value == 0.1
    a = A.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    a.update(12.0, 100)  # KL above target: error clipped to +0.2 -> coef up by 1 + .2 * 100 / 10000
    close(a.value, 0.1 * 1.002, atol=1e-15)
    a.update(torch.tensor(6.3), 100)  # error 0.05
    close(a.value, 0.1 * 1.002 * 1.0005, atol=1e-15)
    v = a.value
    a.update(3.0, 100)  # below target: error -0.5 clipped to -0.2 -> coef down
    close(a.value, v * 0.998, atol=1e-15)
    b = A.AdaptiveKLController(1.0, 1.0, 1.0)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() == {"value": a.value, "target": 6.0, "horizon": 10000.0}
    f2 = A.FixedKLController(0.5)
    f2.load_state_dict(f.state_dict())
    assert f2.value == 0.1
    assert isinstance(A.get_kl_controller("adaptive", 0.2, 6, 100), A.AdaptiveKLController)
    assert A.get_kl_controller("fixed", 0.2).value == 0.2


# ------------------------------------------------------------------------------------------
# critic-free estimators


def test_grpo_two_groups():
    scores = t([1., 2., 3., 0., 10., 5.])
    mask = suffix_mask([3, 1, 2, 0, 3, 3], 3)
    adv, ret = A.grpo_advantages(scores, 3, mask)
    # group 1: mean 2, std 1; group 2: mean 5, std 5
    per = [-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), -5 / (5 + 1e-6), 5 / (5 + 1e-6), 0.0]
    close(adv, torch.tensor(per, dtype=D)[:, None] * mask)
    close(ret, adv)
    adv, _ = A.grpo_advantages(scores, 3, mask, norm_by_std=False)
    close(adv, t([-1., 0., 1., -5., 5., 0.])[:, None] * mask)
    # a group with identical scores gets 0, not NaN
    adv, _ = A.grpo_advantages(t([4., 4.]), 2, torch.ones(2, 2))
    close(adv, torch.zeros(2, 2))
    with pytest.raises(ValueError):
        A.grpo_advantages(scores, 4, mask)


def test_grpo_batch_std_divides_by_the_std_of_every_score_and_keeps_the_old_values():
    """--grpo_norm_by_std batch (TRL's scale_rewards="batch", Lite PPO's group mean with batch std): each answer's
    score less its group's mean over the std of all the batch's scores; 1/True and 0/False stay group and none."""
    scores = t([1., 2., 3., 0., 10., 5.])
    mask = suffix_mask([3, 1, 2, 0, 3, 3], 3)
    adv, ret = A.grpo_advantages(scores, 3, mask, norm_by_std="batch")
    batch_std = statistics.stdev(scores.tolist())
    per = t([-1., 0., 1., -5., 5., 0.]) / (batch_std + 1e-6)
    close(adv, per[:, None] * mask)
    close(ret, adv)
    group, _ = A.grpo_advantages(scores, 3, mask)
    assert not torch.allclose(adv, group)  # (the group scope's: 1/1 and 5/5, not over the batch's std)
    for old, scope in ((True, "group"), (1, "group"), ("1", "group"), (False, "none"), (0, "none"), ("0", "none")):
        assert A.std_scope(old) == scope
        close(A.grpo_advantages(scores, 3, mask, norm_by_std=old)[0],
              A.grpo_advantages(scores, 3, mask, norm_by_std=scope)[0])
    with pytest.raises(ValueError, match="norm_by_std='batches'"):
        A.grpo_advantages(scores, 3, mask, norm_by_std="batches")
    # a group scored alike gets 0 under the batch's std too; a batch scored alike, 0 and not NaN
    adv, _ = A.grpo_advantages(t([4., 4., 1., 3.]), 2, torch.ones(4, 2), norm_by_std="batch")
    close(adv[:2], torch.zeros(2, 2))
    assert adv[2:].abs().min() > 0.5
    adv, _ = A.grpo_advantages(torch.full((4,), 0.7), 2, torch.ones(4, 2), norm_by_std="batch")
    assert torch.all(adv == 0)


def _grpo_batch_worker(rank, world, port, path):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        scores = GRPO_BATCH_SCORES[4 * rank:4 * rank + 4]  # each rank: its own two groups of two
        adv, _ = A.grpo_advantages(scores, 2, torch.ones(4, 1, dtype=D), norm_by_std="batch",
                                   process_group=dist.group.WORLD)
        torch.save(adv, os.path.join(path, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


GRPO_BATCH_SCORES = t([0., 1., 2., 4., 100., 110., 90., 96.])  # rank 1's spread far wider than rank 0's


def test_grpo_batch_std_is_over_every_ranks_scores(tmp_path):
    """With several ranks the batch's std is that of every rank's scores (TRL gathers the rewards of all processes
    first), so each rank's advantages are the ones the whole batch would get on one rank."""
    import torch.multiprocessing as mp
    mp.spawn(_grpo_batch_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    got = torch.cat([torch.load(tmp_path / "r0.pt"), torch.load(tmp_path / "r1.pt")])
    whole, _ = A.grpo_advantages(GRPO_BATCH_SCORES, 2, torch.ones(8, 1, dtype=D), norm_by_std="batch")
    close(got, whole)
    deviations = t([-.5, .5, -1., 1., -5., 5., -3., 3.])
    close(got[:, 0], deviations / (statistics.stdev(GRPO_BATCH_SCORES.tolist()) + 1e-6))
    # (rank 0's scores alone would have given it advantages ~30 times larger)
    assert A.grpo_advantages(GRPO_BATCH_SCORES[:4], 2, torch.ones(4, 1), norm_by_std="batch")[0].abs().max() > 0.5


def test_grpo_group_scored_alike_gets_exactly_zero_advantage_whatever_the_score():
    """A group whose answers all scored the same trains nothing (zero_std_fraction counts it so). The group's mean in
    float32 may round off the common score (0.7 eight times: by 6e-8), and the division by std + eps made that an
    advantage of up to 0.8 for every answer of the group, all of one sign (30.7: 0.63; 100.3: 0.83)."""
    for value in (0.7, 2.7, 30.7, 100.3, -0.9, 1 / 3):
        for n in (3, 6, 7, 8, 16):
            scores = torch.full((2 * n,), value, dtype=torch.float32)
            scores[n:] = torch.arange(n, dtype=torch.float32)  # a second group whose scores differ
            adv, _ = A.grpo_advantages(scores, n, torch.ones(2 * n, 2))
            assert torch.all(adv[:n] == 0), (value, n, adv[:n, 0])
            assert adv[n:, 0].abs().sum() > 1  # (trained: not zeroed)
            assert A.zero_std_fraction(scores, n) == 0.5, (value, n)
    # a reward model's large scores: the rounding (std 7e-5) exceeded the eps itself, and the group was not counted
    assert A.zero_std_fraction(torch.full((7,), 1e3 + 0.1), 7) == 1.0


def test_grpo_group_within_eps_of_alike_trains_nothing_as_zero_std_fraction_counts_it():
    """Scores of like answers that differ in their last bits ([3, 3 + 1 ulp, 3, 3]): zero_std_fraction counted the
    group as scored alike, yet GRPO's division by std + eps made the noise advantages of -0.053 and +0.160."""
    three = torch.tensor(3.0)
    ulp = torch.nextafter(three, torch.tensor(4.0)) - three
    scores = torch.stack([three, three + ulp, three, three, three, three + 1, three - 1, three + 2])
    adv, _ = A.grpo_advantages(scores, 4, torch.ones(8, 2))
    assert A.zero_std_fraction(scores, 4) == 0.5
    assert torch.all(adv[:4] == 0), adv[:4, 0]
    assert adv[4:, 0].abs().min() > 0.1  # (a group that differs is still normalised)
    unnormalised, _ = A.grpo_advantages(scores, 4, torch.ones(8, 2), norm_by_std=False)
    assert unnormalised[:4].abs().max() < 1e-6  # (Dr. GRPO's: the noise itself, no division to scale it)
    # the noise grows with the scores: at 1000 one ulp (6e-5) gave advantages of -0.48/+1.45
    large = scores + 997
    large[1] = torch.nextafter(large[0], torch.tensor(2000.0))
    adv, _ = A.grpo_advantages(large, 4, torch.ones(8, 2))
    assert A.zero_std_fraction(large, 4) == 0.5
    assert torch.all(adv[:4] == 0), adv[:4, 0]


def test_rloo_two_groups():
    scores = t([1., 2., 3., 0., 10., 5.])
    mask = suffix_mask([3, 1, 2, 0, 3, 3], 3)
    adv, ret = A.rloo_advantages(scores, 3, mask)
    # A_i = s_i - mean of the other two
    close(adv, t([1 - 2.5, 2 - 2.0, 3 - 1.5, 0 - 7.5, 10 - 2.5, 5 - 5.0])[:, None] * mask)
    close(ret, adv)
    with pytest.raises(ValueError):
        A.rloo_advantages(scores, 1, mask)


def test_rloo_group_scored_alike_gets_exactly_zero_advantage_whatever_the_score():
    """As GRPO's: a group scored alike trains nothing. The leave-one-out sums in float32 rounded off the common
    score, so each answer kept an advantage of up to 8e-6 (these cases), all of one sign."""
    found_rounding = False
    for value in (0.7, 2.7, 30.7, 100.3, -0.9, 1 / 3):
        for n in (3, 6, 7, 8, 16):
            scores = torch.full((2 * n,), value, dtype=torch.float32)
            scores[n:] = torch.arange(n, dtype=torch.float32)
            g = scores[:n].view(1, n)
            found_rounding |= bool((g - (g.sum(1, keepdim=True) - g) / (n - 1)).abs().max() > 0)
            adv, _ = A.rloo_advantages(scores, n, torch.ones(2 * n, 2))
            assert torch.all(adv[:n] == 0), (value, n, adv[:n, 0])
            assert adv[n:, 0].abs().sum() > 1
    assert found_rounding  # (the cases do round off without the shift)


def test_reinforce_pp():
    rewards = t([[0., 0., 1.], [0., 2., 9.]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = A.reinforce_pp_advantages(rewards, mask, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])  # the 9 past the end is ignored
    vals = [0.25, 0.5, 1.0, 1.0, 2.0]
    mu, sd = statistics.mean(vals), statistics.stdev(vals)
    exp = (t([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]) - mu) / math.sqrt(sd ** 2 + 1e-8) * mask
    close(adv, exp, atol=1e-9)


def test_reinforce_pp_batch_scored_alike_gets_exactly_zero_advantage_whatever_the_score():
    """Every answer scored alike (and no KL): every return-to-go is that score, and the whitened advantages must be
    exactly 0. The batch's mean in floating point rounded off the common score and the division by sqrt(var + eps)
    scaled that up: 6e-4 at 0.7, 5e-3 at 4.7966, 0.95 at 1e4 + 0.1 (float32), 4e-8 in float64, all of one sign."""
    found_rounding = False
    for value in (0.1, 4.7966, 0.7, 1 / 3, -3.3, 1e4 + 0.1):
        for dtype in (torch.float32, D):
            for shape in ((3, 5), (7, 3), (5, 37), (16, 256)):
                rewards = torch.zeros(shape, dtype=dtype)
                rewards[:, -1] = value
                mask = torch.ones(shape)
                mask[0, 2:] = 0  # (a shorter answer: its score on its own last token)
                rewards[0, 1] = value
                adv, ret = A.reinforce_pp_advantages(rewards, mask)
                assert torch.all(ret[mask.bool()] == torch.tensor(value, dtype=dtype))
                assert torch.all(adv == 0), (value, dtype, shape, adv.abs().max())
                x = ret[mask.bool()].to(A._compute_dtype(ret))
                found_rounding |= bool(x.mean() != x[0])
    assert found_rounding  # (the cases do round off in a plain mean)
    # the statistics themselves: exactly the common value and 0, and so whitening without the shift gives it back
    x = torch.full((5, 37), 4.7966)
    mean, var = A.masked_mean_var(x, torch.ones(5, 37))
    assert mean == x[0, 0] and var == 0
    assert torch.equal(A.masked_whiten(x, torch.ones(5, 37), shift_mean=False), x)
    # a batch that differs is whitened as before (mean 0, std ~1)
    adv, _ = A.reinforce_pp_advantages(t([[0., 1e4 + 0.1], [0., 1e4 + 0.2]]), torch.ones(2, 2))
    close(adv, t([[-1., -1.], [1., 1.]]) * math.sqrt(3) / 2, atol=1e-5)


def test_whitening_values_alike_but_for_rounding_gives_zero_not_scaled_up_noise():
    """Values that differ only in their last bits (a reward model's float32 scores of like answers) are alike: they
    whiten to 0, to their mean without the shift. TRL's (x - mean) / sqrt(var + 1e-8) scales a std of 1e-5 (float32's
    rounding near 100) by 1e4, to advantages of +-0.4; a real spread is whitened as before."""
    g = torch.Generator().manual_seed(11)
    mask = suffix_mask([64, 10, 64, 1], 64).float()
    for value in (0.7, 4.7966, 100.0, -3e3):
        x = torch.full((4, 64), value) * (1 + 2e-7 * torch.randn(4, 64, generator=g))  # (a few float32 ulps)
        mean, var = A.masked_mean_var(x, mask)
        assert var > 0
        assert torch.all(A.masked_whiten(x, mask) == 0), value
        assert torch.all(A.masked_whiten(x, mask, shift_mean=False) == mean.float() * mask)
        if abs(value) >= 100:  # (TRL's formula: rounding made advantages)
            assert ((x - mean) * torch.rsqrt(var + 1e-8) * mask).abs().max() > 0.1
    x = torch.full((4, 64), 100.0, dtype=D) * (1 + 4e-16 * torch.randn(4, 64, generator=g, dtype=D))  # (float64's)
    assert torch.all(A.masked_whiten(x, mask) == 0)
    rewards = torch.zeros(6, 8)
    rewards[:, -1] = 100.0 * (1 + 2e-7 * torch.randn(6, generator=g))  # REINFORCE++: a batch scored alike
    assert torch.all(A.reinforce_pp_advantages(rewards, torch.ones(6, 8))[0] == 0)
    # real spreads, small and large, are whitened exactly as before (float64: a spread of 1e-6 of the values is real)
    for x in (torch.randn(4, 64, generator=g, dtype=D), 100 + 1e-4 * torch.randn(4, 64, generator=g, dtype=D),
              100 + 1e-3 * torch.randn(4, 64, generator=g), t([[1e-5, -1e-5, 2e-5, 0.0]])):
        m = torch.ones_like(x)
        mean, var = A.masked_mean_var(x, m)
        assert torch.equal(A.masked_whiten(x, m), (x - mean) * torch.rsqrt(var + 1e-8))


def test_compute_advantages_dispatch():
    g = torch.Generator().manual_seed(9)
    r, v = torch.randn(4, 5, generator=g, dtype=D), torch.randn(4, 5, generator=g, dtype=D)
    s = torch.randn(4, generator=g, dtype=D)
    m = suffix_mask([5, 3, 0, 2], 5)
    kw = dict(mask=m, token_rewards=r, values=v, scores=s, group_size=2, gamma=0.9, lam=0.8)
    for name, expected in [("gae", A.gae_advantages(r, v, m, 0.9, 0.8)),
                           ("grpo", A.grpo_advantages(s, 2, m)),
                           ("rloo", A.rloo_advantages(s, 2, m)),
                           ("reinforce_pp", A.reinforce_pp_advantages(r, m, 0.9))]:
        got = A.compute_advantages(name, **kw)
        close(got[0], expected[0])
        close(got[1], expected[1])
    with pytest.raises(ValueError, match="values"):
        A.compute_advantages("gae", mask=m, token_rewards=r)


# ------------------------------------------------------------------------------------------
# check_finite


def test_check_finite():
    ok = t([[1., 2.], [3., 4.]])
    assert A.check_finite("fine", ok) is ok
    bad = t([[1., 2.], [float("nan"), 4.], [5., float("inf")], [float("-inf"), float("nan")]])
    with pytest.raises(FloatingPointError, match=r"actor_loss is not finite") as ei:
        A.check_finite("actor_loss", bad)
    msg = str(ei.value)
    assert "2 NaN" in msg and "2 inf" in msg and "[1, 2, 3]" in msg
    with pytest.raises(FloatingPointError, match="critic_loss is not finite"):
        A.check_finite("critic_loss", torch.tensor(float("nan")))
    A.check_finite("ids", torch.tensor([1, 2]))  # integer tensors are always finite


def test_an_extreme_log_prob_at_a_masked_position_leaves_losses_and_gradients_finite():
    """A padding position's log-prob overflowed k3's exp (inf * mask 0 = NaN): the KL loss term, the clipped policy
    loss and their gradients were NaN, and one NaN step ruins the actor."""
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    ref = torch.tensor([[-1.0, -2.0, -1.0]])
    for extreme in (-95.0, -math.inf):
        logp = torch.tensor([[-1.1, -2.2, extreme]], requires_grad=True)
        kl = A.kl_loss_term(logp, ref, mask, "k3")
        pg, stats = A.policy_loss_clipped(logp, torch.tensor([[-1.0, -2.0, -1.0]]), torch.ones(1, 3) * mask, mask)
        (kl + pg).backward()
        assert torch.isfinite(kl) and torch.isfinite(pg) and torch.isfinite(logp.grad).all(), (extreme, logp.grad)
        assert logp.grad[0, 2] == 0 and all(torch.isfinite(value) for value in stats.values())
        assert torch.allclose(kl, A.kl_loss_term(logp[:, :2], ref[:, :2], mask[:, :2], "k3")), "the same as unpadded"
    for extreme in (math.inf, math.nan):
        values = torch.tensor([[0.5, 0.2, extreme]], requires_grad=True)
        vf, _ = A.value_loss_clipped(values, torch.tensor([[0.4, 0.1, extreme]]), torch.tensor([[1.0, 0.0, extreme]]),
                                     mask, clip_range_value=0.2)
        vf.backward()
        assert torch.isfinite(vf) and torch.isfinite(values.grad).all() and values.grad[0, 2] == 0, values.grad
        assert torch.allclose(vf, A.value_loss_clipped(values[:, :2], torch.tensor([[0.4, 0.1]]),
                                                       torch.tensor([[1.0, 0.0]]), mask[:, :2], 0.2)[0])
    rewards = A.kl_penalized_rewards(torch.tensor([[-1.0, -math.inf]]), torch.tensor([[-1.0, 5.0]]),
                                     torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), kl_kind="k3")
    assert torch.isfinite(rewards).all() and rewards[0, 1] == 0


@pytest.mark.parametrize("advantage", [-1.0, 0.0, 1.0])
def test_policy_loss_stays_finite_for_a_token_far_off_the_rollout_policy(advantage):
    # a kept token whose log-ratio is past fp32's exp range (88): the ratio was inf, so with A < 0 the loss was inf;
    # verl clamps the log-ratio to +-20 and so does dschat now (A >= 0: guards that the clamp keeps them finite)
    old = t([[-5.0, -1.0, -2.0]])
    lp = (old + t([[100.0, 0.1, -0.1]])).requires_grad_()
    adv = torch.full((1, 3), advantage)
    loss, stats = A.policy_loss_clipped(lp, old, adv, torch.ones(1, 3))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in stats.values())
    assert lp.grad[0, 0] == 0, "no gradient through the clamped token"
    if advantage:
        assert lp.grad[0, 1:].abs().sum() > 0, "the other tokens still train"
