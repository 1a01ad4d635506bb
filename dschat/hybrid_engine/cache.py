"""A preallocated KV cache kept across generations.

transformers' ``StaticCache`` is model-agnostic: the HF model's own attention modules write their keys/values into it
when given ``past_key_values``/``cache`` (and ``cache_position`` on transformers versions that take it). It is sized
(batch, prompt + new tokens, at most ``max_out_tokens``) once and reset, not reallocated, while later batches fit, so
PPO iterations with a fixed prompt length never allocate in the decode path.

For CUDA graphs (``graphs.py``) the same storage also serves smaller batches: ``acquire_rows`` hands out a cache whose
key/value tensors are the first rows of the allocated ones (rows are the outermost dimension, so such a view is
contiguous). One storage then backs every batch-size bucket, and each bucket's cache object, which a captured graph
holds on to, stays the same object while the storage lives.
"""
import gc

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from dschat.errors import UsageError
from dschat.hybrid_engine.attention import FAILED, call_kernel, triton_runs_on
from dschat.models.positions import bias_counts_key_slots


def _accelerator_empty_cache():
    from deepspeed.accelerator import get_accelerator

    get_accelerator().empty_cache()


def is_out_of_memory(error):
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


# Config fields of attentions that name their KV heads otherwise than num_key_value_heads, e.g. Falcon's multi-query
# flag (one KV head whatever num_kv_heads says). Such caches, and compressed latent ones (DeepSeek's MLA, below),
# are left to the cache's own lazy allocation at the first forward.
NONSTANDARD_KV_FIELDS = ("multi_query", "num_kv_heads", "n_kv_heads", "multi_query_group_num")


# Fields that shape the KV cache: the static cache has one value of each for all the decoder's layers.
_LAYOUT_FIELDS = ("head_dim", "num_key_value_heads", "num_attention_heads", "hidden_size")


def _per_layer_layout_error(cfg, field, values=None):
    what = "one head dim" if field == "head_dim" else f"one {field}"
    per_layer = f" ({values})" if values else ""
    return UsageError(f"{type(cfg).__name__} sets {field} per layer{per_layer}; the hybrid engine's static KV cache "
                      f"needs {what} per model. Run step 3 without the hybrid engine for this model "
                      "(--no-enable_hybrid_engine: actor generation then uses HF generate).")


def layout_field(cfg, field):
    """``cfg.<field>`` (None when it is not there). transformers' heterogeneous configs (Gemma-4: a larger head_dim
    on its full-attention layers) refuse the global value of a per-layer field: then the layers' common value, or a
    ``UsageError`` when they differ, since one static cache cannot hold them."""
    per_layer_fields = getattr(cfg, "per_layer_attributes", None) or ()
    if field in per_layer_fields:
        values = [getattr(layer, field, None) for layer in cfg.per_layer_config]
        if len(set(values)) > 1:
            raise _per_layer_layout_error(cfg, field, values)
        return values[0] if values else None
    try:
        return getattr(cfg, field, None)
    except RuntimeError as error:  # AmbiguousGlobalPerLayerAttributeError (per_layer_attributes not exposed)
        if type(error).__name__ == "AmbiguousGlobalPerLayerAttributeError":
            raise _per_layer_layout_error(cfg, field) from error
        raise


def check_one_kv_layout(model_config):
    """A ``UsageError`` when the decoder's layers differ in a field that shapes the KV cache (see ``layout_field``);
    the engine checks this when it is built."""
    cfg = model_config.get_text_config(decoder=True)
    for field in _LAYOUT_FIELDS:
        layout_field(cfg, field)


def check_static_cache_layers(model_config):
    """A ``UsageError`` when transformers' ``StaticCache`` has no static layer for a layer type of the decoder
    (DeepSeek-V4's compressed attentions: the cache's KeyError at the first generation); the engine checks this when
    it is built. HF's generate keeps such a model's own dynamic cache."""
    try:
        from transformers.cache_utils import STATIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs
    except ImportError:  # (a transformers without them builds its StaticCache otherwise)
        return
    layer_types, _ = get_layer_types_and_kwargs(model_config.get_text_config(decoder=True))
    unknown = sorted(set(layer_types) - set(STATIC_LAYER_TYPE_MAPPING))
    if unknown:
        raise UsageError(f"{type(model_config).__name__} has layers of type {', '.join(unknown)}, for which "
                         "transformers' StaticCache has no layer; the hybrid engine decodes over a StaticCache. Run "
                         "step 3 without the hybrid engine for this model (--no-enable_hybrid_engine: actor "
                         "generation then uses HF generate).")


