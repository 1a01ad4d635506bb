"""Attention functions dschat plugs into a model for a span of calls, through transformers' ``AttentionInterface``.

transformers lets a model's attention modules call any function registered in its ``AttentionInterface`` under the
name in ``config._attn_implementation``. :func:`sdpa_replaced` switches a model that uses SDPA through that interface
to such a function and back; models configured with another implementation (eager, flash-attention, ...) or with their
own dispatch on the string "sdpa" keep theirs. Two users: the hybrid engine's decode kernel
(``hybrid_engine/attention.py``) and :func:`no_empty_query_rows` below, for training over left-padded rows.
"""
import contextlib
import functools
import inspect
import sys

import torch

from dschat.models.lora import unwrap_peft

NO_EMPTY_ROWS = "dschat_sdpa_rows"


def routes_through_interface(hf_model):
    """Whether the model's attention modules call the ``AttentionInterface`` function named in its config. Models that
    test for the string "sdpa" themselves (Falcon before transformers 5.25) would take another branch under any other
    name, with SDPA's boolean mask, so they are never switched; nor are those whose modeling code otherwise branches on
    the name
    (Gemma-4's KV-shared layers slice the queries to ``logits_to_keep`` unless the name is "sdpa" and a mask is None:
    under another name the causal alignment is lost)."""
    compatible = getattr(type(hf_model), "is_backend_compatible", None)
    return callable(compatible) and bool(compatible()) and not _branches_on_sdpa(type(hf_model))


@functools.lru_cache(maxsize=None)
def _branches_on_sdpa(model_class):
    """Whether transformers' modeling file of ``model_class`` compares its attention implementation with "sdpa"."""
    if not model_class.__module__.startswith("transformers.models."):
        return False
    try:
        source = inspect.getsource(sys.modules[model_class.__module__])
    except (OSError, TypeError, KeyError):
        return False
    return any(test in source for test in ('_attn_implementation == "sdpa"', '_attn_implementation != "sdpa"'))


def _text_config(hf_model):
    config = hf_model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _uses_sdpa(hf_model):
    return getattr(_text_config(hf_model), "_attn_implementation_internal", None) == "sdpa"


@contextlib.contextmanager
def sdpa_replaced(hf_model, name):
    """For the duration of the block, route the decoder's SDPA attention through the function registered as ``name``;
    yields whether it did.

    Only the decoder's (text) config is switched, by its stored value, so the sub-configs of a multimodal model (e.g.
    an eager vision tower) are neither switched nor overwritten when it is restored."""
    text_config = _text_config(hf_model)
    current = getattr(text_config, "_attn_implementation_internal", None)
    if current != "sdpa" or not routes_through_interface(hf_model):
        yield False
        return
    text_config._attn_implementation_internal = name
    try:
        yield True
    finally:
        text_config._attn_implementation_internal = current


def sdpa_no_empty_rows(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA, except that a query row the mask leaves with no key (a left pad's) attends to its own key
    and its output is then zeroed: the same output as SDPA's for such a row (zeros), and no gradient flows through it.

    Why: on an H200 (torch 2.11), cuDNN's SDPA backward returns NaN query/key gradients when a row is fully masked, even
    when that row's output gets no gradient; the efficient and math backends do not (bench/graph_equality.py
    ``zero3_grad_diagnosis``, docs/benchmarks.md). One NaN spreads to every weight below that layer, and the step is
    skipped."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None or attention_mask.dtype != torch.bool:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    q_len, kv_len = attention_mask.shape[-2:]
    seen = attention_mask.any(-1, keepdim=True)  # (B, 1 or H, q, 1)
    rows = torch.arange(q_len, device=attention_mask.device)[:, None] + (kv_len - q_len)
    own = rows == torch.arange(kv_len, device=attention_mask.device)  # query i's own key, past any cached keys
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask | (own & ~seen), **kwargs)
    return torch.where(seen.transpose(1, 2), out, 0.0), weights  # out: (B, q, H, D); exact zeros, zero gradient


@functools.lru_cache(maxsize=None)
def register_no_empty_rows():
    """Make ``"dschat_sdpa_rows"`` a valid ``attn_implementation`` (idempotent); its masks are SDPA's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NO_EMPTY_ROWS, sdpa_no_empty_rows)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NO_EMPTY_ROWS, sdpa_mask)
    return NO_EMPTY_ROWS


def _attention_owner(model):
    """The HF model whose config names the attention: under a reward/critic head (``RewardModel``), under PEFT."""
    return unwrap_peft(getattr(model, "rwtransformer", model))


@contextlib.contextmanager
def no_empty_query_rows(*models):
    """Forwards and backwards (gradient checkpointing recomputes the forward inside the backward, so keep both in the
    block) of models trained over left-padded rows with a padding mask run :func:`sdpa_no_empty_rows`. ``models``: HF
    models, PEFT models or ``RewardModel`` heads (a DeepSpeed engine's ``module``). If one of them cannot be switched
    (its own SDPA dispatch, or code that branches on the name "sdpa"), SDPA runs without its cuDNN backend in the block
    instead: slower masked kernels, finite gradients."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    name = register_no_empty_rows()
    owners = [_attention_owner(model) for model in models]
    with contextlib.ExitStack() as stack:
        left_as_is = [owner for owner in owners if not stack.enter_context(sdpa_replaced(owner, name))]
        if any(_uses_sdpa(owner) for owner in left_as_is):
            stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                             SDPBackend.MATH]))
        yield
