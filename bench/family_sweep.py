"""CPU sweep of transformers' causal-LM families through dschat's public pieces ("any decoder-only model").

For every model type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose config can be built tiny (hidden 64, 2 layers,
4 heads, vocabulary 96; whatever else each needs), with random weights and no network:
  a) generate: the hybrid engine's greedy tokens (left-padded batch of 4 rows, eager decode, static KV cache) equal
     HF ``generate``'s (for the families of ``LEFT_PADDING_MOVES_SCORES``, HF's of each row alone without its padding,
     as dschat generates them); a ``UsageError`` that names the way out (--no-enable_hybrid_engine), when the engine
     is built or at its first forward, counts as a refusal;
  b) reward: step 2's model on that backbone (the causal LM saved, then ``RewardModel.from_pretrained`` as
     ``create_critic_model`` loads it) gives finite scores, the same for a left-padded row as for the row alone
     (otherwise exactly for the families of ``LEFT_PADDING_MOVES_SCORES``, which dschat warns of);
  c) lora: dschat's ``apply_lora`` on the causal LM, non-zero adapters: the hybrid engine's merged inference copy
     generates PEFT's greedy tokens, and PEFT's merge/unmerge leaves the logits where they were.
Encoder families used as decoders, encoder-decoders' decoders and multimodal models are skipped, each with its reason.

    python bench/family_sweep.py [--families llama,gpt2] [--json out.json] [--timeout 90]

One line per family (PASS / FAIL / ERROR / REFUSED / SKIP per check, and three statuses of transformers' own
behaviour, not dschat's: HF_ERROR, HF ``generate`` itself fails on the tiny model, so there is nothing to compare;
HF_STATIC, the engine's tokens are HF ``generate``'s over a ``StaticCache``, which are not its tokens over its default
dynamic cache; HF_PADDING, left padding moves the reward model's score, as dschat's list of such families says and
warns), then a count. Exits 1 if a check FAILs or ERRORs.
"""
import argparse
import contextlib
import copy
import difflib
import functools
import inspect
import json
import logging
import os
import signal
import sys
import tempfile
import traceback
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VOCAB = 96
PAD = 0
FIRST_TOKEN = 3
MAX_NEW = 8
PROMPT_LENGTHS = (7, 3, 5, 1)
MAX_PARAMS = 20_000_000

# Sizes given to every config that has the field (under any of its names: attribute_map aliases included).
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, n_embd=64, d_model=64, dim=64, embed_dim=64,
    num_hidden_layers=2, n_layer=2, n_layers=2, num_layers=2,
    num_attention_heads=4, n_head=4, n_heads=4, num_heads=4, num_key_value_heads=2,
    intermediate_size=128, ffn_dim=128, n_inner=128, d_ff=128, ffn_hidden_size=128, ff_intermediate_size=128,
    head_dim=16, max_position_embeddings=256, n_positions=256, max_seq_len=256, n_ctx=256,
    moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_topk=2, top_k=2, n_group=1, topk_group=1,
    first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=16, rotary_dim=8, initializer_range=0.1,
    bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=True,
)
# Fields whose default is a per-layer list (its length must be the layer count).
PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types", "attn_layer_indices",
                   "attention_layers", "layer_block_types", "hybrid_override_pattern", "mlp_only_layers",
                   "full_attn_idxs")
