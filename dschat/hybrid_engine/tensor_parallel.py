"""Inference tensor parallelism (``hybrid_engine.inference_tp_size``).

Ranks form groups of ``inference_tp_size`` consecutive ranks. Each group generates its members' prompts together with
the model split across its ranks, Megatron-style, and hands every rank back its own answers:

* Attention q/k/v and MLP up/gate projections are split by output (whole heads; key/value heads too when their number
  divides by the group size, each rank keeping the one key/value head its query heads use when it does not), attention
  output and MLP down projections by input, followed by an all-reduce over the group (the bias is added once, by the
  group's first rank). Norms, embeddings and the LM head stay whole on every rank, and so does attention where the
  model's plan replicates it (Olmo2's q/k norms): each rank then computes, and caches, every head.
* Which linear layer is which comes from dschat's plan for the family where it has one (Falcon, GPTBigCode, Bloom,
  GPT-2, Phi-3: ``_FAMILY_PLANS``; transformers' own plan for Phi-3 gathers its packed outputs, splitting nothing),
  else from the model's own tensor-parallel plan (``config.base_model_tp_plan``) where transformers provides one, else
  from the common projection names (``q_proj``, ``out_proj``, ``fc1``, ...). transformers' ``Conv1D`` (GPT-2) stores
  its weight (in, out): it is split along dim 1 column-wise, along dim 0 row-wise.
* A fused q/k/v projection (Falcon's ``query_key_value``, GPTBigCode's ``c_attn``) orders its rows per key/value head:
  that head's queries, its key, its value (multi-query: all queries, the key, the value; as many key/value heads as
  query heads: q/k/v per head; Bloom's too); GPT-2's ``c_attn`` and Phi-3's ``qkv_proj`` hold all the queries, then all
  the keys, then all the values. Each rank keeps the rows of its query heads and of the key/value heads they read.
  Phi-3's ``gate_up_proj`` (all the gate rows, then all the up rows) keeps its part of each half.
* The attention modules are told their local head counts (and widths) by their usual attribute names (``num_heads``,
  ``num_key_value_groups``, ``embed_dim``, ``split_size``, ...); HF attention reshapes with ``-1`` heads otherwise. An
  attention that reads its head counts from its ``config`` (Phi-3) gets a view of the config with the rank's counts
  (``LocalHeadsConfig``; the model's config stays whole). A bias per head (ALiBi: Falcon's in the attention mask,
  Bloom's ``alibi`` argument) is narrowed to the rank's heads.

The split happens in the inference copy only (``weights.InferenceCopy``): the training model is untouched, and the copy's
slices are refreshed from the (ZeRO-3-gathered) training weights like any other inference weight.

Prompts are gathered across the group (padded on the left to the longest; batch sizes may differ) and sampling uses
the group's first rank's generator state on every member, so a group samples identically and groups independently.
"""
import dataclasses
import logging
import re

import torch
import torch.distributed as dist
from torch import nn

from dschat.hybrid_engine.cache import layout_field

logger = logging.getLogger(__name__)

COLWISE, ROWWISE = "colwise", "rowwise"
# A fused q/k/v projection, its rows grouped per key/value head (see the module docstring): split by heads.
QKV = "colwise_qkv"
# A fused q/k/v projection of all the queries, then all the keys, then all the values (GPT-2's c_attn): each of the
# three blocks split by heads.
STACKED_QKV = "colwise_stacked_qkv"
# Two equal projections in one (Phi-3's gate_up_proj: all the gate rows, then all the up rows): each half split evenly.
STACKED_PAIR = "colwise_stacked_pair"
# Styles of transformers' plans that dschat shards, and those that mean "whole on every rank" here (embeddings, norms
# and layers whose split input/gathered output make them equivalent to a replicated layer).
_SHARDED_STYLES = {"colwise": COLWISE, "local_colwise": COLWISE, "rowwise": ROWWISE, "local_rowwise": ROWWISE,
                   QKV: QKV, STACKED_QKV: STACKED_QKV, STACKED_PAIR: STACKED_PAIR}
_REPLICATED_STYLES = {"replicate", "replicated_with_grad_allreduce", "embedding_rowwise", "embedding_colwise",
                      "colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep", "sequence_parallel",
                      "isolated", "gather"}
