"""PPO-iteration benchmark: wall seconds per step-3 iteration, split into generation, experience forwards
(actor, reference, critic, reward) and training, for dschat's DeepSpeedPPOTrainer on one GPU or, under a launcher,
on every GPU of a data-parallel job (64 prompts per GPU; the slowest rank sets each iteration's time).

OPT-1.3B-shaped actor and OPT-350m-shaped critic/reward with random weights, bf16, 64 prompts of 256 tokens,
256 generated tokens (answers never end early), generation batch = training batch = 64, one PPO epoch, actor
gradient checkpointing (as in DeepSpeed-Chat's measured run) unless the variant says nockpt. Mean (and median) of
iterations 2..N.

    python bench/ppo_iteration.py --variants z2_hybrid,z2_hf,z3_hybrid,z3_hf --iterations 6
    python bench/ppo_iteration.py --variants z2_hybrid,z2_hybrid_compiled,z2_hybrid_genlogp --cuda_graph

A variant is z<stage>_hybrid or z<stage>_hf, optionally followed by _compiled (``--compile_decode_step default``),
_genlogp (``--logprobs_from_generation``), _nockpt (actor gradient checkpointing off), _gcfreeze (``gc.freeze()``
after building the models), _overflowcheck (``--check_grad_overflow``), _padded (``--padded_forwards``: masked
forwards over the left-padded rows, as DeepSpeed-Chat), _z3module (``--zero3_fetch module``: DeepSpeed's hooks on
every submodule instead of one per decoder layer), _fuse / _nofuse (``--fuse_projections on`` / ``off``; default
auto), _torchsample (torch's ops choose the tokens, without the one-pass sampling kernel); the flags of the same names
apply to every hybrid variant. ``--profile`` adds two untimed iterations per variant: one under torch.profiler
(kernel time, GPU idle time per trainer phase) and one under cProfile (host time by function, GC pauses).
    torchrun --nproc_per_node 2 bench/ppo_iteration.py --variants z2_hybrid,z3_hybrid --cuda_graph   # data-parallel

Without a launcher each variant runs in a fresh process of its own (``--same_process``: all in this one).

Needs a CUDA GPU; run through the device tool. Prints a table; writes JSON to $OUT when set.
"""
import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import results as results_io  # noqa: E402

ACTOR = dict(vocab_size=50272, hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32,
             max_position_embeddings=2048, word_embed_proj_dim=2048, do_layer_norm_before=True, dropout=0.0)
CRITIC = dict(vocab_size=50272, hidden_size=1024, num_hidden_layers=24, ffn_dim=4096, num_attention_heads=16,
              max_position_embeddings=2048, word_embed_proj_dim=512, do_layer_norm_before=False, dropout=0.0)


SMOKE_ACTOR = dict(ACTOR, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                   word_embed_proj_dim=64, vocab_size=1024)
SMOKE_CRITIC = dict(CRITIC, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                    word_embed_proj_dim=32, vocab_size=1024)


VARIANT_OPTIONS = ("compiled", "genlogp", "nockpt", "gcfreeze", "overflowcheck", "padded", "z3module", "fuse", "nofuse",
                   "torchsample")


# the options that set the hybrid engine's generation, which a z<stage>_hf variant (HF's generate) does not use
HYBRID_OPTIONS = ("compiled", "genlogp", "fuse", "nofuse", "torchsample")


def variant_error(name):
    """A ``results.list_flag`` check of --variants: z<stage>_hybrid or z<stage>_hf with options of VARIANT_OPTIONS
    (see above). A misspelled option was left out, and the row labelled with it measured another variant; a name
    without a stage failed only after the models were built; a hybrid engine's option on a _hf variant was ignored,
    its row z<stage>_hf's under another name."""
    stage, _, options = name.partition("_")
    kind, *extra = options.split("_")
    if kind == "hf" and (unused := [o for o in extra if o in HYBRID_OPTIONS]):
        return f"_{'_'.join(unused)} sets the hybrid engine's generation, which a _hf variant (HF's generate) does " \
            "not use"
    if stage in ("z0", "z1", "z2", "z3") and kind in ("hybrid", "hf") and all(o in VARIANT_OPTIONS for o in extra):
        return None
    return f"a variant is z<stage 0-3>_hybrid or z<stage>_hf, optionally followed by _<option>, of " \
        f"{', '.join(VARIANT_OPTIONS)}"


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def log(*a):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


