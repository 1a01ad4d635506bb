"""Tiny models, DeepSpeed configs and reference generation shared by the hybrid-engine tests and 2-rank scripts."""
import contextlib

import torch
from transformers import (AutoModelForCausalLM, BloomConfig, FalconConfig, Gemma2Config, GPT2Config, GPTBigCodeConfig,
                          GPTJConfig, GPTNeoXConfig, LlamaConfig, MistralConfig, OPTConfig, Phi3Config, Qwen2Config)

PAD = 0  # never an EOS id in these tests; prompt tokens are drawn from [FIRST_TOKEN, vocab)
FIRST_TOKEN = 3

_SIZES = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=256)
# Bloom's and Falcon's default init (std 0.02, no per-layer scaling) makes a tiny random model repeat one token, which
# neither an optimizer step nor a stale weight set would change: a wider init gives tokens that react to both.
_VARIED = dict(initializer_range=0.2)


def tiny_config(family, vocab_size=96, num_layers=2):
    no_special = dict(bos_token_id=None, eos_token_id=None)
    if family == "llama":  # GQA: 2 kv heads for 4 query heads
        return LlamaConfig(vocab_size=vocab_size, intermediate_size=128, num_hidden_layers=num_layers,
                           num_key_value_heads=2, **_SIZES, **no_special)
    if family == "qwen2":
        return Qwen2Config(vocab_size=vocab_size, intermediate_size=128, num_hidden_layers=num_layers,
                           num_key_value_heads=2, **_SIZES, **no_special)
    if family == "mistral":
        return MistralConfig(vocab_size=vocab_size, intermediate_size=128, num_hidden_layers=num_layers,
                             num_key_value_heads=2, sliding_window=None, **_SIZES, **no_special)
    if family == "opt":
        return OPTConfig(vocab_size=vocab_size, ffn_dim=128, num_hidden_layers=num_layers, word_embed_proj_dim=64,
                         **_SIZES, **no_special)
    if family == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=num_layers, n_head=4, n_positions=256,
                          **no_special)
    if family == "gptj":  # rotary positions from a precomputed table of n_positions rows (rotary_emb.embed_positions)
        return GPTJConfig(vocab_size=vocab_size, n_embd=64, n_layer=num_layers, n_head=4, rotary_dim=8, n_positions=256,
                          **no_special)
    if family == "bloom":  # ALiBi bias built from the 2-D mask
        return BloomConfig(vocab_size=vocab_size, hidden_size=64, n_layer=num_layers, n_head=4, **_VARIED, **no_special)
    if family == "falcon":  # Falcon-7B's layout: multi-query (one KV head), which num_kv_heads does not say
        return FalconConfig(vocab_size=vocab_size, num_hidden_layers=num_layers, **_SIZES, **_VARIED, **no_special)
    if family == "falcon_alibi":
        return FalconConfig(vocab_size=vocab_size, num_hidden_layers=num_layers, multi_query=False, alibi=True,
                            **_SIZES, **_VARIED, **no_special)
    if family == "falcon_new":  # Falcon-40B's layout: q/k/v grouped per key/value head, two layer norms
        return FalconConfig(vocab_size=vocab_size, num_hidden_layers=num_layers, new_decoder_architecture=True,
                            num_kv_heads=2, **_SIZES, **_VARIED, **no_special)
    if family in ("gpt_bigcode", "gpt_bigcode_mha"):  # multi-query (StarCoder) or not: one fused c_attn either way
        # (std 0.1: 0.02 repeats one token; at 0.2 a trained step makes sampling at temperature 1 deterministic)
        return GPTBigCodeConfig(vocab_size=vocab_size, n_embd=64, n_layer=num_layers, n_head=4, n_positions=256,
                                multi_query=family == "gpt_bigcode", initializer_range=0.1, **no_special)
    if family == "gemma2":  # sliding-window layers (4 tokens) between global ones, logit soft-capping
        return Gemma2Config(vocab_size=vocab_size, intermediate_size=128, num_hidden_layers=num_layers,
                            num_key_value_heads=2, head_dim=16, sliding_window=4, **_SIZES, **no_special)
    if family == "phi3":  # packed qkv_proj and gate_up_proj
        return Phi3Config(vocab_size=vocab_size, intermediate_size=128, num_hidden_layers=num_layers,
                          num_key_value_heads=2, pad_token_id=0, **_SIZES, **no_special)
    if family == "gpt_neox":  # per-head q/k/v in one query_key_value, partial rotary
        return GPTNeoXConfig(vocab_size=vocab_size, intermediate_size=128, num_hidden_layers=num_layers, **_SIZES,
                             **no_special)
    raise ValueError(family)


