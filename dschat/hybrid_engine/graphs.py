"""CUDA-graph decode (``hybrid_engine.enable_cuda_graph``): one captured decode step per batch-size bucket, replayed
once per generated token.

Why: the eager loop (``decode.py``) launches every kernel of every decoder layer from Python for each token, so at
PPO's batch sizes it is bound by launch overhead, not by memory bandwidth. A graph launches the whole step at once: the
one-token forward over the static KV cache, sampling, EOS bookkeeping, the position / cache-length counters and the
attention-mask update (with a repetition penalty, also the record of the tokens seen so far).

Why a replay is valid:

* Everything the step reads or writes keeps its storage. The step's inputs and outputs are :class:`DecodeBuffers`,
  allocated once per graph and refilled in place; the KV cache is a row view of the engine's ``KVCache`` storage (one
  storage serves every bucket); the weights are the ``InferenceWeights`` model, whose parameters keep their storage
  across optimizer steps, ZeRO-3 refreshes and LoRA merges. That invariant is checked before every generation (a
  fingerprint of data pointers): if it ever breaks, the graphs are dropped and captured again.
* Nothing in the step reads a device value on the host. Positions and the mask column are device counters and
  transformers' ``StaticLayer`` keeps the cache length as a device tensor. transformers skips its data-dependent mask
  shortcuts while a stream is capturing (``is_tracing``) and, with a static cache, never takes them for one-token
  queries, so eager decode and the graph build the same mask.
* Sampling is the exponential race of ``sampling.py`` drawing from a private generator registered with every graph:
  each replay draws at the generator's current offset. The caller's generator state is copied in before and back out
  after a generation, so a seed reproduces and per-rank seeds differ, as in eager decode.

Rows are padded up to the bucket with copies of row 0 that start finished. The prefill and the first token run outside
the graph (the prompt length varies; with a compile mode the prefill is compiled too); the graph replays tokens 2..n.
"""
import dataclasses
import itertools
import logging

import torch

from dschat.hybrid_engine.cache import keeps_length_on_device, kv_layout
from dschat.hybrid_engine.decode import (Generation, as_eos_tensor, decode_step, forward_spec, generated_lengths,
                                         prefill, prompt_position_ids)
from dschat.hybrid_engine.sampling import (apply_repetition_penalty, choose_tokens, mark_seen, one_pass_applies,
                                           penalty_start, prompt_seen_tokens)
from dschat.models.lora import unwrap_peft

logger = logging.getLogger(__name__)

CACHE_LEN_MULTIPLE = 64  # the cache length is rounded up so that nearby prompt lengths share a graph
# The graphs a compiled forward may keep: the decode step's one per batch-size bucket and cache length, the prefill's
# few. Dynamo's default recompile limit (8) counts them together (one code object: the model's forward), and past it
# ran the forward eagerly without a word.
RECOMPILE_LIMIT = 64
WARMUP_STEPS = 2  # eager steps on a side stream before capture: library handles, workspaces, lazy initialisation


def bucket_for(batch_size):
    """The batch size a graph is captured for: the next power of two, so a handful of graphs cover every batch."""
    return 1 << (batch_size - 1).bit_length()


def round_up(n, multiple):
    return -(-n // multiple) * multiple


def pad_rows(tensor, rows):
    """``tensor`` with copies of its first row appended up to ``rows`` rows (well-defined dummy rows)."""
    missing = rows - tensor.shape[0]
    if missing == 0:
        return tensor
    return torch.cat([tensor, tensor[:1].expand(missing, *tensor.shape[1:])])


def weights_fingerprint(model):
    """Where the model's tensors live; a captured graph reads them there and nowhere else."""
    return id(model), tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers()))


