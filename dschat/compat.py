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
