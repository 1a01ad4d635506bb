"""Where a decoder-only model keeps its repeated blocks, found without per-family tables, and how DeepSpeed ZeRO-3
can fetch each of them as one unit; the families whose generation on several ranks needs such units
(``CALLS_VARY_BY_LENGTH``), and those whose every forward does (``EVERY_FORWARD_VARIES``)."""
import dataclasses

import torch
from torch import nn

from dschat.errors import UsageError
from dschat.models.zero3 import full_numel

ZERO3_FETCH_UNITS = ("layer", "module")
DEFAULT_ZERO3_FETCH = "layer"


def decoder_layer_list(model):
    """(name, ModuleList) of the repeated decoder blocks: the ModuleList holding the most parameters."""
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(full_numel(p) for p in module.parameters())  # (ZeRO-3: numel() is 0 outside a gather)
            if best is None or size > best[2]:
                best = (name, module, size)
    return (best[0], best[1]) if best else (None, None)


def _decoder_layers_or_none(model):
    """The decoder blocks when the largest ModuleList is clearly them (one class, as many as the config's layers) and
    every one runs in every forward (no layer drop: a skipped unit never fires the backward hook DeepSpeed waits for)."""
    _, layers = decoder_layer_list(model)
    if not layers or len({type(layer) for layer in layers}) != 1:
        return None
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "layerdrop", 0) or getattr(config, "decoder_layerdrop", 0):
        return None
    expected = getattr(config, "num_hidden_layers", None)
    return layers if expected in (None, len(layers)) else None


def _first_input_requires_grad(layer, args):
    """Forward pre-hook of a ZeRO-3 fetch unit: DeepSpeed reduces a unit's gradients and releases its gathered
    parameters from a full backward hook, which fires as soon as the unit's output gradient exists when none of its
    positional inputs requires grad (e.g. the first layer's hidden states when only LoRA adapters train), that is,
    before the unit's own backward has read those parameters. A detached copy that requires grad keeps the order."""
    if not torch.is_grad_enabled() or not any(p.requires_grad for p in layer.parameters()):
        return None
    if not args or not torch.is_tensor(args[0]) or not args[0].is_floating_point():
        raise RuntimeError(f"--zero3_fetch layer: {type(layer).__name__} was called without its hidden states as the "
                           "first positional argument, so DeepSpeed could release its weights before its backward; "
                           "use --zero3_fetch module")
    if args[0].requires_grad:
        return None
    return (args[0].detach().requires_grad_(True), *args[1:])


def mark_zero3_leaf_layers(model):
    """Make each decoder layer one unit for DeepSpeed ZeRO-3's parameter hooks ("z3 leaf modules"): its parameters are
    gathered and released together by one hook pair, instead of by hooks on each of its ~10 submodules. Must run
    before ``deepspeed.initialize``, which registers the hooks. Returns how many layers were marked: 0 when the
    largest ModuleList is not clearly the decoder stack (mixed classes, or not the config's number of layers) or the
    model drops layers at random, and DeepSpeed's per-module hooks then stay."""
    from deepspeed.utils import set_z3_leaf_module

    layers = _decoder_layers_or_none(model)
    for layer in layers or ():
        if not getattr(layer, "_dschat_zero3_unit", False):
            set_z3_leaf_module(layer, True)
            layer.register_forward_pre_hook(_first_input_requires_grad)
            layer._dschat_zero3_unit = True
    return len(layers or ())


# Families (config.model_type) whose decoder layers call other submodules, or read a submodule's weight without
# calling it, as the number of tokens a forward takes changes. Under ZeRO-3 fetching submodule by submodule
# (``--zero3_fetch module``) each submodule gathers its own weights as it is called, a collective: ranks that generate
# from prompts of other lengths at once (each rank's own, every forward a gather: the hybrid engine without pinned
# parameters, HF generate) then gather other weights (2 CPU ranks: gloo's "Received data size doesn't match expected
# size"; NCCL: a hang). A whole layer as one unit gathers the same weights whatever it calls inside. Listed: nothing
# in the config tells.
CALLS_VARY_BY_LENGTH = {
    "recurrent_gemma": "a prompt of one token takes its recurrent blocks' decode path, which reads conv_1d's weight "
                       "without calling conv_1d, where a longer prompt calls it",
    "deepseek_v4": "its compressed attention calls its compressors' norms only in a forward that fills a window of "
                   "tokens (4 and 128 by default), which a longer prompt or batch fills first",
}

