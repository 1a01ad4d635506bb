"""LoRA through PEFT: family-neutral target selection, optimizer groups, and the one merge of adapters into weights.

The merge (``W + sum over active adapters of scaling * B @ A``, in fp32, rounded once) is shared by the hybrid engine's
inference copy, checkpoint saving and the actor EMA. It only reads the training tensors: PEFT's merge/unmerge is never
called, and LoRA variants whose merge differs (DoRA, lora_bias, non-Linear LoRA, MoE expert parameters, trainable
tokens) are refused rather than folded wrongly.
"""
import dataclasses

import torch
from torch import nn

from dschat.compat import peft_reading_checkpointing, peft_targets_as_named
from dschat.errors import UsageError

# Output heads are never adapted: they are tied to embeddings in many models or newly initialised.
HEAD_NAMES = ("lm_head", "v_head", "score", "embed_out")
PEFT_PREFIX = "base_model.model."  # where a PeftModel keeps its base model
# DeepSpeed-Chat's LoRA adds (1 / lora_dim) * B @ A, i.e. PEFT's lora_alpha / r with alpha 1.
DEFAULT_LORA_ALPHA = 1.0
# Linear modules whose weight the model's forward reads past the module (``dt_proj.weight @ x``), by model type: an
# adapter there never acts in training, but the merge (the hybrid engine's copy, saved checkpoints) would fold it in.
# Listed, not found by tracing a forward: the fused-kernel paths (Mamba's mamba_inner_fn reads x_proj, dt_proj and
# out_proj when training on CUDA) differ from the path any CPU or meta-device trace takes.
# LongCat-Flash's MoE router computes its logits as F.linear(x, classifier.weight) in fp32.
READ_PAST_FORWARD = {"mamba": ("x_proj", "dt_proj"), "falcon_mamba": ("dt_proj",), "jamba": ("dt_proj",),
                     "longcat_flash": ("classifier",)}


def lora_target_modules(model, lora_module_name="", flag="--lora_module_name"):
    """Names of the Linear-like modules to adapt: those whose name contains ``lora_module_name`` (all when empty);
    ``flag``, the one that gave it, is named when it matches none (step 3's are --actor_/--critic_lora_module_name).

    DeepSpeed-Chat matched "decoder.layers." (an OPT path); matching a substring of the module path against the
    model's own Linear modules works for every family (GPT-2's Conv1D included).
    """
    from transformers.pytorch_utils import Conv1D

    names, refused, unused, linear = [], [], [], []
    head = output_head(model)
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, Conv1D)) or not acts_as_linear(module):
            continue
        if module is head or any(part in HEAD_NAMES for part in name.split(".")):
            continue
        linear.append(name)
        if lora_module_name and lora_module_name not in name:
            continue
        if read_past_forward(model, name):
            unused.append(name)
            continue
        (refused if peft_refuses(model, name) else names).append(name)
    if not names and unused and not refused:
        raise UsageError(f"{flag} {lora_module_name!r} matches only modules whose weight "
                         f"{model.config.model_type} models read past the module ({unused[0]}"
                         f"{' ...' if len(unused) > 1 else ''}): a LoRA adapter there would not train, yet would "
                         f"change the merged weights (generation, saved checkpoints); name other modules")
    if not names:
        head_names = [n for n, m in model.named_modules() if head is not None and m is head]
        names_a_head = any(part in HEAD_NAMES for part in (lora_module_name or "").split(".")) or \
            any(lora_module_name and lora_module_name in n for n in head_names)
        heads = " (output heads are never adapted: " + ", ".join([*HEAD_NAMES, *head_names]) + ")" \
            if names_a_head else ""
        if refused:
            heads = f" that PEFT can adapt (it refuses {refused[0]}{' ...' if len(refused) > 1 else ''} in " \
                    f"{model.config.model_type} models)"
        elif linear and not names_a_head:  # (DeepSpeed-Chat's "decoder.layers." is OPT's path: say this model's)
            heads = f" (its Linear modules are named like {linear[0]}; '' adapts every one)"
        raise UsageError(f"{flag} {lora_module_name!r} matches no Linear module of "
                         f"{type(model).__name__}{heads}")
    return names


