"""Work-arounds for library interactions, applied once, in one place."""
import contextlib
import functools
import re
import warnings


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


def enable_activation_checkpointing(model, **kwargs):
    """Activation (gradient) checkpointing on an HF model: transformers 5.2x renamed ``gradient_checkpointing_enable``
    to ``activation_checkpointing_enable`` and made the old name warn on every run; earlier 5.x have only the old one.
    A model of dschat's (the reward model) keeps DeepSpeed-Chat's name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_activation_checkpointing(model):
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def engine_takes_checkpointing_calls(engine):
    """DeepSpeed-Chat's step-3 loop switches the actor's checkpointing with ``rlhf_engine.actor
    .gradient_checkpointing_enable()`` (and ``_disable``). The hybrid engine takes the call itself; a DeepSpeed engine
    forwards it (``__getattr__``) to transformers' deprecated name: a FutureWarning on every call, gone in transformers
    6. This engine (the instance, not DeepSpeed's class) takes both calls, as the hybrid engine does; bound to its
    model, not to itself, so that no reference cycle keeps the engine. Returns ``engine``."""
    engine.gradient_checkpointing_enable = functools.partial(checkpointing_enable_call, engine.module)
    engine.gradient_checkpointing_disable = functools.partial(disable_activation_checkpointing, engine.module)
    return engine


def checkpointing_enable_call(model, gradient_checkpointing_kwargs=None):
    """HF's ``gradient_checkpointing_enable`` call, as DeepSpeed-Chat's loop makes it on the actor's engine; its
    default is dschat's own checkpointing: torch's non-reentrant checkpoint."""
    enable_activation_checkpointing(model, **(gradient_checkpointing_kwargs or {"use_reentrant": False}))


@contextlib.contextmanager
def peft_reading_checkpointing():
    """PEFT (0.21) reads the model's ``is_gradient_checkpointing``, which transformers 5.2x deprecated in favour of
    ``is_activation_checkpointing``: the FutureWarning is PEFT's to act on, not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


@contextlib.contextmanager
def peft_targets_as_named():
    """PEFT (0.21, with transformers 5) rewrites a LoRA config's ``target_modules`` for MoE families whose experts
    transformers 5 fused into 3-D parameters (DeepSeek-V2/V3, GLM-4-MoE, ...: those of transformers' checkpoint
    conversion mapping), so that an adapter written against transformers 4's module names still loads: every target
    ending in ``down_proj`` (``gate_proj`` + ``up_proj``) becomes ``target_parameters=['down_proj']``
    (``gate_up_proj``). dschat's targets are the full names of this model's own Linear modules (a dense layer's
    ``mlp.down_proj``, the shared experts'), so the rewrite took the adapters off those layers and put them on every
    routed expert's parameter, which the LoRA merge refuses. For new adapters on a transformers-5 model the rewrite is
    off: the targets are taken as named."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # a PEFT without the rewrite
        yield
        return
    convert = getattr(conversion, "convert_peft_config_for_transformers", None)
    if convert is None:
        yield
        return
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = convert


@contextlib.contextmanager
def backbone_ignoring_lm_head(config, head_names=()):
    """Loading a causal LM's folder (a step-1 output) as its backbone (``AutoModel``, the reward model's and critic's),
    the head's weights (``lm_head``; GPT-NeoX's ``embed_out``: ``lora.HEAD_NAMES``; a *ForSequenceClassification's
    ``score`` and the modules named in ``head_names``, e.g. an OpenRLHF reward model's value head, are read by the
    reward model itself) are left over by design, and transformers 5 prints a "LOAD REPORT ... UNEXPECTED ... not ok
    if you expect identical arch" for them on every step-2/3 run. The backbone class ignores just those keys while it
    loads (every other unexpected or missing key is still reported). dschat loads models from one thread: the class
    attribute is set and put back around the load."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    from dschat.models.lora import HEAD_NAMES

    backbone = MODEL_MAPPING[type(config)] if type(config) in MODEL_MAPPING else None
    if backbone is None:  # a family transformers does not map (remote code): its report stays as it is
        yield
        return
    saved = backbone.__dict__.get("_keys_to_ignore_on_load_unexpected", _UNSET)
    heads = "|".join(map(re.escape, (*HEAD_NAMES, "score", *head_names)))
    backbone._keys_to_ignore_on_load_unexpected = [*(backbone._keys_to_ignore_on_load_unexpected or ()),
                                                   rf"^({heads})\."]
    try:
        yield
    finally:
        if saved is _UNSET:
            del backbone._keys_to_ignore_on_load_unexpected
        else:
            backbone._keys_to_ignore_on_load_unexpected = saved