@dataclasses.dataclass(frozen=True)
class GraphKey:
    """What a captured step bakes in; a generation with another key needs (and gets) another graph."""

    bucket: int
    cache_len: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    eos: tuple
    pad_token_id: int
    suppresses_eos: bool  # min_new_tokens > 0 with an EOS: EOS logits are masked while step < min_new_tokens
    logprobs: bool = False  # the step also records the sampled tokens' log-probabilities
    repetition_penalty: float = 1.0  # != 1.0: the step penalises the tokens seen so far (DecodeBuffers.seen)
    one_pass: bool = False  # the tokens come from triton_sampling's one-pass kernel (sampling.one_pass_applies)
    token_count: int = None  # the tokenizer's size: no id from it on is chosen (sampling.chosen_columns)

    @classmethod
    def of(cls, bucket, cache_len, do_sample, temperature, top_k, top_p, eos, pad_token_id, min_new_tokens,
           logprobs=False, repetition_penalty=1.0, one_pass_sampling=False, token_count=None):
        if not do_sample:  # greedy ignores the sampling settings (not the penalty); one graph serves them all
            temperature, top_k, top_p = 1.0, 0, 1.0
        eos = tuple(eos or ())
        suppresses_eos = bool(eos) and min_new_tokens > 0
        one_pass = one_pass_sampling and one_pass_applies(do_sample, logprobs,
                                                          repetition_penalty != 1.0 or suppresses_eos)
        return cls(bucket, cache_len, bool(do_sample), float(temperature), int(top_k), float(top_p), eos,
                   int(pad_token_id), suppresses_eos, bool(logprobs), float(repetition_penalty), one_pass,
                   int(token_count) if token_count is not None else None)


def logits_vocab_size(model):
    """The width of the model's logits: its output embedding's ``out_features`` (else its weight's rows, else the
    config's ``vocab_size``)."""
    hf_model = unwrap_peft(model)
    head = hf_model.get_output_embeddings()
    size = getattr(head, "out_features", None)
    if size is None and getattr(head, "weight", None) is not None and head.weight.dim() == 2:
        size = head.weight.shape[0]
    return int(size or hf_model.config.vocab_size)


class DecodeBuffers:
    """The step's inputs and outputs, allocated once per graph and refilled in place for each generation."""

    def __init__(self, bucket, cache_len, eos_ids, device, logprobs=False, vocab_size=None):
        longs = dict(dtype=torch.long, device=device)
        # with a repetition penalty (vocab_size given): the tokens of each row so far, prompt included (sampling.py);
        # the last column collects ids past the logits' vocabulary
        self.seen = torch.zeros((bucket, vocab_size + 1), dtype=torch.bool, device=device) \
            if vocab_size is not None else None
        self.logprobs = torch.zeros((bucket, cache_len), dtype=torch.float32, device=device) if logprobs else None
        self.mask = torch.zeros((bucket, cache_len), **longs)  # 1 for the prompt's tokens and the tokens fed so far
        self.position_ids = torch.zeros((bucket, 1), **longs)  # position of the token fed next, per row
        self.cache_position = torch.zeros((1,), **longs)  # cache column of the token fed next
        self.step = torch.zeros((1,), **longs)  # index of the token sampled next
        self.min_new_tokens = torch.zeros((1,), **longs)
        self.tokens = torch.zeros((bucket,), **longs)  # each row's last sampled token: the next step's input
        self.generated = torch.zeros((bucket, cache_len), **longs)
        self.finished = torch.zeros((bucket,), dtype=torch.bool, device=device)
        self.finish_step = torch.zeros((bucket,), **longs)
        self.eos = as_eos_tensor(list(eos_ids), device) if eos_ids else None

    @property
    def bucket(self):
        return self.tokens.shape[0]

    def load(self, input_ids, attention_mask, max_new_tokens, min_new_tokens, prompt_start=None):
        """Copy a generation's prompts in; returns the bucket-padded (ids, mask) for the prefill. ``prompt_start``:
        see ``generate_tokens``."""
        batch_size, prompt_len = input_ids.shape
        ids, mask = pad_rows(input_ids, self.bucket), pad_rows(attention_mask, self.bucket)
        if self.seen is not None:
            start = penalty_start(mask, pad_rows(prompt_start, self.bucket) if prompt_start is not None else None)
            self.seen.copy_(prompt_seen_tokens(ids, start, self.seen.shape[1] - 1))
        self.mask.zero_()
        self.mask[:, :prompt_len] = mask
        self.position_ids.copy_(mask.long().sum(-1, keepdim=True))
        self.cache_position.fill_(prompt_len)
        self.step.zero_()
        self.min_new_tokens.fill_(min_new_tokens)
        self.finished.zero_()
        self.finished[batch_size:] = True  # dummy rows must never keep the early exit waiting
        self.finish_step.fill_(max_new_tokens)
        return ids, mask


