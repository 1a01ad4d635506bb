"""The weight set the generator reads, and how it follows the training weights.

Four cases, chosen by :func:`build_inference_weights`:

(a) ZeRO 0-2, no LoRA: the training module itself. Its parameters keep their storage across optimizer steps (DeepSpeed
    updates them in place), so there is nothing to copy (the fused projections of ``fusion.py`` are the exception: a
    copy of a few small matrices, rewritten from these parameters at every generation).
(b) ZeRO-3, ``pin_parameters=True``: a persistent, unsharded copy of the model (same HF class, built on ``meta`` and
    given real storage once). Before a generation that follows an optimizer step it is refreshed by gathering the
    sharded parameters ``tp_gather_partition_size`` decoder layers at a time, so the extra peak memory is one group.
(c) ZeRO-3, ``pin_parameters=False``: the training module itself; DeepSpeed's hooks gather each layer inside every
    forward (least memory, slowest). Its forward is a collective, so the decode loop keeps ranks in lock-step.
(d) LoRA (a ``peft`` model) at any stage but (c): an inference copy whose LoRA-adapted weights are
    ``W + scale * (B @ A)`` computed in fp32 and rounded once to the weight dtype. The training weights are only read
    (PEFT's merge/unmerge is never called on the training model). Under ZeRO 0-2 the copy shares storage with every
    training parameter that LoRA does not adapt, so it costs only the adapted matrices.

With ``inference_tp_size`` > 1 the copy of (b)/(d) is always used (also under ZeRO 0-2): it holds this rank's slices
of the split layers (``tensor_parallel.ShardPlan``), cut from the gathered (and LoRA-merged) training weights at each
refresh; parameters that are not split are shared with training storage under ZeRO 0-2.

Parameter names are mapped generically (``dschat.models.lora.inference_name``): the PEFT wrapper's base model is used
(no ``base_model.model.`` prefix), ``base_layer.`` is dropped, ``lora_*`` tensors are folded into their layer's weight
and ``modules_to_save`` copies replace the original module. No per-model-family tables. The merge itself
(``dschat.models.lora``) is the one checkpoint saving and the actor EMA use too.
"""
import copy
import dataclasses
import os
import warnings

import torch
from torch import nn

from dschat.models.layers import check_ranks_gather_alike, decoder_layer_list
from dschat.models.lora import (active_adapters, head_trains_untied, lora_layers, merged_fp32, plain_named, unwrap_peft,
                                weight_deltas)
from dschat.models.zero3 import gathered, is_zero3_param
from dschat.utils.dist import get_world_size


def layer_index(param_name, layers_prefix):
    """Index of the decoder layer a parameter belongs to, or None (embeddings, final norm, head)."""
    if layers_prefix is None or not param_name.startswith(layers_prefix + "."):
        return None
    return int(param_name[len(layers_prefix) + 1:].split(".", 1)[0])


@dataclasses.dataclass
class WeightCopy:
    """One inference parameter and where its value comes from."""

    name: str
    target: nn.Parameter
    source: nn.Parameter
    deltas: list
    aliased: bool  # target shares the source's storage (ZeRO 0-2, not LoRA-adapted): nothing to copy
    shard: object = None  # tensor_parallel.Slice: the part of the (merged) source this rank keeps

    def training_params(self):
        params = [self.source]
        for delta in self.deltas:
            params.extend(delta.params())
        return params

    def load(self):
        """Copy (or merge into) the target; the sources must be gathered."""
        if self.aliased:
            if self.target.data_ptr() != self.source.data_ptr():  # storage moved: follow it (host-only check)
                self.target.data = self.source.data
            return
        source = self.source.detach()
        expected = self.target.shape if self.shard is None else None
        if expected is not None and source.shape != expected:
            raise RuntimeError(f"{self.name}: training tensor has shape {tuple(source.shape)} (not gathered?), "
                               f"inference tensor {tuple(self.target.shape)}")
        if self.deltas:
            source = merged_fp32(source, self.deltas)
        if self.shard is not None:
            source = self.shard(source)
            if source.shape != self.target.shape:
                raise RuntimeError(f"{self.name}: this rank's slice has shape {tuple(source.shape)}, inference "
                                   f"tensor {tuple(self.target.shape)} (not gathered?)")
        self.target.data.copy_(source)  # with LoRA: the one rounding to the weight dtype