_UNSET = object()


@contextlib.contextmanager
def zero3_loads_initialize_per_module():
    """``from_pretrained`` under ZeRO-3 initializes what the checkpoint lacked (``_initialize_missing_keys``) by
    gathering only the parameters not loaded, then running every module's ``_init_weights``: a family whose
    ``_init_weights`` reads a loaded parameter's shape before its guarded init skips it (RWKV's
    ``math.sqrt(max(shape[0], shape[1]))`` on its embedding) read a partitioned, empty one: "IndexError: tuple index
    out of range", and RWKV did not load under ZeRO-3. While this is open, such loads take
    ``initialize_unloaded_weights_zero3`` instead (transformers' own ``from_config`` under ZeRO-3 gathers per module
    too); other loads go on as transformers' do."""
    from transformers import PreTrainedModel
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    original = PreTrainedModel._initialize_missing_keys

    def initialize_missing_keys(model, is_quantized):
        if is_deepspeed_zero3_enabled() and not is_quantized:
            initialize_unloaded_weights_zero3(model)
        else:
            original(model, is_quantized)

    PreTrainedModel._initialize_missing_keys = initialize_missing_keys
    try:
        yield
    finally:
        PreTrainedModel._initialize_missing_keys = original


def initialize_unloaded_weights_zero3(model):
    """transformers' ``initialize_weights`` (its per-module ``_initialize_weights``, sub-models dispatching to their
    own) on a ZeRO-3-partitioned model just loaded. A module runs where a parameter beneath it, at any depth, did not
    load (an ancestor's ``_init_weights`` may reach it: ImageGPT's top-level call redraws every ``c_proj`` weight), or
    one of its own buffers did not; then with gathered what it may read (its own and its children's parameters) and
    what it may set that did not load (those beneath it). Any other module is skipped, as its guarded init would skip
    each tensor: a full checkpoint gathers nothing, a missing head only the head. On every rank as transformers' load
    runs it (rank 0's values are kept)."""
    import torch
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions

    from dschat.models.zero3 import gathered

    custom_code = model.is_custom_code()

    def loaded(tensor):
        return getattr(tensor, "_is_hf_initialized", False)

    def initialize(module, initialize_weights):
        """Runs ``module``'s init (after its children's, as transformers' ``smart_apply``) where needed; returns the
        parameters beneath it that did not load."""
        unloaded_beneath = [p for p in module.parameters(recurse=False) if not loaded(p)]
        for child in module.children():
            unloaded_beneath += initialize(
                child, child._initialize_weights if isinstance(child, PreTrainedModel) else initialize_weights)
        readable = [*module.parameters(recurse=False), *(p for child in module.children()
                                                         if not isinstance(child, PreTrainedModel)
                                                         for p in child.parameters(recurse=False))]
        # (only its own buffers: non-persistent ones never load, and a rotary embedding's inv_freq beneath would run,
        # and gather for, every ancestor on a full checkpoint)
        buffers = [b for b in module.buffers(recurse=False) if b is not None]
        if loaded(module) or (not unloaded_beneath and all(loaded(t) for t in (*readable, *buffers))):
            return unloaded_beneath
        with gathered(list(dict.fromkeys([*readable, *unloaded_beneath])), modifier_rank=0):
            initialize_weights(module, custom_code)
        return unloaded_beneath

    with torch.no_grad(), guard_torch_init_functions():
        initialize(model, model._initialize_weights)


