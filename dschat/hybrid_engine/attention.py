"""Which attention kernel the decode step uses (``HybridEngine(decode_attention=...)``).

transformers lets a model's attention modules call any function registered in its ``AttentionInterface`` under the
name in ``config._attn_implementation``. dschat registers ``"dschat_decode"``: for a one-token query over the static
KV cache it runs the Triton flash-decoding kernel of ``triton_decode.py`` (reads only the cache blocks the mask
leaves visible); for everything else (prefill, training forwards, features the kernel does not have) it calls
transformers' SDPA function unchanged. Its mask is SDPA's. With it, the KV cache writes each new token with one Triton
kernel too (``cache.TokenWriteLayer``). The engine switches a model that uses SDPA through the interface to it for the
duration of a generation only (:func:`decode_attention`), so training forwards never see it, and every such family
(Llama, Qwen2, Mistral, OPT, GPT-2, ...) gets it without model-specific code. If a kernel fails, that is said once and
torch's ops serve from then on.
"""
import contextlib
import functools
import logging
import os

import torch

from dschat.models.attention import sdpa_replaced

logger = logging.getLogger(__name__)

NAME = "dschat_decode"
MODES = ("auto", "triton", "sdpa")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def triton_available():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreted():
    """Triton's interpreter (TRITON_INTERPRET=1) runs the kernel on CPU tensors: how the tests exercise it."""
    return os.environ.get("TRITON_INTERPRET") == "1"


_kernel_failure = []  # the first error of a dschat Triton kernel in this process; once set, torch's ops serve instead


def triton_runs_on(tensor):
    """Whether dschat's Triton kernels may run on this tensor: on a CUDA device (or Triton's interpreter), as long as
    none of them has failed in this process."""
    return not _kernel_failure and (tensor.device.type == "cuda" or _interpreted())


def report_kernel_failure(error):
    """A dschat Triton kernel failed (e.g. Triton cannot compile it for this GPU): said once; from then on the
    decode step uses torch's ops (slower, not wrong)."""
    _kernel_failure.append(error)
    logger.warning("hybrid engine: a Triton decode kernel failed (%s: %s); using torch's ops (SDPA) from now on.",
                   type(error).__name__, error)


FAILED = object()  # what call_kernel returns for a kernel that could not run


def call_kernel(kernel, *args):
    """``kernel(*args)``, or ``FAILED`` if a dschat Triton kernel cannot run here (compile, launch): reported once, and
    torch's ops serve from then on. Out-of-memory is raised: transient, and torch's ops would need the memory too."""
    try:
        return kernel(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure of the kernel means: use torch's ops
        report_kernel_failure(error)
        return FAILED


def kernel_applies(query, key, value, attention_mask, dropout=0.0, **kwargs):
    """Whether the Triton kernel computes exactly what SDPA would for this call; anything else goes to SDPA."""
    if query.dim() != 4 or query.shape[2] != 1 or dropout:
        return False
    if any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "position_bias")):
        return False
    if not triton_runs_on(query):
        return False
    if query.dtype not in _KERNEL_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if _interpreted() and query.dtype == torch.bfloat16:
        return False  # Triton's interpreter gets bf16 dot products wrong
    head_dim = query.shape[-1]
    if key.shape[-1] != head_dim or value.shape[-1] != head_dim or head_dim > 256:
        return False
    if key.shape[0] != query.shape[0] or query.shape[1] % key.shape[1]:
        return False
    if attention_mask is None:
        return True
    # SDPA's mask for a one-token query: boolean (B or 1, 1, 1, L), shared by the heads.
    return (attention_mask.dtype == torch.bool and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
            and attention_mask.shape[2] == 1 and attention_mask.shape[3] == key.shape[2]
            and attention_mask.shape[0] in (1, query.shape[0]))


def decode_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """An ``AttentionInterface`` function: the decode kernel where it applies, transformers' SDPA otherwise.

    If the kernel fails (e.g. Triton cannot compile it for this GPU), that is said once and SDPA takes over for the
    rest of the process: the generation is slower, not wrong."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kernel_applies(query, key, value, attention_mask, dropout, **kwargs):
        from dschat.hybrid_engine import triton_decode

        out = call_kernel(triton_decode.decode_attention, query, key, value, attention_mask,
                          query.shape[-1] ** -0.5 if scaling is None else scaling)
        if out is not FAILED:
            return out, None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


@functools.lru_cache(maxsize=None)
def register():
    """Make ``"dschat_decode"`` a valid ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, decode_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


def resolve_mode(mode, device):
    """"auto" -> "triton" on CUDA when triton is importable, else "sdpa"; an explicit "triton" without triton is an
    error (asked for, cannot be had)."""
    if mode not in MODES:
        raise ValueError(f"decode_attention must be one of {MODES}, got {mode!r}")
    if mode == "sdpa":
        return mode
    if not triton_available():
        if mode == "triton":
            raise ValueError("decode_attention='triton' needs the triton package (pip install triton)")
        return "sdpa"
    if mode == "auto" and torch.device(device).type != "cuda":
        return "sdpa"
    return "triton"


def decode_attention(hf_model, mode):
    """For the duration of a generation, route the decoder's attention through :func:`decode_attention_forward`
    (``mode`` "triton"), if it uses SDPA through transformers' attention interface (``models/attention.py``)."""
    return sdpa_replaced(hf_model, register()) if mode == "triton" else contextlib.nullcontext()
