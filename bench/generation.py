"""Generation benchmark: HF generate (dynamic / static cache) vs dschat's hybrid engine (ZeRO-0 / ZeRO-3, eager or
with CUDA graphs: the ``_graph`` variants; ``_compiled``: torch.compile of the decode forward and of the prefill;
``_eagerprefill``: with ``_compiled``, the prefill left eager; ``_autotune``: compiled in inductor's
max-autotune-no-cudagraphs mode (each decode GEMM's kernel picked by timing); ``_sdpa``: SDPA for the
decode attention instead of dschat's Triton kernel; ``_nofuse``: each projection its own GEMM, not q/k/v as one;
``_fuse``: ``fuse_projections="on"``, the same as auto on CUDA; ``_tilemask``: the decode attention loads the mask
for every tile, without ``triton_decode.CONTIGUOUS_FAST_PATH``; the tenth session's logs call it ``_holes0``, and the
default ``_holes2``; ``_scan``: every attention program scans its row's mask, without
``triton_decode.SPANS_PER_FORWARD``, as before the fourteenth session; ``_torchsample``: torch's ops choose the tokens,
without ``triton_sampling``'s one-pass kernel, as before the fifteenth session; ``_onecut``: with ``--top_p`` alone,
each row's cut searched by one program, not split over chunks, as before the twenty-fifth session),
against the memory-bandwidth floor measured in the same run. Random-weight models built from configs, bf16, sampled,
prompts of P tokens, G generated tokens (no early stop), batch B.

    python bench/generation.py --models opt-1.3b --batches 64 --variants hf_dynamic,hf_static,dschat_z0,dschat_z3
    python bench/generation.py --batches 1,16,64,128 --variants dschat_z0_graph,dschat_z3_graph --profile 64

Each row (model, batch, variant) runs in a fresh process of its own (``--same_process``: all in this one, one after
another). Prints a table and writes JSON (to $OUT when set). Needs a CUDA GPU; run it through the device tool.
"""
import argparse
import contextlib
import gc
import itertools
import json
import os
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import results as results_io  # noqa: E402

# DeepSpeed ZeRO-3 replaces torch.nn.functional.linear process-wide (memory_efficient_linear); put torch's back after
# each variant so that the variants after a ZeRO-3 one are not measured with it.
TORCH_LINEAR = torch.nn.functional.linear

SHAPES = {
    "opt-1.3b": lambda: __import__("transformers").OPTConfig(
        vocab_size=50272, hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32,
        max_position_embeddings=2048, word_embed_proj_dim=2048, do_layer_norm_before=True, enable_bias=True,
        dropout=0.0, attention_dropout=0.0),
    # OPT-30B's config (issue 6's 30B-class actor; ZeRO-3 and inference tensor parallelism in bench/tensor_parallel.py)
    "opt-30b": lambda: __import__("transformers").OPTConfig(
        vocab_size=50272, hidden_size=7168, num_hidden_layers=48, ffn_dim=28672, num_attention_heads=56,
        max_position_embeddings=2048, word_embed_proj_dim=7168, do_layer_norm_before=True, enable_bias=True,
        dropout=0.0, attention_dropout=0.0),
    # Qwen2.5-7B's config: grouped-query attention (28 query heads, 4 key/value heads)
    "qwen2.5-7b": lambda: __import__("transformers").Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False),
}


def log(*a):
    print(*a, flush=True)


def copy_bandwidth():
    """Device-to-device copy bandwidth (bytes read + written per second)."""
    x = torch.randn(1024**3 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(20):
        y.copy_(x)
    e.record()
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 2 * 20 / (s.elapsed_time(e) / 1e3)
    del x, y
    return bw


def decode_floor(cfg, weight_bytes, batch, prompt, gen, bw):
    """Each decode step reads every weight once and the KV cache so far (prefill not counted)."""
    layers = cfg.num_hidden_layers
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * layers * kv_heads * head_dim * 2
    return sum((weight_bytes + kv_per_token * batch * (prompt + t)) / bw for t in range(gen))


def build_model(name):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(SHAPES[name](), dtype=torch.bfloat16)
    return model.eval()


def weight_bytes_read_per_step(model):
    """Bytes of weights a decode step reads: the input embedding table is gathered (B rows), not read whole."""
    emb = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is emb
    return total if tied else total - emb.numel() * emb.element_size()


def timed(fn, repeats):
    times, out = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2], out


# --top_k / --top_p: the sampling filters of every variant (HF's and dschat's); none by default
FILTERS = dict(top_k=0, top_p=1.0)