def output_head(model):
    """The model's LM head, whatever its name (BioGPT's ``output_projection``, XLNet's ``lm_loss``, ModernBERT's
    ``decoder``): HEAD_NAMES alone let LoRA adapt these by default, and where the head is tied to the embeddings the
    merge (generation, saving) then refused the adapter the user never asked for. None for a backbone."""
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if callable(get_head) else None


def acts_as_linear(module):
    """Whether ``module``'s output is its linear map of the input, to which LoRA adds ``B @ A x``: a Linear (or
    Conv1D) subclass with a forward of its own may return something else, e.g. a MoE router's (logits, weights,
    experts) tuple (Llama-4's, PhiMoE's: LoRA on it failed at the first forward, inside PEFT). Such a forward is tried
    on meta tensors (no memory, no compute; ZeRO-3 shards by their full shape); one that fails there or gives no
    (1, out_features) tensor is no target."""
    from transformers.pytorch_utils import Conv1D

    base = Conv1D if isinstance(module, Conv1D) else nn.Linear
    if type(module).forward is base.forward:
        return True
    weight = module.weight
    shape = tuple(getattr(weight, "ds_shape", weight.shape))
    in_features, out_features = (shape[0], shape[1]) if base is Conv1D else (shape[1], shape[0])
    params = {name: torch.empty(tuple(getattr(p, "ds_shape", p.shape)), dtype=p.dtype, device="meta")
              for name, p in module.named_parameters(recurse=False)}
    probe = torch.empty((1, in_features), dtype=weight.dtype, device="meta")
    try:
        out = torch.func.functional_call(module, params, (probe,))
    except Exception:  # noqa: BLE001 (a forward that cannot run on its input alone is not a plain linear map)
        return False
    return torch.is_tensor(out) and tuple(out.shape) == (1, out_features)


def read_past_forward(model, name):
    """Whether ``model``'s forward reads the weight of its module ``name`` directly (READ_PAST_FORWARD), so that a
    LoRA adapter there would not train."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return name.rsplit(".", 1)[-1] in READ_PAST_FORWARD.get(model_type, ())


def peft_refuses(model, name):
    """Whether PEFT refuses LoRA on the module ``name`` of ``model``: the ``out_proj`` of its Mamba-based models
    (Mamba, Mamba-2, Falcon-Mamba, Falcon-H1, Nemotron-H), which their fused kernels read past any adapter. Every
    Linear module being a target by default, LoRA on those models failed in ``get_peft_model`` with PEFT's error."""
    try:
        from peft import LoraConfig
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba as check
    except ImportError:  # no peft (then no LoRA at all), or a PEFT without the check (nothing refused)
        return False
    try:
        check(LoraConfig(), model, name.rsplit(".", 1)[-1])
    except ValueError:
        return True
    return False


def check_only_optimize_lora(only_optimize_lora, *lora_dims):
    """--only_optimize_lora freezes all but the adapters: with no model given LoRA it would silently train everything
    (the flag then does nothing), so say so."""
    if only_optimize_lora and not any(lora_dims):
        raise UsageError("--only_optimize_lora trains only LoRA adapters, but no model gets any: give --lora_dim "
                         "(step 3: --actor_lora_dim / --critic_lora_dim) > 0, or drop the flag")