class InferenceWeights:
    """The module the generator calls, kept in step with the training weights.

    ``mark_stale()`` is called after every optimizer step that changed the weights (the HybridEngine's ``step()``, or
    the DeepSpeed engine's own as its step counts show: ``HybridEngine._follow_engine_steps``); ``follow_writes()``
    marks a copy stale whose training sources were written in place since its refresh (``write_mark``);
    ``refresh_if_stale()`` before a generation brings the inference weights up to date only when they are behind.
    """

    kind = "base"
    forward_has_collectives = False  # True when every forward all-gathers (ZeRO-3 without pinned parameters)
    num_kv_heads = None  # key/value heads per rank when the copy is tensor-parallel (None: the config's)

    # What ``kind`` means, for the run's log (a tensor-parallel copy's kind ends in _tp<N>).
    DESCRIPTIONS = {"base": "the model itself",
                    "training_module": "the training module's own weights (no copy)",
                    "training_module_zero3": "the training module, its ZeRO-3 shards gathered in each forward",
                    "pinned_copy": "a persistent copy of the weights, refreshed after each optimizer step",
                    "lora_copy": "a persistent copy with the LoRA deltas merged, refreshed after each optimizer step"}

    @property
    def description(self):
        return self.DESCRIPTIONS[self.kind.split("_tp")[0]]

    def __init__(self, model):
        self.model = model
        self.version = 0  # bumped by each optimizer step that changed the training weights
        self.loaded_version = -1
        self.refresh_count = 0

    @property
    def is_stale(self):
        return self.loaded_version != self.version

    def mark_stale(self):
        self.version += 1

    def follow_writes(self):
        """Mark the weights stale if their training sources were written since the last refresh (a copy's only: the
        training module itself is never behind)."""

    def refresh_if_stale(self):
        """Bring the inference weights up to date; returns True if anything was done."""
        if not self.is_stale:
            return False
        with torch.no_grad():
            self._refresh()
        self.loaded_version = self.version
        self.refresh_count += 1
        return True

    def _refresh(self):
        pass


class TrainingModuleWeights(InferenceWeights):
    """Cases (a) and (c): generate with the training module's own parameters; no copy, nothing to refresh."""

    def __init__(self, training_module, gathers_in_forward):
        super().__init__(training_module)
        self.kind = "training_module_zero3" if gathers_in_forward else "training_module"
        self.forward_has_collectives = gathers_in_forward