class LibraryMend:
    """dschat's fix of some methods of a library's classes, put in for the whole process only where a probe shows the
    library's own failing it, and kept only where the probe then holds; else the library's own methods are put back.
    The probes (``works``: no arguments, True where it holds) read no model's weights, so any rank may run them alone,
    at any time. One holder of a mend's state: the library's own methods while the fix is in, and the answer of a
    mend probed once per process."""

    def __init__(self, fixes):
        self.fixes = fixes  # () -> {(class, method name): dschat's method}: imports the library only when called
        self.replaced = {}  # (class, method name): the library's own method, while the fix is in
        self.answer = None  # ``holds_once``'s, once probed

    def holds(self, works):
        """Whether ``works()`` holds, with the fix put in first where the library's own fails it. Not put in twice:
        where it is in already and the probe still fails, False; where the patched probe fails, the library's own
        methods go back (False; raising, the error goes on), and a later call tries again."""
        if works():
            return True
        if self.replaced:
            return False
        fixes = self.fixes()
        self.replaced = {where: getattr(*where) for where in fixes}
        for (cls, name), method in fixes.items():
            setattr(cls, name, method)
        mended = False
        try:  # (a probe that raises fails too: left in, the fix was a later ``holds_once``'s reference)
            mended = bool(works())
        finally:
            if not mended:
                self.restore()
        return mended

    def holds_once(self, make_works):
        """``holds(make_works())``, asked once per process: later calls get the first answer (nothing probed, nothing
        put in, the probe not even made)."""
        if self.answer is None:
            self.answer = self.holds(make_works())
        return self.answer

    def restore(self):
        """The library's own methods back in place of the fix."""
        for (cls, name), method in self.replaced.items():
            setattr(cls, name, method)
        self.replaced = {}


def rwkv_decode_keeps_rows_apart(model):
    """Whether the one-token decode step of transformers' RWKV (``model`` holds its blocks) keeps a batch's rows apart,
    with dschat's fix of it put in where transformers' own mixes them. transformers 5.25 (4.36 too; models/rwkv/
    modeling_rwkv.py, lines 250-251 and 306-307: the ``if hidden.size(1) == 1 and state is not None`` branch of
    ``RwkvSelfAttention.extract_key_value`` and of ``RwkvFeedForward.forward``) takes a one-token step's previous
    tokens from the state as stored, (B, H), and mixes them into the (B, 1, H) hidden states unsqueezed nowhere: the
    sum broadcasts to (B, B, H), so each row's step runs B tokens, the j-th its new token mixed with row j's previous
    one, and the last position, which generate reads, mixes in row B-1's. Batched generation mixed the rows from its
    second token on (one row is right).

    The fix (``_rwkv_shifted``: a one-token step shifts as transformers' multi-token path does, which is right for one
    token too) goes in (``LibraryMend``), for the whole process, only where a probe shows the mix, and stays only
    where that probe then gives each row's output alone as transformers' own computes it; else it is taken out again
    (False: generate the rows one at a time). Probed once per process, on a tiny block of the probe's own
    (``_rwkv_probe_block``), not on ``model``'s weights, which ZeRO-3 partitions: no rank gathers anything, so any rank
    may call it at any time, alone or under ``synced_gpus``, and all come to the same answer."""
    _first_rwkv_block(model)  # (only that it is transformers' RWKV, whose classes the fix replaces methods of)
    return _RWKV_DECODE_MEND.holds_once(lambda: _rwkv_rows_apart_probe(model.config))


def _first_rwkv_block(model):
    from transformers.models.rwkv.modeling_rwkv import RwkvBlock

    block = next((module for module in model.modules() if isinstance(module, RwkvBlock)), None)
    if block is None:
        raise ValueError(f"rwkv_decode_keeps_rows_apart: {type(model).__name__} holds no RwkvBlock")
    return block


def _rwkv_probe_block(config):
    """A first RWKV block 8 wide, of ``config``'s settings otherwise (its context length: the CUDA kernel transformers
    loads for it is the model's), on the CPU in float32, its weights fixed values, not drawn (the process's random
    state is left as it was, and every rank's probe computes alike)."""
    import copy

    import torch
    from transformers.models.rwkv.modeling_rwkv import RwkvBlock

    config = copy.deepcopy(config)
    config.hidden_size, config.attention_hidden_size, config.intermediate_size = 8, 8, 16
    with torch.device("meta"):  # (no init drawn: every weight is set below)
        block = RwkvBlock(config, layer_id=0).to(torch.float32)
    block = block.to_empty(device="cpu").eval()
    with torch.no_grad():
        for i, param in enumerate(block.parameters()):  # distinct, varied values in [-0.5, 0.5]
            param.copy_(0.5 * torch.sin(torch.arange(param.numel(), dtype=torch.float32) * 1.7 + i).view(param.shape))
    return block