def apply_lora(model, lora_dim, lora_module_name="", lora_alpha=None, lora_dropout=0.0,
               only_optimize_lora=False, modules_to_save=None, module_name_flag="--lora_module_name"):
    """Wrap ``model`` with PEFT LoRA adapters of rank ``lora_dim`` (returns the model unchanged when 0), with
    DeepSpeed-Chat's semantics: the adapted layers' weights are frozen; everything else (their biases, embeddings,
    norms, other layers) trains too unless ``only_optimize_lora``; the update is scaled by lora_alpha / lora_dim with
    alpha 1 unless given."""
    if not lora_dim:
        return model
    from peft import LoraConfig, get_peft_model

    targets = lora_target_modules(model, lora_module_name, module_name_flag)
    alpha = DEFAULT_LORA_ALPHA if lora_alpha is None else lora_alpha
    config = LoraConfig(r=lora_dim, lora_alpha=alpha, lora_dropout=lora_dropout,
                        target_modules=targets, modules_to_save=modules_to_save, bias="none")
    # adapters in the base weights' dtype: PEFT would make them fp32 beside bf16/fp16 weights, and DeepSpeed's ZeRO-3
    # flattens all trainable partitions into one buffer of one dtype (DeepSpeed keeps fp32 master copies anyway)
    with peft_reading_checkpointing(), peft_targets_as_named():
        model = get_peft_model(model, config, autocast_adapter_dtype=False)
    if not only_optimize_lora:  # PEFT froze every base parameter; DeepSpeed-Chat freezes only the adapted weights
        for name, param in model.named_parameters():
            param.requires_grad_(not name.endswith("base_layer.weight"))
    return model


def head_trains_untied(model):
    """Whether a model configured with tied input and output embeddings trains a head of its own: PEFT's
    ``modules_to_save=["lm_head"]`` gives the head a trained copy, so a plain model built from it (the hybrid engine's
    inference copy, a saved checkpoint) must untie the two, or ``from_pretrained`` ties the head back to the
    embeddings and the trained head is lost."""
    model = unwrap_peft(model)
    head = model.get_output_embeddings()
    if not getattr(model.config, "tie_word_embeddings", False) or not hasattr(head, "modules_to_save"):
        return False
    return bool(active_adapters(head) & set(head.modules_to_save))  # an inactive copy is not what is saved


def is_lora_param(name):
    return "lora_" in name


def optimizer_param_groups(model, weight_decay, lora_learning_rate=None):
    """Weight decay on matrices only (biases and norm weights are 1-D); LoRA parameters may get their own lr. Under
    ZeRO-3 a parameter's local tensor is a flat (or empty) shard: its full shape is ``ds_shape``."""
    groups = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        matrix = len(getattr(param, "ds_shape", param.shape)) >= 2
        decay = weight_decay if matrix and not name.endswith(".bias") else 0.0
        lora = lora_learning_rate is not None and is_lora_param(name)
        key = (decay, lora)
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": decay}
            if lora:
                groups[key]["lr"] = lora_learning_rate
        groups[key]["params"].append(param)
    return list(groups.values())


def _lora_layer_class():
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft not installed: no LoRA models either
        return None
    return LoraLayer


def lora_layers(module):
    """{module name: peft LoraLayer} inside ``module`` (empty for a model without LoRA)."""
    lora_cls = _lora_layer_class()
    if lora_cls is None:
        return {}
    return {name: m for name, m in module.named_modules() if isinstance(m, lora_cls)}


def _peft_wrapper_classes():
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:
        return ()
    return (BaseTunerLayer, AuxiliaryTrainingWrapper)


def active_adapters(module):
    """Names of the adapters active in ``module``'s PEFT layers (LoRA layers, ``modules_to_save`` wrappers)."""
    classes = _peft_wrapper_classes()
    names = set()
    if classes:
        for m in module.modules():
            if isinstance(m, classes):
                active = m.active_adapters
                names.update([active] if isinstance(active, str) else active)
    return names


def inference_name(training_name, active):
    """The plain-model name of a training parameter/buffer name, or None if it has no plain counterpart.

    ``q_proj.base_layer.weight`` -> ``q_proj.weight``; ``lm_head.modules_to_save.default.weight`` -> ``lm_head.weight``
    for an active adapter; ``lora_A...``, ``original_module...`` and inactive ``modules_to_save`` copies -> None.
    Names are relative to the PEFT wrapper's base model (no ``base_model.model.`` prefix).
    """
    parts = training_name.split(".")
    out = []
    i = 0
    while i < len(parts):
        part = parts[i]
        if part == "base_layer":
            i += 1
        elif part == "modules_to_save":
            if i + 1 >= len(parts) or parts[i + 1] not in active:
                return None
            i += 2
        elif part == "original_module" or part.startswith("lora_"):
            return None
        else:
            out.append(part)
            i += 1
    return ".".join(out)