# Without a plan: the projection names most decoder-only families use.
_COLWISE_NAMES = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1"}
_ROWWISE_NAMES = {"o_proj", "out_proj", "down_proj", "fc2"}
# Families transformers gives no plan, in its plans' form (by config.model_type; head counts come from the config).
_FAMILY_PLANS = {
    "falcon": {"h.*.self_attention.query_key_value": QKV, "h.*.self_attention.dense": "rowwise",
               "h.*.mlp.dense_h_to_4h": "colwise", "h.*.mlp.dense_4h_to_h": "rowwise"},
    "gpt_bigcode": {"h.*.attn.c_attn": QKV, "h.*.attn.c_proj": "rowwise",
                    "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
    "bloom": {"h.*.self_attention.query_key_value": QKV, "h.*.self_attention.dense": "rowwise",
              "h.*.mlp.dense_h_to_4h": "colwise", "h.*.mlp.dense_4h_to_h": "rowwise"},
    # (Conv1D layers: weights stored (in, out), split along their dim 1 column-wise, dim 0 row-wise)
    "gpt2": {"h.*.attn.c_attn": STACKED_QKV, "h.*.attn.c_proj": "rowwise",
             "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
    # (transformers' plan gathers the packed outputs: each rank would compute them whole)
    "phi3": {"layers.*.self_attn.qkv_proj": STACKED_QKV, "layers.*.self_attn.o_proj": "rowwise",
             "layers.*.mlp.gate_up_proj": STACKED_PAIR, "layers.*.mlp.down_proj": "rowwise"},
}
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads")
# Widths (heads x head_dim) that attention code splits its fused q/k/v output by (GPTBigCode's multi-query split).
_WIDTH_ATTRS = ("embed_dim", "split_size")  # (GPT-2 splits its c_attn output by split_size)
_KV_WIDTH_ATTRS = ("kv_dim",)


# -- groups ------------------------------------------------------------------------------------------------------------
def ranks_agree(flag, device, group=None):
    """True on every rank when ``flag`` is true on every rank of ``group`` (default: the world; a collective)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def together(work, device, elsewhere, errors):
    """``work()``'s result; when it raises one of ``errors`` on any rank, every rank raises: that rank its error, the
    others a UsageError saying ``elsewhere`` (e.g. "another rank refused its prompts"). On several ranks, one
    stopping alone would leave the others waiting in the next collective. A collective: every rank calls it."""
    from dschat.errors import UsageError
    from dschat.utils.dist import get_world_size

    result, error = None, None
    try:
        result = work()
    except errors as failed:
        error = failed
    if get_world_size() > 1 and not ranks_agree(error is None, device) and error is None:
        raise UsageError(f"{elsewhere} (its error says why); every rank stops")
    if error is not None:
        raise error
    return result


@dataclasses.dataclass
class TensorParallelGroup:
    """This rank's inference group: ``size`` consecutive ranks starting at ``ranks[0]``, with its own process group
    (collectives captured in CUDA graphs must not share a communicator with training's)."""

    size: int
    rank: int  # index of this rank inside the group
    ranks: list
    group: object

    @property
    def leader(self):
        return self.ranks[0]

    @property
    def is_leader(self):
        return self.rank == 0

    def share_tokens(self, tokens):
        """The leader's sampled tokens on every rank of the group, in place. The replicated parts of the step (norms,
        LM head, sampling) should give every rank the same tokens; this makes sure of it, so that a one-bit difference
        (e.g. kernels autotuned per process) can neither feed the ranks different inputs nor make them stop at
        different steps (a hang). One small collective per step; it is captured in the decode graph too."""
        dist.broadcast(tokens, src=self.leader, group=self.group)
        return tokens

    def all_agree(self, flag, device):
        """True on every rank when ``flag`` is true on every rank of the group (a collective)."""
        return ranks_agree(flag, device, self.group)

    def destroy(self):
        """Destroy this group's process group (``release_engine``): torch keeps every group of a process until it
        is destroyed, so an engine built again and again (a notebook) would add one each time. Every rank of the group
        destroys it at the same point, as every rank made it."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    @classmethod
    def create(cls, size):
        """Every rank must call this at the same point (``new_group`` is collective over the world)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if size < 1 or world % size != 0:
            raise ValueError(f"hybrid_engine.inference_tp_size={size} must divide the number of ranks ({world})")
        rank = dist.get_rank()
        mine = None
        for start in range(0, world, size):
            ranks = list(range(start, start + size))
            group = dist.new_group(ranks)  # every rank creates every group, in the same order
            if rank in ranks:
                mine = cls(size, ranks.index(rank), ranks, group)
        return mine


# -- the plan ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HeadLayout:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config):
        """From the config's fields; a UsageError when they vary per layer (Gemma-4's head dims)."""
        cfg = config.get_text_config(decoder=True)
        heads = layout_field(cfg, "num_attention_heads")
        kv = layout_field(cfg, "num_key_value_heads") or heads
        head_dim = layout_field(cfg, "head_dim") or layout_field(cfg, "hidden_size") // heads
        return cls(heads, kv, head_dim)


def _pattern_regex(pattern):
    """``layers.*.self_attn.q_proj`` -> a regex matching that module under any prefix (``model.layers.3...``)."""
    body = r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in pattern.split("."))
    return re.compile(r"(?:.*\.)?" + body)


def model_tp_plan(model):
    """{pattern: style} of dschat's plan for the model's family, else from its config, or None when there is neither
    (dschat's plan first: Phi-3's config has one that splits nothing)."""
    text_config = model.config.get_text_config(decoder=True)
    plan = _FAMILY_PLANS.get(getattr(text_config, "model_type", None)) or \
        getattr(text_config, "base_model_tp_plan", None) or getattr(model.config, "base_model_tp_plan", None)
    return dict(plan) if plan else None


def sharded_linears(model, layers_prefix):
    """{module name: COLWISE | ROWWISE} for the decoder layers' linear projections to split.

    From ``model_tp_plan`` when there is one (dschat's plan for the family, else the config's; an unsupported style,
    e.g. MoE experts or packed projections, is an error), else by projection name. Only ``nn.Linear`` modules inside the repeated decoder blocks are split.
    """
    plan = model_tp_plan(model)
    in_layers = {name: m for name, m in model.named_modules()
                 if layers_prefix and name.startswith(layers_prefix + ".")}
    styles = {}
    if plan is not None:
        unsupported = sorted({s for s in plan.values() if s not in _SHARDED_STYLES and s not in _REPLICATED_STYLES})
        if unsupported:
            raise NotImplementedError(f"{type(model).__name__}'s tensor-parallel plan uses {unsupported}, which the "
                                      "hybrid engine's inference tensor parallelism does not support; use "
                                      "inference_tp_size=1")
        compiled = [(_pattern_regex(p), _SHARDED_STYLES[s]) for p, s in plan.items() if s in _SHARDED_STYLES]
        for name in in_layers:
            for regex, style in compiled:
                if regex.fullmatch(name):
                    styles[name] = style
                    break
    else:
        for name in in_layers:
            leaf = name.rsplit(".", 1)[-1]
            if leaf in _COLWISE_NAMES:
                styles[name] = COLWISE
            elif leaf in _ROWWISE_NAMES:
                styles[name] = ROWWISE
    _check_plan(model, styles, in_layers, plan)
    return styles


def _check_plan(model, styles, modules, plan=None):
    """Every split block (attention, MLP) needs both halves, or a partial result would go on un-reduced."""
    if not styles and plan is not None:
        # transformers' plan is there, but none of its styles splits a decoder layer's projection (e.g. Phi-3's packed
        # qkv_proj/gate_up_proj are 'colwise_gather_output'/'rowwise_split_input', gpt-oss's plan only holds its
        # embedding): say so, rather than that the config has no plan
        raise NotImplementedError(f"no tensor-parallel plan for {type(model).__name__}: its config's "
                                  f"base_model_tp_plan splits none of its decoder layers' linear projections (styles "
                                  f"{sorted(set(plan.values()))}, which each rank would compute whole); use "
                                  "inference_tp_size=1")
    if not styles:
        raise NotImplementedError(f"no tensor-parallel plan for {type(model).__name__}: its config has no "
                                  "base_model_tp_plan and its projections have none of the usual names "
                                  f"({sorted(_COLWISE_NAMES | _ROWWISE_NAMES)}); use inference_tp_size=1")
    halves = {}
    for name, style in styles.items():
        if not _plain_linear(modules[name]):
            raise NotImplementedError(f"{name} is a {type(modules[name]).__name__}, not an nn.Linear (or "
                                      "transformers' Conv1D); inference tensor parallelism cannot split it")
        halves.setdefault(name.rpartition(".")[0], set()).add(ROWWISE if style == ROWWISE else COLWISE)
    incomplete = sorted(block for block, kinds in halves.items() if kinds != {COLWISE, ROWWISE})
    if incomplete:
        raise NotImplementedError(f"tensor-parallel plan of {type(model).__name__} splits {incomplete[0]} only on one "
                                  "side (needs column-wise inputs and a row-wise output projection)")


# nn.Linear subclasses of transformers' that compute the same x @ W.T + b (Falcon's adds its bias after the matmul);
# others may not (DeepSeek-V4's grouped, Idefics' decoupled linears; quantized linears hold packed weights).
_SAME_AS_LINEAR = {("transformers.models.falcon.modeling_falcon", "FalconLinear")}


def _plain_linear(module):
    kind = type(module)
    return kind is nn.Linear or (kind.__module__, kind.__name__) in _SAME_AS_LINEAR or _is_conv1d(module)


def _is_conv1d(module):
    """transformers' Conv1D (GPT-2): x @ W + b, its weight stored (in, out)."""
    kind = type(module)
    return (kind.__module__, kind.__name__) == ("transformers.pytorch_utils", "Conv1D")


def _features(module):
    """(inputs, outputs, the weight's output dimension) of an nn.Linear (weight (out, in)) or a Conv1D ((in, out))."""
    if _is_conv1d(module):
        return module.nx, module.nf, 1
    return module.in_features, module.out_features, 0


def _set_features(module):
    """A shrunk layer's sizes from its new weight (Conv1D's forward shapes its output by ``nf``)."""
    if _is_conv1d(module):
        module.nx, module.nf = module.weight.shape
    else:
        module.out_features, module.in_features = module.weight.shape


@dataclasses.dataclass(frozen=True)
class Slice:
    """Rows or columns ``[start, stop)`` of a weight; ``zero`` for a row-wise bias on ranks other than the first."""

    dim: int
    start: int
    stop: int
    zero: bool = False

    def __call__(self, tensor):
        if self.zero:
            return torch.zeros_like(tensor)
        return tensor.narrow(self.dim, self.start, self.stop - self.start)

    def shape_of(self, shape):
        shape = list(shape)
        if not self.zero:
            shape[self.dim] = self.stop - self.start
        return torch.Size(shape)


@dataclasses.dataclass(frozen=True)
class Rows:
    """Several row ranges ``((start, stop), ...)`` of a weight or bias along ``dim`` (1: a Conv1D's outputs),
    concatenated: this rank's heads of a fused q/k/v projection (its queries, and the key and value they read)."""

    ranges: tuple
    dim: int = 0

    def __call__(self, tensor):
        return torch.cat([tensor.narrow(self.dim, start, stop - start) for start, stop in self.ranges], dim=self.dim)

    def shape_of(self, shape):
        shape = list(shape)
        shape[self.dim] = sum(stop - start for start, stop in self.ranges)
        return torch.Size(shape)


def grouped_qkv_rows(layout, tp, rank):
    """The rows of this rank's heads in a fused q/k/v output grouped per key/value head (for each: its query heads,
    its key, its value): the rank's query heads, and the key and value of each group they fall in."""
    heads, kv, head_dim = layout.num_heads, layout.num_kv_heads, layout.head_dim
    per_group = heads // kv
    first, last = _even(heads, tp, rank, "attention heads")
    ranges = []
    for group in range(kv):
        base, group_first = group * (per_group + 2) * head_dim, group * per_group
        lo, hi = max(first, group_first), min(last, group_first + per_group)
        if lo < hi:
            ranges.append((base + (lo - group_first) * head_dim, base + (hi - group_first) * head_dim))
            ranges.append((base + per_group * head_dim, base + (per_group + 2) * head_dim))  # its key and value
    return _rows(ranges)


def stacked_qkv_rows(layout, tp, rank, dim=0):
    """The rows of this rank's heads in a fused q/k/v output of all the queries, then all the keys, then all the
    values: its query heads, and the key/value heads they read, of each block."""
    heads, kv, head_dim = layout.num_heads, layout.num_kv_heads, layout.head_dim
    first, last = _even(heads, tp, rank, "attention heads")
    kv_first, kv_last = first * kv // heads, max(first * kv // heads + 1, last * kv // heads)
    q_rows, kv_rows = heads * head_dim, kv * head_dim
    return _rows([(first * head_dim, last * head_dim),
                  (q_rows + kv_first * head_dim, q_rows + kv_last * head_dim),
                  (q_rows + kv_rows + kv_first * head_dim, q_rows + kv_rows + kv_last * head_dim)], dim)


def _rows(ranges, dim=0):
    """One Slice, or Rows, of ``ranges`` (adjacent ones merged)."""
    merged = [ranges[0]]
    for start, stop in ranges[1:]:
        if start == merged[-1][1]:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return Slice(dim, *merged[0]) if len(merged) == 1 else Rows(tuple(merged), dim)


def _even(n, tp, rank, what):
    if n % tp:
        raise ValueError(f"{what} ({n}) is not divisible by inference_tp_size={tp}")
    part = n // tp
    return part * rank, part * (rank + 1)


def _is_attention(module):
    return "attention" in type(module).__name__.lower()


def local_head_counts(layout, tp_size, splits_attention):
    """(query heads, key/value heads) of each rank's attention, which its KV cache holds.

    ``splits_attention``: whether the plan splits the attention projections at all. When it does not (the plan
    replicates attention, e.g. Olmo2's q/k/v ``colwise_gather_output``), every rank keeps the config's head counts.
    When it does, the query heads are split evenly and the key/value heads too when their number divides by the group
    size; with fewer key/value heads than ranks each rank keeps one.
    """
    heads, kv = layout.num_heads, layout.num_kv_heads
    if not splits_attention:
        return heads, kv
    if heads % tp_size:
        raise ValueError(f"{heads} attention heads cannot be split over inference_tp_size={tp_size}")
    if kv % tp_size and tp_size % kv:
        raise ValueError(f"{kv} key/value heads can be neither split over nor replicated to "
                         f"inference_tp_size={tp_size} ranks")
    return heads // tp_size, max(1, kv // tp_size)


def _refuse_sliced_projections(config):
    """Bloom's ``slow_but_exact`` with ``pretraining_tp`` > 1 multiplies slices of its output projections' weights
    itself (``F.linear`` on ``dense.weight[:, ...]``), past the layer and its all-reduce: each rank would keep only its
    partial sum."""
    cfg = config.get_text_config(decoder=True)
    if getattr(cfg, "slow_but_exact", False) and (getattr(cfg, "pretraining_tp", 1) or 1) > 1:
        raise NotImplementedError(f"{cfg.model_type} with slow_but_exact=True and pretraining_tp={cfg.pretraining_tp} "
                                  "computes its output projections from slices of their weights outside the layers, "
                                  "which inference tensor parallelism cannot split: set slow_but_exact=false in the "
                                  "model's config.json, or use inference_tp_size=1")


class ShardPlan:
    """How this rank's inference copy slices each split linear layer, and what its attention modules must be told."""

    def __init__(self, model, layers_prefix, tp):
        self.tp = tp
        self.layout = HeadLayout.of(model.config)
        _refuse_sliced_projections(model.config)
        self.styles = sharded_linears(model, layers_prefix)
        # Plans such as Olmo2's replicate attention (q/k/v ``colwise_gather_output``, o_proj ``rowwise_split_input``):
        # then every rank computes, and caches, all the heads.
        self.splits_attention = any(_is_attention(model.get_submodule(block))
                                    for block in {name.rpartition(".")[0] for name in self.styles})
        self.local_heads, self.local_kv_heads = local_head_counts(self.layout, tp.size, self.splits_attention)
        self.slices = {}  # parameter name -> Slice
        for name, style in self.styles.items():
            linear = model.get_submodule(name)
            attention = _is_attention(model.get_submodule(name.rpartition(".")[0]))
            self.slices.update(self._linear_slices(name, linear, style, attention))

    def _linear_slices(self, name, linear, style, in_attention):
        tp, rank = self.tp.size, self.tp.rank
        in_features, out_features, out_dim = _features(linear)
        if style in (QKV, STACKED_QKV):
            layout = self.layout
            if out_features != (layout.num_heads + 2 * layout.num_kv_heads) * layout.head_dim:
                raise NotImplementedError(
                    f"{name} has {out_features} outputs, not the fused queries, keys and values of "
                    f"{layout.num_heads} heads and {layout.num_kv_heads} key/value heads of {layout.head_dim} that "
                    "inference tensor parallelism splits (use inference_tp_size=1)")
            if style == QKV:
                rows, bias_rows = grouped_qkv_rows(layout, tp, rank), None
            else:
                rows = stacked_qkv_rows(layout, tp, rank, out_dim)
                bias_rows = stacked_qkv_rows(layout, tp, rank)
            slices = {f"{name}.weight": rows}
            if linear.bias is not None:
                slices[f"{name}.bias"] = bias_rows or rows
            return slices
        if style == STACKED_PAIR:
            half = out_features // 2
            start, stop = _even(half, tp, rank, f"{name} output size (each half)")
            slices = {f"{name}.weight": _rows([(start, stop), (half + start, half + stop)], out_dim)}
            if linear.bias is not None:
                slices[f"{name}.bias"] = _rows([(start, stop), (half + start, half + stop)])
            return slices
        if style == ROWWISE:
            start, stop = _even(in_features, tp, rank, f"{name} input size")
            slices = {f"{name}.weight": Slice(1 - out_dim, start, stop)}
            if linear.bias is not None:
                slices[f"{name}.bias"] = Slice(0, 0, linear.bias.shape[0], zero=not self.tp.is_leader)
            return slices
        layout = self.layout
        kv_rows = layout.num_kv_heads * layout.head_dim
        if in_attention and layout.num_kv_heads != layout.num_heads and out_features == kv_rows \
                and layout.num_kv_heads % tp:
            # Fewer key/value heads than ranks: each rank keeps the one its query heads read.
            head = rank * layout.num_kv_heads // tp
            start, stop = head * layout.head_dim, (head + 1) * layout.head_dim
        else:
            start, stop = _even(out_features, tp, rank, f"{name} output size")
        slices = {f"{name}.weight": Slice(out_dim, start, stop)}
        if linear.bias is not None:
            slices[f"{name}.bias"] = Slice(0, start, stop)
        return slices

    def apply(self, model):
        """Shrink ``model`` (a meta-device copy) to this rank's shard and install the all-reduces."""
        for name, style in self.styles.items():
            linear = model.get_submodule(name)
            for leaf in ("weight", "bias"):
                param = getattr(linear, leaf)
                if param is not None:
                    shape = self.slices[f"{name}.{leaf}"].shape_of(param.shape)
                    setattr(linear, leaf, nn.Parameter(torch.empty(shape, dtype=param.dtype, device=param.device),
                                                       requires_grad=False))
            _set_features(linear)
            if style == ROWWISE:
                linear.register_forward_hook(self._all_reduce_output)
        for block_name in {name.rpartition(".")[0] for name in self.styles}:
            block = model.get_submodule(block_name)
            if _is_attention(block):
                self._refuse_per_head_state(block_name, block)
                self._localise_heads(block)
                if self.local_heads != self.layout.num_heads:
                    block.register_forward_pre_hook(self._own_heads_of_bias, with_kwargs=True)

    def _refuse_per_head_state(self, name, attention):
        """Per-head weights outside the split projections (e.g. StableLM's per-head q/k LayerNorms, Cohere's (heads,
        head_dim) q/k norms) would stay whole while the heads are split: refuse rather than compute wrong values."""
        heads = {self.layout.num_heads, self.layout.num_kv_heads}
        split = {f"{leaf}.{p}" for leaf in (n.rsplit(".", 1)[-1] for n in self.styles if n.startswith(name + "."))
                 for p in ("weight", "bias")}
        for child_name, child in attention.named_modules():
            if isinstance(child, nn.ModuleList) and len(child) in heads:
                raise NotImplementedError(f"{name}.{child_name} holds one module per attention head; inference tensor "
                                          "parallelism cannot split it (use inference_tp_size=1)")
        for param_name, param in attention.named_parameters():
            if param_name not in split and param.dim() >= 2 and param.shape[0] in heads:
                raise NotImplementedError(f"{name}.{param_name} {tuple(param.shape)} looks per-head; inference "
                                          "tensor parallelism cannot split it (use inference_tp_size=1)")

    def _localise_heads(self, attention):
        layout = self.layout
        for attr in _HEAD_ATTRS:
            if getattr(attention, attr, None) == layout.num_heads:
                setattr(attention, attr, self.local_heads)
        for attr in _KV_HEAD_ATTRS:
            if getattr(attention, attr, None) == layout.num_kv_heads:
                setattr(attention, attr, self.local_kv_heads)
        for attrs, full, local in ((_WIDTH_ATTRS, layout.num_heads, self.local_heads),
                                   (_KV_WIDTH_ATTRS, layout.num_kv_heads, self.local_kv_heads)):
            for attr in attrs:
                if getattr(attention, attr, None) == full * layout.head_dim:
                    setattr(attention, attr, local * layout.head_dim)
        if hasattr(attention, "num_key_value_groups"):
            attention.num_key_value_groups = self.local_heads // self.local_kv_heads
        config = getattr(attention, "config", None)
        if config is not None:
            # Phi-3's attention reads its query width from its config's head count: give it counts of its own
            local = {field: count for field, full, count in
                     (("num_attention_heads", layout.num_heads, self.local_heads),
                      ("num_key_value_heads", layout.num_kv_heads, self.local_kv_heads))
                     if layout_field(config, field) == full}
            if local:
                attention.config = LocalHeadsConfig(config, **local)

    def _own_heads_of_bias(self, module, args, kwargs):
        """A bias per query head narrowed to this rank's heads: a mask of (batch, heads, q, k) (Falcon folds ALiBi
        into it) and Bloom's ``alibi`` of (batch * heads, 1, k). Masks shared by all heads (one row of heads) pass as
        they are."""
        heads = self.layout.num_heads
        first, _ = _even(heads, self.tp.size, self.tp.rank, "attention heads")
        mask, alibi = kwargs.get("attention_mask"), kwargs.get("alibi")
        if not (torch.is_tensor(mask) and mask.dim() == 4 and mask.shape[1] == heads) and not torch.is_tensor(alibi):
            return None
        if torch.is_tensor(mask) and mask.dim() == 4 and mask.shape[1] == heads:
            kwargs["attention_mask"] = mask.narrow(1, first, self.local_heads)
        if torch.is_tensor(alibi):
            kwargs["alibi"] = alibi.unflatten(0, (-1, heads)).narrow(1, first, self.local_heads).flatten(0, 1)
        return args, kwargs

    def _all_reduce_output(self, module, inputs, output):
        dist.all_reduce(output, group=self.tp.group)
        return output


class LocalHeadsConfig:
    """The model's config as one attention module of a rank's shard reads it: its own head counts, every other field
    the shared config's, read (and written) live: dschat switches the attention implementation on the shared config
    for each generation (``models.attention.sdpa_replaced``), which a copy would not see."""

    def __init__(self, config, **local):
        object.__setattr__(self, "_shared", config)
        object.__setattr__(self, "_local", local)

    def __getattr__(self, name):  # (only for names not on the instance: everything but _shared and _local)
        if name.startswith("__") or name in ("_shared", "_local"):
            raise AttributeError(name)
        local = self._local
        return local[name] if name in local else getattr(self._shared, name)

    def __setattr__(self, name, value):
        if name in self._local:
            self._local[name] = value
        else:
            setattr(self._shared, name, value)


def check_splits(config, tp_size):
    """Raise what the inference copy's ``ShardPlan`` would for a causal LM of ``config`` split over ``tp_size`` ranks
    (no plan for the family, a layer it cannot split, head counts that do not divide), before any weight loads: the
    model is built on the meta device (no memory, no weights), then planned and shrunk as the inference copy is."""
    from transformers import AutoModelForCausalLM

    from dschat.models.layers import decoder_layer_list

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # a model that cannot be built this way (remote code, no causal-LM class): the engine checks
        return         # the real one when it builds its inference copy
    group = TensorParallelGroup(tp_size, 0, list(range(tp_size)), None)  # rank 0's plan: every rank's splits alike
    ShardPlan(model, decoder_layer_list(model)[0], group).apply(model)


# -- prompts in, answers out -------------------------------------------------------------------------------------------
@dataclasses.dataclass
class GroupBatch:
    """The group's prompts, LEFT-padded to the longest, in rank order; and where this rank's rows are."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    row_start: int
    rows: int
    prompt_len: int  # this rank's own prompt length
    # (group rows,) the column where each row's own prompt begins (the longest prompt's length minus its rank's): the
    # repetition penalty counts a row's tokens as HF would on that rank's own batch
    prompt_start: torch.Tensor = None

    def own_rows(self, generation):
        """This rank's part of the group's ``decode.Generation``: its rows, its own prompt width, trimmed to its own
        longest answer."""
        rows = slice(self.row_start, self.row_start + self.rows)
        own_lengths = generation.lengths[rows]
        group_prompt = self.input_ids.shape[1]
        n = int(own_lengths.max()) if self.rows else 0
        own = generation.sequences[rows, group_prompt - self.prompt_len:group_prompt + n].contiguous()
        logprobs = generation.logprobs[rows, :n].contiguous() if generation.logprobs is not None else None
        return dataclasses.replace(generation, sequences=own, lengths=own_lengths, logprobs=logprobs)


def _all_gather(tensor, group, size):
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def gather_prompts(input_ids, attention_mask, pad_token_id, tp):
    """Concatenate the group's prompts (shapes may differ per rank) into one LEFT-padded batch."""
    device = input_ids.device
    shape = torch.tensor(input_ids.shape, dtype=torch.long, device=device)
    shapes = [tuple(int(v) for v in s) for s in _all_gather(shape, tp.group, tp.size)]
    max_rows = max(rows for rows, _ in shapes)
    max_len = max(length for _, length in shapes)
    rows, length = input_ids.shape
    ids = torch.full((max_rows, max_len), pad_token_id, dtype=input_ids.dtype, device=device)
    mask = torch.zeros((max_rows, max_len), dtype=attention_mask.dtype, device=device)
    ids[:rows, max_len - length:] = input_ids
    mask[:rows, max_len - length:] = attention_mask
    all_ids = _all_gather(ids, tp.group, tp.size)
    all_mask = _all_gather(mask, tp.group, tp.size)
    group_ids = torch.cat([part[:r] for part, (r, _) in zip(all_ids, shapes)])
    group_mask = torch.cat([part[:r] for part, (r, _) in zip(all_mask, shapes)])
    row_start = sum(r for r, _ in shapes[:tp.rank])
    prompt_start = torch.cat([torch.full((r,), max_len - n, dtype=torch.long, device=device) for r, n in shapes])
    return GroupBatch(group_ids, group_mask, row_start, rows, length, prompt_start)


def check_same_in_group(tp, device, **settings):
    """The group runs one generation: its members must ask for the same one (else collectives would mismatch)."""
    values = torch.tensor([float(v) for v in settings.values()], dtype=torch.float64, device=device)
    parts = _all_gather(values, tp.group, tp.size)
    for part in parts[1:]:
        if not torch.equal(part, parts[0]):
            got = {k: [p[i].item() for p in parts] for i, k in enumerate(settings)}
            raise ValueError(f"ranks of one inference tensor-parallel group asked for different generations: {got}")


def shared_generator(generator, default, device, tp):
    """A generator on ``device`` holding the group leader's sampling state (its ``generator``, else ``default``)."""
    state = (generator if generator is not None else default).get_state()
    buffer = state.to(device)
    dist.broadcast(buffer, src=tp.leader, group=tp.group)
    shared = torch.Generator(device=device)
    shared.set_state(buffer.cpu())
    return shared