def _rwkv_rows_apart_probe(config):
    """A probe (``LibraryMend.holds``'s ``works``) of whether a one-token step of two rows together, on a probe block
    for ``config``, gives each row's output alone as transformers' own code computes it (right for one row)."""
    block = _rwkv_probe_block(config)
    alone = _rwkv_one_token_step_rows_alone(block)  # (computed before any fix goes in)
    return lambda: _same_rows(_rwkv_one_token_step_rows_together(block), alone)


def _rwkv_one_token_step_fixes():
    """(class, method name): dschat's method, for each of transformers' RWKV methods that the fix replaces."""
    from transformers.models.rwkv.modeling_rwkv import RwkvFeedForward, RwkvSelfAttention

    return {(RwkvSelfAttention, "extract_key_value"): _rwkv_attention_key_value,
            (RwkvFeedForward, "forward"): _rwkv_feed_forward}


_RWKV_DECODE_MEND = LibraryMend(_rwkv_one_token_step_fixes)


def _rwkv_one_token_step_rows_together(block):
    """``block``'s (``_rwkv_probe_block``'s: float32, on the CPU) output of one one-token step of two rows from a
    state, the rows together."""
    import torch

    with torch.no_grad():
        return block(_rwkv_probe_hidden(block), state=_rwkv_probe_state(block), use_cache=True)[0]


def _rwkv_one_token_step_rows_alone(block):
    """As ``_rwkv_one_token_step_rows_together``, each row alone."""
    import torch

    hidden, state = _rwkv_probe_hidden(block), _rwkv_probe_state(block)
    with torch.no_grad():
        return torch.cat([block(hidden[r:r + 1], state=[s[r:r + 1].clone() for s in state], use_cache=True)[0]
                          for r in range(2)])


def _rwkv_probe_hidden(block):
    import torch

    return torch.linspace(-1, 1, 2 * block.config.hidden_size).reshape(2, 1, block.config.hidden_size)


def _rwkv_probe_state(block):
    """Two distinct rows of state: the time-mix shifts (0, 1) and the wkv sums (2-4)."""
    import torch

    width, layers = block.config.hidden_size, block.layer_id + 1
    return [torch.linspace(0.5, 1.5, 2 * width * layers).reshape(2, width, layers) for _ in range(5)]


def _same_rows(together, alone):
    import torch

    # (not bit for bit: a batch's matmuls may round otherwise than one row's)
    return together.shape == alone.shape and torch.allclose(together, alone, rtol=1e-4, atol=1e-4)


def _rwkv_shifted(module, hidden, previous):
    """``hidden`` (B, T, H) one token later, the token before each row's first ``previous`` ((B, H), the state's;
    None: zeros): transformers' RWKV multi-token shift, for one token too."""
    shifted = module.time_shift(hidden)
    if previous is not None:
        shifted[:, 0] = previous
    return shifted


def _rwkv_attention_key_value(self, hidden, state=None):
    """transformers' ``RwkvSelfAttention.extract_key_value`` with a one-token step shifted as a longer one is."""
    import torch

    shifted = _rwkv_shifted(self, hidden, None if state is None else state[1][:, :, self.layer_id])
    key = hidden * self.time_mix_key + shifted * (1 - self.time_mix_key)
    value = hidden * self.time_mix_value + shifted * (1 - self.time_mix_value)
    receptance = hidden * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance)
    if state is not None:
        state[1][:, :, self.layer_id] = hidden[:, -1]
    return torch.sigmoid(self.receptance(receptance)), self.key(key), self.value(value), state