class InferenceCopy(InferenceWeights):
    """Cases (b) and (d): a persistent plain HF model refreshed from the training weights, one layer group at a time."""

    def __init__(self, training_module, device, gather_group_size, share_unadapted=False, tp=None):
        base = unwrap_peft(training_module)
        deltas = weight_deltas(base)  # {weight name: LoRA deltas}, one entry per LoRA layer
        super().__init__(_empty_copy_of(base))
        self.kind = "lora_copy" if deltas else "pinned_copy"
        self.device = torch.device(device)
        self.shard_plan = None
        if tp is not None:
            # Inference tensor parallelism: this rank's copy holds only its slice of the split layers.
            from dschat.hybrid_engine.tensor_parallel import ShardPlan

            self.shard_plan = ShardPlan(self.model, decoder_layer_list(self.model)[0], tp)
            self.shard_plan.apply(self.model)
            self.kind += f"_tp{tp.size}"
            self.num_kv_heads = self.shard_plan.local_kv_heads
        self.copies = self._plan(base, deltas, share_unadapted)
        self.groups = self._group(gather_group_size)
        self._marks_at_refresh = None  # the sources' write_mark()s when the copy was last loaded
        # DSCHAT_CHECK_WEIGHTS=1: also the sources' checksums, to find writes that leave no mark (p.data.copy_)
        self._checks_weights = checks_weights()
        self._checksums_at_refresh = None
        self._materialise()
        self.model.eval()
        self.model.requires_grad_(False)

    # -- build ------------------------------------------------------------------------------------------------------
    def _plan(self, base, deltas, share_unadapted):
        active = active_adapters(base)
        targets = dict(self.model.named_parameters())
        copies = []
        for name, param in plain_named(base.named_parameters(), active).items():
            if name not in targets:
                raise RuntimeError(f"training parameter {name!r} (plain name) has no counterpart in the inference "
                                   "model")
            adapters = deltas.get(name, [])
            shard = self.shard_plan.slices.get(name) if self.shard_plan is not None else None
            aliased = share_unadapted and not adapters and shard is None and not is_zero3_param(param)
            copies.append(WeightCopy(name, targets[name], param, adapters, aliased, shard))
        missing = sorted(set(targets) - {c.name for c in copies})
        if missing:
            raise RuntimeError(f"inference parameters with no training source: {missing[:8]}")
        self._training_buffers = plain_named(base.named_buffers(), active)
        return copies

    def _group(self, gather_group_size):
        """Non-layer parameters first, then ``gather_group_size`` decoder layers per group."""
        prefix, _ = decoder_layer_list(self.model)
        groups = {}
        for c in self.copies:
            index = layer_index(c.name, prefix)
            key = -1 if index is None else index // gather_group_size
            groups.setdefault(key, []).append(c)
        return [groups[k] for k in sorted(groups)]

    def _materialise(self):
        """Give the meta copy real storage: shared with the source where aliased, own tensors elsewhere."""
        new_params = {}
        for c in self.copies:
            source_dtype = c.source.dtype
            if c.aliased:
                tensor = c.source.detach()
            else:
                tensor = torch.empty(c.target.shape, dtype=source_dtype, device=self.device)
            new_params[id(c.target)] = nn.Parameter(tensor, requires_grad=False)
        # Replace parameters by identity so tied weights (e.g. lm_head = embed_tokens) stay tied.
        for module in self.model.modules():
            for key, param in list(module._parameters.items()):
                if param is not None:
                    module._parameters[key] = new_params[id(param)]
        targets = dict(self.model.named_parameters())
        for c in self.copies:
            c.target = targets[c.name]
        for name, buf in self.model.named_buffers():
            if name not in self._training_buffers:
                raise RuntimeError(f"inference buffer {name!r} has no counterpart in the training model")
        for module_name, module in self.model.named_modules():
            for key in list(module._buffers):
                if module._buffers[key] is not None:
                    full = f"{module_name}.{key}" if module_name else key
                    module._buffers[key] = self._training_buffers[full].detach().clone().to(self.device)

    # -- refresh ----------------------------------------------------------------------------------------------------
    def _source_marks(self):
        return [write_mark(p) for c in self.copies for p in c.training_params()]

    def follow_writes(self):
        # A copy already stale (an optimizer step, a load, mark_stale) is refreshed anyway, and its refresh records the
        # sources afresh: looking further would only take that step's own writes (DeepSpeed's go through .data and
        # leave no mark) for DSCHAT_CHECK_WEIGHTS's unseen ones.
        if self.is_stale or self._marks_at_refresh is None:
            return
        if self._source_marks() != self._marks_at_refresh:
            self.mark_stale()
        elif self._checks_weights and self._checksums_at_refresh is not None:
            self._find_unmarked_writes()

    def _sources(self):
        return [(c.name, p) for c in self.copies for p in c.training_params()]

    def _source_checksums(self):
        # (on the copy's device: a ZeRO-3 shard may be offloaded to the CPU)
        return torch.stack([checksum(p).to(self.device) for _, p in self._sources()])

    def _find_unmarked_writes(self):
        """DSCHAT_CHECK_WEIGHTS=1: sources whose values changed with no write_mark moved (``p.data.copy_``, which the
        engine cannot see) are said, naming the first, and the copy is refreshed. A read of every source each
        generation (one sync): a debugging aid, off by default."""
        changed = (self._source_checksums() != self._checksums_at_refresh).nonzero().flatten().tolist()
        if not changed:
            return
        name = self._sources()[changed[0]][0]
        warnings.warn(f"DSCHAT_CHECK_WEIGHTS: {len(changed)} training tensor(s) of the actor changed since the "
                      f"inference copy was last refreshed, with no step, load or in-place write the hybrid engine "
                      f"sees (the first: the one {name!r} comes from); refreshed now. Without this check the engine "
                      "would have generated from the old weights: a write through p.data (p.data.copy_) must be "
                      "followed by engine.mark_weights_stale()", RuntimeWarning)
        self.mark_stale()

    def _refresh(self):
        for group in self.groups:
            sources = [p for c in group if not c.aliased for p in c.training_params()]
            # One group of layers gathered at a time bounds the extra memory.
            with gathered(sources):
                for c in group:
                    c.load()
        # Buffers are never partitioned; copy them in case training changed one (e.g. a dynamic RoPE frequency).
        for name, buf in self.model.named_buffers():
            source = self._training_buffers[name]
            if source.shape == buf.shape:
                buf.copy_(source)
        self._marks_at_refresh = self._source_marks()
        if self._checks_weights:
            self._checksums_at_refresh = self._source_checksums()

    @property
    def nbytes(self):
        """Storage owned by the copy (aliased parameters excluded)."""
        return sum(c.target.nbytes for c in self.copies if not c.aliased)


