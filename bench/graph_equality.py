"""GPU check of the CUDA-graph decode (hybrid_engine.enable_cuda_graph): tokens with graphs on equal graphs off.

For each family (Llama with GQA, Qwen2, Mistral, OPT, GPT-2, Bloom, Gemma, Phi-3, GPT-NeoX), in fp32 and bf16, under DeepSpeed ZeRO-0:
  * greedy, 5 left-padded rows (bucket 8: 3 dummy rows), an EOS that ends row 0 early: graph == eager (required),
    graph == HF generate (reported);
  * the same after an optimizer step, with no new capture (the graph is reused);
  * sampled, 4 rows (= the bucket, so both paths draw the same noise): graph == eager (reported), a seed reproduces
    and another seed differs (required).
Then Llama with LoRA (merged inference copy) and under ZeRO-3 (pinned copy, refreshed after a step): graph == eager;
and the host synchronisations of one graph generation. Exits non-zero if a required check fails.

    python bench/graph_equality.py [zero3_check lora_check host_syncs]   (needs a CUDA GPU, DeepSpeed and peft;
                                                                          names: run only those checks)
    python bench/graph_equality.py --families gpt2,bloom [CHECK ...]    (these families' checks, then the named
                                                                          checks: none named, none run)
"""
import argparse
import copy
import os
import sys
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
from hybrid_common import PAD, early_token, hf_generate, left_padded_batch  # noqa: E402
from results import require_cuda, run_benchmark, write_json  # noqa: E402

DEVICE = torch.device(os.environ.get("GRAPH_EQUALITY_DEVICE", "cuda"))  # "cpu": a dry run of the script's flow
FAMILIES = ["llama", "qwen2", "mistral", "opt", "gpt2", "bloom", "gemma", "phi3", "gpt_neox"]
VOCAB = 2048
MAX_NEW = 40
RESULTS = []
FAILURES = []


def config_of(family):
    from transformers import (BloomConfig, GemmaConfig, GPT2Config, GPTNeoXConfig, LlamaConfig, MistralConfig,
                              OPTConfig, Phi3Config, Qwen2Config)

    common = dict(vocab_size=VOCAB, hidden_size=256, num_attention_heads=8, max_position_embeddings=512,
                  bos_token_id=None, eos_token_id=None)
    if family == "llama":
        return LlamaConfig(intermediate_size=512, num_hidden_layers=4, num_key_value_heads=2, **common)
    if family == "qwen2":
        return Qwen2Config(intermediate_size=512, num_hidden_layers=4, num_key_value_heads=2, **common)
    if family == "mistral":
        return MistralConfig(intermediate_size=512, num_hidden_layers=4, num_key_value_heads=2, sliding_window=None,
                             **common)
    if family == "opt":
        return OPTConfig(ffn_dim=512, num_hidden_layers=4, word_embed_proj_dim=256, **common)
    if family == "bloom":  # ALiBi from the 2-D mask
        return BloomConfig(vocab_size=VOCAB, hidden_size=256, n_layer=4, n_head=8, bos_token_id=None,
                           eos_token_id=None)
    if family == "gemma":
        return GemmaConfig(intermediate_size=512, num_hidden_layers=4, num_key_value_heads=2, head_dim=32, **common)
    if family == "phi3":  # q/k/v and gate/up already fused in the checkpoint
        return Phi3Config(intermediate_size=512, num_hidden_layers=4, num_key_value_heads=2, pad_token_id=None,
                          **common)
    if family == "gpt_neox":  # partial rotary
        return GPTNeoXConfig(intermediate_size=512, num_hidden_layers=4, rotary_pct=0.25, **common)
    return GPT2Config(vocab_size=VOCAB, n_embd=256, n_layer=4, n_head=8, n_positions=512, bos_token_id=None,
                      eos_token_id=None)


def build_model(family, dtype, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_of(family)).to(DEVICE, dtype)
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, None)
    return model


def ds_engine(model, stage, dtype, **zero):
    import deepspeed

    from dschat.utils.dist import ensure_distributed

    ensure_distributed()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-2), config=config,
                                      dist_init_required=False)
    return engine