def hf_variant(model, prompt, mask, gen, static, repeats):
    kw = dict(max_new_tokens=gen, min_new_tokens=gen, do_sample=True, **FILTERS, pad_token_id=1,
              eos_token_id=2)
    if static:
        kw["cache_implementation"] = "static"
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(prompt, attention_mask=mask, **kw)  # warm-up (static: compiles)
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    seconds, out = timed(lambda: model.generate(prompt, attention_mask=mask, **kw), repeats)
    return {"seconds": seconds, "first_call_s": warm, "shape": list(out.shape)}


def dschat_engine(model, stage, train, graph=False, compile_mode=None, attention="auto", fuse="auto",
                  compile_prefill=True):
    import deepspeed

    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig
    from dschat.utils.dist import ensure_distributed

    ensure_distributed()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1e4},
              "bf16": {"enabled": True}, "steps_per_print": 10**9}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6) if train else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                      dist_init_required=False)
    return HybridEngine(engine, HybridEngineConfig(enabled=True, max_out_tokens=1024, enable_cuda_graph=graph),
                        pad_token_id=1, eos_token_id=2, compile_decode_step=compile_mode, decode_attention=attention,
                        fuse_projections=fuse, compile_prefill=compile_prefill)


def dschat_variant(model, prompt, mask, gen, stage, repeats, train, graph=False, profile=False, compile_mode=None,
                   attention="auto", fuse="auto", compile_prefill=True):
    he = dschat_engine(model, stage, train, graph, compile_mode, attention, fuse, compile_prefill)
    generator = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(max_new_tokens=gen, do_sample=True, **FILTERS, eos_token_id=None, pad_token_id=1,
              generator=generator)

    def one():  # what a PPO iteration does: switch to generation (gathering under ZeRO-3), generate
        he.mark_weights_stale() if hasattr(he, "mark_weights_stale") else None
        he.eval()
        out = he.generate(prompt, attention_mask=mask, **kw)
        he.train()
        return out

    t0 = time.perf_counter()
    one()
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    seconds, out = timed(one, repeats)
    stats = he.latency_stats() if hasattr(he, "latency_stats") else {}
    result = {"seconds": seconds, "first_call_s": warm, "shape": list(out.shape), "engine_stats": stats,
              "decode_attention": he.decode_attention}
    if graph:
        g = he.graph_decoder
        result.update(graph_captures=g.captures, graph_replays=g.replays, graph_disabled=g.disabled_reason)
    if train:  # the RLHF loop: a training step, then generation must see the new weights
        x = prompt[:4, :64]
        loss = he(input_ids=x, labels=x).loss
        he.backward(loss)
        he.step()
        result["after_step_s"], _ = timed(one, 1)
        if graph:
            result["graph_captures_after_step"] = he.graph_decoder.captures
    if profile:
        result["profile"] = profile_decode(he, prompt, mask, kw, profile)
    del he
    return result


def profile_decode(he, prompt, mask, kw, new_tokens):
    """Kernel time of a generation (prefill + ``new_tokens`` - 1 decode steps) by kernel: says whether the decode
    step's time is in a few bandwidth-bound kernels (GEMMs, attention) or in many small ones."""
    from profiling import profile_kernels

    kw = dict(kw, max_new_tokens=new_tokens)
    he.generate(prompt, attention_mask=mask, **kw)  # same key as the timed runs: no capture inside the profile
    summary = profile_kernels(lambda: he.generate(prompt, attention_mask=mask, **kw), f"{new_tokens} tokens", log)
    return dict(summary, new_tokens=new_tokens)


def write_json(args, bw, rows):
    results_io.write_json(args.json, {"bandwidth_Bps": bw, "args": vars(args), "rows": rows})


DSCHAT_OPTIONS = ("graph", "compiled", "eagerprefill", "autotune", "sdpa", "fuse", "nofuse", "tilemask", "scan",
                  "torchsample", "onecut")


# the tenth session's option names (docs/benchmarks.md's commands of then)
RENAMED_OPTIONS = {"holes0": "_tilemask", "holes2": "the default (no option)"}


# Checked at parsing: a misspelled variant option was dropped and its row measured another variant ("hf_statc" HF's
# dynamic cache), an unknown model or a batch that is no number failed in each row.
def variant_error(variant):
    stage, _, options = variant.removeprefix("dschat_").partition("_")
    if variant in ("hf_dynamic", "hf_static") or (variant.startswith("dschat_") and stage in ("z0", "z1", "z2", "z3")
                                                   and all(o in DSCHAT_OPTIONS for o in options.split("_") if options)):
        return None
    renamed = [f"_{old} is now {new}" for old, new in RENAMED_OPTIONS.items() if old in options.split("_")]
    return f"a variant is hf_dynamic, hf_static or dschat_z<stage 0-3> with _<option>s of {', '.join(DSCHAT_OPTIONS)}" \
        + (f" ({'; '.join(renamed)})" if renamed else "")


