"""Work-arounds for library interactions, applied once, in one place."""
import functools


@functools.lru_cache(maxsize=None)
def prepare_for_zero_init():
    """Import modules that must not be imported for the first time inside ``deepspeed.zero.Init``.

    ``zero.Init`` patches tensor constructors (``new_tensor`` among them). transformers' generation and
    masking modules import ``torch._dynamo`` lazily, and when that first import happens under the patch it
    fails with "TypeError: Signature mismatch ... new_tensor". Importing them beforehand avoids it.
    """
    import torch._dynamo  # noqa: F401
    import transformers.generation.utils  # noqa: F401
    try:
        import transformers.masking_utils  # noqa: F401
    except ImportError:  # older transformers
        pass
    return True


@functools.lru_cache(maxsize=None)
def zero3_single_rank_dequantizer():
    """Give DeepSpeed's ZeRO-3 ``Init`` class the quantizer its one-rank gather path reads.

    With ``zero_quantized_nontrainable_weights`` (Mixed Precision ZeRO++), DeepSpeed 0.19 sets ``quantizer_module`` on
    each ``Init`` instance, but with a single rank (nothing to all-gather) ``NoGatherHandle`` and
    ``NoGatherCoalescedHandle`` dequantize through ``Init.quantizer_module``, a class attribute that is never set:
    "AttributeError: type object 'Init' has no attribute 'quantizer_module'" at the first gather.
    """
    from deepspeed.runtime.zero import partition_parameters

    if not hasattr(partition_parameters.Init, "quantizer_module"):
        partition_parameters.Init.quantizer_module = partition_parameters.CUDAQuantizer()
    return True
