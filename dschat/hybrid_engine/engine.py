"""The switch between training (DeepSpeed ZeRO) and generation (dschat's static-cache decode) for the PPO actor.

``HybridEngine`` keeps DeepSpeed's hybrid-engine contract so DeepSpeed-Chat-style trainers work unchanged:
``eval()`` -> ``generate(...)`` (also reachable as ``engine.module.generate``) -> ``train()`` -> forward/backward ->
``step()``. Everything it does not define is the wrapped ``DeepSpeedEngine``'s.

Generation reads the training parameters themselves (ZeRO 0-2 without LoRA, ZeRO-3 unpinned) or a copy of them (ZeRO-3
pinned, LoRA merged, inference tensor parallelism: ``weights.py``), which the first generation after a change brings up
to date. What marks that copy stale: every optimizer step DeepSpeed applied, taken through this wrapper's ``step()`` or
through the DeepSpeed engine's own (read from its step counts at each generation: a skipped step or a ``step()``
between accumulation boundaries refreshes nothing), ``load_state_dict`` into ``engine.module`` or the HF model inside
a PEFT one (a post-hook; DeepSpeed's ``load_checkpoint`` loads through it), an in-place write into a training parameter
that bumps its version counter or moves its storage, read at each generation (``weights.write_mark``: ``p.copy_(...)``
under ``torch.no_grad()``, ``p.data = t``, and under ZeRO-3 any write inside ``GatheredParameters(modifier_rank=...)``),
and ``mark_weights_stale()``. A write through ``p.data`` outside ZeRO-3 (``p.data.copy_(...)``, e.g. from an EMA model:
``.data`` has a version counter of its own, and nothing on the host moves: ``weights.write_mark``) is not seen by
what a copy owns (LoRA-adapted weights and matrices, tensor-parallel slices): call ``mark_weights_stale()`` before the
next generation (``DSCHAT_CHECK_WEIGHTS=1``, a debugging aid, finds such writes by checksums:
``InferenceCopy._find_unmarked_writes``).
A parameter replaced by another object is followed by neither DeepSpeed's optimizer nor the copy: ``load_state_dict``
with ``assign=True`` is refused before it loads (``_RefusesAssignedLoad``), other module surgery
(``resize_token_embeddings``, PEFT's ``merge_and_unload``) at the next ``eval()``/``generate`` or ``train()`` that
begins a train phase (``ParameterPlaces``; in an inference tensor-parallel group under ZeRO 0-2 at ``generate`` and
that ``train()`` alone, where the group meets: every rank of the group stops, ranks outside it are not told).
Under ZeRO-3 on several ranks the ranks agree at each ``eval()`` and ``generate`` and at the ``train()`` that begins a
train phase (which every rank calls together there): a copy stale on one rank (a load on rank 0 alone, inside
``GatheredParameters(modifier_rank=0)``) is refreshed on all, and surgery on one rank stops all. The fused projections
(``fusion.py``) are rewritten at every generation and never behind.
"""
import contextlib
import dataclasses
import functools
import time
import weakref

import torch
import torch.distributed as dist

from dschat.args import check_compile_mode
from dschat.compat import checkpointing_enable_call, disable_activation_checkpointing
from dschat.hybrid_engine.attention import decode_attention as decode_attention_kernel
from dschat.hybrid_engine.attention import resolve_mode as resolve_decode_attention
from dschat.hybrid_engine.cache import KVCache, longest_cache
from dschat.hybrid_engine.config import HybridEngineConfig
from dschat.hybrid_engine.decode import (check_decodable, generate_tokens, joined_generations,
                                         prompt_length_groups)
from dschat.hybrid_engine.fusion import ProjectionFusion
from dschat.hybrid_engine.fusion import resolve_mode as resolve_fuse_projections
from dschat.hybrid_engine.graphs import GraphDecoder, default_generator
from dschat.hybrid_engine.generate_args import (check_generation_config, check_hf_kwargs, merged_generation_config,
                                                left_padded_lengths, resolve_settings)
from dschat.hybrid_engine.tensor_parallel import (TensorParallelGroup, check_same_in_group, gather_prompts,
                                                  shared_generator)
from dschat.hybrid_engine.weights import ParameterPlaces, build_inference_weights
from dschat.models.loading import generable_token_count
from dschat.models.lora import unwrap_peft
from dschat.models.positions import bias_counts_key_slots, position_limit, position_table
from dschat.models.left_padding import left_padding_moves, warn_of_padded_generation
from dschat.models.training_engine import first_release, is_released, released_as
from dschat.utils.dist import in_step_with_other_ranks, print_beside_progress_bars

# The engine's meetings of the ranks that generate together (a ZeRO-3 world, an inference tensor-parallel group), in
# their order: eval(); generate()'s arguments, then its weight check; the train() that begins a train phase
# (_refuse_surgery_before_training). A tensor-parallel group without ZeRO-3 meets in generate()'s arguments and at that
# train() alone. Each rank says which one it is in (``_ranks_agree_on``), so a rank that called generate() alone, whose
# collective would pair with another call of the others (their next eval(), say) and put the ranks out of step, stops
# every rank with an error that says so. A lone eval() + generate() makes a rollout's meetings and meets the others'
# next rollout: it is caught at the others' next train() (its next meeting, eval() under ZeRO-3, generate() in a group,
# meets that one), not where a collective of the others comes first (within a train phase, or under ZeRO-3 a forward
# before train(): README).
_MEETINGS = ("eval()", "generate()", "generate()'s weight check", "train()")

# the most flags a meeting agrees on: the weight check's (copy fresh, parameters in place); generate()'s arguments in a
# tensor-parallel group without ZeRO-3 (arguments accepted, parameters in place)
_AGREED_FLAGS = 2

# what a rank whose flag is set reduces: above any rank, so the MIN is the lowest rank whose flag is unset
_NO_RANK = torch.iinfo(torch.int32).max