class ParameterPlaces:
    """Where each parameter of the training module sits: every module and attribute on the way from the module down to
    it (``model.layers.0.self_attn.q_proj.weight``: the child ``model`` of the root, its ``layers``, ..., the parameter
    ``weight``). DeepSpeed's optimizer and the inference weights hold the parameter objects themselves, so neither
    follows one replaced on that way (``load_state_dict(assign=True)``, ``resize_token_embeddings``, PEFT's
    ``merge_and_unload``, a module set by hand): :meth:`replaced` finds it on the host, by dictionary look-ups alone,
    one per module and parameter on the ways (measured on a shared 2-core CPU: 0.06-0.14 ms for a 7B Llama's 680,
    0.4-1 ms for its 2,250 with LoRA on every linear; ``list(model.parameters())`` alone takes 0.4-1 and 4-9 ms)."""

    def __init__(self, module):
        steps = {}  # (id(owner), attribute) -> (qualified name, owner, its table's name, attribute, what it held)
        for name, param in module.named_parameters(remove_duplicate=False):  # (tied weights: each place)
            *path, leaf = name.split(".")
            owner = module
            for depth, key in enumerate(path):
                child = owner._modules[key]
                steps.setdefault((id(owner), key), (".".join(path[:depth + 1]), owner, "_modules", key, child))
                owner = child
            steps.setdefault((id(owner), leaf), (name, owner, "_parameters", leaf, param))
        self._steps = list(steps.values())  # a module's step before those below it: the highest replaced is named

    def replaced(self):
        """The qualified name of the first module or parameter that is no longer the object it was, or None."""
        for name, owner, table, key, held in self._steps:
            # the table read afresh: ZeRO-3 may put a new one in place (deepspeed's ensure_zero_ordered_dict); .get
            # does not run its __getitem__, which would gather a partitioned parameter
            if getattr(owner, table).get(key) is not held:
                return name
        return None


def write_mark(param):
    """What an in-place write into a training parameter changes, read on the host alone (a few microseconds for a
    model's parameters: no device work, no sync): its tensor's version counter, which every in-place op that autograd
    can see bumps (``p.copy_`` under ``no_grad``, ``p.detach().copy_``, torch's optimizers), and its storage's address,
    which ``p.data = t`` moves. A write through ``p.data`` (``p.data.copy_``) bumps neither: each ``.data`` is a new
    tensor whose version counter starts at 0, and nothing else on the host moves (the storage keeps no count; its
    ``_cdata`` and address stay). Reading a field per tensor would be cheap (~0.5 ms for 739), but none changes: the
    values are the only trace (``checksum``). Under ZeRO-3 the parameter's own shard (``ds_tensor``), whose version
    the repartition after a write inside ``GatheredParameters(modifier_rank=...)`` bumps on every rank (with either
    idiom); its address is left out (NVMe offload moves it between generations). DeepSpeed's optimizer steps write
    through ``.data`` and bump neither: the engine follows them by its step counts."""
    shard = getattr(param, "ds_tensor", None)
    if shard is not None:
        return shard._version
    return param._version, param.data_ptr()