def kv_layout(model_config):
    """(num_kv_heads, head_dim) of the decoder, from the standard HF config fields; None when they are not there or
    the config says the attention caches another layout. A ``UsageError`` when they vary per layer."""
    cfg = model_config.get_text_config(decoder=True)
    compressed = getattr(cfg, "kv_lora_rank", None)  # MLA caches a latent vector, whatever num_key_value_heads says
    if compressed or (layout_field(cfg, "num_key_value_heads") is None and
                      any(getattr(cfg, f, None) for f in NONSTANDARD_KV_FIELDS)):
        return None
    try:
        num_heads = layout_field(cfg, "num_attention_heads")
        if num_heads is None:
            return None
        num_kv_heads = layout_field(cfg, "num_key_value_heads") or num_heads
        head_dim = layout_field(cfg, "head_dim") or layout_field(cfg, "hidden_size") // num_heads
    except (AttributeError, TypeError):
        return None
    return num_kv_heads, head_dim


def recurrent_layers(cache):
    """Which layers of ``cache`` hold a recurrent state rather than keys alone (bools): Mamba's, and the
    short-convolution and linear-attention layers of hybrid models (LFM2, Jamba, Qwen3-Next, Granite-4, ...)."""
    return [hasattr(layer, "has_previous_state") for layer in getattr(cache, "layers", ())]


def longest_cache(model_config):
    """The most slots a static cache may have for this model to attend as it does without one, or None (no bound).
    GPT-Neo's local layers cut their window out of a causal table at the cache's length, not at each token's position
    (transformers: "needs a hybrid cache"): in a cache longer than ``window_size`` a token loses keys of its window.
    MPT's ALiBi bias is ``max_seq_len`` keys long, and every slot of the cache is a key (``bias_counts_key_slots``)."""
    cfg = model_config.get_text_config(decoder=True)
    if "local" in (getattr(cfg, "attention_layers", None) or ()):
        return cfg.window_size
    if bias_counts_key_slots(cfg):
        return cfg.max_seq_len
    return None


def estimated_bytes(model_config, batch_size, max_len, dtype, num_kv_heads=None):
    layout = kv_layout(model_config)
    if layout is None:
        return None
    num_kv_heads, head_dim = num_kv_heads or layout[0], layout[1]
    num_layers = model_config.get_text_config(decoder=True).num_hidden_layers
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * batch_size * num_kv_heads * max_len * head_dim * element_size


class TokenWriteLayer(StaticLayer):
    """A ``StaticLayer`` that writes a decode step's one new token with dschat's Triton kernel (the slot read from the
    layer's device counter) and one counter add: transformers' update builds an index tensor (arange + add), bumps the
    counter and runs two ``index_copy_``, slow for one slot. Everything else (prefill, no device counter, no Triton, a
    compiled step) is ``StaticLayer.update`` unchanged."""

    def update(self, key_states, value_states, *args, **kwargs):
        counter = getattr(self, "cumulative_length", None)
        # Under torch.compile (compile_decode_step) inductor already fuses transformers' update into one kernel.
        if key_states.shape[-2] == 1 and self.is_initialized and torch.is_tensor(counter) and \
                counter.device == key_states.device and triton_runs_on(key_states) and \
                not torch.compiler.is_compiling():
            from dschat.hybrid_engine import triton_decode

            if call_kernel(triton_decode.write_token_kv, self.keys, self.values, key_states, value_states,
                           counter) is not FAILED:
                counter.add_(1)
                return self.keys, self.values
        return super().update(key_states, value_states, *args, **kwargs)


def keeps_length_on_device(cache):
    """Whether every layer of ``cache`` counts its tokens in a device tensor (plain ``StaticLayer``), as a CUDA graph
    needs: sliding-window layers also count in a Python int, which a captured graph would freeze at capture time."""
    return all(type(layer) in (StaticLayer, TokenWriteLayer) for layer in cache.layers)