def hybrid_pair(engine):
    """Two hybrid engines over one DeepSpeed engine: CUDA graphs on, and off."""
    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig

    return [HybridEngine(engine, HybridEngineConfig(enabled=True, max_out_tokens=64, enable_cuda_graph=graphs),
                         pad_token_id=PAD) for graphs in (True, False)]


def prompts(lengths, seed):
    ids, mask = left_padded_batch(lengths, vocab_size=VOCAB, seed=seed)
    return ids.to(DEVICE), mask.to(DEVICE)


def lm_step(engine, sequences):
    """One optimizer step of a language-modelling loss over ``sequences`` (pad positions ignored); returns what the
    check records: the loss and the gradient norm (DeepSpeed skips a step whose norm is not finite)."""
    from dschat.models.attention import no_empty_query_rows

    engine.train()
    mask = (sequences != PAD).long()
    with no_empty_query_rows(engine.module):  # left pads: cuDNN's backward gives NaN for a fully masked query row
        loss = engine(input_ids=sequences, attention_mask=mask, labels=sequences.masked_fill(mask == 0, -100)).loss
        engine.backward(loss)
    engine.step()
    norm = engine.get_global_grad_norm()
    return {"loss": round(loss.item(), 4), "grad_norm": None if norm is None else float(norm)}


def train_step(pair, sequences):
    graph_engine, eager_engine = pair
    graph_engine.train()
    mask = (sequences != PAD).long()
    with torch.no_grad():
        logits = graph_engine(input_ids=sequences, attention_mask=mask).logits
    stats = lm_step(graph_engine, sequences)
    # a skipped step (non-finite gradients) would leave nothing for the "after step" checks to see; what was
    # non-finite: the loss, the logits at real or at padding positions (fully masked query rows), the gradient norm
    record("optimizer step applied", graph_engine.was_step_applied(), **stats,
           nonfinite_logits_real=int((~torch.isfinite(logits[mask.bool()])).sum()),
           nonfinite_logits_pad=int((~torch.isfinite(logits[~mask.bool()])).sum()))
    eager_engine.mark_weights_stale()  # its inference copy (LoRA / ZeRO-3) follows the same training weights
    for engine in pair:
        engine.eval()


def record(name, ok, required=True, **extra):
    RESULTS.append({"check": name, "ok": bool(ok), "required": required, **extra})
    print(f"{'ok  ' if ok else ('FAIL' if required else 'diff')} {name} {extra if extra else ''}", flush=True)
    if required and not ok:
        FAILURES.append(name)


def graph_state(engine):
    g = engine.graph_decoder
    return {"captures": g.captures, "replays": g.replays, "disabled": g.disabled_reason}


def greedy_checks(tag, pair, model, eos=None, after_step=False):
    """Required: 8 rows (= the bucket) give the eager tokens. Reported: 5 rows (3 dummy rows) give them too, which
    can fail only by rounding: the padded batch may get another GEMM kernel than the eager batch of 5."""
    graph_engine, eager_engine = pair
    when = " after step" if after_step else ""
    # 24 + 40 = 64 tokens: the graph's cache (rounded up to 64) is as long as the eager one, so both attend over
    # the same number of columns (in bf16 a longer, masked tail can change the rounding of the softmax sums).
    ids, mask = prompts([24, 7, 13, 3, 16, 9, 11, 5], seed=1)
    if eos is None:
        eos = early_token(hf_generate(model, ids, mask, MAX_NEW)[0, 24:])
    kwargs = dict(max_new_tokens=MAX_NEW, eos_token_id=eos)
    got = graph_engine.generate(ids, attention_mask=mask, **kwargs)
    eager = eager_engine.generate(ids, attention_mask=mask, **kwargs)
    state = graph_state(graph_engine)
    record(f"{tag} greedy graph==eager{when}",
           torch.equal(got, eager) and state["disabled"] is None and state["captures"] >= 1, **state)
    if not after_step:
        record(f"{tag} greedy graph==HF generate", torch.equal(got, hf_generate(model, ids, mask, MAX_NEW,
                                                                                  eos_token_id=eos)), required=False)
    padded = [graph_engine.generate(ids[:5], attention_mask=mask[:5], **kwargs),
              eager_engine.generate(ids[:5], attention_mask=mask[:5], **kwargs)]
    record(f"{tag} greedy graph==eager{when}, 5 rows in bucket 8", torch.equal(*padded), required=False)
    return got, eos