class CapturedDecoder:
    """The decode step of one :class:`GraphKey`: its buffers, the cache view it writes, and its graph."""

    def __init__(self, model, cache, key, rng, device, forward=None, token_sync=None):
        self.model = model
        self.token_sync = token_sync  # inference tensor parallelism: the group leader's tokens on every rank
        self.forward = forward if forward is not None else model  # what feed_token calls (maybe torch.compile'd)
        self.spec = forward_spec(model)
        self.cache = cache
        self.key = key
        self.rng = rng
        self.buffers = DecodeBuffers(key.bucket, key.cache_len, key.eos, device, key.logprobs,
                                     logits_vocab_size(model) if key.repetition_penalty != 1.0 else None)
        self.graph = None  # None: ``replay`` runs the step eagerly (capture disabled, for tests of the logic)

    def select_token(self, logits):
        """Sample (or argmax) the next token from ``logits`` and do the bookkeeping the eager loop does."""
        b, key = self.buffers, self.key
        model_logits = logits
        if b.seen is not None:
            if b.seen.shape[1] != logits.shape[-1] + 1:  # static shapes: a host check, outside any replay
                raise ValueError(f"the model's logits have {logits.shape[-1]} columns, the repetition penalty's "
                                 f"record of seen tokens {b.seen.shape[1] - 1}")
            logits = apply_repetition_penalty(logits, b.seen, key.repetition_penalty)
        if key.suppresses_eos:
            too_early = (b.step < b.min_new_tokens).view(1, 1)
            logits = torch.where(too_early, logits.index_fill(-1, b.eos, float("-inf")), logits)
        tokens, logp = choose_tokens(logits, model_logits, temperature=key.temperature, top_k=key.top_k,
                                     top_p=key.top_p, do_sample=key.do_sample, generator=self.rng,
                                     logprobs=b.logprobs is not None, one_pass=key.one_pass,
                                     token_sync=self.token_sync, token_count=key.token_count)
        if b.logprobs is not None:
            b.logprobs.index_copy_(1, b.step, logp.masked_fill(b.finished, 0.0)[:, None])
        tokens = torch.where(b.finished, key.pad_token_id, tokens)
        b.generated.index_copy_(1, b.step, tokens[:, None])
        if b.seen is not None:  # the group's shared tokens, finished rows' pads included (as in HF's input_ids)
            mark_seen(b.seen, tokens)
        if b.eos is not None:
            newly_finished = (tokens[:, None] == b.eos).any(-1) & ~b.finished
            b.finish_step.copy_(torch.where(newly_finished, b.step, b.finish_step))
            b.finished |= newly_finished
        b.tokens.copy_(tokens)
        b.step += 1

    def feed_token(self):
        """Forward the last sampled tokens over the cache; the whole fixed-length mask is passed (later columns are
        0 and causally hidden anyway), so every replay sees tensors of the same shape at the same address."""
        b = self.buffers
        b.mask.index_fill_(1, b.cache_position, 1)
        logits = decode_step(self.forward, self.spec, b.tokens[:, None], b.mask, b.position_ids, b.cache_position,
                             self.cache)
        b.position_ids += 1
        b.cache_position += 1
        return logits

    def step(self):
        self.select_token(self.feed_token())

    def prefill_logits(self, forward, ids, mask):
        """The prompt's forward through ``forward`` (the model or its compiled prefill), outside the graph (the prompt
        length is not part of it); the first token is then selected from these logits with :meth:`select_token`."""
        prompt_len = ids.shape[1]
        return prefill(forward, self.spec, ids, self.buffers.mask, prompt_position_ids(mask),
                       torch.arange(prompt_len, device=ids.device), self.cache)

    def capture(self, pool):
        """Warm up on a side stream, then record one step. The buffers must hold a loaded generation; the caller
        resets the cache and reloads the buffers afterwards (the warm-up writes to both)."""
        # keep the warm-up's writes inside the cache, and its positions inside a learned table, whatever the prompt
        self.buffers.cache_position.zero_()
        self.buffers.position_ids.zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.key.do_sample:
            # Replays then draw at the generator's offset of the moment and advance it, as eager calls would.
            graph.register_generator_state(self.rng)
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self.step()
        self.graph = graph

    def replay(self):
        if self.graph is None:
            self.step()
        else:
            self.graph.replay()


