"""Where a decoder-only model keeps its repeated blocks, found without per-family tables."""
from torch import nn


def _output_requires_grad(module, inputs, output):
    return output.requires_grad_(True)


def decoder_layer_list(model):
    """(name, ModuleList) of the repeated decoder blocks: the ModuleList holding the most parameters."""
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[2]:
                best = (name, module, size)
    return (best[0], best[1]) if best else (None, None)


ZERO3_FETCH_UNITS = ("layer", "module")


def mark_zero3_leaf_layers(model):
    """Make each decoder layer one unit for DeepSpeed ZeRO-3's parameter hooks ("z3 leaf modules"): its parameters are
    gathered and released together by one pre-forward / pre-backward hook, instead of by hooks on every submodule
    (a layer has ~10). Must run before ``deepspeed.initialize``, which registers the hooks. Returns how many layers
    were marked (0 when the model has no ModuleList of blocks: DeepSpeed's per-module hooks then stay)."""
    from deepspeed.utils import set_z3_leaf_module

    _, layers = decoder_layer_list(model)
    for layer in layers or ():
        set_z3_leaf_module(layer, True)
    return len(layers or ())


def frozen_embeddings_pass_gradients(model):
    """When some parameters train but the embeddings are frozen (LoRA only), make the embeddings' outputs require grad,
    as transformers' ``enable_input_require_grads`` does for the input embeddings (also for position tables and
    wrappers such as the critic, which have no such method). ZeRO-3 needs it: DeepSpeed releases a module's gathered
    parameters from a backward hook on its inputs, which fires too early when no input requires grad (the first
    layer's backward then reads released, empty weights). Returns how many embeddings were hooked."""
    if not any(p.requires_grad for p in model.parameters()):
        return 0
    frozen = [m for m in model.modules() if isinstance(m, nn.Embedding) and not m.weight.requires_grad
              and not getattr(m, "_dschat_passes_gradients", False)]
    for embedding in frozen:
        embedding.register_forward_hook(_output_requires_grad)
        embedding._dschat_passes_gradients = True
    return len(frozen)