# Per family, what the shared sizes do not say (or say wrong for it).
OVERRIDES = {
    "reformer": dict(is_decoder=True, axial_pos_shape=[16, 16], axial_pos_embds_dim=[32, 32]),
    # (a pattern cut to the default's first two letters, "ME": a Mamba layer and an MoE one, none attends)
    "nemotron_h": dict(layers_block_type=["linear_attention", "full_attention"],
                       layer_types=["linear_attention", "full_attention"], hybrid_override_pattern="M*"),
    "granitemoehybrid": dict(layers_block_type=["linear_attention", "full_attention"]),  # (default: all Mamba)
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention"]),  # (default None: the model fails)
    # Sizes the shared ones do not reach: per-layer-input embeddings (Gemma-3n/4), the rotary part of MLA heads
    # (LongCat), the embedding's real rows (Inkling-2), the indexer (Qwen4-exp), a rope per layer type (Command A)
    "gemma3n_text": dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, num_kv_shared_layers=0,
                         activation_sparsity_pattern=[0.0, 0.0], laurel_rank=4),
    "gemma4_text": dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16),
    "longcat_flash": dict(head_dim=8),
    "inkling2_text": dict(unpadded_vocab_size=VOCAB, swa_head_dim=16),
    "inkling2_loop_text": dict(unpadded_vocab_size=VOCAB, swa_head_dim=16),
    "qwen4_exp_text": dict(full_attention_interval=2, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16,
                           indexer_budget=64, indexer_compress_ratio=4),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # (DBRX's attention reads rope_theta and clip_qkv from its attn_config, whose defaults lack the one and clamp to
    # None with the other)
    "dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}),
    "zaya": dict(num_experts_per_tok=1),
    "bamba": dict(attn_layer_indices=[1]),  # (by default every layer of these is recurrent: none attends)
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "cpmant": dict(dim_head=16, dim_ff=128),
    "zamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "zamba2": dict(hybrid_layer_ids=[1]),
    "dots3_note_text": dict(num_key_value_heads=4),
    "qwen3_next": dict(full_attention_interval=2),  # (the default 4: both tiny layers linear attention, none attends)
    "qwen3_5_text": dict(full_attention_interval=2),
    "qwen3_5_moe_text": dict(full_attention_interval=2),
}
# Sub-configs of another modality (a text model's own attn_config/ffn_config, MPT's and DBRX's, are not)
MODALITY_WORDS = ("vision", "audio", "vq", "image", "speech", "encoder", "patcher", "depth", "decoder", "global")
# Standalone decoders of encoder-decoder models, and models of text and images under one config
NOT_TEXT_DECODERS = {"trocr": "an encoder-decoder's decoder (TrOCR: AutoModel has no backbone for it)",
                     "fuyu": "multimodal (image patches into a Persimmon decoder)"}

SKIP_ENCODER = "an encoder family (its causal LM is the encoder run with is_decoder=True)"
SKIP_SEQ2SEQ = "an encoder-decoder's decoder"
SKIP_MULTIMODAL = "multimodal (sub-configs {})"


def encoder_and_seq2seq_types():
    from transformers.models.auto.modeling_auto import (MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    return set(MODEL_FOR_MASKED_LM_MAPPING_NAMES), set(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)


def skip_reason(model_type, config_cls):
    masked, seq2seq = encoder_and_seq2seq_types()
    if model_type in seq2seq or getattr(config_cls, "is_encoder_decoder", False):
        return SKIP_SEQ2SEQ
    if model_type in masked and model_type not in ("reformer",):
        return SKIP_ENCODER
    if model_type in NOT_TEXT_DECODERS:
        return NOT_TEXT_DECODERS[model_type]
    subs = sorted(k for k in (getattr(config_cls, "sub_configs", None) or {})
                  if any(word in k for word in MODALITY_WORDS))
    if subs:
        return SKIP_MULTIMODAL.format(", ".join(subs))
    return None


def two_kinds(per_layer):
    """Two layers' entries of a per-layer list, of two kinds where it has several (a linear-attention layer and a
    full one, a sliding one and a global one, dense and sparse): what the model's first layers are, plus the other."""
    other = next((v for v in per_layer if v != per_layer[0]), per_layer[-1])
    return [per_layer[0], other]


def known_fields(config_cls, default):
    fields = set(default.to_dict()) | set(getattr(config_cls, "attribute_map", {}) or {})
    with contextlib.suppress(TypeError, ValueError):
        fields |= set(inspect.signature(config_cls.__init__).parameters)
    return fields


def tiny_config(model_type):
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    default = config_cls()
    fields = known_fields(config_cls, default)
    settable = {k for k in fields if not isinstance(getattr(config_cls, k, None), property)}
    kwargs = {k: v for k, v in TINY.items() if k in settable}
    if "kv_lora_rank" in fields:  # MLA: its head_dim is the rotary part's (qk_rope_head_dim)
        kwargs.pop("head_dim", None)
        kwargs["num_key_value_heads"] = TINY["num_attention_heads"]
    if getattr(default, "multi_query", False):  # (one KV head: a num_key_value_heads given would contradict it)
        kwargs.pop("num_key_value_heads", None)
    if isinstance(getattr(default, "sliding_window", None), int):  # windows longer than prompt + answer
        kwargs["sliding_window"] = 32
    for name in (n for n in PER_LAYER_LISTS if n in settable):
        value = getattr(default, name, None)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], str):
            kwargs[name] = two_kinds(value)
        elif isinstance(value, str) and name == "hybrid_override_pattern":
            kwargs[name] = value[:2]
    if "attn_layer_indices" in fields and getattr(default, "attn_layer_indices", None):
        kwargs["attn_layer_indices"] = [1]
    if "full_attn_idxs" in fields and getattr(default, "full_attn_idxs", None):
        kwargs["full_attn_idxs"] = [1]
    if "mlp_only_layers" in fields:
        kwargs["mlp_only_layers"] = []
    kwargs.update(OVERRIDES.get(model_type, {}))
    return built_with_retries(config_cls, kwargs)


TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": PAD}


def built_with_retries(config_cls, kwargs, tries=6):
    """``config_cls(**kwargs)``, leaving out a field it cannot take (a read-only property) and giving token ids to a
    config that insists on them."""
    for _ in range(tries):
        try:
            return config_cls(**kwargs)
        except Exception as error:  # noqa: BLE001 (each retry fixes one named field, else the error stands)
            text = str(error)
            token = next((k for k in TOKEN_IDS if f"'{k}'" in text and kwargs.get(k, 0) is None), None)
            read_only = next((k for k in kwargs if f"property '{k}'" in text), None)
            if read_only is None and "has no setter" in text and "layer_types" in kwargs:
                read_only = "layer_types"  # (an alias of the read-only field)
            if token:
                kwargs[token] = TOKEN_IDS[token]
            elif read_only:
                kwargs.pop(read_only)
            else:
                raise
    return config_cls(**kwargs)


def build_model(config, seed=0):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if count > MAX_PARAMS:
        raise RuntimeError(f"not tiny: {count / 1e6:.1f}M parameters")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, None)
    return model


def left_padded_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    total = max(PROMPT_LENGTHS)
    ids = torch.full((len(PROMPT_LENGTHS), total), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(PROMPT_LENGTHS):
        ids[row, total - n:] = torch.randint(FIRST_TOKEN, VOCAB, (n,), generator=g)
        mask[row, total - n:] = 1
    return ids, mask


def hf_generate(model, ids, mask, **kwargs):
    """HF generate's greedy tokens, each call from fresh module-held states (RecurrentGemma's: HF never resets them);
    for a family whose answers left padding moves (``LEFT_PADDING_MOVES_SCORES``), each row alone without its
    padding, as dschat's HF generate and its hybrid engine answer them."""
    from dschat.models.left_padding import left_padding_moves
    from dschat.rlhf.trainer import from_fresh_module_states, generate_row_by_row

    def generate(input_ids, attention_mask, **_):
        with torch.no_grad():
            return type(model).generate(model, input_ids=input_ids, attention_mask=attention_mask,
                                        max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=PAD, eos_token_id=None,
                                        **kwargs)

    generate = functools.partial(from_fresh_module_states, model, generate)  # (a no-op for other models)
    if left_padding_moves(model):
        return generate_row_by_row(model, generate, ids, mask, pad_token_id=PAD)
    return generate(ids, attention_mask=mask)


def peft_merged_gives(model, ids, mask, tokens):
    """Whether HF generate on PEFT's merged model (the weights the engine's inference copy holds) gives ``tokens``:
    then a difference from the unmerged model's is the rounding of two ways to compute the same weights (HRM's
    reasoning cycles grow it into another token)."""
    model.merge_adapter()
    try:
        return torch.equal(hf_generate(model, ids, mask), tokens)
    finally:
        model.unmerge_adapter()


def hf_static_cache_gives(model, ids, mask, tokens):
    """Whether HF generate over a ``StaticCache`` (the cache the engine decodes over) gives ``tokens``: then a
    difference from HF's default generate is transformers' own, between its two caches."""
    try:
        return torch.equal(hf_generate(model, ids, mask, cache_implementation="static"), tokens)
    except Exception:  # noqa: BLE001 (a model HF cannot run over a StaticCache says nothing either way)
        return False


def hybrid_engine(model):
    import deepspeed

    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig
    from dschat.utils.dist import ensure_distributed

    ensure_distributed()
    # torch's Adam: DeepSpeed's default FusedAdam is JIT-built on a CPU, longer than a check's time limit on a fresh
    # machine (its alarm then left the build half done, and every later family failed to import it)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 0},
              "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    ds_engine, *_ = deepspeed.initialize(model=model, config=config,
                                         model_parameters=[p for p in model.parameters() if p.requires_grad])
    return HybridEngine(ds_engine, HybridEngineConfig(enabled=True, max_out_tokens=32), pad_token_id=PAD,
                        decode_attention="sdpa", fuse_projections="off")