def main():
    # (sizes of 0 failed deep inside the model or engine; a mode that is none, in torch.compile at the first generation)
    from dschat.args import COMPILE_MODES, non_negative_int, positive_int

    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--models", type=results_io.list_flag(results_io.unknown_name(SHAPES, "model shape")),
                   default="opt-1.3b")
    p.add_argument("--batches", type=results_io.list_flag(results_io.batch_error), default="64")
    p.add_argument("--prompt", type=positive_int, default=256)
    p.add_argument("--gen", type=positive_int, default=256)
    p.add_argument("--variants", type=results_io.list_flag(variant_error),
                   default="hf_dynamic,hf_static,dschat_z0,dschat_z3")
    p.add_argument("--repeats", type=positive_int, default=2)
    p.add_argument("--top_k", type=non_negative_int, default=0, help="sampling filter of every variant (0: none)")
    p.add_argument("--top_p", type=results_io.top_p_flag, default=1.0,
                   help="sampling filter of every variant (1: none)")
    p.add_argument("--train_step", action="store_true", help="dschat variants: also time after an optimizer step")
    p.add_argument("--profile", type=int, default=0, help="profile the dschat variants at this batch size")
    p.add_argument("--profile_tokens", type=positive_int, default=33,
                   help="tokens generated under the profiler (the first is the prefill's); the timed runs' --gen "
                        "gives the whole generation's mix of short and long caches")
    p.add_argument("--compile_mode", default="default", choices=COMPILE_MODES,
                   help="torch.compile mode of the *_graph_compiled variants")
    p.add_argument("--attention_programs_per_sm", type=positive_int, default=None,
                   help="the decode attention kernel's split target (dschat.hybrid_engine.triton_decode.PROGRAMS_PER_SM)")
    p.add_argument("--inductor_pdl", action="store_true",
                   help="inductor's Triton kernels use programmatic dependent launch (Hopper): each kernel's start "
                        "overlaps the previous one's tail")
    p.add_argument("--same_process", action="store_true",
                   help="all rows in this process, one after another (default: each row in a fresh process of its "
                        "own, so that nothing one row leaves behind changes the next one's timing)")
    p.add_argument("--json", type=results_io.json_name, default="generation.json",
                   help="file name of the JSON written to $OUT")
    args = p.parse_args()
    # (checked here, not in the rows' processes, each of which runs one of the batches)
    if args.profile and not results_io.in_row_process() and args.profile not in map(int, args.batches.split(",")):
        p.error(f"--profile {args.profile}: no such batch in --batches {args.batches} (nothing would be profiled)")
    results_io.require_cuda()  # (before each row's process fails alike)
    if not args.same_process:
        rows, _ = run_rows_in_fresh_processes(args)  # (which writes the JSON)
        print_table(rows)
        return
    if args.inductor_pdl:
        import torch._inductor.config as inductor_config

        if not hasattr(inductor_config.triton, "enable_pdl"):
            raise SystemExit(f"--inductor_pdl: torch {torch.__version__}'s inductor has no triton.enable_pdl")
        inductor_config.triton.enable_pdl = True
    if args.attention_programs_per_sm is not None:
        from dschat.hybrid_engine import triton_decode

        triton_decode.PROGRAMS_PER_SM = args.attention_programs_per_sm
    FILTERS.update(top_k=args.top_k, top_p=args.top_p)
    import transformers
    log(f"torch {torch.__version__} transformers {transformers.__version__} {torch.cuda.get_device_name()}")
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    for name in args.models.split(","):
        for batch in map(int, args.batches.split(",")):
            for variant in args.variants.split(","):
                model = build_model(name)
                wbytes = weight_bytes_read_per_step(model)
                floor = decode_floor(model.config, wbytes, batch, args.prompt, args.gen, bw)
                prompt = torch.randint(4, model.config.vocab_size, (batch, args.prompt), device="cuda")
                mask = torch.ones_like(prompt)
                torch.cuda.reset_peak_memory_stats()
                try:
                    if variant.startswith("hf_"):
                        r = hf_variant(model, prompt, mask, args.gen, variant == "hf_static", args.repeats)
                    else:  # dschat_z<stage>[_graph][_compiled][_eagerprefill][_autotune][_sdpa][_[no]fuse][_tilemask]
                        # [_scan][_torchsample][_onecut]
                        from dschat.hybrid_engine import sampling, triton_filters

                        options = variant.split("_")[1:]
                        stage = int(options[0][1:])
                        graph = "graph" in options
                        compile_mode = args.compile_mode if "compiled" in options else None
                        if "autotune" in options:  # inductor picks each decode GEMM's kernel by timing candidates
                            compile_mode = "max-autotune-no-cudagraphs"
                        with attention_paths("tilemask" not in options, "scan" not in options), \
                                mock.patch.object(sampling, "ONE_PASS", "torchsample" not in options), \
                                mock.patch.object(triton_filters, "SPLIT_TOP_P", False if "onecut" in options else None):
                            r = dschat_variant(model, prompt, mask, args.gen, stage, args.repeats, args.train_step,
                                               graph, compile_mode=compile_mode,
                                               profile=args.profile_tokens if batch == args.profile else 0,
                                               attention="sdpa" if "sdpa" in options else "auto",
                                               fuse="off" if "nofuse" in options else "on" if "fuse" in options
                                               else "auto", compile_prefill="eagerprefill" not in options)
                    r.update(ok=True)
                except Exception as ex:  # a failing variant is reported, not fatal
                    r = {"ok": False, "error": f"{type(ex).__name__}: {str(ex)[:400]}"}
                # (the GPU in each row: plot.py's titles name it, and rows of several runs join one file)
                r.update(model=name, batch=batch, variant=variant, floor_s=floor,
                         peak_gb=torch.cuda.max_memory_allocated() / 1e9, device=torch.cuda.get_device_name())
                if r["ok"]:
                    r["x_floor"] = r["seconds"] / floor
                    r["tokens_per_s"] = batch * args.gen / r["seconds"]
                log(json.dumps(r))
                rows.append(r)
                write_json(args, bw, rows)  # after every row: a run cut short still leaves its results
                del model, prompt, mask
                torch.nn.functional.linear = TORCH_LINEAR
                # each variant compiles its own decode step: torch.compile's guards accept another instance of the
                # same class, so the next row would reuse this row's code (traced with or without fused projections)
                torch._dynamo.reset()
                gc.collect()
                torch.cuda.empty_cache()
    print_table(rows)