def _ranks_agree_on(meeting, flags, device, group=None):
    """For each of ``flags``: None where it is set on every rank of ``group`` (default: the world), else the lowest
    global rank where it is not (so a rank's error can say which rank to look at), in one all-reduce that also
    compares the ranks' ``meeting`` (one of ``_MEETINGS``): ranks in different ones all raise the same error. Every
    meeting reduces as many flags (the rest set), so ranks in different meetings still reduce tensors of one size,
    and learn it."""
    code = _MEETINGS.index(meeting) + 1
    rank = dist.get_rank()
    padded = [*(_NO_RANK if flag else rank for flag in flags), *[_NO_RANK] * (_AGREED_FLAGS - len(flags))]
    t = torch.tensor([*padded, code, -code], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    *unset_on, lowest, highest = t.tolist()  # (one copy to the host)
    unset_on, highest = unset_on[:len(flags)], -highest
    if lowest != highest:
        other = _MEETINGS[(highest if lowest == code else lowest) - 1]
        raise RuntimeError(f"hybrid engine: the ranks are out of step: this rank is in {meeting} while another is in "
                           f"{other}. Under ZeRO-3 on several ranks eval(), generate() (engine.module.generate too) "
                           "and the train() that begins a train phase are collectives, and in an inference "
                           "tensor-parallel group under ZeRO 0-2 so are generate() and that train(): every rank calls "
                           "them together, in the same order, each with its own prompts. A call on some ranks alone (a "
                           "sample generated under `if rank == 0:`) pairs with the other ranks' next call, or waits "
                           "for ever where they make none: generate on every rank, print on rank 0")
    return [None if unset == _NO_RANK else unset for unset in unset_on]


def _refuse_replaced(name, cause=None, on_rank=None):
    """A parameter of the actor, or a module on the way to one, replaced since the engine was built (module surgery
    after ``deepspeed.initialize``: ``ParameterPlaces``) is an error: DeepSpeed's optimizer would go on training the old
    parameters and an inference copy would generate from them. ``name``: the one replaced on this rank, or None where
    another rank's was (under ZeRO-3, and in an inference tensor-parallel group, the ranks agree on it, and all
    stop): ``on_rank``, the lowest global rank where one was (``_ranks_agree_on``), whose log holds the named error.
    ``cause``: this rank's own refusal of the call's arguments, raised with it."""
    where = f"the actor's {name!r} is" if name is not None else \
        f"on another rank, rank {on_rank} (the lowest if several), a parameter of the actor (its error names it) is"
    raise RuntimeError(
        f"hybrid engine: {where} no longer the one DeepSpeed's optimizer and this engine were "
        "built with: it was replaced (load_state_dict(assign=True) into a submodule, resize_token_embeddings, "
        "PEFT's merge_and_unload, a module or parameter set by hand). DeepSpeed would go on training the old "
        "parameters, and generation would not follow: change the model before deepspeed.initialize and build "
        "the engines after it; load weights with load_state_dict without assign=True (it copies into the "
        "parameters)") from cause


def _synchronize():
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()


def _is_rank_0():
    return not dist.is_initialized() or dist.get_rank() == 0


def _world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def _zero3_world(ds_engine):
    """Whether the actor's weights are ZeRO-3 shards over several ranks (each refresh gathers over the world)."""
    return _world_size() > 1 and ds_engine.zero_optimization_stage() == 3


@dataclasses.dataclass
class IterationStats:
    """One PPO iteration: its rollout (one generation or more) and the training on it, from the ``eval()`` that
    begins the rollout to the first ``eval()`` after a train phase. Samples and tokens are this rank's."""

    start: float
    gather_s: float = 0.0
    generate_s: float = 0.0
    training_s: float = 0.0  # all its train phases (train() to the next eval())
    generated_tokens: int = 0
    samples: int = 0
    trained: bool = False  # a train phase began in it: the next eval() closes it
    end: float = None
    # once closed: its number (1, 2, ...) and this rank's samples and the E2E latencies of iterations 1..index
    index: int = None
    total_samples: int = 0
    total_e2e_s: float = 0.0

    def e2e_s(self, now):
        return (self.end if self.end is not None else now) - self.start


class HybridEngine:
    """Wraps the actor's ``DeepSpeedEngine``; generation reads :class:`InferenceWeights` through a static KV cache."""

    def __init__(self, ds_engine, config=None, pad_token_id=None, eos_token_id=None, early_exit_interval=8,
                 log_on_eval=False, compile_decode_step=None, decode_attention="auto", fuse_projections="auto",
                 compile_prefill=True, token_count=None):
        check_compile_mode(compile_decode_step)
        if type(ds_engine).__name__ == "DeepSpeedHybridEngine":
            raise ValueError("the actor was built with DeepSpeed's own hybrid engine; pass the DeepSpeed config "
                             "through strip_deepspeed_hybrid_engine() before deepspeed.initialize")
        self._engine = ds_engine
        # the engine's step counts when this engine last knew its weights (a step through the DeepSpeed engine itself
        # moves them: _follow_engine_steps)
        self._step_counts_seen = _step_counts(ds_engine)
        self.hybrid_config = config if config is not None else HybridEngineConfig(enabled=True)
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.early_exit_interval = early_exit_interval
        self.log_on_eval = log_on_eval
        # how many ids may be generated (models.loading.generable_token_count): rows from it on, which no token has,
        # are never chosen
        self.token_count = token_count
        # inference_tp_size > 1: this rank's group of ranks generates together, each holding a slice of the model.
        tp_size = self.hybrid_config.inference_tp_size
        self.tp = TensorParallelGroup.create(tp_size) if tp_size > 1 else None
        try:
            self._build_generation(ds_engine, decode_attention, fuse_projections, compile_decode_step,
                                   compile_prefill)
        except BaseException:
            if self.tp is not None:  # (no engine would release it; every rank fails alike: the same model and settings)
                self.tp.destroy()
            raise
        # Stats
        self._iteration = None  # IterationStats in progress (inside evaluation(): the evaluation's)
        self.last_iteration = None  # the last completed one
        self.last_evaluation = None  # the stats of the last evaluation() block
        self._iterations_done = 0
        self._total_samples = 0  # this rank's, over the completed iterations
        self._total_e2e_s = 0.0
        self._train_start = None  # when the train phase in progress began
        self._evaluating = False
        _wrappers_of(ds_engine).add(self)
        self.route_module_generate()
        self._load_hooks = _watch_loads(ds_engine.module, self)
        # where the actor's parameters sit, checked at each eval()/generate and train phase: surgery since is refused
        self._parameter_places = ParameterPlaces(ds_engine.module)
        released_as(ds_engine, self)  # (a step run's, or a notebook engine's failed build's, released_engines block)

    def _build_generation(self, ds_engine, decode_attention, fuse_projections, compile_decode_step, compile_prefill):
        """What generating reads: the inference weights, the KV cache, the fused projections and the graph path. Where
        any of it cannot be built (a model the group cannot split: GPT-2's fused qkv, per-head norms, MoE; a setting
        refused, e.g. a misspelt decode_attention), ``__init__`` destroys the group it has just made."""
        check_decodable(ds_engine.module)
        self.inference_weights = build_inference_weights(ds_engine.module, self.hybrid_config,
                                                         ds_engine.zero_optimization_stage(), ds_engine.device,
                                                         tp=self.tp)
        # decode_attention: "triton" runs one-token attention with dschat's flash-decoding kernel (attention.py) and
        # writes each new token into the KV cache with one kernel, and chooses tokens in one pass over the logits where
        # it can (triton_sampling.py); "sdpa" leaves the model's SDPA, transformers' cache update and torch's
        # sampling; "auto" picks triton on CUDA when it is installed.
        self.decode_attention = resolve_decode_attention(decode_attention, ds_engine.device)
        model_config = unwrap_peft(self.inference_weights.model).config
        self.kv_cache = KVCache(model_config, num_kv_heads=self.inference_weights.num_kv_heads,
                                token_writes=self.decode_attention == "triton")
        self.longest_cache = longest_cache(model_config)  # (GPT-Neo's local window; None for most models)
        # fuse_projections: linears that read the same input (q/k/v, ...) run as one GEMM while generating (fusion.py);
        # "auto": on CUDA, with or without a compiled decode step (OPT-1.3B, batch 64: 0.839 s compiled and fused,
        # 0.893 s compiled alone; docs/benchmarks.md). Never when every forward gathers ZeRO-3 shards (nothing whole
        # to copy).
        fuse = resolve_fuse_projections(fuse_projections, ds_engine.device) \
            and not self.inference_weights.forward_has_collectives
        self.fusion = ProjectionFusion(unwrap_peft(self.inference_weights.model)) if fuse else None
        # enable_cuda_graph: decode steps replayed from CUDA graphs; falls back to the eager loop where it cannot.
        # compile_decode_step (a torch.compile mode) also compiles the forward inside the graph and, unless
        # compile_prefill is False, the prefill.
        # (the graphs round the cache's length up, but never past max_out_tokens or the model's longest cache)
        cache_cap = min(filter(None, (self.hybrid_config.max_out_tokens, self.longest_cache)), default=None)
        self.graph_decoder = GraphDecoder(self.kv_cache, compile_mode=compile_decode_step,
                                          token_sync=self.tp.share_tokens if self.tp else None,
                                          group_agrees=self._group_agrees if self.tp else None,
                                          compile_prefill=compile_prefill, max_out_tokens=cache_cap) \
            if self.hybrid_config.enable_cuda_graph else None

    # -- delegation to the DeepSpeed engine -------------------------------------------------------------------------
    def __getattr__(self, name):
        # Only called for attributes not found on the wrapper: forward, backward, module, optimizer, ...
        if name == "_engine":
            raise AttributeError(name)
        return getattr(self._engine, name)

    def __call__(self, *args, **kwargs):
        return self._engine(*args, **kwargs)

    @property
    def ds_engine(self):
        return self._engine

    # DeepSpeed-Chat's step-3 loop switches the actor's checkpointing on for each PPO update and off after it
    # (rlhf_engine.actor.gradient_checkpointing_enable()): forwarded, that reached transformers' deprecated name (a
    # FutureWarning on every call; gone in transformers 6), so the engine takes the call itself
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        checkpointing_enable_call(self.module, gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self):
        disable_activation_checkpointing(self.module)

    def route_module_generate(self):
        """Make ``engine.module.generate`` (DeepSpeed-Chat's call site) this engine's ``generate``. Another
        HybridEngine of the same DeepSpeed engine keeps its place behind it: released, this one hands the module's
        generate back to it."""
        module = self._engine.module
        routed = module.__dict__.get("generate")
        if isinstance(routed, _RoutedGenerate) and routed.routes(module):
            routed.add(self)
            return
        # An instance attribute shadows the class's generate; nn.Module stores plain callables in __dict__.
        object.__setattr__(module, "generate", _RoutedGenerate(self, module))

    def release_generation(self):
        """Drop what generating keeps (the captured decode steps and compiled forwards, the KV cache, the fused
        projections and the inference copy of the weights: their memory goes now, not when the last reference to this
        engine does, e.g. a notebook's trainer) and destroy the inference tensor-parallel group this engine made
        (``release_engine`` calls it). Every rank of the world releases its engine at the same point, as it built it.
        The engine cannot generate afterwards; its module's ``generate`` is the model class's again (or another
        HybridEngine's of the same DeepSpeed engine, where one is left). Once: a second
        call does nothing (``release_engine``'s record of released engines says whether it was made)."""
        if not first_release(self):
            return
        self._unroute_module_generate()
        for hook in self._load_hooks:
            hook.remove()
        if self.graph_decoder is not None:
            self.graph_decoder.drop()  # (the captured steps hold the cache's storage and the group's collectives)
            self.graph_decoder = None
        self.kv_cache.release()
        self.fusion = None
        self.inference_weights = None
        if self.tp is not None:
            self.tp.destroy()

    def _unroute_module_generate(self):
        """The module's generate goes to the latest other HybridEngine of this DeepSpeed engine not released (a
        second wrapper's, which deleting the route took from it), or to the model class's where none is left."""
        module = self._engine.module
        routed = module.__dict__.get("generate")
        if not isinstance(routed, _RoutedGenerate):
            return
        routed.discard(self)
        if routed.engine() is None:
            del module.__dict__["generate"]

    def _check_not_released(self):
        if is_released(self):
            raise RuntimeError("this hybrid engine was released (release_engine, DeepSpeedRLHFEngine.release()): it "
                               "cannot generate; build a new one")

    # -- mode switches ----------------------------------------------------------------------------------------------
    def eval(self):
        """Enter generation mode and bring the inference weights up to date.

        An iteration is a rollout and the training on it: the first ``eval()`` after a train phase closes it (and
        logs it with ``log_on_eval``) and begins the next. An ``eval()`` with no train phase since the iteration began
        (the next generation batch of a rollout, ``--generation_batches``) continues it: generation that no training
        follows is never an iteration of its own. A held-out evaluation stays out of the iterations in
        :meth:`evaluation`.
        """
        self._check_not_released()
        now = time.perf_counter()
        if not self._evaluating:
            self._end_train_phase(now)
            if self._iteration is not None and self._iteration.trained:
                self._close_iteration(now)
            if self._iteration is None:
                self._iteration = IterationStats(start=now)
        self._engine.eval()
        self._refresh_weights("eval()")
        return self

    def train(self, mode=True):
        """Enter training mode. A train phase lasts until the next ``eval()`` (or ``train(False)``, or a generation):
        DeepSpeed-Chat-style trainers call ``train()`` before every PPO micro-batch, and those calls continue the
        phase, so the iteration's training time is all of its training (DeepSpeed's hybrid engine adds it up in
        ``step()``). The train() that begins a phase refuses module surgery (``_refuse_surgery_before_training``)."""
        begins_phase = mode and self._train_start is None
        if begins_phase:
            self._refuse_surgery_before_training()
        self._engine.train(mode)
        now = time.perf_counter()
        if not mode:
            self._end_train_phase(now)
        elif begins_phase:
            self._train_start = now
            if self._iteration is not None:
                self._iteration.trained = True
        return self

    def _refuse_surgery_before_training(self):
        """A parameter of the actor replaced since the engine was built (``ParameterPlaces``) is refused before a train
        phase as at eval() and generate: a loop that trains without generating would have DeepSpeed's optimizer train
        the old parameters. Where ranks must train in step the ranks agree on it first, in one small all-reduce per
        train phase (not per micro-batch: DeepSpeed-Chat calls train() before each), so a replacement on one rank
        stops every rank there; a refusal on that rank alone would leave the others in their next collective. Under
        ZeRO-3 on several ranks that is the world (every forward already gathers over it, so every rank of a correct
        loop begins its train phases together); in an inference tensor-parallel group under ZeRO 0-2, the group (the
        gradient all-reduce, the train path's only collective there, is DeepSpeed's own buckets: nothing can ride
        it). Not once released (nothing is left to check)."""
        if is_released(self):
            return
        replaced = self._parameter_places.replaced()
        replaced_on = None
        if _zero3_world(self._engine):
            replaced_on, = _ranks_agree_on("train()", [replaced is None], self._engine.device)
        elif self.tp is not None:
            replaced_on, = _ranks_agree_on("train()", [replaced is None], self._engine.device, self.tp.group)
        if replaced is not None or replaced_on is not None:
            _refuse_replaced(replaced, on_rank=replaced_on)

    def _end_train_phase(self, now):
        if self._train_start is not None and self._iteration is not None:
            self._iteration.training_s += now - self._train_start
        self._train_start = None

    def _close_iteration(self, now):
        it, self._iteration = self._iteration, None
        it.end = now
        self._iterations_done += 1
        self._total_samples += it.samples
        self._total_e2e_s += it.e2e_s(now)
        it.index, it.total_samples, it.total_e2e_s = self._iterations_done, self._total_samples, self._total_e2e_s
        self.last_iteration = it
        if self.log_on_eval:
            self.log_stats(it)

    @contextlib.contextmanager
    def evaluation(self):
        """A block whose generations are no part of a PPO iteration (step 3's held-out evaluation): its ``eval()``
        calls neither close nor begin iterations, its time is left out of the E2E latency of the iteration in
        progress, and its stats (``latency_stats(engine.last_evaluation)``) count in no iteration or average."""
        if self._evaluating:
            yield self
            return
        start = time.perf_counter()
        self._end_train_phase(start)
        outer, self._iteration = self._iteration, IterationStats(start=start)
        self._evaluating = True
        try:
            yield self
        finally:
            end = time.perf_counter()
            self._end_train_phase(end)
            self._iteration.end = end
            self.last_evaluation, self._iteration = self._iteration, outer
            self._evaluating = False
            if outer is not None:
                outer.start += end - start  # the block's time is no part of the iteration's E2E

    def step(self, *args, **kwargs):
        """The DeepSpeed step; weights it changed are marked stale so the next generation refreshes them."""
        result = self._engine.step(*args, **kwargs)
        was_applied = getattr(self._engine, "was_step_applied", None)
        if was_applied is None or was_applied():
            self.mark_weights_stale()
        return result

    def load_checkpoint(self, *args, **kwargs):
        result = self._engine.load_checkpoint(*args, **kwargs)
        self.mark_weights_stale()
        return result

    def mark_weights_stale(self):
        """For code that changes the actor's weights in a way the engine does not see (module docstring): a write
        through ``p.data`` outside ZeRO-3 (``p.data.copy_(...)``, e.g. from an EMA model): the next generation
        refreshes the inference copy. Every HybridEngine of this DeepSpeed engine is marked: another's inference copy
        is as far behind."""
        counts = _step_counts(self._engine)
        for wrapper in list(_wrappers_of(self._engine)):
            if wrapper.inference_weights is not None:  # (None once released)
                wrapper.inference_weights.mark_stale()
                wrapper._step_counts_seen = counts  # (the steps so far are in this mark)

    def _follow_engine_steps(self):
        """Optimizer steps taken through the DeepSpeed engine itself since this engine last looked (a loop that kept
        the engine ``deepspeed.initialize`` returned and calls its ``step()``) mark the weights stale too: DeepSpeed's
        step counts say whether one was applied, so a skipped step (overflow) or a ``step()`` between accumulation
        boundaries refreshes nothing, and each HybridEngine of the engine looks for itself."""
        counts = _step_counts(self._engine)
        if _weights_moved(self._step_counts_seen, counts):
            self.inference_weights.mark_stale()
        self._step_counts_seen = counts

    def _refresh_weights(self, meeting):
        """``meeting``: the call it is part of (``_MEETINGS``), which every rank of a ZeRO-3 world must be in."""
        self._follow_engine_steps()
        self.inference_weights.follow_writes()  # in-place writes into the training parameters (weights.write_mark)
        if _zero3_world(self._engine):
            # the refresh gathers over the world: a load on one rank alone (into GatheredParameters with
            # modifier_rank=0, or a mark_weights_stale there) refreshes every rank's copy; surgery on one rank alone
            # stops every rank here (raised on that rank alone, it left the others in the gather)
            replaced = self._parameter_places.replaced()
            stale_on, replaced_on = _ranks_agree_on(meeting, (not self.inference_weights.is_stale, replaced is None),
                                                    self._engine.device)
            if replaced_on is not None:
                _refuse_replaced(replaced, on_rank=replaced_on)
            if stale_on is not None:
                self.inference_weights.mark_stale()
        elif self.tp is None:
            replaced = self._parameter_places.replaced()
            if replaced is not None:
                _refuse_replaced(replaced)
        # (a tensor-parallel group without ZeRO-3 meets in generate()'s argument check, which carries the surgery
        # check: _failing_together, and at the train() that begins a train phase. Its eval() has no collective, so a
        # refusal there would stop one rank and leave the others waiting in their generate)
        start = time.perf_counter()
        if self.inference_weights.refresh_if_stale():
            _synchronize()  # copies are asynchronous on accelerators; time them fully
            if self._iteration is not None:
                self._iteration.gather_s += time.perf_counter() - start

    # -- generation -------------------------------------------------------------------------------------------------
    # A caller's inference_mode would make the KV cache and other state kept across calls inference tensors, which
    # every later call outside it could no longer reset in place: generation never runs in it (it runs under no_grad).
    @torch.inference_mode(False)
    def generate(self, input_ids=None, attention_mask=None, max_new_tokens=None, do_sample=None, temperature=None,
                 top_k=None, top_p=None, eos_token_id=None, pad_token_id=None, generator=None, min_new_tokens=None,
                 max_length=None, min_length=None, return_logprobs=False, repetition_penalty=None, **hf_kwargs):
        """HF-``generate``-like: LEFT-padded prompts in, (B, P + n) sequences out, EOS'd rows padded with pad.

        ``max_length``/``min_length`` (totals, as DeepSpeed-Chat passes them) are converted to new-token counts; prompt
        + new tokens may not exceed ``hybrid_engine.max_out_tokens``, GPT-Neo's local attention window, nor a learned
        position table (GPT-2's, OPT's: a row's left padding takes no position). What is not given comes, as in HF, from
        the model's generation_config, then HF's defaults (e.g. ``top_k`` 50 when sampling); EOS and pad ids from the
        engine's tokenizer apply where neither the call nor a generation_config gives them. ``repetition_penalty`` (e.g.
        Qwen2.5-Instruct's generation_config sets 1.05) is HF's ``RepetitionPenaltyLogitsProcessor``, greedy or sampled:
        the logit of every token already in the row (prompt and answer so far; the prompt's left padding only with
        transformers < 5.23, as HF's own ``generate`` does) is divided by it when positive, multiplied by it when
        negative, before the ``min_new_tokens`` EOS suppression and temperature / top-k / top-p. With
        ``return_logprobs`` returns ``(sequences, logprobs)``: the (B, n) fp32 log-probability of each generated token
        under the model's unfiltered distribution at the sampling temperature (greedy: 1; no repetition penalty, top-k/p
        or EOS suppression: what step 3's training forward scores it with; 0 after a row's end), computed in the
        decode step. With the engine's ``token_count`` (``generable_token_count``, which step 3 gives it) no id from it on
        is generated: a model's embedding rows that no token has (Qwen2.5's 271) are left out of the choice as HF's
        ``suppress_tokens`` would leave them (greedy and sampled); HF's ``generate`` without it may pick one, an id that
        decodes to nothing. ``synced_gpus``,
        ``use_cache``, ``early_stopping`` (a beam-search setting), ``bos_token_id`` and ``renormalize_logits`` are
        accepted and change nothing (ranks are kept in step automatically when the forward needs it); other HF kwargs
        that would change the result (``num_return_sequences=2``, ``no_repeat_ngram_size``, beams, ...) are errors.
        Under ZeRO-3 on several ranks (and in a tensor-parallel group) every rank calls ``generate`` (and ``eval()``)
        together, each with its own prompts: the ranks agree on their arguments first, and a refusal on one stops them
        all, as does a rank found in another of the engine's calls (``_MEETINGS``: one that generates alone).
        """
        self._check_not_released()
        device = self._engine.device
        input_ids, s = self._resolved_call(device, input_ids, attention_mask, generator, hf_kwargs,
                                           max_new_tokens=max_new_tokens, max_length=max_length,
                                           min_new_tokens=min_new_tokens, min_length=min_length, do_sample=do_sample,
                                           temperature=temperature, top_k=top_k, top_p=top_p,
                                           repetition_penalty=repetition_penalty, eos_token_id=eos_token_id,
                                           pad_token_id=pad_token_id)
        attention_mask = s.attention_mask
        now = time.perf_counter()
        self._end_train_phase(now)  # generating (without eval()) ends a train phase: no time counted twice
        if self._iteration is None:
            self._iteration = IterationStats(start=now)
        self._refresh_weights("generate()'s weight check")
        start = time.perf_counter()
        model = self.inference_weights.model
        batch_size = input_ids.shape[0]
        sync_group = dist.group.WORLD if self.inference_weights.forward_has_collectives and _world_size() > 1 \
            else None
        own_generator, group_batch = generator, None
        if self.tp is not None:
            s, group_batch, generator = self._group_call(s, input_ids, generator, return_logprobs, device)
            input_ids, attention_mask = group_batch.input_ids, group_batch.attention_mask
            sync_group = self.tp.group  # the group's ranks decode in lock-step: they stop together
        sampling = dict(do_sample=s.do_sample, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                        eos_token_id=s.eos_list or None, pad_token_id=s.pad_token_id, min_new_tokens=s.min_new_tokens,
                        generator=generator, early_exit_interval=self.early_exit_interval,
                        repetition_penalty=s.repetition_penalty,
                        one_pass_sampling=self.decode_attention == "triton",  # dschat's Triton decode kernels
                        token_count=self.token_count,
                        # the group's prompts are padded to the longest: where each row's own prompt begins
                        prompt_start=group_batch.prompt_start if group_batch is not None else None)
        prompt_lengths = self._prompt_lengths_apart(attention_mask)
        was_training = model.training
        model.eval()  # no dropout while sampling, even if the caller skipped eval()
        try:
            if prompt_lengths is None:
                batches = [(input_ids, attention_mask)]
            else:  # (the rows have no padding left: their own prompts are all the penalty sees)
                groups = prompt_length_groups(input_ids, prompt_lengths)
                batches = [(ids, torch.ones_like(ids)) for _, ids in groups]
                sampling = {**sampling, "prompt_start": None}
            generations = self._decoded_in_step_with_other_ranks(
                lambda ids, mask: self._decode(model, ids, mask, s.max_new_tokens, device, sync_group,
                                               return_logprobs, sampling),
                batches, generator, device)
            result = generations[0] if prompt_lengths is None \
                else joined_generations(input_ids, groups, generations, s.pad_token_id)
            if group_batch is not None:
                result = group_batch.own_rows(result)
                batch_size = group_batch.rows
                if s.do_sample and self.tp.is_leader:  # the leader's generator moves on as the shared one did
                    (own_generator or default_generator(torch.device(device))).set_state(generator.get_state())
        finally:
            model.train(was_training)
            if self.hybrid_config.release_inference_cache:
                if self.graph_decoder is not None:
                    self.graph_decoder.drop()  # the graphs hold the cache's storage; they are captured again next time
                self.kv_cache.release()
        tokens = int(result.lengths.sum())  # waits for the decode's kernels: they count in the generate time
        self._iteration.generate_s += time.perf_counter() - start
        self._iteration.generated_tokens += tokens
        self._iteration.samples += batch_size
        return (result.sequences, result.logprobs) if return_logprobs else result.sequences

    def _resolved_call(self, device, input_ids, attention_mask, generator, hf_kwargs, **settings):
        """(the prompts on ``device``, the call's settings resolved as HF's ``generate`` resolves them), or an error,
        before the engine's state changes; on every rank that generates with this one, since a refusal on one rank
        alone would leave the others waiting in the weight gather or the group."""
        with self._failing_together(device):
            if input_ids is None:  # HF's name for the prompts (``generate(inputs=...)``)
                input_ids = hf_kwargs.pop("inputs", None)
            if input_ids is None:
                raise ValueError("generate needs the prompts: input_ids (or inputs), a LEFT-padded (B, P) tensor")
            # HF's generation_config argument (TRL passes one): its settings over the model's, the call's over both
            generation_config = self._generation_config(hf_kwargs.pop("generation_config", None))
            check_hf_kwargs(hf_kwargs)
            self.check_generation_config(hf_kwargs, generation_config)
            if generator is not None and generator.device.type != torch.device(device).type:
                raise ValueError(f"the sampling generator is on {generator.device} but generation runs on {device}; "
                                 f"create it with torch.Generator(device={str(device)!r})")
            input_ids = input_ids.to(device)
            s = resolve_settings(input_ids, attention_mask, generation_config, default_eos=self.eos_token_id,
                                 default_pad=self.pad_token_id, max_positions=self._max_positions(), **settings)
            # this rank's prompt: a tensor-parallel group's prompts, padded to its longest, then fit as well
            self._check_fits(input_ids.shape[1], s.max_new_tokens)
            self._check_positions(s.attention_mask, s.max_new_tokens)
        return input_ids, s

    def _group_call(self, s, input_ids, generator, return_logprobs, device):
        """A tensor-parallel group generates as one: (its settings, checked alike on every rank; the group's prompts,
        gathered; the sampling generator the group shares)."""
        if not s.do_sample:  # greedy ignores them (HF-style callers may pass None)
            s = dataclasses.replace(s, temperature=1.0, top_k=0, top_p=1.0)
        check_same_in_group(self.tp, device, max_new_tokens=s.max_new_tokens, min_new_tokens=s.min_new_tokens,
                            do_sample=s.do_sample, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                            pad_token_id=s.pad_token_id, return_logprobs=return_logprobs,
                            repetition_penalty=s.repetition_penalty,
                            eos_token_ids=hash(tuple(sorted(s.eos_list))) % 2**52)  # ints hash alike everywhere
        group_batch = gather_prompts(input_ids, s.attention_mask, s.pad_token_id, self.tp)
        if s.do_sample:
            generator = shared_generator(generator, default_generator(torch.device(device)), device, self.tp)
        return s, group_batch, generator

    def _prompt_lengths_apart(self, attention_mask):
        """Each row's prompt length where the model is of a family whose answers left padding moves
        (``LEFT_PADDING_MOVES_SCORES``: RecurrentGemma's recurrence reads no mask) and some row is padded: the rows of
        each length then generate together without their padding (``prompt_length_groups``), as each row alone.
        None where the batch decodes as it is: another family, no padding, or rows that cannot leave it out (a
        prompt with no token or a hole): then warned of once."""
        if not left_padding_moves(self.module) or bool(attention_mask.all()):
            return None
        lengths = left_padded_lengths(attention_mask)
        if lengths is None:
            warn_of_padded_generation(self.module, attention_mask)
        return lengths

    def _decoded_in_step_with_other_ranks(self, decode, batches, generator, device):
        """``decode(ids, mask)`` of each of ``batches``, in order. Where every forward is a collective over the world
        (ZeRO-3 on several ranks without pinned parameters) and the model's rows of each prompt length decode apart
        (``_prompt_lengths_apart``: each rank's count of decodes is its prompts'), every rank makes as many decodes
        (``in_step_with_other_ranks``): a rank with fewer decodes one row of its first batch again for each it
        lacks, the sampling generator's state kept. (Within one decode the ranks step until all have finished, the
        decode's sync_group: a spare decode of another prompt length or EOS stays in step.)"""
        synced = bool(left_padding_moves(self.module)) and self.inference_weights.forward_has_collectives \
            and _world_size() > 1
        ids, mask = batches[0]
        rng = generator if generator is not None else default_generator(torch.device(device))

        def spare():
            row = int(mask.sum(1).argmax()) if len(mask) else 0  # (the fullest: never a prompt with no token)
            state = rng.get_state()
            decode(ids[row:row + 1], mask[row:row + 1])
            rng.set_state(state)

        return in_step_with_other_ranks([functools.partial(decode, *batch) for batch in batches], spare, synced,
                                        device)

    def _decode(self, model, input_ids, attention_mask, max_new_tokens, device, sync_group, return_logprobs,
                sampling):
        """The decode loop over the inference weights: the captured graph step where it can run, else the eager
        loop over the engine's KV cache."""
        hf_model = unwrap_peft(model)
        with torch_linear(), decode_attention_kernel(hf_model, self.decode_attention), self._fused_projections(), \
                without_training_forward_hooks(self._engine):
            if self._graphs_usable(device):
                result = self.graph_decoder.generate(self.inference_weights, input_ids, attention_mask,
                                                     max_new_tokens, dtype=hf_model.dtype,
                                                     return_logprobs=return_logprobs, **sampling)
                if result is not None:
                    return result
            batch_size, prompt_len = input_ids.shape
            cache = self.kv_cache.acquire(batch_size, prompt_len + max_new_tokens, hf_model.dtype, device)
            return generate_tokens(model, input_ids, attention_mask, cache, max_new_tokens, sync_group=sync_group,
                                   return_lengths=True, return_logprobs=return_logprobs,
                                   token_sync=self.tp.share_tokens if self.tp else None, **sampling)

    @contextlib.contextmanager
    def _failing_together(self, device):
        """Ranks that generate together (under ZeRO-3 every rank, whose weights are gathered over the world; else the
        tensor-parallel group) learn whether any refused its arguments (a right-padded batch is one rank's data), and
        all raise. So there, as the gather already requires, every such rank calls ``generate`` each time. A
        tensor-parallel group without ZeRO-3 also agrees here on module surgery (``ParameterPlaces``), in the same
        all-reduce: a parameter replaced on one rank alone stops the whole group (no other meeting of it could)."""
        error = None
        try:
            yield
        except Exception as e:  # not a KeyboardInterrupt
            error = e
        zero3 = _zero3_world(self._engine)
        if zero3 or self.tp is not None:
            # ZeRO-3's gathers span the world; under ZeRO 0-2 the groups generate apart (a meeting of the world would
            # hold every group to the same count of generate calls), so surgery does not stop the other groups here
            group = None if zero3 else self.tp.group
            # (under ZeRO-3 the weight check agrees on surgery, at eval() too: _refresh_weights)
            replaced = None if zero3 else self._parameter_places.replaced()
            flags = [error is None] if zero3 else [error is None, replaced is None]
            refused_on, *replaced_on = _ranks_agree_on("generate()", flags, device, group)
            if replaced is not None:  # before this rank's own argument error: the others' errors say this one names it
                _refuse_replaced(replaced, cause=error)
            replaced_elsewhere = [rank for rank in replaced_on if rank is not None]
            if error is None and replaced_elsewhere:
                _refuse_replaced(None, on_rank=replaced_elsewhere[0])
            if refused_on is not None and error is None:
                raise ValueError(f"generate: another rank, rank {refused_on} (the lowest if several), refused its "
                                 "arguments (its error says why); every rank that generates with it stops too")
        if error is not None:
            raise error

    def _fused_projections(self):
        if self.fusion is None:
            return contextlib.nullcontext()
        return self.fusion.active()

    def _group_agrees(self, flag):
        return self.tp.all_agree(flag, self._engine.device)

    def _graphs_usable(self, device):
        """Whether this generation may take the graph path; in a tensor-parallel group only if it may on every rank
        (a rank decoding eagerly while the others replay graphs would mismatch their collectives; ranks agree again
        after capturing, in ``GraphDecoder.generate``)."""
        if self.graph_decoder is None:
            return False
        if self.tp is None:
            return True  # the graph decoder decides, says why once, and falls back by itself
        reason = self.graph_decoder.unsupported_reason(self.inference_weights, torch.device(device))
        if reason is not None:
            self.graph_decoder.notice(reason)
        return self.tp.all_agree(reason is None, device)

    def _generation_config(self, given=None):
        """The generation_config HF's ``generate`` would read: the actor's own (the live object, not the inference
        copy's snapshot: settings changed after the engine was built count), under ``given`` (a call's
        ``generation_config``) whose set values win, as in HF."""
        return merged_generation_config(getattr(unwrap_peft(self._engine.module), "generation_config", None), given)

    def check_generation_config(self, hf_kwargs=None, generation_config=None):
        """What the model's generation_config sets that this decode cannot do is an error unless the call overrides
        it (``generate_args.check_generation_config``)."""
        check_generation_config(hf_kwargs or {}, generation_config or self._generation_config())

    def _max_positions(self):
        """The model config's ``max_position_embeddings`` (an int), which HF's default length stays within."""
        limit = getattr(unwrap_peft(self.inference_weights.model).config, "max_position_embeddings", None)
        return limit if isinstance(limit, int) else None

    def _check_positions(self, attention_mask, max_new_tokens):
        """The positions a generation feeds the model within a position table (GPT-2's and OPT's learned one, GPT-J's
        precomputed rotary one, ``position_table``): past it, HF's generate fails with an IndexError (a device-side
        assert on CUDA) from inside the model. The last new token is never fed back, so HF generates up to one token
        past the table, as this allows."""
        model = unwrap_peft(self.inference_weights.model)
        limit = position_limit(model)
        if limit is None or attention_mask.shape[1] + max_new_tokens - 1 <= limit:
            return
        table = position_table(model)
        if table is None:
            return
        longest = int(attention_mask.sum(-1).max())  # (positions count a row's tokens: left padding takes none)
        if longest + max_new_tokens - 1 > limit:
            raise ValueError(f"a prompt of {longest} tokens + max_new_tokens={max_new_tokens} is past the model's "
                             f"table of {limit} {table} positions: lower max_new_tokens to at most "
                             f"{max(limit + 1 - longest, 0)}, or shorten the prompt")

    def _check_fits(self, prompt_len, max_new_tokens):
        """Prompt + new tokens within ``max_out_tokens`` (the KV cache's length) and the most slots the model's cache
        may have (``longest_cache``: GPT-Neo's local attention window, MPT's position bias); ranks that generate
        together learn of a refusal through ``_failing_together``."""
        limit = self.hybrid_config.max_out_tokens
        if prompt_len + max_new_tokens > limit:
            raise ValueError(f"a prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds "
                             f"hybrid_engine.max_out_tokens={limit} (prompt + answer)")
        if self.longest_cache is None or prompt_len + max_new_tokens <= self.longest_cache:
            return
        model_config = unwrap_peft(self.inference_weights.model).config
        if bias_counts_key_slots(model_config):
            raise ValueError(f"a prompt of {prompt_len} tokens (left padding included) + max_new_tokens="
                             f"{max_new_tokens} is past the model's position bias of {self.longest_cache} keys "
                             "(max_seq_len), which spans every slot of the KV cache: generate at most that many "
                             "tokens (prompt + answer)")
        raise ValueError(f"a prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} is longer than the "
                         f"model's local attention window ({self.longest_cache} tokens), which its layers cut "
                         "from the KV cache's length: the hybrid engine's static cache would give other tokens "
                         "than HF's generate. Generate at most that many tokens (prompt + answer), or run step 3 "
                         "without the hybrid engine (--no-enable_hybrid_engine: actor generation then uses HF "
                         "generate).")

    # -- stats ------------------------------------------------------------------------------------------------------
    def latency_stats(self, iteration=None):
        """Latencies (s) and throughput of ``iteration`` (default: the one in progress, up to now; ``last_iteration``
        is the last completed one, ``last_evaluation`` the last :meth:`evaluation` block's).

        ``e2e_latency`` = gather + generate + training + others. ``samples`` and ``tokens_per_sec`` (generated tokens
        per second of generate time) are this rank's; ``samples_per_sec`` and ``avg_samples_per_sec`` count the whole
        data-parallel batch, as DeepSpeed's CurSamplesPerSec/AvgSamplesPerSec do. ``avg_samples_per_sec``: all samples
        of iterations 1..this one over their E2E time (with the one in progress up to now); after one iteration it is
        ``samples_per_sec``. An evaluation block has neither an iteration number nor an average.
        """
        now = time.perf_counter()
        it = iteration or self._iteration
        if it is None:
            return {}
        training = it.training_s
        if it is self._iteration and self._train_start is not None:
            training += now - self._train_start
        e2e = it.e2e_s(now)
        if it.index is not None:  # completed
            index, samples_so_far, e2e_so_far = it.index, it.total_samples, it.total_e2e_s
        elif it is self._iteration and not self._evaluating:  # in progress
            index = self._iterations_done + 1
            samples_so_far, e2e_so_far = self._total_samples + it.samples, self._total_e2e_s + e2e
        else:  # an evaluation block
            index = samples_so_far = e2e_so_far = None
        total_samples = self._world_samples(it.samples)
        stats = {
            "iteration": index,
            "e2e_latency": e2e,
            "gather_latency": it.gather_s,
            "generate_latency": it.generate_s,
            "training_latency": training,
            "others": max(0.0, e2e - it.gather_s - it.generate_s - training),
            "generated_tokens": it.generated_tokens,
            "samples": it.samples,
            "tokens_per_sec": it.generated_tokens / it.generate_s if it.generate_s > 0 else 0.0,
            "samples_per_sec": total_samples / e2e if e2e > 0 else 0.0,
        }
        if index is not None:
            stats["avg_samples_per_sec"] = self._world_samples(samples_so_far) / e2e_so_far if e2e_so_far > 0 else 0.0
        return stats

    def _world_samples(self, samples):
        # Like DeepSpeed: samples/s counts the whole data-parallel batch (assumes equal per-rank batches).
        return samples * _world_size()

    def log_stats(self, iteration=None):
        """One line on rank 0, in the style of DeepSpeed's hybrid engine."""
        s = self.latency_stats(iteration)
        if not s or not _is_rank_0():
            return s
        e2e = s["e2e_latency"] or 1e-12

        def part(label, key):
            return f"|{label}={s[key]:.2f}s ({s[key] / e2e * 100:.2f}%) "

        line = (f"|E2E latency={s['e2e_latency']:.2f}s " + part("Gather latency", "gather_latency")
                + part("Generate time", "generate_latency") + part("Training time", "training_latency")
                + part("Others", "others") + f"|Gen tokens/s={s['tokens_per_sec']:.1f} "
                + f"|CurSamplesPerSec={s['samples_per_sec']:.2f} ")
        if "avg_samples_per_sec" in s:
            line += f"|AvgSamplesPerSec={s['avg_samples_per_sec']:.2f}"
        print_beside_progress_bars(line)  # (step 3 draws its bar under it)
        return s


@contextlib.contextmanager
def without_training_forward_hooks(ds_engine):
    """DeepSpeed's hooks on its module's forward belong to the training step: its throughput timer, which synchronizes
    the device once the engine has taken two optimizer steps, the wall-clock timers and the flops profiler. A decode
    through the training module ran them on every token, and a CUDA-graph capture after the second optimizer step (a
    resumed run's first generation, a new batch-size bucket, a cache that grew) failed on that synchronize, so every
    later generation ran eagerly. While the engine generates, what the hooks call does nothing (the hooks stay, in
    their order). Under ZeRO-3 they run: they also mark the forward for ZeRO-3's discovery of parameters used outside
    their module."""
    partitioned = getattr(ds_engine, "zero_optimization_partition_weights", lambda: True)()
    if partitioned or not hasattr(ds_engine, "_forward_prologue"):
        yield
        return
    ds_engine._forward_prologue = lambda inputs, kwargs: None  # (instance attributes: the class's methods stay)
    ds_engine._forward_epilogue = lambda: None
    try:
        yield
    finally:
        del ds_engine._forward_prologue, ds_engine._forward_epilogue


@contextlib.contextmanager
def torch_linear():
    """``torch.nn.functional.linear`` as torch defines it, for the duration of a generation.

    DeepSpeed ZeRO-3 replaces it process-wide (``zero_optimization.memory_efficient_linear``, on by default) with an
    autograd function that saves activation memory in backward but, for 3-D inputs, runs the GEMM and the bias add as
    two kernels: in the H200 profile of OPT-1.3B decode at batch 64 the extra adds took 0.55 ms of a ~4.5 ms step.
    Generation has no backward, and the gathered or pinned weights are whole, so the original is right here too.
    """
    try:
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses
    except ImportError:
        original = None
    else:
        original = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    replaced = torch.nn.functional.linear
    if original is None or replaced is original:
        yield
        return
    torch.nn.functional.linear = original
    try:
        yield
    finally:
        torch.nn.functional.linear = replaced


class _LoadMarksStale:
    """A ``load_state_dict`` post-hook of the actor's module: weights loaded into it (``engine.module
    .load_state_dict``, the DeepSpeed engine's ``load_checkpoint``) mark the HybridEngine's inference copy stale. It
    holds the engine weakly; a copy of the module (deep copy: a reference or EMA model; pickle) gets one that does
    nothing, as its ``generate`` is no longer the engine's (``_RoutedGenerate``)."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)

    def __call__(self, module, incompatible_keys):
        engine = self._engine()
        if engine is not None and engine.inference_weights is not None:  # (None once released)
            engine.inference_weights.mark_stale()

    def __deepcopy__(self, memo):
        return _CopiedModuleLoadHook()

    def __reduce__(self):
        return _CopiedModuleLoadHook, ()


class _RefusesAssignedLoad:
    """A ``load_state_dict`` pre-hook of the actor's module: ``assign=True`` would put the state dict's tensors in
    place of the parameters, which DeepSpeed's optimizer and the inference copy hold (DeepSpeed then trains the old
    ones; under ZeRO 1-2 its next step fails), so it is refused before anything is loaded. A copy of the module gets
    one that does nothing (it is no actor)."""

    def __call__(self, module, state_dict, prefix, local_metadata, *args):
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError("load_state_dict(..., assign=True) into the hybrid engine's actor would replace its "
                             "parameters, which DeepSpeed's optimizer and the engine's inference weights hold: "
                             "training would go on with the old ones. Load without assign=True (the values are "
                             "copied into the parameters, and the next generation reads them); nothing was loaded")

    def __deepcopy__(self, memo):
        return _CopiedModuleLoadHook()

    def __reduce__(self):
        return _CopiedModuleLoadHook, ()


class _CopiedModuleLoadHook:
    def __call__(self, *args):  # (a post-hook's arguments or a pre-hook's)
        return None


def _watch_loads(module, engine):
    """The handles of ``_LoadMarksStale`` and ``_RefusesAssignedLoad`` on ``module`` and, under LoRA, on the HF model
    inside it: a user may load into either. A load into a submodule alone is not seen (``mark_weights_stale``; one with
    assign=True is refused at the next generation: ``_refuse_replaced``)."""
    marks_stale, refuses_assign = _LoadMarksStale(engine), _RefusesAssignedLoad()
    modules = {id(m): m for m in (module, unwrap_peft(module))}.values()
    return [handle for m in modules for handle in (m.register_load_state_dict_pre_hook(refuses_assign),
                                                   m.register_load_state_dict_post_hook(marks_stale))]


def _step_counts(ds_engine):
    """(optimizer steps taken, steps skipped) as DeepSpeed counts them: ``global_steps`` counts the ``step()`` of each
    gradient accumulation boundary, ``skipped_steps`` those of them that left the weights as they were (an overflow,
    an invalid gradient norm); a ``step()`` between boundaries counts in neither. None for an engine that keeps no
    counts (a test's stand-in)."""
    counts = getattr(ds_engine, "global_steps", None), getattr(ds_engine, "skipped_steps", None)
    return counts if all(isinstance(count, int) for count in counts) else None


def _weights_moved(before, now):
    """Whether the weights may have changed between two ``_step_counts``: a step applied in between (more steps than
    skips), or counts that went back (DeepSpeed's ``load_checkpoint`` of an earlier step)."""
    if before is None or now is None:
        return False
    (steps_before, skipped_before), (steps, skipped) = before, now
    return steps - skipped != steps_before - skipped_before or steps < steps_before


_WRAPPERS = weakref.WeakKeyDictionary()  # DeepSpeed engine -> the HybridEngines around it (weakly, both)


def _wrappers_of(ds_engine):
    return _WRAPPERS.setdefault(ds_engine, weakref.WeakSet())


class _RoutedGenerate:
    """``module.generate`` routed to a HybridEngine: the latest of the module's engines that is neither gone nor
    released, each held weakly (none left: the model's own generate). A deep copy of the module (a reference or EMA
    copy, TRL's ``create_reference_model``) would otherwise copy the engines and their process groups, and fail; the
    copy's ``generate`` is an error that says how to generate from the copy instead."""

    def __init__(self, engine, module):
        self._engines, self._module = [weakref.ref(engine)], weakref.ref(module)

    def routes(self, module):
        return self._module() is module

    def add(self, engine):
        """``engine`` generates from now on (the engines before it, once it is released)."""
        self.discard(engine)
        self._engines.append(weakref.ref(engine))

    def discard(self, engine):
        self._engines = [ref for ref in self._engines if ref() is not None and ref() is not engine]

    def engine(self):
        live = [ref() for ref in reversed(self._engines)]
        return next((engine for engine in live if engine is not None and not is_released(engine)), None)

    def __call__(self, *args, **kwargs):
        engine = self.engine()
        if engine is None:  # every engine is gone: the model generates as its class does
            module = self._module()
            return type(module).generate(module, *args, **kwargs)
        return engine.generate(*args, **kwargs)

    def __deepcopy__(self, memo):
        return _CopiedModuleGenerate()

    def __reduce__(self):
        return _CopiedModuleGenerate, ()


class _CopiedModuleGenerate:
    def __call__(self, *args, **kwargs):
        raise RuntimeError("this module is a copy of a hybrid-engine actor, whose generate went through the engine: "
                           "generate from the copy with type(model).generate(model, ...), or from the actor")


def wrap_actor(ds_engine, ds_config, tokenizer_or_ids=None, **kwargs):
    """The actor's engine for PPO: a :class:`HybridEngine` when ``hybrid_engine.enabled``, else ``ds_engine`` as is.

    ``tokenizer_or_ids``: a tokenizer (its ``pad_token_id``/``eos_token_id``, and the engine's ``token_count`` from
    its size, ``generable_token_count``), a ``(pad, eos)`` pair, a dict with those keys, or None (the model's generation config decides).
    """
    config = HybridEngineConfig.from_ds_config(ds_config)
    if not config.enabled:
        return ds_engine
    pad, eos = _token_ids(tokenizer_or_ids)
    if hasattr(tokenizer_or_ids, "pad_token_id") and hasattr(tokenizer_or_ids, "__len__"):
        kwargs.setdefault("token_count", generable_token_count(ds_engine.module, tokenizer_or_ids))
    return HybridEngine(ds_engine, config, pad_token_id=pad, eos_token_id=eos, **kwargs)


def _token_ids(tokenizer_or_ids):
    if tokenizer_or_ids is None:
        return None, None
    if isinstance(tokenizer_or_ids, dict):
        return tokenizer_or_ids.get("pad_token_id"), tokenizer_or_ids.get("eos_token_id")
    if isinstance(tokenizer_or_ids, (tuple, list)):
        pad, eos = tokenizer_or_ids
        return pad, eos
    return tokenizer_or_ids.pad_token_id, tokenizer_or_ids.eos_token_id