def engine_matches_hf(model, what):
    """(status, note): the engine's greedy tokens against HF generate's on ``model``."""
    from dschat.errors import UsageError
    from dschat.models.training_engine import release_engine

    ids, mask = left_padded_batch()
    try:
        expected = hf_generate(model, ids, mask)
    except Exception as error:  # noqa: BLE001 (transformers' own generate: nothing of dschat's ran)
        return "HF_ERROR", f"HF generate itself fails: {first_line(error)}"
    try:
        engine = hybrid_engine(model)
    except UsageError as error:
        return "REFUSED", str(error)
    try:
        engine.eval()
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    except UsageError as error:  # (a model that fails on the static cache is refused at its first forward)
        return "REFUSED", str(error)
    finally:
        release_engine(engine)
    if torch.equal(got, expected):
        return "PASS", ""
    rows = [r for r in range(ids.shape[0]) if not torch.equal(got[r], expected[r])]
    if hasattr(model, "merge_adapter") and peft_merged_gives(model, ids, mask, got):
        return "PASS", f"{what}: rows {rows} are PEFT's merged model's tokens, not its unmerged one's (fp32 rounding)"
    if hf_static_cache_gives(model, ids, mask, got):
        return "HF_STATIC", f"{what}: rows {rows} differ from HF generate, as HF generate's over a StaticCache do"
    return "FAIL", f"{what}: rows {rows} differ from HF generate"


def check_generate(model_type):
    return engine_matches_hf(build_model(tiny_config(model_type)), "greedy")


def check_reward(model_type):
    from dschat.models.left_padding import LEFT_PADDING_MOVES_SCORES
    from dschat.models.reward_model import RewardModel

    model = build_model(tiny_config(model_type))
    ids, mask = left_padded_batch(seed=1)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        reward = RewardModel.from_pretrained(folder, new_head_expected=True).eval()
    torch.nn.init.normal_(reward.v_head.weight)
    with torch.no_grad():
        scores = reward.end_scores(ids, mask)
        alone = reward.end_scores(ids[:1, -PROMPT_LENGTHS[0]:], mask[:1, -PROMPT_LENGTHS[0]:])
        row = ids.shape[1] - PROMPT_LENGTHS[2]
        padded_away = reward.end_scores(ids[2:3, row:], mask[2:3, row:])
    if not torch.isfinite(scores).all():
        return "FAIL", f"scores {scores.tolist()} are not finite"
    listed = model_type in LEFT_PADDING_MOVES_SCORES
    if not torch.allclose(scores[0:1], alone, atol=1e-4) or not torch.allclose(scores[2:3], padded_away, atol=1e-4):
        moved = f"left padding moves the score: {scores[[0, 2]].tolist()} vs {alone.item(), padded_away.item()}"
        return ("HF_PADDING", f"{moved} ({LEFT_PADDING_MOVES_SCORES[model_type]}; dschat warns)") if listed \
            else ("FAIL", moved)
    if listed:  # (the list is what dschat warns of: one that no longer holds is a wrong warning)
        return "FAIL", "left padding does not move the score, yet LEFT_PADDING_MOVES_SCORES lists the family"
    return "PASS", ""


def merge_drift(model, ids, mask):
    """(drift, tolerance): how far PEFT's merge and unmerge move ``model``'s logits, measured in float64 on a copy.
    In fp32 the rounding of a merge grows through recurrent loops (HRM's reasoning cycles moved its logits 0.6 %, 0 in
    float64), while a wrong merge (LongCat's adapter that never acted: 0.5) shows at any precision. A model whose
    forward will not run in float64 (a kernel or a cast of its own) is measured in fp32, with fp32's tolerance."""
    try:
        return _merge_drift(copy.deepcopy(model).double(), ids, mask, relative_tolerance=1e-6)
    except Exception:  # noqa: BLE001 (then in the model's own fp32)
        return _merge_drift(model, ids, mask, relative_tolerance=1e-3)