class FinishedProbe:
    """``all(finished)`` copied to the host without stalling the stream: posted at one check, read at the next, so
    the host waits only for work launched a check interval ago while the device still has that interval queued."""

    def __init__(self, device):
        self.on_cuda = device.type == "cuda"
        self.host = torch.zeros((), dtype=torch.bool, pin_memory=self.on_cuda)
        self.event = torch.cuda.Event() if self.on_cuda else None
        self.posted = False

    def post(self, finished):
        self.host.copy_(finished.all(), non_blocking=self.on_cuda)
        if self.event is not None:
            self.event.record()
        self.posted = True

    def read(self):
        """The last posted flag (False before any post)."""
        if not self.posted:
            return False
        if self.event is not None:
            self.event.synchronize()
        return bool(self.host)


def unmark_capturing(*generators):
    """A capture marks the CUDA generators it may draw from (the device's default one always, and the engine's) as
    capturing until it ends; one that fails ends without unmarking them (torch's capture_end raises first), and every
    later draw from them outside a graph raises "Offset increment outside graph capture encountered unexpectedly"
    (HF generate's sampling, dropout, ``torch.rand``). Each gets a fresh, unmarked state with the same seed and
    offset."""
    for generator in generators:
        if generator is not None and generator.device.type == "cuda":
            generator.graphsafe_set_state(generator.clone_state())