def checks_weights():
    """Whether DSCHAT_CHECK_WEIGHTS asks for the checksum check of ``InferenceCopy._find_unmarked_writes``."""
    return os.environ.get("DSCHAT_CHECK_WEIGHTS", "0") not in ("", "0")


_SAME_SIZE_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(param):
    """The sum of the bits of the values a training parameter holds here (its ZeRO-3 shard), read as integers of its
    element size: exact, so a change of one value changes it (changes that cancel out, or a permutation, would not)."""
    values = getattr(param, "ds_tensor", param).detach().reshape(-1)
    return values.view(_SAME_SIZE_INTS[values.element_size()]).sum(dtype=torch.int64)


def _empty_copy_of(base):
    """A plain instance of ``base``'s HF class on the meta device (no memory, no init cost); its output embedding is
    untied when the training model's head trains as a copy of its own (see ``_unties_head``)."""
    config = copy.deepcopy(base.config)
    if _unties_head(base, config):
        config.tie_word_embeddings = False
    with torch.device("meta"):
        model = type(base)(config)
    if getattr(base, "generation_config", None) is not None:
        # the checkpoint's generation_config (sampling, lengths, EOS), not one rebuilt from the config: generate's
        # defaults must not change with the ZeRO stage or LoRA
        model.generation_config = copy.deepcopy(base.generation_config)
    return model


def _unties_head(base, config):
    """Whether a tied model's inference copy must untie its head: PEFT's ``modules_to_save=["lm_head"]`` trains a
    head of its own (the copy then takes it by name). Adapters or a trained copy on the shared embedding with a
    still-tied head would make the head read the unmerged weights in training and the merged ones in the copy, so
    that is refused rather than generated from differently."""
    head, embeddings = base.get_output_embeddings(), base.get_input_embeddings()
    if not getattr(config, "tie_word_embeddings", False) or head is None:
        return False
    if head_trains_untied(base):
        return True
    adapted = {id(layer) for layer in lora_layers(base).values()}
    if id(head) in adapted or id(embeddings) in adapted or hasattr(embeddings, "modules_to_save"):
        raise ValueError("the hybrid engine cannot mirror a model with tied input and output embeddings whose "
                         "embeddings or head carry LoRA adapters or modules_to_save (the tied head would differ "
                         "between training and generation): leave them out of the adapters, or train the head as "
                         "modules_to_save=['lm_head']")
    return False


def build_inference_weights(training_module, hybrid_config, zero_stage, device, tp=None):
    """Choose the case (see module docstring) for this training module and configuration; with ``tp`` (a
    ``tensor_parallel.TensorParallelGroup``) always a copy holding this rank's slice."""
    has_lora = bool(lora_layers(unwrap_peft(training_module)))
    if tp is not None:
        if zero_stage == 3 and not hybrid_config.pin_parameters:
            raise ValueError("hybrid_engine.inference_tp_size > 1 needs pin_parameters=true under ZeRO-3 (the "
                             "tensor-parallel slices are kept in a persistent inference copy)")
        return InferenceCopy(training_module, device, hybrid_config.tp_gather_partition_size,
                             share_unadapted=zero_stage < 3, tp=tp)
    if zero_stage == 3 and not hybrid_config.pin_parameters:
        check_ranks_gather_alike(training_module, get_world_size())
        return TrainingModuleWeights(training_module, gathers_in_forward=True)
    if zero_stage == 3:
        return InferenceCopy(training_module, device, hybrid_config.tp_gather_partition_size)
    if has_lora:
        return InferenceCopy(training_module, device, hybrid_config.tp_gather_partition_size, share_unadapted=True)
    return TrainingModuleWeights(training_module, gathers_in_forward=False)