def tiny_model(family="llama", seed=0, vocab_size=96, num_layers=2, dtype=torch.float32):
    """A random-weight model whose generation config has no EOS/pad, so only explicit ids apply."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, vocab_size, num_layers)).to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def tiny_recurrent_gemma():
    """RecurrentGemma: recurrent layers that read no attention mask, their states kept in the modules."""
    from transformers import RecurrentGemmaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(RecurrentGemmaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, lru_width=32, attention_window_size=16,
        block_types=["recurrent", "attention"], pad_token_id=PAD, bos_token_id=1, eos_token_id=2))
    model.generation_config.eos_token_id = None
    return model


def biased_recurrent_gemma():
    """A tiny RecurrentGemma (recurrent layers that read no attention mask, states kept in the modules; an MQA
    attention layer), ``with_biases``."""
    return with_biases(tiny_recurrent_gemma())


def with_biases(model):
    """``model`` in eval mode, its biases and pad embedding not 0, as a trained model's: where the model reads a
    row's left padding (a recurrence that reads no mask), the padding then moves its answer, so generating it padded
    would show."""
    torch.manual_seed(33)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
        model.get_input_embeddings().weight[PAD].normal_()
    return model.eval()


def ds_config(stage=0, lr=5e-2, micro_batch=2, bf16=False, **zero_extra):
    zero = {"stage": stage, **zero_extra}
    if stage == 3:
        # Partition even the tiny test tensors (by default small ones stay whole on every rank).
        zero.setdefault("stage3_param_persistence_threshold", 0)
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": lr}}, "zero_optimization": zero,
              "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def zero3_actor(folder, tokenizer, zero3_fetch="layer"):
    """The actor saved at ``folder`` as step 3 loads it under ZeRO-3 (every weight partitioned), with ``tokenizer``
    (what loading reads of one), in a DeepSpeed engine on this world's ranks; ``zero3_fetch``: ``--zero3_fetch``."""
    import torch.distributed as dist

    from dschat.models.loading import load_causal_lm
    from dschat.models.training_engine import initialize_engine

    config = ds_config(stage=3)
    config.pop("optimizer")
    config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * dist.get_world_size()
    model = load_causal_lm(folder, tokenizer, config)
    return initialize_engine(model, config, lr=1e-3, weight_decay=0.0, lora_learning_rate=None,
                             lr_scheduler_type="constant", num_warmup_steps=0, total_steps=1,
                             zero3_fetch=zero3_fetch)


def make_ds_engine(model, stage=0, **kwargs):
    import deepspeed

    from dschat.utils.dist import ensure_distributed

    ensure_distributed()
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage, **kwargs),
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    return engine


def left_padded_batch(lengths, vocab_size=96, seed=0, total=None):
    """LEFT-padded prompts of the given lengths (mixed lengths -> different amounts of padding per row)."""
    g = torch.Generator().manual_seed(seed)
    total = total or max(lengths)
    ids = torch.full((len(lengths), total), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), total), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, total - n:] = torch.randint(FIRST_TOKEN, vocab_size, (n,), generator=g)
        mask[row, total - n:] = 1
    return ids, mask