class KVCache:
    """Owns at most one ``StaticCache``; ``acquire`` hands out a reset cache that fits, ``release`` frees it."""

    def __init__(self, model_config, num_kv_heads=None, token_writes=False):
        check_one_kv_layout(model_config)  # at the engine's construction, not at the first allocation
        check_static_cache_layers(model_config)
        self.model_config = model_config
        self.num_kv_heads = num_kv_heads  # per rank under inference tensor parallelism (None: the config's)
        self.token_writes = token_writes  # plain static layers write decode tokens with Triton (TokenWriteLayer)
        self._cache = None
        self._shape = None  # (batch_size, max_len, dtype, device) of the allocated cache
        self._row_views = {}  # batch size -> StaticCache viewing the first rows of the storage (acquire_rows)
        self.allocations = 0  # how many times storage was allocated (tests and stats read it)

    @property
    def is_allocated(self):
        return self._cache is not None

    @property
    def nbytes(self):
        return sum(t.nbytes for t in self.storages())

    def storages(self):
        """The allocated key/value tensors (for memory accounting and tests); a recurrent layer's (Mamba's) holds no
        keys."""
        if self._cache is None:
            return []
        return [t for layer in self._cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                if t is not None]

    def _fits(self, batch_size, max_len, dtype, device):
        if self._shape is None:
            return False
        have_batch, have_len, have_dtype, have_device = self._shape
        # The batch must match exactly: the attention modules write whole-batch keys into the static tensors.
        return have_batch == batch_size and have_len >= max_len and have_dtype == dtype and have_device == device

    def acquire(self, batch_size, max_len, dtype, device):
        """A zeroed cache for ``batch_size`` rows of up to ``max_len`` tokens, reusing the current one if it fits."""
        device = torch.device(device)
        if self._fits(batch_size, max_len, dtype, device):
            self._cache.reset()
            return self._cache
        self.release()
        try:
            self._cache = self._allocate(batch_size, max_len, dtype, device)
        except Exception as first_error:  # noqa: BLE001 - only out-of-memory is retried, the rest re-raised
            if not is_out_of_memory(first_error):
                raise
            # Fragmentation or garbage still holding memory (e.g. activations of the last training step): retry once.
            gc.collect()
            _accelerator_empty_cache()
            try:
                self._cache = self._allocate(batch_size, max_len, dtype, device)
            except Exception as error:  # noqa: BLE001
                if not is_out_of_memory(error):
                    raise
                need = estimated_bytes(self.model_config, batch_size, max_len, dtype, self.num_kv_heads)
                need_text = f"{need / 2**20:.1f} MiB" if need is not None else "an unknown amount"
                raise RuntimeError(
                    f"hybrid engine: could not allocate the KV cache ({need_text} for batch {batch_size} x "
                    f"{max_len} tokens, {dtype}) on {device}, even after freeing cached memory. Use a smaller "
                    f"generation batch or a smaller hybrid_engine.max_out_tokens, or set "
                    f"hybrid_engine.release_inference_cache=true.") from error
        self._shape = (batch_size, max_len, dtype, device)
        self.allocations += 1
        return self._cache

    @property
    def max_len(self):
        """Tokens the allocated storage holds per row (None when nothing is allocated)."""
        return None if self._shape is None else self._shape[1]

    def acquire_rows(self, batch_size, max_len, dtype, device):
        """A zeroed cache of exactly ``batch_size`` rows and the storage's length (>= ``max_len``), viewing the first
        rows of the storage, which is (re)allocated only when it has fewer rows or tokens than asked for.

        The same object is returned for the same batch size while the storage lives (``allocations`` unchanged), so a
        CUDA graph captured on it can be replayed in later generations.
        """
        device = torch.device(device)
        if not self.holds(batch_size, max_len, dtype, device):
            rows, tokens = batch_size, max_len
            if self._shape is not None and self._shape[2:] == (dtype, device):
                # Grow to cover both the old and the new request, so every bucket seen so far still fits.
                rows, tokens = max(rows, self._shape[0]), max(tokens, self._shape[1])
            self.acquire(rows, tokens, dtype, device)
        cache = self._row_view(batch_size)
        cache.reset()
        return cache

    def holds(self, batch_size, max_len, dtype, device):
        """Whether ``acquire_rows`` can serve this request from the current storage (else it allocates new storage,
        after releasing the old: whoever still holds views of it, e.g. captured graphs, must let go first)."""
        device = torch.device(device)
        if self._shape is None:
            return False
        have_batch, have_len, have_dtype, have_device = self._shape
        return have_batch >= batch_size and have_len >= max_len and have_dtype == dtype and have_device == device

    def _row_view(self, batch_size):
        if batch_size == self._shape[0]:
            return self._cache
        view = self._row_views.get(batch_size)
        if view is None:
            view = self._new_cache(self._shape[1])
            for layer, base in zip(view.layers, self._cache.layers):
                if not base.is_initialized:
                    raise RuntimeError("the KV cache's layers were not allocated up front; cannot view their rows")
                keys, values = base.keys[:batch_size], base.values[:batch_size]
                # lazy_initialization sets the layer's bookkeeping (device, sizes, its own length counter) from the
                # tensors' shapes; its freshly allocated tensors are then replaced by the views (one layer's worth of
                # transient memory at a time).
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
            self._row_views[batch_size] = view
        return view

    def _new_cache(self, max_len):
        cache = StaticCache(config=self.model_config, max_cache_len=max_len)
        if self.token_writes:
            for layer in cache.layers:
                if type(layer) is StaticLayer:  # sliding-window and other layer kinds keep their own update
                    layer.__class__ = TokenWriteLayer
        return cache

    def _allocate(self, batch_size, max_len, dtype, device):
        cache = self._new_cache(max_len)
        layout = kv_layout(self.model_config)
        if layout is not None:
            # Allocate now rather than lazily inside the first forward, so memory errors surface here (and are retried)
            # and the decode loop itself never allocates cache storage.
            num_kv_heads, head_dim = self.num_kv_heads or layout[0], layout[1]
            cache.early_initialization(batch_size=batch_size, num_heads=num_kv_heads, head_dim=head_dim,
                                       dtype=dtype, device=device)
        return cache

    def release(self):
        """Drop the cache storage and return it to the device (``release_inference_cache``)."""
        if self._cache is None:
            return
        self._cache = None
        self._shape = None
        self._row_views = {}
        gc.collect()
        _accelerator_empty_cache()