@contextlib.contextmanager
def attention_paths(fast_path, spans_per_forward):
    """For one row: the decode attention without its contiguous-span fast path (``_tilemask``) and/or with each
    program scanning its row's mask (``_scan``)."""
    if fast_path and spans_per_forward:
        yield
        return
    from dschat.hybrid_engine import triton_decode

    saved = triton_decode.CONTIGUOUS_FAST_PATH, triton_decode.SPANS_PER_FORWARD
    triton_decode.CONTIGUOUS_FAST_PATH = saved[0] and fast_path
    triton_decode.SPANS_PER_FORWARD = saved[1] and spans_per_forward
    try:
        yield
    finally:
        triton_decode.CONTIGUOUS_FAST_PATH, triton_decode.SPANS_PER_FORWARD = saved


def print_table(rows):
    log(f"\n{'model':<12}{'B':>5} {'variant':<16}{'seconds':>9}{'x floor':>9}{'tok/s':>9}{'first':>8}{'peak GB':>9}")
    for r in rows:
        if r["ok"]:
            log(f"{r['model']:<12}{r['batch']:>5} {r['variant']:<16}{r['seconds']:>9.3f}{r['x_floor']:>9.2f}"
                f"{r['tokens_per_s']:>9.0f}{r['first_call_s']:>8.1f}{r['peak_gb']:>9.1f}")
        else:
            log(f"{r['model']:<12}{r['batch']:>5} {r['variant']:<16} FAILED {r['error'][:80]}")
        if r.get("floor_s") is not None:
            log(f"{'':<17}floor {r['floor_s']:.3f} s")


def row_runs(args, argv):
    """One run of this script per (model, batch, variant) row, in that order: ``argv`` with the row's own
    ``--models``/``--batches``/``--variants`` (argparse keeps the last) and ``--same_process``."""
    rows = itertools.product(args.models.split(","), args.batches.split(","), args.variants.split(","))
    return [((name, int(batch), variant), argv + ["--models", name, "--batches", batch, "--variants", variant,
                                                   "--same_process"])
            for name, batch, variant in rows]


def run_rows_in_fresh_processes(args):
    """Each row in a fresh process of its own (results.run_in_fresh_processes says why); their rows and bandwidths."""
    runs = row_runs(args, sys.argv[1:])
    keys = dict((f"row{i}", key) for i, (key, _) in enumerate(runs))
    rows, bandwidths = [], []
    for label, payload, returncode in results_io.run_in_fresh_processes(
            __file__, [(f"row{i}", argv) for i, (_, argv) in enumerate(runs)]):
        if payload is not None and payload["rows"]:
            rows += payload["rows"]
            bandwidths.append(payload["bandwidth_Bps"])
        else:
            name, batch, variant = keys[label]
            rows.append({"ok": False, "error": f"its process exited with {returncode} and left no result",
                         "model": name, "batch": batch, "variant": variant, "floor_s": None})
        # after every row, as --same_process writes: a run cut short (the device tool's time limit) leaves the rows
        # done, not nothing (the rows' own files are in a temporary folder)
        results_io.write_json(args.json, {"bandwidth_Bps": bandwidths, "args": vars(args), "rows": rows})
    return rows, bandwidths


if __name__ == "__main__":
    results_io.run_benchmark(main)