def hf_generate(model, input_ids, attention_mask, max_new_tokens, eos_token_id=None, pad_token_id=PAD, **kwargs):
    """HF's own greedy ``generate`` in eval mode (no dropout), called as the class method because the engine routes
    the instance's ``generate`` to itself."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return type(model).generate(model, input_ids=input_ids, attention_mask=attention_mask,
                                        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                                        pad_token_id=pad_token_id, **kwargs)
    finally:
        model.train(was_training)


def hf_generate_alone(model, prompt, max_new_tokens, **kwargs):
    """``hf_generate`` of one unpadded prompt ((1, n)), the states a model keeps in its modules set up afresh: HF's
    generate sets up RecurrentGemma's only for a forward given no cache, never for its own, so a one-token prompt went
    on from the previous generation's (as dschat's trainer does)."""
    from dschat.hybrid_engine.decode import reset_states_kept_in_modules

    reset_states_kept_in_modules(model, 1, prompt.device)
    return hf_generate(model, prompt, torch.ones_like(prompt), max_new_tokens, **kwargs)


def early_token(generated_row, avoid=(), steps=(1, 2, 3)):
    """A token the row generates at one of ``steps`` (so it ends there when used as EOS) that is not in ``avoid``."""
    for step in steps:
        token = int(generated_row[step])
        if token != PAD and token not in set(int(t) for t in avoid):
            return token
    return None


def train_step(engine, sequences):
    """One optimizer step of a language-modelling loss on ``sequences`` (pad positions ignored)."""
    engine.train()
    mask = (sequences != PAD).long()
    loss = engine(input_ids=sequences, attention_mask=mask, labels=sequences.masked_fill(mask == 0, -100)).loss
    engine.backward(loss)
    engine.step()


def answer_logprobs_and_live(model, sequences, prompt_mask, eos_token_id, temperature=1.0):
    """(log-probs a full forward of ``model`` gives each answer token of ``sequences`` at ``temperature``, mask of the
    answer positions up to and including each row's first EOS): what the decode step's ``return_logprobs`` must
    reproduce (at the sampling temperature)."""
    from dschat.models.reward_model import positions_from_mask

    prompt_len = prompt_mask.shape[1]
    answers = sequences[:, prompt_len:]
    full_mask = torch.cat([prompt_mask, torch.ones_like(answers)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=full_mask,
                       position_ids=positions_from_mask(full_mask)).logits.float()
    logprobs = torch.log_softmax(logits[:, prompt_len - 1:-1] / temperature, -1).gather(-1, answers[..., None])
    logprobs = logprobs.squeeze(-1)
    live = torch.ones_like(answers, dtype=torch.bool)
    live[:, 1:] = (answers[:, :-1] == eos_token_id).cumsum(-1) == 0
    return logprobs, live


def check_refresh_after_step(engine, reference, got, ids, mask, max_new_tokens, eos, expected, world):
    """One optimizer step over the ranks' own answers; the next generation must use the new weights (compared with
    HF generate on ``reference`` refreshed from the trained, possibly partitioned, weights)."""
    import torch.distributed as dist

    train_step(engine, got)
    gather_into(reference, engine.module)
    expected_after = hf_generate(reference, ids, mask, max_new_tokens, eos_token_id=eos)
    changed = [None] * world
    dist.all_gather_object(changed, not torch.equal(expected_after, expected))
    assert any(changed), "the step did not change any answer; the test could not see stale weights"
    engine.eval()
    got_after = engine.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=eos)
    assert torch.equal(got_after, expected_after), (got_after, expected_after)


def gather_into(reference, model):
    """The reference becomes a full copy of the partitioned training weights."""
    import deepspeed

    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            ref[name].data.copy_(p.data)


def sdpa_reference(q, k, v, mask, scale):
    """One-token attention by SDPA on fp64 copies, key/value heads repeated for grouped-query attention; (B, 1, H, D)
    as transformers' attention functions return it (the decode-attention kernel's reference)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                           scale=scale)
    return out.transpose(1, 2)


@contextlib.contextmanager
def rank_0_replaces(o_proj, rank):
    """Module surgery on rank 0 alone for the block: ``o_proj``'s weight replaced by a new Parameter (a copy), put back
    after."""
    weight = o_proj._parameters["weight"]
    if rank == 0:
        o_proj._parameters["weight"] = torch.nn.Parameter(weight.detach().clone())
    try:
        yield
    finally:
        o_proj._parameters["weight"] = weight


def check_surgery_on_rank_0_refused(rank, meet):
    """``meet()`` (where the ranks meet the replaced parameter: eval() under ZeRO-3, generate in an inference
    tensor-parallel group) after rank 0 alone replaced ``model.layers.1.self_attn.o_proj.weight``: every rank refuses,
    rank 0 naming the parameter, the others saying it was rank 0's."""
    try:
        meet()
    except RuntimeError as error:
        message = str(error)
    else:
        raise AssertionError(f"rank {rank}: a parameter replaced on rank 0 alone was not refused here")
    assert "no longer the one DeepSpeed's optimizer and this engine were built with" in message, (rank, message)
    assert ("'model.layers.1.self_attn.o_proj.weight'" if rank == 0 else "on another rank, rank 0 (the lowest") \
        in message, (rank, message)
    print(f"rank {rank} surgery on rank 0: refused", flush=True)