# Of ``CALLS_VARY_BY_LENGTH``, the families whose calls vary at the widths of training and scoring forwards too, not
# only at a one-token prompt: a DeepSeek-V4 batch narrower than a compression window calls no compressor norm, and
# each rank pads its batches to its own width, so every step's engine under ZeRO-3 fetched submodule by submodule
# gathers other weights on its ranks (2 CPU ranks, training widths 3 and 20: gloo aborted; whole layers: trained).
EVERY_FORWARD_VARIES = frozenset({"deepseek_v4"})


def model_family(model):
    """``model``'s ``config.model_type`` (a PEFT model's or a reward model's too: their config is their base's)."""
    return getattr(getattr(model, "config", None), "model_type", None)


def gathers_whole_layers(model):
    """Whether ZeRO-3 fetches each decoder layer's weights as one unit (``mark_zero3_leaf_layers``, or a user's own
    ``set_z3_leaf_module``) rather than submodule by submodule."""
    from deepspeed.utils import z3_leaf_module

    _, layers = decoder_layer_list(model)
    return bool(layers) and all(z3_leaf_module(layer) for layer in layers)


# How each forward gathers submodule by submodule, as said in a refusal: the flag that asked for it, or the layers
# --zero3_fetch layer could not make units (``mark_zero3_leaf_layers`` found no clear decoder stack); and the way out
GATHERED_BY = {
    "module": ("(--zero3_fetch module)", "Use --zero3_fetch layer (the default: each decoder layer gathered whole, "
                                         "whatever it calls inside)"),
    "layer": ("(its decoder layers could not be made --zero3_fetch layer units: mixed or miscounted blocks, or "
              "layerdrop)", "Run it at ZeRO stage 2 or below, or on one rank"),
}


@dataclasses.dataclass(frozen=True)
class GatheringRun:
    """What runs with each forward a ZeRO-3 gather submodule by submodule, as ``refuse_ranks_gathering_otherwise``
    says it: ``what`` runs, how its ranks' forwards differ (``ranks_differ``), and a way out besides the one
    ``GATHERED_BY`` names (``other_way``, said after it)."""
    what: str
    ranks_differ: str = "generating from prompts of other lengths"
    other_way: str = ""


UNPINNED_GENERATION = GatheringRun(
    "the hybrid engine generating without pinned parameters (--unpin_actor_parameters, or hybrid_engine.pin_parameters "
    "false)", other_way=", or keep the actor's parameters pinned (no --unpin_actor_parameters: "
    "hybrid_engine.pin_parameters true)")
HF_GENERATION = GatheringRun("HF generate (--no-enable_hybrid_engine)")
TRAINING_OR_SCORING = GatheringRun("a model trained or scored",
                                   ranks_differ="forwarding batches of other widths (each rank pads its own)")


def refuse_ranks_gathering_otherwise(run, family, world_size, zero3_fetch="module", whose="the actor's"):
    """Refuse, naming the way out, ``run`` (a ``GatheringRun``: every forward a ZeRO-3 gather submodule by submodule)
    on ``world_size`` ranks where ``family``'s layers call other submodules by length (``CALLS_VARY_BY_LENGTH``): its
    ranks would gather other weights. ``zero3_fetch``: the --zero3_fetch given (``layer``: its layers were not made
    units); ``whose``: the model's name in the message."""
    if world_size < 2 or family not in CALLS_VARY_BY_LENGTH:
        return
    gathered_by, way_out = GATHERED_BY[zero3_fetch]
    raise UsageError(f"{run.what} under ZeRO-3 on {world_size} ranks, each forward gathering {whose} "
                     f"({family}) weights submodule by submodule {gathered_by}, and "
                     f"{CALLS_VARY_BY_LENGTH[family]}: ranks {run.ranks_differ} would gather other weights (a hang). "
                     f"{way_out}{run.other_way}")


def refuse_unpinned_generation(family, world_size, zero3_fetch="module"):
    """``refuse_ranks_gathering_otherwise`` for the hybrid engine generating without pinned parameters (every
    forward a gather), with pinning as the other way out: the check before loading
    (``rlhf.engine.check_generation_gathers_alike``) and the hybrid engine's own (``check_ranks_gather_alike``)."""
    refuse_ranks_gathering_otherwise(UNPINNED_GENERATION, family, world_size, zero3_fetch)