def sampled_checks(tag, pair):
    graph_engine, eager_engine = pair
    ids, mask = prompts([24, 4, 12, 6], seed=2)  # 24 + 40: the same cache length as eager

    def sample(engine, seed):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        return engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=True, top_k=50,
                               top_p=0.95, temperature=0.9, generator=gen)

    a, b, c = sample(graph_engine, 7), sample(graph_engine, 7), sample(graph_engine, 8)
    record(f"{tag} sampled: seed reproduces, other seed differs", torch.equal(a, b) and not torch.equal(a, c),
           **graph_state(graph_engine))
    record(f"{tag} sampled graph==eager (same seed)", torch.equal(a, sample(eager_engine, 7)), required=False)


def family_checks(family, dtype):
    tag = f"{family} {str(dtype).split('.')[-1]}"
    model = build_model(family, dtype)
    pair = hybrid_pair(ds_engine(model, 0, dtype))
    for engine in pair:
        engine.eval()
    got, eos = greedy_checks(tag, pair, model)
    captures = pair[0].graph_decoder.captures
    train_step(pair, got)
    greedy_checks(tag, pair, model, eos, after_step=True)
    record(f"{tag} graphs reused after the optimizer step", pair[0].graph_decoder.captures == captures,
           captures=captures)
    sampled_checks(tag, pair)


def lora_check():
    import peft

    model = build_model("llama", torch.bfloat16, seed=3)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)
    model = peft.get_peft_model(model, config).to(torch.bfloat16)
    pair = hybrid_pair(ds_engine(model, 0, torch.bfloat16))
    for engine in pair:
        engine.eval()
    assert pair[0].inference_weights.kind == "lora_copy"
    got, eos = greedy_checks("llama LoRA bf16", pair, model)
    captures = pair[0].graph_decoder.captures
    train_step(pair, got)
    greedy_checks("llama LoRA bf16", pair, model, eos, after_step=True)
    record("llama LoRA bf16 graphs reused after the step (merged copy rewritten in place)",
           pair[0].graph_decoder.captures == captures, captures=captures)


def zero3_check():
    model = build_model("llama", torch.bfloat16, seed=4)
    reference = copy.deepcopy(model)
    pair = hybrid_pair(ds_engine(model, 3, torch.bfloat16))
    for engine in pair:
        engine.eval()
    assert pair[0].inference_weights.kind == "pinned_copy"
    got, eos = greedy_checks("llama ZeRO-3 bf16", pair, reference)
    captures = pair[0].graph_decoder.captures
    train_step(pair, got)
    greedy_checks("llama ZeRO-3 bf16", pair, reference, eos, after_step=True)
    record("llama ZeRO-3 bf16 graphs reused after the refresh (pinned copy rewritten in place)",
           pair[0].graph_decoder.captures == captures, captures=captures)