def slowest(times):
    """{name: seconds} -> the maximum over ranks of each."""
    names = sorted(times)
    t = torch.tensor([float(times[k]) for k in names], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(names, t.tolist()))


def profiled(prefix):
    """fn, label -> fn's result, run under torch.profiler (kernel and host-op tables logged)."""
    def run(fn, label):
        from profiling import profile_kernels

        result = {}
        profile_kernels(lambda: result.update(value=fn()), f"{prefix} {label}", log)
        return result["value"]
    return run


def save_random_model(folder, shape, tokenizer):
    from transformers import AutoModelForCausalLM, OPTConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(OPTConfig(**shape), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def add_value_head(folder):
    """Make ``folder`` a step-2 reward model (a random value head beside its backbone): step 3 refuses a reward model
    without a trained head."""
    from dschat.models.reward_model import RewardModel

    torch.manual_seed(1)
    model = RewardModel.from_pretrained(folder)
    model.save_head_and_meta(folder, {"v_head.weight": model.v_head.weight.detach()})
    return folder


def run_variant(name, actor_dir, critic_dir, tokenizer, args, vocab):
    from dschat import DeepSpeedPPOTrainer, DeepSpeedRLHFEngine

    stage = int(name[1])
    options = name.split("_")[1:]
    hybrid = "hybrid" in options
    compile_mode = "default" if "compiled" in options else args.compile_decode_step
    settings = {"actor_zero_stage": stage, "critic_zero_stage": stage, "enable_hybrid_engine": hybrid,
                "dtype": "bf16" if torch.cuda.is_available() else "fp32",
                "per_device_generation_batch_size": args.batch, "per_device_training_batch_size": args.batch,
                "max_prompt_seq_len": args.prompt, "max_answer_seq_len": args.gen,
                "actor_gradient_checkpointing": "nockpt" not in options, "num_warmup_steps": 0,
                "critic_model_name_or_path": critic_dir,
                "check_grad_overflow": "overflowcheck" in options, "padded_forwards": "padded" in options,
                "zero3_fetch": "module" if "z3module" in options else "layer"}
    if hybrid:  # (step 3 refuses the hybrid engine's own flags without it, even False: a _hf variant failed so)
        settings.update({"enable_cuda_graph": args.cuda_graph, "compile_decode_step": compile_mode,
                         "logprobs_from_generation": args.logprobs_from_generation or "genlogp" in options,
                         "fuse_projections": "on" if "fuse" in options else "off" if "nofuse" in options else "auto"})
    from dschat.hybrid_engine import sampling

    sampling.ONE_PASS = "torchsample" not in options  # a process per variant; with --same_process set for each
    engine = DeepSpeedRLHFEngine(actor_model_name_or_path=actor_dir, tokenizer=tokenizer, args=settings)
    trainer = DeepSpeedPPOTrainer(engine=engine, args=settings)
    if "gcfreeze" in options:  # the models' Python objects out of the collector's reach (see docs/benchmarks.md)
        gc.collect()
        gc.freeze()
    # answers run to full length, as in the measured baseline: an EOS id no token can take
    trainer.eos_token_id = vocab
    if hybrid:
        trainer.actor_model.eos_token_id = trainer.eos_token_id
    g = torch.Generator().manual_seed(dist.get_rank())  # each data-parallel rank has its own prompts
    prompts = torch.randint(4, vocab, (args.batch, args.prompt), generator=g).to(device())
    mask = torch.ones_like(prompts)
    if args.left_pad:  # every other prompt shorter, left-padded as a collator does: a padding mask from iteration 1
        prompts[::2, :args.left_pad] = tokenizer.pad_token_id
        mask[::2, :args.left_pad] = 0
    batch = {"prompt": prompts, "prompt_att_mask": mask}
    rows = []
    for i in range(args.iterations):
        dist.barrier()
        synchronize()
        run = profiled(f"{name} iteration {i}") if i in args.profile_iteration else (lambda fn, label: fn())
        t0 = time.perf_counter()
        exp = run(lambda: trainer.generate_experience(batch, step=i), "generate_experience")
        synchronize()
        t1 = time.perf_counter()
        run(lambda: trainer.train_rlhf(exp), "train_rlhf")
        synchronize()
        t2 = time.perf_counter()
        # The slowest rank sets the pace of a data-parallel iteration.
        row = slowest({"wall": t2 - t0, "generation": trainer.stats["generation_time"],
                       "experience": trainer.stats["experience_time"], "training": t2 - t1})
        row["answer_length"] = trainer.stats["answer_length"]
        rows.append(row)
        log(name, i, json.dumps(rows[-1]))
    steady = rows[1:]
    mean = {k: sum(r[k] for r in steady) / len(steady) for k in steady[0]}
    world = dist.get_world_size()
    mean.update(variant=name, world_size=world, samples_per_s=world * args.batch / mean["wall"],
                median_wall=statistics.median(r["wall"] for r in steady), iterations=rows,
                peak_gb=torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0)
    if args.profile and torch.cuda.is_available():  # after the timed iterations, so they are not slowed by it
        from profiling import profile_host, profile_kernels

        holder = {}
        mean["profile"] = [
            profile_kernels(lambda: holder.update(exp=trainer.generate_experience(batch, step=args.iterations)),
                            f"{name} generate_experience", log),
            profile_kernels(lambda: trainer.train_rlhf(holder["exp"]), f"{name} train_rlhf", log),
            profile_host(lambda: holder.update(exp=trainer.generate_experience(batch, step=args.iterations)),
                         f"{name} generate_experience", log),
            profile_host(lambda: trainer.train_rlhf(holder["exp"]), f"{name} train_rlhf", log)]
    del trainer, engine
    return mean


def main():
    # (sizes of 0 failed deep inside the model or engine; a mode that is none, in torch.compile at the first generation)
    from dschat.args import COMPILE_MODES, non_negative_int, positive_int

    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--variants", type=results_io.list_flag(variant_error), default="z2_hybrid,z2_hf,z3_hybrid,z3_hf")
    p.add_argument("--iterations", type=positive_int, default=6, help="at least 2: the first is the warm-up, left "
                                                                        "out of the means")
    p.add_argument("--batch", type=positive_int, default=64)
    p.add_argument("--prompt", type=positive_int, default=256)
    p.add_argument("--gen", type=positive_int, default=256)
    p.add_argument("--cuda_graph", action="store_true")
    p.add_argument("--left_pad", type=non_negative_int, default=0,
                   help="left-pad every other prompt by this many tokens, as real prompts of different lengths are: "
                        "the forwards see a padding mask from the first iteration (default 0: full-length prompts, "
                        "the first mask comes with the first pad token sampled inside an answer)")
    p.add_argument("--compile_decode_step", default=None, choices=COMPILE_MODES,
                   help="torch.compile mode of the decode step")
    p.add_argument("--logprobs_from_generation", action="store_true",
                   help="hybrid variants: the actor's old log-probs from the decode step (no actor experience forward)")
    p.add_argument("--profile", action="store_true",
                   help="two more iterations per variant: under torch.profiler and under cProfile")
    p.add_argument("--profile_iteration", type=lambda v: sorted(int(x) for x in v.split(",")), default=[],
                   help="0-based iterations run under torch.profiler, e.g. 1: the first after the warm-up (still "
                        "timed, profiler overhead included)")
    p.add_argument("--same_process", action="store_true",
                   help="run all variants in this process (default on one GPU: a fresh process each, so that no "
                        "variant inherits another's memory, compiled kernels or first-call costs)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (runs on the CPU): checks the script only")
    p.add_argument("--json", type=results_io.json_name, default="ppo_iteration.json",
                   help="file name of the JSON written to $OUT")
    p.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it
    args = p.parse_args()
    if args.iterations < 2:  # (one ran, then failed with an IndexError: the means leave the warm-up out)
        p.error(f"--iterations {args.iterations}: at least 2 (the first iteration is the warm-up, left out of the "
                "means)")
    if args.left_pad >= args.prompt:  # (a negative one, refused above, padded all but the last tokens instead)
        p.error(f"--left_pad {args.left_pad}: at most --prompt {args.prompt} - 1 (a prompt of pad tokens alone is "
                "no prompt)")
    if any(not 0 <= i < args.iterations for i in args.profile_iteration):  # (else silently not profiled)
        p.error(f"--profile_iteration {','.join(map(str, args.profile_iteration))}: the iterations are 0-based, "
                f"0 to {args.iterations - 1} with --iterations {args.iterations}")
    if not args.smoke:  # (the GPU shapes would build on the CPU, each variant failing later)
        results_io.require_cuda("--smoke checks the script on the CPU")
    variants = args.variants.split(",")
    from dschat.utils.dist import ensure_distributed, local_device, under_launcher

    # under a launcher (deepspeed's, torchrun, mpirun, srun) the variants share its ranks
    if len(variants) > 1 and not args.same_process and not under_launcher():
        print_table(run_each_in_its_own_process(variants, args), 1)
        return
    from dschat.tiny import load_tiny_tokenizer

    ensure_distributed()
    if torch.cuda.is_available():  # one GPU per rank, known with the process group (mpirun, srun set no LOCAL_RANK)
        torch.cuda.set_device(local_device())

    tokenizer = load_tiny_tokenizer()
    tokenizer.padding_side = "left"
    actor_shape, critic_shape = (SMOKE_ACTOR, SMOKE_CRITIC) if args.smoke else (ACTOR, CRITIC)
    # Rank 0 writes the random models (transformers saves on rank 0 only), every rank loads them.
    root = [tempfile.mkdtemp(prefix="dschat_bench_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    actor_dir, critic_dir = os.path.join(root[0], "actor"), os.path.join(root[0], "critic")
    if dist.get_rank() == 0:
        save_random_model(actor_dir, actor_shape, tokenizer)
        add_value_head(save_random_model(critic_dir, critic_shape, tokenizer))
    dist.barrier()
    try:
        results = run_variants(variants, actor_dir, critic_dir, tokenizer, args, actor_shape["vocab_size"])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:  # the random models: GBs at the real shapes, this run's alone
            shutil.rmtree(root[0], ignore_errors=True)
    print_table(results, dist.get_world_size())
    if dist.get_rank() == 0:
        write_json(args, results)


def run_variants(variants, actor_dir, critic_dir, tokenizer, args, vocab_size):
    """One result row per variant, run one after another in this process (a failing variant gives an error row)."""
    results = []
    for name in variants:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        try:
            results.append(run_variant(name, actor_dir, critic_dir, tokenizer, args, vocab_size))
        except Exception as ex:  # report and go on
            import traceback
            traceback.print_exc()
            results.append({"variant": name, "error": f"{type(ex).__name__}: {str(ex)[:300]}"})
        gc.unfreeze()  # a gcfreeze variant, also when it failed
        torch._dynamo.reset()  # compiled decode steps hold their models
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def run_each_in_its_own_process(variants, args):
    """This script once per variant, each in a fresh process; returns their result rows. The combined JSON goes to
    $OUT as usual."""
    results = []
    runs = [(name, sys.argv[1:] + ["--variants", name, "--same_process"])  # argparse keeps the last
            for name in variants]
    for name, payload, returncode in results_io.run_in_fresh_processes(__file__, runs):
        if returncode == 0 and payload is not None:
            results += payload["results"]
        else:
            results.append({"variant": name, "error": f"its process exited with {returncode}"})
        write_json(args, results)  # after every variant: a run cut short by a time limit keeps those done
    return results


def write_json(args, results):
    results_io.write_json(args.json, {"args": vars(args), "results": results})


def print_table(results, world_size):
    log(f"\nranks: {world_size} (samples/s counts all of them)")
    log(f"\n{'variant':<34}{'wall s':>8}{'median':>8}{'gen s':>8}{'exp s':>8}{'train s':>9}{'samples/s':>11}"
        f"{'peak GB':>9}")
    for r in results:
        if "error" in r:
            log(f"{r['variant']:<34} FAILED {r['error'][:90]}")
            continue
        log(f"{r['variant']:<34}{r['wall']:>8.2f}{r['median_wall']:>8.2f}{r['generation']:>8.2f}"
            f"{r['experience']:>8.2f}{r['training']:>9.2f}{r['samples_per_s']:>11.1f}{r['peak_gb']:>9.1f}")


if __name__ == "__main__":
    results_io.run_benchmark(main)