def default_generator(device):
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def _within_recompile_limit(compiled):
    """``compiled`` called with dynamo's recompile limit at least ``RECOMPILE_LIMIT`` (the process's own elsewhere)."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # (torch < 2.6)

    def call(*args, **kwargs):
        with config.patch(**{name: max(getattr(config, name), RECOMPILE_LIMIT)}):
            return compiled(*args, **kwargs)
    return call


class GraphDecoder:
    """The engine's CUDA-graph decode: captured steps by key, the memory pool they share, and when they must go.

    ``generate`` returns None when a generation has to run eagerly (no CUDA device, a forward with collectives, a
    cache that counts tokens on the host, a failed capture); each reason is logged once.
    """

    def __init__(self, kv_cache, capture_graphs=True, compile_mode=None, token_sync=None, group_agrees=None,
                 compile_prefill=True, max_out_tokens=None):
        self.kv_cache = kv_cache
        # hybrid_engine.max_out_tokens: the cache length is rounded up to CACHE_LEN_MULTIPLE but never past it (nor
        # below the generation's own prompt + new tokens). None: no cap.
        self.max_out_tokens = max_out_tokens
        self.token_sync = token_sync  # see CapturedDecoder
        # Inference tensor parallelism: group_agrees(flag) is True on every rank of the group when flag is True on
        # every rank. The group's ranks capture together (a capture's warm-up steps run the forward's collectives).
        self.group_agrees = group_agrees
        self.capture_graphs = capture_graphs  # False: same buffers and steps, run eagerly (tests of the logic on CPU)
        # Not None: the one-token forward inside the graph is torch.compile'd with this mode (e.g. "default" or
        # "max-autotune-no-cudagraphs"), fusing the small kernels a graph replays one by one. Compiled during the
        # warm-up, before capture.
        self.compile_mode = compile_mode
        # With a compile mode, the prefill is compiled as well (its own torch.compile, with torch's automatic dynamic
        # shapes: a second prompt length compiles one graph for every length, not one per length): 7B shape, B=64,
        # 1.728 -> 1.690 s (docs/benchmarks.md). If compiling it fails, that is said once and the prefill runs eagerly
        # from then on. Not in a tensor-parallel group: a recompilation (a new prompt length) failing on one rank
        # only, after part of the forward's all-reduces ran, would leave the group's collectives mismatched.
        self.compile_prefill = compile_prefill and token_sync is None
        self._compiled = {}  # (id(model), "decode" | "prefill") -> compiled module
        self.decoders = {}  # GraphKey -> CapturedDecoder
        self.disabled_reason = None  # set by a failed capture: every later generation runs eagerly
        self.captures = 0
        self.replays = 0
        self._pool = None
        self._rng = None
        self._probe = None
        self._fingerprint = None
        self._cache_allocations = None
        self._noticed = set()

    # -- when graphs apply ------------------------------------------------------------------------------------------
    def unsupported_reason(self, weights, device):
        if self.disabled_reason is not None:
            return self.disabled_reason
        if self.capture_graphs and device.type != "cuda":
            return f"CUDA graphs need a CUDA device, this engine generates on {device}"
        if weights.forward_has_collectives:
            return "the forward gathers ZeRO-3 parameters (pin_parameters=false), which a graph cannot replay"
        if kv_layout(self.kv_cache.model_config) is None:
            return "the model config has no standard KV-head layout, so the cache cannot be allocated up front"
        return None

    def notice(self, reason):
        if reason not in self._noticed:
            self._noticed.add(reason)
            logger.warning("hybrid_engine.enable_cuda_graph: %s; generating eagerly.", reason)

    def drop(self):
        """Forget every captured step (they hold the KV cache's storage and the graphs' memory pool)."""
        self.decoders.clear()
        self._pool = None

    def _drop_if_moved(self, model):
        fingerprint = weights_fingerprint(model)
        if self._fingerprint is not None and fingerprint != self._fingerprint and self.decoders:
            logger.info("hybrid engine: the inference weights moved in memory; capturing the decode graphs again")
            self.drop()
        self._fingerprint = fingerprint
        if self.kv_cache.allocations != self._cache_allocations:  # the decoders view the old storage
            self.drop()
            self._cache_allocations = self.kv_cache.allocations

    # -- generation -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, weights, input_ids, attention_mask, max_new_tokens, *, dtype, do_sample=False, temperature=1.0,
                 top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0, min_new_tokens=0, generator=None,
                 early_exit_interval=8, return_logprobs=False, repetition_penalty=1.0, prompt_start=None,
                 one_pass_sampling=False, token_count=None):
        """A ``Generation`` exactly as ``generate_tokens(..., return_lengths=True)`` makes it, or None (run eagerly).

        In a tensor-parallel group the ranks capture together (see ``_prepare``) and replay only if every rank has its
        step captured: a capture that failed on one rank makes the whole group decode eagerly from then on (a rank
        replaying a graph while another decodes eagerly would mismatch their collectives). Not covered: a rank failing
        during the capture's eager warm-up steps, which run the forward's collectives, leaves the others waiting."""
        decoder = self._prepare(weights, input_ids, attention_mask, max_new_tokens, dtype=dtype, do_sample=do_sample,
                               temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                               pad_token_id=pad_token_id, min_new_tokens=min_new_tokens,
                               return_logprobs=return_logprobs, repetition_penalty=repetition_penalty,
                               one_pass_sampling=one_pass_sampling, token_count=token_count)
        if self.group_agrees is not None and not self.group_agrees(decoder is not None):
            if decoder is not None:
                self.disable("another rank of the tensor-parallel group could not capture the decode step")
            return None
        if decoder is None:
            return None
        return self._run(decoder, input_ids, attention_mask, max_new_tokens, min_new_tokens=min_new_tokens,
                        generator=generator, early_exit_interval=early_exit_interval, prompt_start=prompt_start)

    def _prepare(self, weights, input_ids, attention_mask, max_new_tokens, *, dtype, do_sample=False, temperature=1.0,
                top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0, min_new_tokens=0, return_logprobs=False,
                repetition_penalty=1.0, one_pass_sampling=False, token_count=None):
        """The captured step for this generation (capturing it if it is new), or None: it has to run eagerly."""
        device = input_ids.device
        reason = self.unsupported_reason(weights, device)
        if reason is not None:
            self.notice(reason)
            return None
        if max_new_tokens == 0:
            return None
        model = weights.model
        batch_size, prompt_len = input_ids.shape
        bucket = bucket_for(batch_size)
        cache_len = self.cache_len_for(prompt_len + max_new_tokens)
        if not self.kv_cache.holds(bucket, cache_len, dtype, device):
            # New storage: the captured steps hold views of the old one, which must be freed before the new one is
            # allocated (else both are alive at once, and the cache's out-of-memory retry cannot free the old).
            self.drop()
        cache = self.kv_cache.acquire_rows(bucket, cache_len, dtype, device)
        if not keeps_length_on_device(cache):
            self.disable("the model's KV cache has sliding-window or recurrent (Mamba) layers, which count tokens "
                         "on the host")
            return None
        self._drop_if_moved(model)
        key = GraphKey.of(bucket, self.kv_cache.max_len, do_sample, temperature, top_k, top_p, eos_token_id,
                          pad_token_id, min_new_tokens, return_logprobs, repetition_penalty, one_pass_sampling,
                          token_count)
        decoder = self.decoders.get(key)
        if self.group_agrees is not None and not self.group_agrees(decoder is not None):
            decoder = None  # another rank of the group has to capture (e.g. its storage moved): capture together
        if decoder is None:
            try:
                decoder = self._capture(model, cache, key, input_ids, attention_mask, max_new_tokens, min_new_tokens)
            except Exception as error:  # noqa: BLE001 - any capture failure means: this model decodes eagerly
                unmark_capturing(default_generator(device), self._rng)
                self._rng = None
                self.disable(f"capturing the decode step failed ({type(error).__name__}: {error})")
                return None
        return decoder

    def cache_len_for(self, tokens):
        """KV cache length for a generation of ``tokens`` (prompt + new): rounded up so that nearby prompt lengths
        share a graph, capped at ``max_out_tokens``."""
        length = round_up(tokens, CACHE_LEN_MULTIPLE)
        if self.max_out_tokens is not None:
            length = min(length, max(self.max_out_tokens, tokens))
        return length

    def disable(self, reason):
        """Every later generation runs eagerly; says why once."""
        self.drop()
        self.disabled_reason = reason
        self.notice(reason)

    def _capture(self, model, cache, key, input_ids, attention_mask, max_new_tokens, min_new_tokens):
        device = input_ids.device
        if self._rng is None:
            self._rng = torch.Generator(device=device)
        decoder = CapturedDecoder(model, cache, key, self._rng, device, self._forward_of(model), self.token_sync)
        decoder.buffers.load(input_ids, attention_mask, max_new_tokens, min_new_tokens)  # sane values to warm up on
        if self.capture_graphs:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()  # shared: the graphs never run concurrently
            decoder.capture(self._pool)
        cache.reset()  # the warm-up wrote into it
        self.decoders[key] = decoder
        self.captures += 1
        logger.info("hybrid engine: captured the decode step for %s", key)
        return decoder

    def _forward_of(self, model):
        return self._compiled_module(model, "decode", dynamic=False)  # one shape per captured graph

    def _prefill_of(self, model):
        return self._compiled_module(model, "prefill", dynamic=None) if self.compile_prefill else model

    def _compiled_module(self, model, role, dynamic):
        if self.compile_mode is None:
            return model
        key = (id(model), role)
        if key not in self._compiled:
            self._compiled[key] = _within_recompile_limit(torch.compile(model, mode=self.compile_mode,
                                                                        dynamic=dynamic))
        return self._compiled[key]

    def _prefill(self, decoder, ids, mask):
        """The prompt's forward and the first token; a compiled prefill that fails is run again eagerly, and said
        once the eager one has run: an eager prefill that fails too raises its own error (a model that refuses the
        static cache: ``decode.prefill``'s UsageError), with nothing said before it of prefilling eagerly on."""
        forward = self._prefill_of(decoder.model)
        try:
            logits = decoder.prefill_logits(forward, ids, mask)
        except Exception as error:  # noqa: BLE001 - a compiled prefill that fails runs eagerly instead
            if forward is decoder.model:
                raise
            self.compile_prefill = False
            decoder.cache.reset()  # the layers that ran before the failure have moved their write position on
            logits = decoder.prefill_logits(decoder.model, ids, mask)
            logger.warning("hybrid engine: the compiled prefill failed (%s: %s); prefilling eagerly from now on.",
                           type(error).__name__, error)
        decoder.select_token(logits)

    def _run(self, decoder, input_ids, attention_mask, max_new_tokens, *, min_new_tokens=0, generator=None,
            early_exit_interval=8, prompt_start=None):
        """Replay ``decoder`` (from :meth:`_prepare`) for this generation; returns its ``Generation``."""
        check_every = early_exit_interval
        batch_size = input_ids.shape[0]
        ids, mask = decoder.buffers.load(input_ids, attention_mask, max_new_tokens, min_new_tokens, prompt_start)
        caller_rng = generator if generator is not None else default_generator(input_ids.device)
        if decoder.key.do_sample:
            self._rng.set_state(caller_rng.get_state())
        self._prefill(decoder, ids, mask)
        steps = self._replay(decoder, max_new_tokens, check_every if decoder.key.eos else 0)
        if decoder.key.do_sample:
            caller_rng.set_state(self._rng.get_state())  # the caller's generator moves on as in eager decode
        b = decoder.buffers
        lengths = generated_lengths(b.finish_step[:batch_size], steps)
        n = int(lengths.max()) if decoder.key.eos else steps
        sequences = torch.cat([input_ids, b.generated[:batch_size, :n].to(input_ids.dtype)], dim=1)
        logprobs = b.logprobs[:batch_size, :n].clone() if b.logprobs is not None else None
        return Generation(sequences, lengths, logprobs)

    def _replay(self, decoder, max_new_tokens, check_every):
        """Replay the step for tokens 2..max_new_tokens; returns how many tokens were generated. With an EOS, every
        ``check_every`` steps the all-finished flag is posted and the one posted a check earlier is read."""
        if self._probe is None:
            self._probe = FinishedProbe(decoder.buffers.finished.device)
        self._probe.posted = False
        steps = 1  # the prefill sampled the first token
        while steps < max_new_tokens:
            decoder.replay()
            self.replays += 1
            steps += 1
            if check_every and steps % check_every == 0 and steps < max_new_tokens:
                if self._probe.read():  # every row had finished by the previous check
                    break
                self._probe.post(decoder.buffers.finished)
        return steps