def refuse_hf_generation(family, world_size, zero3_fetch="module"):
    """``refuse_ranks_gathering_otherwise`` for step 3's actor generating with HF generate (no hybrid engine: every
    forward a gather): the check before loading (``rlhf.engine.check_generation_gathers_alike``) and the loaded
    actor's (``check_ranks_gather_alike``, from ``DeepSpeedRLHFEngine._init_actor``)."""
    refuse_ranks_gathering_otherwise(HF_GENERATION, family, world_size, zero3_fetch)


def record_zero3_fetch(model, zero3_fetch):
    """Keep on ``model`` the --zero3_fetch its engine was prepared with (``prepare_zero3_hooks``), for a check that
    later sees only the engine (the hybrid engine's ``check_ranks_gather_alike``), whose refusal says what was given."""
    model._dschat_zero3_fetch = zero3_fetch


def zero3_fetch_given(model):
    """The --zero3_fetch ``model``'s engine was prepared with (``record_zero3_fetch``); "module" for one dschat did
    not prepare (DeepSpeed's own per-module hooks)."""
    return getattr(model, "_dschat_zero3_fetch", "module")


def check_ranks_gather_alike(model, world_size, refuse=refuse_unpinned_generation, zero3_fetch=None):
    """``refuse`` (``refuse_unpinned_generation``: the hybrid engine without pinned parameters;
    ``refuse_hf_generation``: HF generate) for ``model`` generating, a ZeRO-3 module whose every forward is a gather,
    where its decoder layers are not ZeRO-3's fetch units (``zero3_fetch``: as given, None for the one its engine was
    prepared with, ``zero3_fetch_given``; ``layer``, its layers could not be made units)."""
    if world_size > 1 and not gathers_whole_layers(model):
        refuse(model_family(model), world_size, zero3_fetch=zero3_fetch or zero3_fetch_given(model))


def refuse_forwards_gathering_otherwise(family, world_size, whose="its", zero3_fetch="module"):
    """The one rule of ``EVERY_FORWARD_VARIES``: ``refuse_ranks_gathering_otherwise`` for any ZeRO-3 engine of a
    ``family`` model (trained or frozen, in any step) on ``world_size`` ranks gathering submodule by submodule, its
    training and scoring forwards too (each rank pads its batches to their own width). Called from a config before
    any weight loads (``check_config_forwards_alike``) and from the model itself (``check_ranks_forward_alike``)."""
    if family in EVERY_FORWARD_VARIES:
        refuse_ranks_gathering_otherwise(TRAINING_OR_SCORING, family, world_size, zero3_fetch, whose)


def check_config_forwards_alike(read_config, zero_stage, zero3_fetch, world_size, whose):
    """``refuse_forwards_gathering_otherwise`` from a model's HF config before its weights load: an engine at
    ``zero_stage`` under ``--zero3_fetch module`` on ``world_size`` ranks. ``read_config()`` gives the config (None:
    not readable yet, checked when it loads), called only there (a read from disk the other runs need not make).
    (Under ``layer`` whether its layers can be made units is known once it is built: ``prepare_zero3_hooks``.)
    ``whose``: the model as the flags name it, e.g. "--model_name_or_path's"."""
    if zero_stage != 3 or zero3_fetch != "module" or world_size < 2:
        return
    config = read_config()
    if config is not None:
        refuse_forwards_gathering_otherwise(getattr(config, "model_type", None), world_size, whose)


def check_ranks_forward_alike(model, world_size, zero3_fetch="module"):
    """``refuse_forwards_gathering_otherwise`` for a ZeRO-3 engine of ``model`` whose decoder layers are not ZeRO-3's
    fetch units (``zero3_fetch``: as given; ``layer``, its layers could not be made units): called by
    ``training_engine.prepare_zero3_hooks`` in every step, before ``deepspeed.initialize``, the backstop of the
    checks from the config."""
    if world_size > 1 and not gathers_whole_layers(model):
        refuse_forwards_gathering_otherwise(model_family(model), world_size, zero3_fetch=zero3_fetch)