def plain_named(named_tensors, active):
    """{plain-model name: tensor} from (training name, tensor) pairs; names with no plain counterpart are dropped."""
    plain = {}
    for training_name, tensor in named_tensors:
        name = inference_name(training_name, active)
        if name is None:
            continue
        if name in plain:
            raise RuntimeError(f"two training tensors map to plain-model name {name!r}")
        plain[name] = tensor
    return plain


def _strip_peft_prefix(name):
    """A PEFT model's parameter name relative to its base model (what ``inference_name`` expects)."""
    return name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name


@dataclasses.dataclass
class LoraDelta:
    """One active adapter's contribution ``scaling * (B @ A)`` (transposed for Conv1D / embedding layouts).

    ``lora_a`` / ``lora_b`` are the training parameters, or their gathered copies from a state dict when saving.
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    transpose: bool

    def params(self):
        return [self.lora_a, self.lora_b]

    def add_to(self, accumulator):
        delta = self.lora_b.detach().float() @ self.lora_a.detach().float()
        accumulator.add_(delta.t() if self.transpose else delta, alpha=self.scaling)


def merged_fp32(weight, deltas):
    """``weight + sum of the deltas`` as a new fp32 tensor; the caller rounds it once to the dtype it stores."""
    merged = weight.detach().to(torch.float32, copy=True)
    for delta in deltas:
        delta.add_to(merged)
    return merged


def lora_deltas(layer, read):
    """The deltas of ``layer``'s active adapters; raises for LoRA variants whose merge is not ``W + s*B@A``.

    ``read(name)`` gives the tensor of the layer's parameter ``name`` as PEFT names it (``lora_A.<adapter>.weight``,
    ``lora_embedding_A.<adapter>``).
    """
    if getattr(layer, "disable_adapters", False):
        return []
    if getattr(layer, "merged_adapters", None):
        # The merge here adds the adapters to the base weight itself: merged ones would be counted twice.
        raise RuntimeError("the model has merged LoRA adapters (PEFT merge_adapter); unmerge them first")
    deltas = []
    for adapter in layer.active_adapters:
        if adapter in getattr(layer, "lora_variant", {}) or layer.use_dora.get(adapter, False):
            raise NotImplementedError(f"LoRA variant of adapter {adapter!r} (e.g. DoRA) is not supported by the "
                                      "LoRA merge (hybrid engine, saving, EMA)")
        if layer.lora_bias.get(adapter, False):
            raise NotImplementedError("LoRA with lora_bias=True is not supported by the LoRA merge (hybrid engine, "
                                      "saving, EMA)")
        if adapter in layer.lora_A:
            _check_adapts_a_weight(layer)
            if not isinstance(layer.lora_A[adapter], nn.Linear):
                raise NotImplementedError(f"LoRA on {type(layer.get_base_layer()).__name__} layers is not supported "
                                          "by the LoRA merge (hybrid engine, saving, EMA)")
            deltas.append(LoraDelta(read(f"lora_A.{adapter}.weight"), read(f"lora_B.{adapter}.weight"),
                                    float(layer.scaling[adapter]), bool(getattr(layer, "fan_in_fan_out", False))))
        elif adapter in layer.lora_embedding_A:
            deltas.append(LoraDelta(read(f"lora_embedding_A.{adapter}"), read(f"lora_embedding_B.{adapter}"),
                                    float(layer.scaling[adapter]), True))
        # else: the adapter does not adapt this layer
    return deltas


def _check_adapts_a_weight(layer):
    """PEFT's ``target_parameters`` LoRA (``ParamWrapper``) adapts a parameter by its name, and a 3-D one (MoE
    experts) by a delta per expert: only a 2-D ``weight`` is ``W + s*B@A`` of the layer's ``weight``. Others would be
    left out of the inference copy and the EMA (no ``.weight`` of that name to add to) and fail saving."""
    parameter, experts = getattr(layer, "parameter_name", "weight"), getattr(layer, "num_experts", 1)
    if parameter != "weight" or experts > 1:
        raise NotImplementedError(f"LoRA on the parameter {parameter!r} ({experts} experts; PEFT's target_parameters) "
                                  "is not supported by the LoRA merge (hybrid engine, saving, EMA)")


def weight_deltas(base, read=None):
    """{plain-model weight name: deltas of its active adapters} for every LoRA layer of the PEFT base model ``base``.

    ``read(name)`` gives the tensor of ``base``'s parameter ``name``; by default the parameter itself.
    """
    _check_no_trainable_tokens(base)
    read = read or base.get_parameter
    active = active_adapters(base)
    return {f"{inference_name(name, active)}.weight": lora_deltas(layer, _reader_under(read, name))
            for name, layer in lora_layers(base).items()}


def _check_no_trainable_tokens(base):
    """PEFT's ``trainable_token_indices`` (a ``TrainableTokensWrapper``) trains new values of some embedding rows: no
    LoRA delta, and its weight is named ``embed_tokens.token_adapter.weight``, so a saved model was written without
    its embeddings (``from_pretrained`` then made random ones). Refused, as the other merges this one cannot do."""
    try:
        from peft.utils.other import TrainableTokensWrapper
    except ImportError:
        return
    wrapped = [name for name, module in base.named_modules() if isinstance(module, TrainableTokensWrapper)]
    if wrapped:
        raise NotImplementedError(f"PEFT's trainable_token_indices ({', '.join(wrapped)}) is not supported by the "
                                  "LoRA merge (hybrid engine, saving, EMA)")


def _reader_under(read, prefix):
    """``read`` for the parameters of the submodule ``prefix`` (a function, so each layer keeps its own prefix)."""
    return lambda name: read(f"{prefix}.{name}")


def check_lora_mergeable(model):
    """Raise if ``model``'s LoRA adapters cannot be folded into its weights (DoRA, lora_bias, merged adapters, ...).

    Called on every rank before a collective gather, so that no rank is left waiting for one that raised.
    """
    base = unwrap_peft(model)
    weight_deltas(base)
    tied = _tied_parameter_names(base)
    adapted = sorted(f"{name}.base_layer.weight" for name in lora_layers(base) if f"{name}.base_layer.weight" in tied)
    if adapted:
        raise UsageError(f"LoRA on {', '.join(adapted)}, a weight tied to another (the output head and the input "
                         "embeddings share it): its update cannot be folded into one of them alone; leave it out of "
                         "--lora_module_name")


def _tied_parameter_names(model):
    """Names of the parameters that share their tensor with another name (tied embeddings)."""
    names_by_parameter = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_parameter.setdefault(id(param), []).append(name)
    return {name for names in names_by_parameter.values() if len(names) > 1 for name in names}


def merge_lora_state_dict(state_dict, model):
    """The plain HF state dict of ``model`` from its gathered one (PEFT names, e.g. from ZeRO-3 on rank 0).

    Names are mapped by ``inference_name``; each LoRA layer's weight gets all its active adapters, added in fp32 and
    rounded once to the weight's dtype. A model without PEFT: ``state_dict`` as it is.
    """
    if not hasattr(model, "peft_config"):
        return state_dict
    base = unwrap_peft(model)
    plain = plain_named(((_strip_peft_prefix(k), v) for k, v in state_dict.items()), active_adapters(base))
    deltas = weight_deltas(base, read=lambda name: state_dict[PEFT_PREFIX + name])
    for name, adapters in deltas.items():
        if adapters:
            plain[name] = merged_fp32(plain[name], adapters).to(plain[name].dtype)
    return plain


def unwrap_peft(model):
    """The plain HF model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