def zero3_step_after_generation():
    """Whether the ZeRO-3 bf16 step of ``zero3_check`` is skipped (non-finite gradient norm) because of the hybrid
    engine (reported, not required): a first step with no hybrid engine, with an eager one and with a graph one; then,
    over one pair of engines, a step before any generation and after an eager and a graph generation, on the
    generated answers and on random ones."""
    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig

    ids, mask = prompts([24, 7, 13, 3, 16, 9, 11, 5], seed=1)
    seqs = torch.cat([ids, torch.randint(3, VOCAB, (ids.shape[0], MAX_NEW), device=DEVICE)], 1)
    for label, graphs in (("no hybrid engine", None), ("one eager hybrid engine", False),
                          ("one graph hybrid engine", True)):
        engine = ds_engine(build_model("llama", torch.bfloat16, seed=4), 3, torch.bfloat16)
        if graphs is not None:
            engine = HybridEngine(engine, HybridEngineConfig(enabled=True, max_out_tokens=64,
                                                             enable_cuda_graph=graphs), pad_token_id=PAD)
        stats = lm_step(engine, seqs)
        record(f"ZeRO-3 bf16 first step, {label}: applied", engine.was_step_applied(), required=False, **stats)
    graph_engine, eager_engine = pair = hybrid_pair(ds_engine(build_model("llama", torch.bfloat16, seed=4), 3,
                                                              torch.bfloat16))

    def step(label, sequences):
        stats = lm_step(graph_engine, sequences)
        eager_engine.mark_weights_stale()
        record(f"ZeRO-3 bf16 step {label}: applied", graph_engine.was_step_applied(), required=False, **stats)
        for engine in pair:
            engine.eval()

    step("before any generation (random answers)", seqs)
    for engine in pair:
        engine.eval()
    step("after an eager generation (its answers)", eager_engine.generate(ids, attention_mask=mask,
                                                                          max_new_tokens=MAX_NEW))
    step("after an eager generation (random answers)", seqs)
    step("after a graph generation (its answers)", graph_engine.generate(ids, attention_mask=mask,
                                                                         max_new_tokens=MAX_NEW))
    step("after a graph generation (random answers)", seqs)


def nonfinite_grads(named_grads):
    """Names of the parameters whose gradient has a non-finite entry, and the largest finite |gradient|."""
    bad, largest = [], 0.0
    for name, grad in named_grads:
        if grad is None:
            continue
        finite = torch.isfinite(grad)
        if not bool(finite.all()):
            bad.append(f"{name} ({int((~finite).sum())} of {grad.numel()})")
        if bool(finite.any()):
            largest = max(largest, float(grad.float()[finite].abs().max()))
    return {"nonfinite_params": bad[:12], "nonfinite_count": len(bad), "max_abs_grad": largest}


