"""Next-token selection that stays on the device.

No ``torch.multinomial`` and no ``.item()``: sampling is an argmax over ``probs / Exponential(1)`` noise (the
exponential race, equivalent to Gumbel-max), so a decode step has no host synchronisation and is captured in a CUDA
graph by ``graphs.py``. The noise comes from an explicit ``torch.Generator`` so a fixed seed reproduces the same tokens
(a graph draws from a generator registered with it, seeded from the caller's).
"""
import torch


def filter_top_k(logits, top_k):
    """Set every logit below the k-th largest to -inf (``top_k <= 0`` keeps all)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def filter_top_p(logits, top_p):
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p`` (nucleus; at least one)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the tokens ranked above it already reach top_p; the top token is never dropped.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, sorted_idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filtered_logits(logits, temperature=1.0, top_k=0, top_p=1.0):
    """Temperature, then top-k, then top-p (HF's warper order), in fp32 whatever the model dtype."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return filter_top_p(filter_top_k(logits, top_k), top_p)


def sample_from_logits(logits, generator=None):
    """One draw per row from ``softmax(logits)`` by the exponential race: ``argmax(probs / E)``, E ~ Exp(1)."""
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    # exponential_ may return exactly 0 in low precision; a 0 divisor would turn a filtered (p=0) token into nan.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def sample_next_token(logits, temperature=1.0, top_k=0, top_p=1.0, do_sample=False, generator=None):
    """``logits`` (B, V) -> token ids (B,), on the logits' device. Greedy is a plain argmax."""
    if not do_sample:
        return logits.argmax(dim=-1)
    return sample_from_logits(filtered_logits(logits, temperature, top_k, top_p), generator)


def token_log_probs(logits, tokens):
    """``log softmax(logits)[token]`` per row, in fp32, of the unfiltered distribution (no temperature, top-k/p or
    EOS suppression): what the training forward scores the token with, e.g. PPO's old log-probs."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