def _merge_drift(model, ids, mask, relative_tolerance):
    live = mask.bool()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        model.merge_adapter()
        merged = model(input_ids=ids, attention_mask=mask).logits
        model.unmerge_adapter()
        after = model(input_ids=ids, attention_mask=mask).logits
    drift = max((before - merged)[live].abs().max().item(), (before - after)[live].abs().max().item())
    return drift, relative_tolerance * max(before[live].abs().max().item(), 1.0)


def check_lora(model_type):
    from dschat.models.lora import apply_lora

    model = apply_lora(build_model(tiny_config(model_type)), lora_dim=4, lora_alpha=16)
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    model.eval()
    ids, mask = left_padded_batch(seed=2)
    with torch.no_grad():
        try:
            before = model(input_ids=ids, attention_mask=mask).logits
        except Exception as error:  # noqa: BLE001 (the model's own forward, through PEFT: nothing of dschat's ran)
            return "HF_ERROR", f"the model's forward itself fails: {first_line(error)}"
    drift, tolerance = merge_drift(model, ids, mask)
    if drift > tolerance:
        return "FAIL", f"PEFT merge/unmerge moved the logits by {drift:.3g} (more than {tolerance:.3g})"
    live = mask.bool()
    with model.disable_adapter(), torch.no_grad():
        base = model(input_ids=ids, attention_mask=mask).logits
    if torch.allclose(base[live], before[live], atol=1e-3):
        return "FAIL", "the adapters change nothing: the check could not see a wrong merge"
    return engine_matches_hf(model, "lora")


CHECKS = {"generate": check_generate, "reward": check_reward, "lora": check_lora}


class Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds):
    def expired(*_):
        raise Timeout(f"over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def first_line(error):
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return text[0][:240] if text else type(error).__name__


def not_a_model_type(name):
    """Why ``name`` is no transformers model type (with the closest ones), or None where it is one."""
    from transformers import CONFIG_MAPPING

    if name in CONFIG_MAPPING:
        return None
    close = difflib.get_close_matches(name, list(CONFIG_MAPPING.keys()), n=3)
    return f"{name!r} is not a transformers model type" + (f" (close: {', '.join(close)})" if close else "")


def sweep_family(model_type, timeout, verbose):
    from transformers import CONFIG_MAPPING

    try:
        reason = skip_reason(model_type, CONFIG_MAPPING[model_type])
    except KeyError:
        reason = not_a_model_type(model_type)
    if reason:
        return {"family": model_type, "skip": reason}
    try:
        with time_limit(timeout):
            tiny_config(model_type)
    except Exception as error:  # noqa: BLE001 (a sweep reports every failure and goes on)
        return {"family": model_type, "skip": f"no tiny config: {first_line(error)}"}
    result = {"family": model_type}
    for name, check in CHECKS.items():
        try:
            with time_limit(timeout), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result[name] = check(model_type)
        except Exception as error:  # noqa: BLE001
            if verbose:
                traceback.print_exc()
            result[name] = ("ERROR", first_line(error))
    return result


def main(argv=None):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--timeout", type=int, default=90, help="seconds per check")
    parser.add_argument("--verbose", action="store_true", help="tracebacks of the errors")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    families = [f for f in args.families.split(",") if f] or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    unknown = [not_a_model_type(family) for family in families if not_a_model_type(family)]
    if unknown:  # (a typo was swept as "SKIP no config class", as if transformers had such a family)
        parser.error("--families: " + "; ".join(unknown))
    results = []
    for family in families:
        result = sweep_family(family, args.timeout, args.verbose)
        results.append(result)
        if "skip" in result:
            print(f"{family:28s} SKIP  {result['skip']}", flush=True)
        else:
            cells = "  ".join(f"{name}={result[name][0]}" for name in CHECKS)
            notes = "; ".join(f"{name}: {result[name][1]}" for name in CHECKS if result[name][1])
            print(f"{family:28s} {cells}  {notes}", flush=True)
    swept = [r for r in results if "skip" not in r]
    failed = [r["family"] for r in swept if any(r[n][0] in ("FAIL", "ERROR") for n in CHECKS)]
    passed = [r["family"] for r in swept if all(r[n][0] == "PASS" for n in CHECKS)]
    hf_own = [r["family"] for r in swept if any(r[n][0].startswith("HF_") for n in CHECKS)]
    print(f"{len(swept)} swept, {len(results) - len(swept)} skipped, {len(passed)} pass every check, {len(failed)} "
          f"with a failure: {failed}; transformers' own behaviour (HF_ERROR, HF_STATIC, HF_PADDING): {hf_own}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