def sdpa_backend(name, model):
    """A context in which the model's SDPA calls use one backend, or (the last name) dschat's SDPA with no fully masked
    query row (``dschat.models.attention``, what step 3 trains masked rows with)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dschat.models.attention import no_empty_query_rows

    if name == "default":
        return contextlib.nullcontext()
    if name.startswith("default,"):
        return no_empty_query_rows(model)
    return sdpa_kernel([{"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                         "math": SDPBackend.MATH}[name]])


def zero3_grad_diagnosis():
    """Where the ZeRO-3 bf16 step of ``zero3_check`` goes non-finite (reported): the gradients of one backward over
    the same model and batch with plain torch under each SDPA backend, with the check's loss (which, as HF's loss over
    left-padded rows does, makes the last left pad predict the first real token: a query row that sees no key gets a
    gradient) and with that target dropped; then as ZeRO-0 and ZeRO-3 engines (each parameter's full gradient read
    with ``safe_get_full_grad`` before the step)."""
    from deepspeed.utils import safe_get_full_grad

    ids, _ = prompts([24, 7, 13, 3, 16, 9, 11, 5], seed=1)
    seqs = torch.cat([ids, torch.randint(3, VOCAB, (ids.shape[0], MAX_NEW), device=DEVICE)], 1)
    mask = (seqs != PAD).long()
    labels = seqs.masked_fill(mask == 0, -100)
    first_real = mask.bool() & ~torch.nn.functional.pad(mask, (1, 0))[:, :-1].bool()
    losses = {"the check's loss": labels, "no pad predicts a token": labels.masked_fill(first_real, -100)}
    for backend in ("default", "cudnn", "efficient", "math", "default, no query row fully masked"):
        for loss_name, targets in losses.items():
            model = build_model("llama", torch.bfloat16, seed=4)
            try:
                with sdpa_backend(backend, model):
                    loss = model(input_ids=seqs, attention_mask=mask, labels=targets).loss
                    loss.backward()
            except RuntimeError as error:  # a backend this device does not have (cuDNN on the CPU)
                record(f"ZeRO-3 diagnosis: SDPA {backend} unavailable", True, required=False, error=str(error)[:100])
                break
            grads = nonfinite_grads((n, p.grad) for n, p in model.named_parameters())
            record(f"ZeRO-3 diagnosis: plain torch bf16 backward, SDPA {backend}, {loss_name}: gradients finite",
                   grads["nonfinite_count"] == 0, required=False, loss=round(loss.item(), 4), **grads)
    for stage in (0, 3):
        engine = ds_engine(build_model("llama", torch.bfloat16, seed=4), stage, torch.bfloat16)
        loss = engine(input_ids=seqs, attention_mask=mask, labels=labels).loss
        engine.backward(loss)
        grads = nonfinite_grads((n, safe_get_full_grad(p)) for n, p in engine.module.named_parameters())
        engine.step()
        record(f"ZeRO-3 diagnosis: ZeRO-{stage} engine, the check's loss: step applied", engine.was_step_applied(),
               required=False, loss=round(loss.item(), 4), grad_norm=float(engine.get_global_grad_norm()), **grads)


def host_syncs():
    model = build_model("llama", torch.bfloat16, seed=5)
    graph_engine, _ = hybrid_pair(ds_engine(model, 0, torch.bfloat16))
    graph_engine.eval()
    ids, mask = prompts([20, 7, 13, 3, 16], seed=1)
    graph_engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=VOCAB - 1)  # capture
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if DEVICE.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        graph_engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=VOCAB - 1)
        if DEVICE.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    record("host syncs in a 40-token graph generation with an EOS (informational)", True, required=False,
           syncs=len(syncs), kinds=sorted(set(syncs))[:4])


def parse_checks(argv):
    """(families, checks) named on the command line (neither: every family's and every check); a name that is no
    family or check is an error, not a run of nothing that reports no failure."""
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("checks", nargs="*", metavar="CHECK",
                   help=f"run only these checks, of {', '.join(c.__name__ for c in NAMED_CHECKS)}")
    p.add_argument("--families", type=lambda text: text.split(","),
                   help=f"comma-separated, of {','.join(FAMILIES)} (default: all when no check is named, else none)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.checks) - {check.__name__ for check in NAMED_CHECKS})
    if unknown:
        p.error(f"no check named {', '.join(unknown)} (checks: {', '.join(c.__name__ for c in NAMED_CHECKS)})")
    unknown = sorted(set(args.families or ()) - set(FAMILIES))
    if unknown:
        p.error(f"no family {', '.join(unknown)} (families: {', '.join(FAMILIES)})")
    if args.families is None and not args.checks:  # nothing named: everything
        return FAMILIES, [check.__name__ for check in NAMED_CHECKS]
    return args.families or [], args.checks


NAMED_CHECKS = (lora_check, zero3_check, zero3_step_after_generation, zero3_grad_diagnosis, host_syncs)


def main():
    families, checks = parse_checks(sys.argv[1:])
    if DEVICE.type == "cuda":
        require_cuda("GRAPH_EQUALITY_DEVICE=cpu is a dry run of the script's flow")
    import transformers

    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} transformers {transformers.__version__} {name} "
          f"register_generator_state={hasattr(torch.cuda.CUDAGraph, 'register_generator_state')}", flush=True)
    import logging

    logging.basicConfig(level=logging.WARNING)
    for family in families:
        for dtype in (torch.float32, torch.bfloat16):
            try:
                family_checks(family, dtype)
            except Exception as error:  # noqa: BLE001 - report and go on with the other families
                record(f"{family} {dtype} raised", False, error=f"{type(error).__name__}: {str(error)[:300]}")
    for check in NAMED_CHECKS:
        if check.__name__ not in checks:
            continue
        try:
            check()
        except Exception as error:  # noqa: BLE001
            record(f"{check.__name__} raised", False, error=f"{type(error).__name__}: {str(error)[:300]}")
    write_json("graph_equality.json", RESULTS)
    equal = sum(r["ok"] for r in RESULTS)
    differ = [r["check"] for r in RESULTS if not r["ok"] and not r["required"]]
    print(f"\n{equal}/{len(RESULTS)} checks hold; reported differences (not required): {len(differ)}; "
          f"required failures: {FAILURES or 'none'}")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    run_benchmark(main)