def _rwkv_feed_forward(self, hidden, state=None):
    """transformers' ``RwkvFeedForward.forward`` with a one-token step shifted as a longer one is."""
    import torch

    shifted = _rwkv_shifted(self, hidden, None if state is None else state[0][:, :, self.layer_id])
    key = hidden * self.time_mix_key + shifted * (1 - self.time_mix_key)
    receptance = hidden * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance)
    value = self.value(torch.square(torch.relu(self.key(key))))
    if state is not None:
        state[0][:, :, self.layer_id] = hidden[:, -1]
    return torch.sigmoid(self.receptance(receptance)) * value, state


def xlstm_cache_fits_its_layers(model):
    """Whether transformers' ``xLSTMCache`` (made by the first forward with a cache: every HF generate) holds states of
    the widths ``model``'s mLSTM layers compute, with dschat's fix put in where transformers' own does not.
    transformers 5.25 sizes the states by the config's ``qk_head_dim`` and ``v_head_dim`` (configuration_xlstm.py:
    ``hidden_size * qk_dim_factor``, and ``v_dim_factor``, rounded up to a multiple of 64; read only by
    modeling_xlstm.py lines 1355-1363), while ``xLSTMLayer`` projects to those products unrounded (lines 1042-1043, as
    NX-AI's xLSTM-large does). Where a product is no multiple of 64 (hidden 64, factor 0.5: states 16 wide a head,
    the layer's heads 8), every forward with a cache, of one row or several, raised ``ValueError: matC_old has wrong
    shape`` (modeling_xlstm.py line 412). Sizes whose products are multiples of 64 (xLSTM-7b's: 2048 and 4096) fit
    as they are.

    The fix (``_xlstm_cache_init``: transformers' own, then each state as wide as the layers compute) goes in
    (``LibraryMend``), for the whole process, only where a cache of one row for ``model``'s config (on the meta device:
    nothing allocated) misfits its first mLSTM layer, and stays only where such a cache then fits it; else it is taken
    out again (False)."""
    layer = _first_mlstm_layer(model)
    return _XLSTM_CACHE_MEND.holds(lambda: _xlstm_cache_fits(model.config, layer))  # (per model: its config's sizes)


def _first_mlstm_layer(model):
    """``model``'s first mLSTM layer: the first module that says its query/key and value widths."""
    layer = next((module for module in model.modules()
                  if all(isinstance(getattr(module, width, None), int) for width in ("qk_dim", "v_dim"))), None)
    if layer is None:
        raise ValueError(f"xlstm_cache_fits_its_layers: {type(model).__name__} holds no mLSTM layer")
    return layer


def _xlstm_cache_fits(config, layer):
    """Whether the states of an ``xLSTMCache`` of one row for ``config`` are as wide as ``layer`` computes them."""
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache

    heads = config.num_heads
    matrix, normalizer, _ = xLSTMCache(config, 1, device="meta").rnn_state[0]
    return (tuple(matrix.shape) == (1, heads, layer.qk_dim // heads, layer.v_dim // heads)
            and tuple(normalizer.shape) == (1, heads, layer.qk_dim // heads))


def _xlstm_cache_init(self, config, max_batch_size, *args, **kwargs):
    """transformers' ``xLSTMCache.__init__``, then each layer's states as wide as ``xLSTMLayer`` computes them: its
    projections' widths (``int(hidden_size * factor)``, unrounded) split among the heads."""
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache

    _XLSTM_CACHE_MEND.replaced[xLSTMCache, "__init__"](self, config, max_batch_size, *args, **kwargs)
    heads = config.num_heads
    qk, v = (int(config.hidden_size * config.qk_dim_factor) // heads,
             int(config.hidden_size * config.v_dim_factor) // heads)
    shapes = ((max_batch_size, heads, qk, v), (max_batch_size, heads, qk), (max_batch_size, heads, 1))
    self.rnn_state = {layer: tuple(state.new_zeros(shape) for state, shape in zip(states, shapes))
                      for layer, states in self.rnn_state.items()}


def _xlstm_cache_fixes():
    """(class, method name): dschat's method, for the one of transformers' xLSTM methods that the fix replaces."""
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache

    return {(xLSTMCache, "__init__"): _xlstm_cache_init}


_XLSTM_CACHE_MEND = LibraryMend(_xlstm_cache_fixes)
