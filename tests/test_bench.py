"""The GPU benchmarks' own logic, on the CPU with tiny shapes (``--smoke``): device time is scarce, so a benchmark that
breaks should break here first."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).parents[1]


def test_ppo_iteration_runs_each_variant_in_its_own_process_and_keeps_every_iteration(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # not under a launcher
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "ppo_iteration.py"), "--smoke", "--iterations", "2",
                           "--variants", "z2_hybrid_genlogp_nockpt_fuse,z3_hybrid_z3module", "--json", "ppo.json",
                           "--profile_iteration", "1",
                           # the script's logic at a CPU-sized workload (its defaults are the GPU run's 64 prompts of
                           # 256 tokens and 256 answer tokens): more than one early-exit interval of decode steps
                           "--batch", "8", "--prompt", "32", "--gen", "16"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "ppo.json").read_text())["results"]
    assert [r["variant"] for r in results] == ["z2_hybrid_genlogp_nockpt_fuse", "z3_hybrid_z3module"]
    for r in results:
        assert "error" not in r, r
        assert len(r["iterations"]) == 2 and r["wall"] == r["iterations"][1]["wall"], "mean of iterations 2..N"
        assert r["samples_per_s"] > 0 and r["median_wall"] == r["wall"]
    for variant in ("z2_hybrid_genlogp_nockpt_fuse", "z3_hybrid_z3module"):  # the profiled iteration's tables
        for phase in ("generate_experience", "train_rlhf"):
            assert f"profile {variant} iteration 1 {phase}:" in proc.stdout, proc.stdout[-3000:]
    assert proc.stdout.count("host time by operator") == 4
    assert proc.stdout.count("by class: attention") == 4
    assert proc.stdout.count("ranks: 1") == 3, "a table from each variant's own process, then the combined one"
    assert not list(scratch.glob("dschat_bench_*")), "each process removes the random models it wrote"


def test_kernel_classes_sort_kernels_by_name_and_sum_their_time():
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "bench"))
    from profiling import kernel_classes

    def kernel(key, us, count):
        return SimpleNamespace(key=key, self_device_time_total=us, count=count)

    out = kernel_classes([kernel("_partial_kernel", 1000, 24), kernel("nvjet_tst_64x8_64x16", 500, 48),
                          kernel("void cutlass::Kernel2<...>", 250, 24),
                          kernel("triton_poi_fused__to_copy_add_0", 100, 24),
                          kernel("triton_poi_fused_add_decode_attention_index_1", 100, 24),
                          kernel("Memcpy DtoD", 50, 2)])
    assert out["attention"] == {"ms": 1.0, "count": 24}
    assert out["gemm"] == {"ms": 0.75, "count": 72}
    assert out["copy"] == {"ms": 0.05, "count": 2}
    assert out["other"] == {"ms": 0.2, "count": 48}  # inductor's fused element-wise kernels, whatever their names


def test_skinny_gemm_equals_linear_with_and_without_split_k():
    """bench/skinny_gemm.py under Triton's interpreter (chosen before triton is imported, hence a subprocess): split-K
    parts summed by the last program, its counter reset for the next launch, bias, ragged N/K, a 3-D input."""
    code = """
import sys, torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
from skinny_gemm import skinny_linear, Tiling
torch.manual_seed(0)
for rows, k, n, split, bias in [(64, 256, 96, 1, True), (5, 256, 96, 4, True), (64, 512, 80, 2, False),
                                (1, 200, 33, 2, True)]:
    x, w = torch.randn(rows, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    for launch in range(2):
        y = skinny_linear(x[:, None], w, b, Tiling(block_n=32, block_k=64, split_k=split))
        assert y.shape == (rows, 1, n)
        torch.testing.assert_close(y[:, 0], F.linear(x, w, b), rtol=1e-4, atol=1e-4)
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, str(REPO / "bench")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout[-2000:] + proc.stderr[-2000:]


def test_pdl_chain_fused_layers_equal_the_torch_layer_and_write_the_cache_slot():
    """bench/pdl_chain.py's seven-kernel layer under Triton's interpreter (fp32, no PDL or TMA: GPU-only), for each
    tiling preset: the output of two layers, the k/v written into the cache's slot (and nothing else), a second launch
    (split-K counters reset) and the engine's attention in place of the chain's; the compiled layer's attention
    variants (the chain's kernel, with left padding given per row, and the engine's kernel with a fixed tile)."""
    code = """
import functools, sys, torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
import pdl_chain as pc
# H: the smallest multiple of 128 x split-K 4 (the presets' widest); FF != H (a swapped projection would not fit);
# B = 2: one left-padded row and one not below (programs per row: B x heads for the interpreter to run)
H, FF, NH, D, B, L, filled = 512, 1024, 8, 64, 2, 80, 70
pc.HIDDEN, pc.FFN, pc.HEADS, pc.HEAD_DIM, pc.LAYERS = H, FF, NH, D, 2
def make():
    torch.manual_seed(1)
    w = lambda n, k: torch.randn(n, k) * 0.05
    v = lambda n, s=0.05, m=0.0: torch.randn(n) * s + m
    return [{"ln1": (v(H, .1, 1.), v(H)), "qkv": (w(3 * H, H), v(3 * H)), "out": (w(H, H), v(H)),
             "ln2": (v(H, .1, 1.), v(H)), "fc1": (w(FF, H), v(FF)), "fc2": (w(H, FF), v(H)),
             "kv": [torch.randn(B, NH, L, D) for _ in range(2)]} for _ in range(2)]
def reference(h, layers):
    for l in layers:
        kc, vc = l["kv"]
        q, k, v = (t.view(B, NH, 1, D) for t in F.linear(F.layer_norm(h, (H,), *l["ln1"], 1e-5), *l["qkv"]).split(H, -1))
        kc[:, :, filled - 1], vc[:, :, filled - 1] = k[:, :, 0], v[:, :, 0]
        o = F.scaled_dot_product_attention(q, kc[:, :, :filled], vc[:, :, :filled]).reshape(B, H)
        h = h + F.linear(o, *l["out"])
        h = h + F.linear(torch.relu(F.linear(F.layer_norm(h, (H,), *l["ln2"], 1e-5), *l["fc1"])), *l["fc2"])
    return h
x, position = torch.randn(B, H), torch.tensor(filled - 1)
mask = torch.zeros(B, 1, 1, L, dtype=torch.bool)
mask[..., :filled] = True
expected_layers = make()
expected = reference(x, expected_layers)
for tilings, engine_mask in [("base", None), ("wide", None), ("tuned", None), ("base", mask)]:
    layers = make()
    chain = pc.FusedLayers(layers, B, position, None, tilings, engine_attention_mask=engine_mask)
    first, second = chain(x).clone(), chain(x).clone()
    torch.testing.assert_close(first, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(first, second), tilings
    for got, want in zip(layers, expected_layers):
        for i in range(2):
            torch.testing.assert_close(got["kv"][i], want["kv"][i], rtol=1e-5, atol=1e-5)
simple_layer = functools.partial(pc.torch_layer, attention=lambda q, k, v, p, m: pc.simple_attention(q, k, v, p))
torch.testing.assert_close(pc.torch_step(simple_layer, x, make(), position, mask), expected, rtol=1e-4, atol=1e-4)
lo = torch.tensor([3, 0], dtype=torch.int32)  # left padding: the span kernel and the engine's skip it
padded = mask.clone()
padded[::2, ..., :3] = False
engine = pc.torch_step(pc.torch_layer, x, make(), position, padded)
span_layer = functools.partial(pc.torch_layer, attention=lambda q, k, v, p, m: pc.span_attention(q, k, v, p, lo))
tuned_layer = functools.partial(pc.torch_layer, attention=lambda q, k, v, p, m: pc.engine_attention_tuned(q, k, v, m))
torch.testing.assert_close(pc.torch_step(span_layer, x, make(), position, padded), engine, rtol=1e-4, atol=1e-4)
torch.testing.assert_close(pc.torch_step(tuned_layer, x, make(), position, padded), engine, rtol=1e-4, atol=1e-4)
assert not torch.allclose(engine, expected, rtol=1e-4, atol=1e-4)  # the padding changed the result
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, str(REPO / "bench")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_log_space_race_picks_the_tokens_the_probability_race_picked():
    """bench/sampling.py's reference (the sampler dschat had before) and dschat's sampler, fed the same exponential
    noise (same generator state, same shape and dtype), choose the same token in every row, with a temperature."""
    sys.path.insert(0, str(REPO / "bench"))
    import torch
    from sampling import race_on_probabilities

    from dschat.hybrid_engine.sampling import sample_next_token

    logits = (torch.randn(256, 300, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    for temperature in (1.0, 0.7):
        old = race_on_probabilities(logits, temperature, torch.Generator().manual_seed(5))
        new = sample_next_token(logits, temperature, do_sample=True, generator=torch.Generator().manual_seed(5))
        assert torch.equal(old, new), (old != new).sum()
        assert len(set(new.tolist())) > 50  # a race, not an argmax of the logits


def test_fresh_processes_run_each_row_alone_and_say_which_left_no_result(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from results import run_in_fresh_processes

    script = tmp_path / "row.py"
    script.write_text("import json, os, sys\n"
                      "label = sys.argv[sys.argv.index('--json') + 1][:-len('.json')]\n"
                      "if label == 'broken':\n"
                      "    sys.exit(3)\n"
                      "with open(os.path.join(os.environ['OUT'], label + '.json'), 'w') as f:\n"
                      "    json.dump({'pid': os.getpid(), 'argv': sys.argv[1:]}, f)\n")
    runs = [("a", ["a", "--x", "1"]), ("broken", ["broken"]), ("b", ["b"])]
    got = list(run_in_fresh_processes(script, runs))
    assert [(label, returncode) for label, _, returncode in got] == [("a", 0), ("broken", 3), ("b", 0)]
    assert got[0][1]["argv"] == ["a", "--x", "1", "--json", "a.json"] and got[1][1] is None
    assert got[0][1]["pid"] != got[2][1]["pid"] != os.getpid(), "each run in a process of its own"


def test_generation_runs_each_row_in_its_own_process_and_keeps_the_failed_rows(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(REPO / "bench"))
    from types import SimpleNamespace

    from generation import row_runs

    runs = row_runs(SimpleNamespace(models="opt-1.3b,qwen2.5-7b", batches="1,64", variants="dschat_z0,hf_static"),
                    ["--repeats", "3", "--variants", "ignored"])
    assert [key for key, _ in runs] == [(m, b, v) for m in ("opt-1.3b", "qwen2.5-7b") for b in (1, 64)
                                        for v in ("dschat_z0", "hf_static")]
    key, argv = runs[5]  # argparse keeps the last occurrence of an option: the row's own
    assert argv[:4] == ["--repeats", "3", "--variants", "ignored"]
    assert argv[4:] == ["--models", "qwen2.5-7b", "--batches", "1", "--variants", "hf_static", "--same_process"]
    # Without a GPU every row's process fails (their parent, here, is let past its own GPU check): the parent still
    # reports each row, as FAILED, and writes its JSON.
    import generation

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(generation.results_io, "require_cuda", lambda *a: None)
    monkeypatch.setattr(sys, "argv", ["generation.py", "--models", "opt-1.3b", "--batches", "1,2",
                                      "--variants", "dschat_z0", "--json", "gen.json"])
    generation.main()
    rows = json.loads((tmp_path / "gen.json").read_text())["rows"]
    assert [(r["batch"], r["ok"]) for r in rows] == [(1, False), (2, False)]
    assert "left no result" in rows[0]["error"] and capsys.readouterr().out.count("FAILED") == 2


def test_generation_cut_short_leaves_the_rows_its_fresh_processes_finished(tmp_path, monkeypatch):
    """In its default mode (each row in a fresh process) generation.py wrote its JSON only after the last row: a run
    cut short by the device tool's time limit left no result at all, though each finished row's process had one."""
    sys.path.insert(0, str(REPO / "bench"))
    import generation

    def first_row_then_killed(script, runs):
        yield runs[0][0], {"bandwidth_Bps": 3e12, "rows": [{"ok": True, "model": "opt-1.3b", "batch": 1,
                                                            "variant": "dschat_z0", "seconds": 1.0, "floor_s": 0.5}]}, 0
        raise KeyboardInterrupt  # (the limit's signal, in the second row)

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(generation.results_io, "require_cuda", lambda *a: None)
    monkeypatch.setattr(generation.results_io, "run_in_fresh_processes", first_row_then_killed)
    monkeypatch.setattr(sys, "argv", ["generation.py", "--models", "opt-1.3b", "--batches", "1,2",
                                      "--variants", "dschat_z0", "--json", "gen.json"])
    with pytest.raises(KeyboardInterrupt):
        generation.main()
    rows = json.loads((tmp_path / "gen.json").read_text())["rows"]
    assert [(r["batch"], r["seconds"]) for r in rows] == [(1, 1.0)]
    assert [p.name for p in tmp_path.iterdir()] == ["gen.json"]  # (written aside, then renamed)
    # cut short while writing the next row's JSON: the file written last stays whole (written aside, then renamed)

    def cut_while_writing(payload, f, **options):
        f.write('{"rows": [')
        raise KeyboardInterrupt

    monkeypatch.setattr(generation.results_io, "json", SimpleNamespace(dump=cut_while_writing))
    with pytest.raises(KeyboardInterrupt):
        generation.results_io.write_json("gen.json", {"rows": rows * 2})
    assert json.loads((tmp_path / "gen.json").read_text())["rows"] == rows


def test_ppo_iteration_cut_short_leaves_the_variants_its_fresh_processes_finished(tmp_path, monkeypatch):
    """The same for ppo_iteration.py's variants, each in a process of its own."""
    sys.path.insert(0, str(REPO / "bench"))
    import ppo_iteration

    def first_variant_then_killed(script, runs):
        yield runs[0][0], {"results": [{"variant": runs[0][0], "samples_per_s": 36.0}]}, 0
        raise KeyboardInterrupt

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(ppo_iteration.results_io, "run_in_fresh_processes", first_variant_then_killed)
    args = SimpleNamespace(json="ppo.json")
    with pytest.raises(KeyboardInterrupt):
        ppo_iteration.run_each_in_its_own_process(["z2_hybrid", "z3_hybrid"], args)
    results = json.loads((tmp_path / "ppo.json").read_text())["results"]
    assert results == [{"variant": "z2_hybrid", "samples_per_s": 36.0}]


@pytest.mark.parametrize("variant", ["z2_hf", "z3_hf_nockpt", "z2_hybrid_compiled_genlogp_fuse"])
def test_ppo_iteration_gives_each_variant_settings_step_3_takes(variant, monkeypatch):
    """The hybrid engine's flags went to every variant: step 3 refuses them without the hybrid engine, even at False
    (--no-enable_cuda_graph), so every _hf variant failed before its first iteration ('read by the hybrid engine
    only, which is off'), whatever the flags."""
    import dschat
    from dschat.hybrid_engine import sampling
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.engine import check_settings

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import ppo_iteration

    class Checked(Exception):
        pass

    def engine(args=None, **given):
        check_settings(step3_args(args))
        raise Checked

    monkeypatch.setattr(dschat, "DeepSpeedRLHFEngine", engine, raising=False)
    monkeypatch.setattr(sampling, "ONE_PASS", sampling.ONE_PASS)  # (run_variant sets it for its variant)
    args = SimpleNamespace(compile_decode_step=None, batch=2, prompt=8, gen=4, cuda_graph=True,
                           logprobs_from_generation=True)
    with pytest.raises(Checked):
        ppo_iteration.run_variant(variant, "actor", "critic", None, args, 1024)


@pytest.mark.parametrize("script", ["ppo_iteration", "tensor_parallel"])
def test_a_benchmark_under_mpirun_shares_its_ranks_and_takes_each_ranks_own_gpu(script, monkeypatch):
    """mpirun and srun set no RANK or LOCAL_RANK (DeepSpeed's MPI discovery sets them as the process group starts):
    every rank set cuda:0 before that, and ppo_iteration.py took its ranks for plain processes, each running every
    variant in fresh processes of its own."""
    import importlib

    import torch

    from dschat.utils import dist as dschat_dist

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    bench = importlib.import_module(script)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "4"),
                       ("OMPI_COMM_WORLD_LOCAL_RANK", "1")):
        monkeypatch.setenv(key, value)

    def process_group_started():  # as DeepSpeed's init_distributed sets them from mpirun's
        monkeypatch.setenv("RANK", "3")
        monkeypatch.setenv("LOCAL_RANK", "1")
        return 3, 4

    class GpuSet(Exception):
        pass

    def set_device(device):
        raise GpuSet(device)

    monkeypatch.setattr(dschat_dist, "ensure_distributed", process_group_started)
    monkeypatch.setattr(dschat_dist, "local_device", lambda: torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    if script == "ppo_iteration":
        monkeypatch.setattr(bench, "run_each_in_its_own_process",
                            lambda *given: pytest.fail("a rank ran the variants in processes of its own"))
        monkeypatch.setattr(sys, "argv", [script, "--smoke", "--variants", "z2_hybrid,z3_hybrid"])
    else:
        monkeypatch.setattr(bench, "require_cuda", lambda *given: None)
        monkeypatch.setattr(sys, "argv", [script])
    with pytest.raises(GpuSet) as set_to:
        bench.main()
    assert set_to.value.args == (torch.device("cuda", 1),)


GPU_ONLY = [["decode_attention.py"], ["decode_gemm.py"], ["generation.py", "--models", "opt-1.3b"], ["l2_prefetch.py"],
            ["logprob_delta.py"], ["pdl_chain.py"], ["sampling.py"], ["sdpa_first_call.py"], ["tensor_parallel.py"],
            ["ppo_iteration.py", "--variants", "z2_hybrid"]]


@pytest.mark.parametrize("argv", GPU_ONLY, ids=[argv[0] for argv in GPU_ONLY])
def test_a_gpu_benchmark_without_a_gpu_says_so_in_one_line(tmp_path, argv):
    """Each failed deep inside its first CUDA call ("Torch not compiled with CUDA enabled"); ppo_iteration built its
    GPU-sized models on the CPU first."""
    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / argv[0]), *argv[1:]], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{argv[0]} needs a CUDA GPU" in proc.stderr
    assert ("--smoke" in proc.stderr) == (argv[0] in ("logprob_delta.py", "tensor_parallel.py", "ppo_iteration.py"))


GENERATION_ARGS = {"models": "opt-1.3b", "variants": "dschat_z0_graph", "batches": "64"}  # (what plot.py recognises)


def test_plot_lets_the_later_session_win_where_two_measured_the_same_point(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from plot import load_rows

    def row(seconds):
        return {"ok": True, "model": "opt-1.3b", "batch": 64, "variant": "dschat_z0_graph", "seconds": seconds,
                "floor_s": 0.45}

    paths = []
    for name, seconds in (("2026-11-30_s10_call1_gen.json", 0.8), ("2026-11-30_s9_call2_gen.json", 0.9)):
        (tmp_path / name).write_text(json.dumps({"args": GENERATION_ARGS, "rows": [row(seconds)]}))
        paths.append(str(tmp_path / name))
    assert load_rows(paths)["opt-1.3b"]["dschat_z0_graph"][64] == 0.8, "session 10 is later than session 9"


def _session_generation_files(tmp_path, folders):
    """``<folder>/generation.json`` for each (folder, seconds) of ``folders``: one OPT-1.3B row of dschat_z0_graph at
    B=64 taking those seconds (floor 0.45 s); their paths, in that order."""
    paths = []
    for folder, seconds in folders:
        (tmp_path / folder).mkdir(parents=True)
        path = tmp_path / folder / "generation.json"
        path.write_text(json.dumps({"args": GENERATION_ARGS, "rows": [
            {"ok": True, "model": "opt-1.3b", "batch": 64, "variant": "dschat_z0_graph", "seconds": seconds,
             "floor_s": 0.45}]}))
        paths.append(str(path))
    return paths


def test_plot_orders_files_in_session_folders_by_their_folders_date(tmp_path):
    """docs/results' newer sessions keep ``<date>_s<N>/<call>/generation.json``: ordered by the file name alone they
    tied, and an older session's row given later on the command line replaced a newer one's."""
    sys.path.insert(0, str(REPO / "bench"))
    from plot import load_rows

    paths = _session_generation_files(tmp_path, (("2026-12-06_s52/speed", 0.94), ("2026-12-05_s45/speed", 0.81),
                                                 ("2026-11-30_s9_call2", 0.7)))  # (newest first, as may be given)
    flat = tmp_path / "2026-12-01_s12_gen.json"  # (a file named by its date, beside the folders)
    flat.write_text(json.dumps({"args": GENERATION_ARGS, "rows": [
        {"ok": True, "model": "opt-1.3b", "batch": 64, "variant": "dschat_z0_graph", "seconds": 0.5, "floor_s": 0.4}]}))
    assert load_rows(paths)["opt-1.3b"]["dschat_z0_graph"][64] == 0.94
    assert load_rows([*paths, str(flat)])["opt-1.3b"]["dschat_z0_graph"][64] == 0.94
    assert load_rows([paths[2], str(flat)])["opt-1.3b"]["dschat_z0_graph"][64] == 0.5


def test_plot_titles_name_the_gpu_the_rows_record(tmp_path):
    """Every panel's title said "one H200", whatever GPU measured its rows: it names the rows' recorded device (and
    says so where a file records none, or where rows of one panel come from different GPUs)."""
    sys.path.insert(0, str(REPO / "bench"))
    from plot import load_panels, plot

    def row(model, device):
        return {"ok": True, "model": model, "batch": 64, "variant": "dschat_z0_graph", "seconds": 0.8,
                "floor_s": 0.45, **({"device": device} if device else {})}

    path = tmp_path / "gen.json"
    path.write_text(json.dumps({"args": GENERATION_ARGS, "rows": [
        row("opt-1.3b", "NVIDIA H100 80GB HBM3"), row("qwen2.5-7b", None), row("llama-8b", "NVIDIA H100 80GB HBM3"),
        dict(row("llama-8b", "NVIDIA H200"), batch=128)]}))
    figure = plot(*load_panels([str(path)]), str(tmp_path / "plot.png"))
    titles = {ax.get_title().split(" ")[0]: ax.get_title() for ax in figure.axes}
    assert titles["opt-1.3b"] == "opt-1.3b shape, one NVIDIA H100 80GB HBM3, bf16"
    assert titles["qwen2.5-7b"] == "qwen2.5-7b shape, GPU not recorded, bf16"
    assert titles["llama-8b"] == "llama-8b shape, rows from NVIDIA H100 80GB HBM3 and NVIDIA H200, bf16"
    assert "H200" not in titles["opt-1.3b"] + titles["qwen2.5-7b"]
    # a floor of one batch size is a point, drawn (a dashed line alone draws nothing there, its legend entry did)
    floors = [line for ax in figure.axes for line in ax.get_lines() if line.get_label() == "bandwidth floor"]
    assert len(floors) == 3 and all(line.get_marker() not in ("None", None, "") for line in floors)
    # --device names the GPU of files that record none (those written before generation.py recorded it)
    figure = plot(*load_panels([str(path)], unrecorded_device="NVIDIA H200"), str(tmp_path / "plot.png"))
    assert "qwen2.5-7b shape, one NVIDIA H200, bf16" in [ax.get_title() for ax in figure.axes]


def test_plot_takes_the_gpu_of_rows_that_record_none_from_the_gpu_txt_beside_their_file(tmp_path):
    """Older files (docs/results' of sessions 1-51) record no GPU, though many have the nvidia-smi gpu.txt of their
    call beside them: their panel said "GPU not recorded" unless --device was given, and nothing said so."""
    sys.path.insert(0, str(REPO / "bench"))
    from plot import load_panels

    def result(folder, model, gpu_txt=None):
        folder.mkdir()
        if gpu_txt is not None:
            (folder / "gpu.txt").write_text(gpu_txt)
        path = folder / "generation.json"
        path.write_text(json.dumps({"args": GENERATION_ARGS, "rows": [
            {"ok": True, "model": model, "batch": 64, "variant": "dschat_z0_graph", "seconds": 0.8, "floor_s": 0.4}]}))
        return str(path)

    header = "name, driver_version, memory.total [MiB]\n"
    h100 = result(tmp_path / "h100", "opt-1.3b", header + "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB\n")
    h200 = result(tmp_path / "h200", "qwen2.5-7b", "NVIDIA H200, 143771 MiB\n")  # (written without its header)
    two = result(tmp_path / "two", "llama-8b", header + "NVIDIA H100 80GB HBM3, 1, 2\nNVIDIA H200, 1, 2\n")
    bare = result(tmp_path / "bare", "gemma-2b")
    _, devices = load_panels([h100, h200, two, bare], unrecorded_device="NVIDIA A100")
    assert devices == {"opt-1.3b": {"NVIDIA H100 80GB HBM3"}, "qwen2.5-7b": {"NVIDIA H200"},
                       "llama-8b": {"NVIDIA A100"}, "gemma-2b": {"NVIDIA A100"}}  # (several GPUs: which is unknown)
    assert load_panels([bare])[1] == {"gemma-2b": {"GPU not recorded"}}


def test_plot_names_the_files_whose_gpu_is_not_known_and_the_flag_that_names_it(tmp_path):
    path = tmp_path / "2026-11-29_gen.json"
    path.write_text(json.dumps({"args": GENERATION_ARGS, "rows": [
        {"ok": True, "model": "opt-1.3b", "batch": 64, "variant": "dschat_z0_graph", "seconds": 0.8, "floor_s": 0.4}]}))
    out = str(tmp_path / "plot.png")
    proc = run_bench("plot.py", str(path), "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"plot.py: {path}: rows that record no GPU" in proc.stderr and "give --device NAME" in proc.stderr
    proc = run_bench("plot.py", str(path), "--out", out, "--device", "NVIDIA H200")
    assert proc.returncode == 0 and "record no GPU" not in proc.stderr, proc.stderr[-2000:]


def test_plot_title_names_the_gpu_of_the_rows_plotted_not_of_rows_a_later_file_replaced(tmp_path):
    """A point measured again on another GPU by a later file is plotted from the later file alone: the title named the
    replaced row's GPU too ("rows from NVIDIA H100 ... and NVIDIA H200"), though no plotted row came from it."""
    sys.path.insert(0, str(REPO / "bench"))
    from plot import load_panels, panel_title

    def row(device, seconds):
        return {"ok": True, "model": "opt-1.3b", "batch": 64, "variant": "dschat_z0_graph", "seconds": seconds,
                "floor_s": 0.45, "device": device}

    paths = []
    for name, device, seconds in (("2026-11-30_s9_call1_gen.json", "NVIDIA H100 80GB HBM3", 0.9),
                                  ("2026-11-30_s10_call1_gen.json", "NVIDIA H200", 0.8)):
        (tmp_path / name).write_text(json.dumps({"args": GENERATION_ARGS, "rows": [row(device, seconds)]}))
        paths.append(str(tmp_path / name))
    table, devices = load_panels(paths)
    assert table["opt-1.3b"]["dschat_z0_graph"][64] == 0.8
    assert panel_title("opt-1.3b", devices["opt-1.3b"]) == "opt-1.3b shape, one NVIDIA H200, bf16"
    # a point the later file did not measure again keeps its own GPU
    (tmp_path / "2026-11-30_s9_call1_gen.json").write_text(json.dumps({"args": GENERATION_ARGS, "rows": [
        row("NVIDIA H100 80GB HBM3", 0.9), dict(row("NVIDIA H100 80GB HBM3", 1.5), batch=128)]}))
    assert load_panels(paths)[1]["opt-1.3b"] == {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}


@pytest.mark.parametrize("pair", ["gen.json:dschat_z0_grpah", "docs/results/gen.json:dschat_z0_graph",
                                  "gen.jsn:dschat_z0_graph", "gen.json"])
def test_plot_refuses_a_skip_that_leaves_out_no_row(tmp_path, pair):
    """A misspelt --skip pair (or a file named with its folder) left out nothing: the row it was meant to leave out was
    plotted, and nothing was said."""
    sys.path.insert(0, str(REPO / "bench"))
    from plot import load_rows

    path = tmp_path / "gen.json"
    path.write_text(json.dumps({"args": GENERATION_ARGS, "rows": [
        {"ok": True, "model": "opt-1.3b", "batch": 64, "variant": variant, "seconds": seconds, "floor_s": 0.45}
        for variant, seconds in (("dschat_z0_graph", 0.8), ("dschat_z0_graph_compiled", 0.7))]}))
    assert "dschat_z0_graph" not in load_rows([str(path)], {"gen.json:dschat_z0_graph"})["opt-1.3b"]
    with pytest.raises(SystemExit, match=f"--skip {pair}: no row of that variant in a results file of that name"):
        load_rows([str(path)], {pair, "gen.json:dschat_z0_graph_compiled"})


def test_plot_skip_leaves_out_the_rows_of_a_folder_on_the_files_path(tmp_path):
    """Newer sessions keep ``<session>/<call>/generation.json``: --skip matched the file's name alone, so a pair left
    out that variant of every session's file, or (given the session folder) was refused; it now matches a folder on
    the path too, or several parts of it in a row."""
    sys.path.insert(0, str(REPO / "bench"))
    from plot import load_rows

    paths = _session_generation_files(tmp_path, (("2026-12-05_s45/speed", 0.81), ("2026-12-06_s52/speed", 0.94)))

    def plotted(pair):
        return load_rows(paths, {pair}).get("opt-1.3b", {}).get("dschat_z0_graph")

    assert plotted("2026-12-06_s52:dschat_z0_graph") == {64: 0.81}, "its row out, the other kept"
    assert plotted("2026-12-06_s52/speed/generation.json:dschat_z0_graph") == {64: 0.81}
    assert plotted(f"{paths[1]}:dschat_z0_graph") == {64: 0.81}
    assert plotted("2026-12-05_s45/speed:dschat_z0_graph") == {64: 0.94}
    assert plotted("generation.json:dschat_z0_graph") is None, "the file name matches both"
    for pair in ("s52:dschat_z0_graph", "2026-12-06_s52/generation.json:dschat_z0_graph"):  # (a whole part, in a row)
        with pytest.raises(SystemExit, match="no row of that variant in a results file of that name or folder"):
            plotted(pair)


def test_plot_makes_the_folder_of_its_out_file_and_refuses_a_folder_as_it(tmp_path, monkeypatch, capsys):
    """--out in a folder not there yet, or a folder itself, failed in matplotlib's savefig with a traceback once the
    figure was drawn."""
    path = tmp_path / "gen.json"
    path.write_text(json.dumps({"args": GENERATION_ARGS, "rows": [
        {"ok": True, "model": "opt-1.3b", "batch": 64, "variant": "dschat_z0_graph", "seconds": 0.8, "floor_s": 0.45,
         "device": "NVIDIA H200"}]}))
    out = tmp_path / "new" / "figures" / "plot.png"
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import plot

    monkeypatch.setattr(sys, "argv", ["plot.py", str(path), "--out", str(out)])
    plot.main()
    assert out.is_file()
    status, _ = bench_main_exit("plot", [str(path), "--out", str(tmp_path)], monkeypatch, capsys)
    assert f"--out {tmp_path}: a folder; give the image file to write" in str(status)
    status, _ = bench_main_exit("plot", [str(path), "--out", str(path / "plot.png")], monkeypatch, capsys)
    assert f"{path} is a file, not a folder" in str(status)


def bench_main_exit(script, argv, monkeypatch, capsys):
    """(exit status, stderr) of bench/``script``.py's main() given ``argv``, in this process: for the refusals at
    parsing, which end it before any GPU work."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    bench = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as ended:
        bench.main()
    return ended.value.code, capsys.readouterr().err


def run_bench(script, *argv, **env):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, str(REPO / "bench" / script), *argv], env=env, capture_output=True,
                          text=True, timeout=300)


def test_graph_equality_prints_its_help_and_refuses_a_check_it_does_not_have():
    """--help failed inside torch.cuda (without a GPU); a mistyped check name ran no check and exited 0 ("0/0 checks
    hold ... required failures: none")."""
    helped = run_bench("graph_equality.py", "--help")
    assert helped.returncode == 0 and "zero3_check" in helped.stdout, helped.stderr[-2000:]
    typo = run_bench("graph_equality.py", "zero3_chek", GRAPH_EQUALITY_DEVICE="cpu")
    assert typo.returncode == 2 and "no check named zero3_chek" in typo.stderr, typo.stdout[-2000:]
    typo = run_bench("graph_equality.py", "--families", "gpt2,gtp2", GRAPH_EQUALITY_DEVICE="cpu")
    assert typo.returncode == 2 and "no family gtp2" in typo.stderr, typo.stdout[-2000:]


def test_graph_equality_runs_the_families_and_checks_named_and_everything_when_none_is(monkeypatch):
    """--families splits the checks over device calls of under 10 minutes (bench/gpu_verify.sh): a family list alone
    runs no named check, a check name alone runs no family, and neither runs them all."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    import graph_equality

    every_check = [check.__name__ for check in graph_equality.NAMED_CHECKS]
    assert graph_equality.parse_checks([]) == (graph_equality.FAMILIES, every_check)
    assert graph_equality.parse_checks(["--families", "gpt2,bloom"]) == (["gpt2", "bloom"], [])
    assert graph_equality.parse_checks(["--families", "opt", "lora_check"]) == (["opt"], ["lora_check"])
    assert graph_equality.parse_checks(["host_syncs"]) == ([], ["host_syncs"])
    # main runs what was named: these families' checks (in both dtypes) and the named checks, no other
    import torch

    ran = []

    def named(name):
        def check():
            ran.append(name)
        check.__name__ = name
        return check

    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(graph_equality, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(graph_equality, "family_checks", lambda family, dtype: ran.append((family, dtype)))
    monkeypatch.setattr(graph_equality, "NAMED_CHECKS", tuple(named(name) for name in every_check))
    for argv, expected in ((["--families", "opt,gpt2", "host_syncs"],
                            [("opt", torch.float32), ("opt", torch.bfloat16), ("gpt2", torch.float32),
                             ("gpt2", torch.bfloat16), "host_syncs"]),
                           (["--families", "bloom"], [("bloom", torch.float32), ("bloom", torch.bfloat16)]),
                           (["lora_check"], ["lora_check"])):
        ran.clear()
        monkeypatch.setattr(sys, "argv", ["graph_equality.py", *argv])
        with pytest.raises(SystemExit) as ended:
            graph_equality.main()
        assert ended.value.code == 0 and ran == expected, (argv, ran)


def test_masked_rows_backward_help_prints_its_usage_without_running_the_benchmark():
    """The script read no flags: --help ran the whole benchmark (DeepSpeed engines included)."""
    helped = run_bench("masked_rows_backward.py", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage:"), helped.stdout[-2000:]
    assert run_bench("masked_rows_backward.py", "--head_dim", "64").returncode == 2


@pytest.mark.parametrize("argv, said", [(["--variants", "z2_hybrid,z2_hybird"], "'z2_hybird': a variant is"),
                                        (["--variants", "bogus"], "'bogus': a variant is"),
                                        (["--variants", "z2_hybrid_nockpt_fuse", "--iterations", "1"], "at least 2")])
def test_ppo_iteration_refuses_a_variant_it_does_not_know_and_too_few_iterations(argv, said):
    """A misspelled option was dropped (the row labelled z2_hybird measured z2_hf), "bogus" failed after the models were
    built, and one iteration failed with an IndexError after it ran (the means leave the warm-up out)."""
    proc = run_bench("ppo_iteration.py", "--smoke", *argv)
    assert proc.returncode == 2 and said in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("argv, said", [(["--variants", "dschat_z0_grpah"], "'dschat_z0_grpah': a variant is"),
                                        (["--variants", "hf_dynamic,hf_statc"], "'hf_statc': a variant is"),
                                        (["--batches", "1,x"], "'x': a batch size: expected a positive integer"),
                                        (["--variants", "dschat_z0_graph_holes0"], "_holes0 is now _tilemask"),
                                        (["--models", "opt-13b"], "'opt-13b': no such model shape"),
                                        (["--profile", "64", "--profile_tokens", "0"],
                                         "argument --profile_tokens: expected a positive integer, got 0"),
                                        (["--attention_programs_per_sm", "0"],
                                         "argument --attention_programs_per_sm: expected a positive integer, got 0")])
def test_generation_refuses_a_variant_model_or_batch_it_cannot_run_at_parsing(argv, said):
    """A misspelled option was dropped and its row measured another variant (hf_statc: HF's dynamic cache), an unknown
    model failed in each row's process, a batch that is no number with a traceback; --profile_tokens 0 profiled
    nothing and said nothing, and --attention_programs_per_sm 0 (or negative) measured the attention unsplit, as no
    setting does, its rows labelled 0."""
    proc = run_bench("generation.py", *argv)
    assert proc.returncode == 2 and said in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_plot_names_a_file_that_is_no_generation_result_and_says_when_nothing_is_left_to_plot(tmp_path):
    """A glob over docs/results/ takes other benchmarks' JSON: plot.py failed with KeyError: 'rows'; files whose rows
    all failed gave matplotlib's "Number of columns must be a positive integer"."""
    other = tmp_path / "ppo_iteration.json"
    other.write_text(json.dumps({"args": {}, "results": []}))
    rows_too = tmp_path / "decode_attention.json"  # rows, of another benchmark's
    rows_too.write_text(json.dumps({"args": {"layouts": "opt-1.3b"}, "rows": [{"ok": True, "us": 50.0}]}))
    failed = tmp_path / "generation.json"
    failed.write_text(json.dumps({"args": GENERATION_ARGS, "rows": [{"ok": False, "model": "opt-1.3b", "batch": 64,
                                                                  "variant": "dschat_z0"}]}))
    out = str(tmp_path / "plot.png")
    proc = run_bench("plot.py", str(other), "--out", out)
    assert proc.returncode == 1 and f"{other}: not a bench/generation.py result" in proc.stderr, proc.stderr[-2000:]
    proc = run_bench("plot.py", str(rows_too), "--out", out)
    assert proc.returncode == 1 and f"{rows_too}: not a bench/generation.py result" in proc.stderr, proc.stderr[-2000:]
    proc = run_bench("plot.py", str(failed), "--out", out)
    assert proc.returncode == 1 and "no measured row to plot" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("argv", [["logprob_delta.py", "--smoke", "--batch", "0"],
                                  ["logprob_delta.py", "--smoke", "--gen", "0"],
                                  ["ppo_iteration.py", "--smoke", "--variants", "z2_hybrid", "--gen", "0"]],
                         ids=["logprob_delta_batch", "logprob_delta_gen", "ppo_iteration_gen"])
def test_a_size_of_zero_is_a_flag_error_not_a_failure_inside_the_model(argv):
    """--batch 0 failed in the model's reshape, --gen 0 in the engine's generate (once the models were built)."""
    proc = run_bench(*argv)
    assert proc.returncode == 2 and f"argument {argv[-2]}: expected a positive integer, got 0" in proc.stderr, \
        proc.stderr[-2000:]


def test_ppo_iteration_refuses_a_hybrid_engine_option_on_an_hf_variant(monkeypatch):
    """z2_hf_genlogp (or _compiled, _fuse, _nofuse, _torchsample) ran z2_hf, HF's generate, which none of them sets:
    its row was z2_hf's under another name. The options that apply to both kinds stay."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from ppo_iteration import variant_error

    said = "sets the hybrid engine's generation, which a _hf variant (HF's generate) does not use"
    assert variant_error("z2_hf_genlogp_nockpt") == f"_genlogp {said}"
    assert variant_error("z3_hf_compiled_torchsample") == f"_compiled_torchsample {said}"
    assert variant_error("z3_hf_nockpt_padded_z3module_gcfreeze_overflowcheck") is None
    assert variant_error("z2_hybrid_compiled_genlogp_nofuse_torchsample") is None


@pytest.mark.parametrize("argv, said", [
    (["--left_pad", "-8"], "argument --left_pad: expected an integer >= 0, got -8"),
    (["--prompt", "16", "--left_pad", "16"], "--left_pad 16: at most --prompt 16 - 1")], ids=["negative", "whole_prompt"])
def test_ppo_iteration_refuses_a_left_pad_that_is_not_inside_the_prompts(argv, said, monkeypatch, capsys):
    """A negative --left_pad padded all but the last tokens of every other prompt (Python's slice from the end), and
    one of --prompt or more left every other prompt pad tokens alone: each measured another workload than asked."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import ppo_iteration

    monkeypatch.setattr(sys, "argv", ["ppo_iteration.py", "--variants", "z2_hybrid", *argv])
    with pytest.raises(SystemExit) as ended:
        ppo_iteration.main()
    err = capsys.readouterr().err
    assert ended.value.code == 2 and said in err, err[-2000:]


@pytest.mark.parametrize("argv, said", [
    (["ppo_iteration.py", "--smoke", "--variants", "z2_hybrid", "--iterations", "3", "--profile_iteration", "3"],
     "--profile_iteration 3: the iterations are 0-based, 0 to 2"),
    (["ppo_iteration.py", "--smoke", "--variants", "z2_hybrid", "--profile_iteration", "-1"],
     "--profile_iteration -1: the iterations are 0-based"),
    (["generation.py", "--batches", "1,16", "--profile", "64"], "--profile 64: no such batch in --batches 1,16"),
    (["generation.py", "--same_process", "--batches", "1,16", "--profile", "64"], "--profile 64: no such batch")],
    ids=["ppo_iteration", "ppo_iteration_negative", "generation", "generation_same_process"])
def test_a_profile_of_an_iteration_or_batch_the_run_does_not_have_is_a_flag_error(argv, said):
    """Both ran without profiling anything, and said nothing."""
    proc = run_bench(*argv)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("argv, said", [(["decode_attention.py", "--layouts", "opt-13b"], "'opt-13b': no such layout"),
                                        (["decode_gemm.py", "--batches", "64,0"], "'0': a batch size: expected a positive"),
                                        (["sampling.py", "--vocabs", "gpt2"], "'gpt2': no such vocabulary")],
                         ids=["decode_attention", "decode_gemm", "sampling"])
def test_a_gpu_microbenchmarks_unknown_shape_or_batch_is_a_flag_error(argv, said):
    """Each failed with a KeyError (or a tensor of no rows) once its GPU work had begun."""
    proc = run_bench(*argv)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("argv, said", [(["--batches", "16,x"], "'x': a batch size: expected a positive integer"),
                                        (["--stages", "0,4"], "'4': a ZeRO stage: 0, 1, 2 or 3"),
                                        (["--tp", "0"], "'0': an inference_tp_size: expected a positive integer"),
                                        (["--graph", "2"], "'2': CUDA graphs off or on: 0 or 1"),
                                        (["--graph", "yes"], "'yes': CUDA graphs off or on: 0 or 1")],
                         ids=["batches", "stages", "tp", "graph", "graph_word"])
def test_tensor_parallel_refuses_a_batch_stage_tp_or_graph_it_cannot_run_at_parsing(argv, said, monkeypatch, capsys):
    """Each list was read only once the process group had started: a value that is no number failed on every rank
    with a traceback (after the CPU ranks' start with --smoke), and --graph 2 ran with CUDA graphs on."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import tensor_parallel

    monkeypatch.setattr(sys, "argv", ["tensor_parallel.py", *argv])
    with pytest.raises(SystemExit) as ended:
        tensor_parallel.main()
    err = capsys.readouterr().err
    assert ended.value.code == 2 and said in err, err[-2000:]


@pytest.mark.parametrize("script, argv, said", [
    ("logprob_delta", ["--temperature", "0"], "argument --temperature: a sampling temperature is a number from 1e-30"),
    ("logprob_delta", ["--temperature", "nan"], "a sampling temperature is a number from 1e-30 to 1e+30, got 'nan'"),
    ("generation", ["--top_p", "1.5"], "argument --top_p: a top-p is a number in (0, 1]"),
    ("generation", ["--top_k", "-1"], "argument --top_k: expected an integer >= 0, got -1"),
    ("sampling", ["--temperature", "-1"], "argument --temperature: a sampling temperature is"),
    ("sampling", ["--top_p", "0"], "argument --top_p: a top-p is a number in (0, 1]"),
    ("sampling", ["--steps", "0"], "argument --steps: expected a positive integer, got 0")],
    ids=["logprob_delta_zero", "logprob_delta_nan", "generation_top_p", "generation_top_k", "sampling_temperature",
         "sampling_top_p", "sampling_steps"])
def test_a_sampling_setting_generate_refuses_is_a_flag_error(script, argv, said, monkeypatch, capsys):
    """Each failed in the hybrid engine's or HF's generate once the model was built (with a traceback, in each of
    generation.py's row processes), or, for sampling.py, in its kernels."""
    code, err = bench_main_exit(script, argv, monkeypatch, capsys)
    assert code == 2 and said in err, err[-2000:]


def test_pipeline_gpu_refuses_an_unknown_case_before_it_makes_its_output_folder(tmp_path, monkeypatch, capsys):
    """A mistyped --cases made --out, then was refused, naming no case it has."""
    monkeypatch.syspath_prepend(str(REPO / "tests" / "scripts"))
    import pipeline_gpu

    monkeypatch.setattr(sys, "argv", ["pipeline_gpu.py", "--cases", "tiny,qwen_z4", "--out", str(tmp_path / "pipe")])
    with pytest.raises(SystemExit) as ended:
        pipeline_gpu.main()
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "unknown cases ['qwen_z4'] (cases: tiny, opt, qwen_z3," in err, err
    assert not (tmp_path / "pipe").exists()


HAND_RUN_CHECKS = ["mixed_precision_lora_gpu", "hybrid_gpu_smoke", "rng_after_graphs", "align_overflow_fp16",
                   "first_step_gpu"]


@pytest.mark.parametrize("script", HAND_RUN_CHECKS)
def test_a_check_script_run_by_hand_prints_its_usage_on_help_and_runs_nothing(script, tmp_path, monkeypatch, capsys):
    """tests/scripts' checks that docs/benchmarks.md and bench/gpu_verify.sh run by hand read no flags: --help ran the
    whole check (hybrid_gpu_smoke.py's smoke, align_overflow_fp16.py's engines), and mixed_precision_lora_gpu.py took
    it for its OUT_DIR, writing its model into a folder named --help before step 3 began."""
    import importlib

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO / "tests" / "scripts"))
    check = importlib.import_module(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    with pytest.raises(SystemExit) as ended:
        check.main()
    assert ended.value.code == 0 and capsys.readouterr().out.startswith("usage:")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("script, argv, said", [
    ("decode_attention", ["--filled", "384,600"], "--filled 600: more than --cache 512 slots"),
    ("decode_attention", ["--filled", "384,x"], "argument --filled: 'x': a count of filled slots: expected a positive"),
    ("decode_attention", ["--splits", "default,0"], "argument --splits: '0': a count of parts per (row, head)"),
    ("decode_attention", ["--batch", "0"], "argument --batch: expected a positive integer, got 0"),
    ("l2_prefetch", ["--cache", "256"], "--filled 384: more than --cache 256 slots"),
    ("pdl_chain", ["--filled", "16", "--left_pad", "16"], "--left_pad 16: at most --filled 16 - 1"),
    ("pdl_chain", ["--replays", "0"], "argument --replays: expected a positive integer, got 0"),
    ("sdpa_first_call", ["--lengths", "448,0"], "argument --lengths: '0': a sequence length: expected a positive")],
    ids=["decode_attention_filled", "decode_attention_filled_word", "decode_attention_splits", "decode_attention_batch",
         "l2_prefetch_cache", "pdl_chain_left_pad", "pdl_chain_replays", "sdpa_first_call_lengths"])
def test_a_gpu_microbenchmarks_size_it_cannot_measure_is_a_flag_error(script, argv, said, monkeypatch, capsys):
    """Each was read only once the GPU work began: a --filled past --cache cut the mask at --cache slots while the row
    reported the bandwidth of --filled, a left padding of every filled slot left rows nothing to attend to, a count
    that is no number or 0 failed with a traceback (or a division by zero in the timing)."""
    code, err = bench_main_exit(script, argv, monkeypatch, capsys)
    assert code == 2 and said in err, err[-2000:]


@pytest.mark.parametrize("variant, said", [
    ("fused_pld_early", "'fused_pld_early': unknown option 'pld'"),
    ("fused_pdl", "'fused_pdl': _pdl is followed by _wait or _early"),
    ("fused_pdl_erly", "'fused_pdl_erly': unknown option 'erly'"),
    ("fused_tma_pdl_early", "'fused_tma_pdl_early': _pdl is followed by _wait or _early, right after fused"),
    ("fused_pf2", "'fused_pf2': _pf<P> needs _pdl_wait or _pdl_early"),
    ("fused_pdl_early_pfx", "'fused_pdl_early_pfx': unknown option 'pfx'"),
    ("fused_wide_tuned", "'fused_wide_tuned': at most one of _wide, _tuned"),
    ("fusedpdl_early", "'fusedpdl_early': no such variant"),
    ("torch_compiled_pld", "'torch_compiled_pld': unknown option 'pld'"),
    ("torch_compiledpdl", "'torch_compiledpdl': no such variant"),
    ("torch_compiled_simpleattn_spanattn", "at most one of _simpleattn, _spanattn, _engtuned"),
    ("torch_eager_pdl", "'torch_eager_pdl': no such variant"),
    ("sweep:qkv:64", "'sweep:qkv:64': the sweep's variants come from --sweep")])
def test_pdl_chain_refuses_a_variant_option_it_does_not_have(variant, said, monkeypatch, capsys):
    """A misspelt option ran as another variant, or as the plain one, and the row carried the misspelt name
    (fused_pld_early timed the chain without PDL, fused_pdl_erly as _wait, fused_pf2 without prefetch); fused_pdl
    failed with an IndexError once the GPU work had begun; a sweep's tiling was split at its commas into names that
    are no variant. Refused at parsing, naming the known options."""
    code, err = bench_main_exit("pdl_chain", ["--variants", f"torch_eager,{variant}"], monkeypatch, capsys)
    assert code == 2 and "argument --variants" in err and said in err, err[-2000:]
    if "unknown option" in said or "no such variant" in said:  # the known ones are listed
        assert "torch_compiled[_pdl][_tmalinear]" in err and "fused[_pdl_wait|_pdl_early][_pf<P>]" in err, err


def test_pdl_chain_accepts_its_default_variants_and_every_variant_its_results_record():
    """(the check above refuses nothing that was run: every variant in docs/results' pdl_chain rows parses, but for
    the --sweep's own)"""
    import glob

    sys.path.insert(0, str(REPO / "bench"))
    import pdl_chain

    recorded = {row["variant"] for path in glob.glob(str(REPO / "docs/results/*pdl_chain*/*.json"))
                for row in json.load(open(path)).get("rows", []) if "variant" in row
                and not row["variant"].startswith(("dschat_", "sweep:"))}  # (generation.py's rows: the same folders)
    assert len(recorded) > 20, recorded
    names = sorted(recorded) + pdl_chain.DEFAULT_VARIANTS.split(",")
    assert [name for name in names if pdl_chain.variant_error(name)] == []


def test_tensor_parallel_counts_the_samples_of_every_rank(distributed, monkeypatch):
    """samples/s was 2 x B / seconds whatever the world: docs/scaling.md's runs on 4 and 8 GPUs would have reported
    half or a quarter of their rate, and a world of one (--smoke without a launcher) twice its own."""
    import torch

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import tensor_parallel

    args = SimpleNamespace(smoke=True, device="cpu", dtype=torch.float32, prompt=8, gen=4, repeats=1)
    row = tensor_parallel.run_variant(args, stage=0, tp=1, graph=False, batch=2, bw=1e10)
    assert row["world_size"] == distributed[1] == 1
    assert row["samples_per_s"] == pytest.approx(2 / row["seconds"])


@pytest.mark.parametrize("script, name", [("generation", "runs/gen.json"), ("ppo_iteration", "/tmp/ppo.json"),
                                          ("decode_gemm", "../gemm.json"), ("tensor_parallel", "")])
def test_a_json_name_with_a_folder_is_a_flag_error(script, name, monkeypatch, capsys):
    """--json is the name of the file written to $OUT: runs/gen.json failed writing the first row's result once its
    GPU work was done (no such folder under $OUT), and an absolute path was written outside $OUT, where the device tool
    brings nothing back."""
    code, err = bench_main_exit(script, ["--json", name], monkeypatch, capsys)
    assert code == 2 and f"argument --json: {name!r}: a file name, written to $OUT (no folder)" in err, \
        err[-2000:]


GROUP_AT_EXIT = """
import atexit, runpy, sys
import torch.distributed as dist
atexit.register(lambda: print("group at exit:", dist.is_initialized()))
sys.argv = sys.argv[1:]
sys.path.insert(0, {bench!r})
if sys.argv[0] == "exit":
    from results import run_benchmark
    run_benchmark(lambda: sys.exit(int(sys.argv[1])))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_benchmark_leaves_its_process_group_and_keeps_its_exit_status(tmp_path):
    """Every GPU benchmark's exit printed NCCL's "destroy_process_group() was not called before program exit" (session
    51's logprob_delta runs): the group is now left when main() returns, and a main() that exits keeps its status."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "OUT": str(tmp_path)}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    wrapper = GROUP_AT_EXIT.format(bench=str(REPO / "bench"))
    ran = subprocess.run([sys.executable, "-c", wrapper, str(REPO / "bench" / "logprob_delta.py"), "--smoke"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and (tmp_path / "logprob_delta_t1.json").exists(), ran.stderr[-3000:]
    assert "group at exit: False" in ran.stdout, ran.stdout[-2000:]
    stopped = subprocess.run([sys.executable, "-c", wrapper, "exit", "3"], env=env, capture_output=True, text=True,
                             timeout=120)
    assert stopped.returncode == 3, stopped.stderr[-2000:]


def test_family_sweep_checks_a_decoder_skips_an_encoder_and_reports_a_refusal(tmp_path):
    """bench/family_sweep.py (CPU, no network): GPT-2 passes the three checks, BERT's causal LM (an encoder run as a
    decoder) is skipped with its reason, RWKV's generation is refused by the engine (no KV cache), not failed, and its
    reward model's left-padding shift is transformers' (HF_PADDING), which dschat warns of. RecurrentGemma's engine
    generates each prompt without its padding: its tokens are HF's of each row alone (against HF's padded batch the
    LoRA check FAILed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # not under a launcher
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "family_sweep.py"), "--families",
                           "gpt2,bert,rwkv,recurrent_gemma",
                           "--json", str(tmp_path / "sweep.json")], env=env, capture_output=True, text=True,
                          timeout=600)
    results = {r["family"]: r for r in json.loads((tmp_path / "sweep.json").read_text())}
    assert [results["gpt2"][check][0] for check in ("generate", "reward", "lora")] == ["PASS"] * 3, results["gpt2"]
    assert "encoder" in results["bert"]["skip"]
    assert results["rwkv"]["generate"][0] == "REFUSED" and "--no-enable_hybrid_engine" in results["rwkv"]["generate"][1]
    # RWKV reads no attention mask: its reward model scores a left-padded row otherwise (transformers' model, which
    # dschat's LEFT_PADDING_MOVES_SCORES lists and warns of: reported as transformers' own, not failed)
    assert results["rwkv"]["reward"][0] == "HF_PADDING" and "no attention mask" in results["rwkv"]["reward"][1]
    assert "warning: the reward model or critic on RwkvModel" in proc.stdout, proc.stdout
    assert [results["recurrent_gemma"][check][0] for check in ("generate", "lora")] == ["PASS"] * 2, \
        results["recurrent_gemma"]
    assert proc.returncode == 0 and "4 swept" not in proc.stdout and "3 swept, 1 skipped" in proc.stdout, proc.stdout


def test_family_sweep_refuses_a_name_that_is_no_transformers_model_type(capsys):
    """bench/family_sweep.py --families lama: the typo was swept as "SKIP no config class", as if it were a family
    transformers has; it is an error naming the flag, with the model types close to it, before any family runs."""
    sys.path.insert(0, str(REPO / "bench"))
    import family_sweep

    with pytest.raises(SystemExit) as stopped:
        family_sweep.main(["--families", "gpt2,lama,nosuchfamily"])
    assert stopped.value.code == 2
    said = capsys.readouterr()
    assert "--families: 'lama' is not a transformers model type (close: llama" in said.err, said.err
    assert "'nosuchfamily' is not a transformers model type" in said.err and "gpt2" not in said.out, said


def test_family_sweep_builds_its_engines_with_torch_adam():
    """bench/family_sweep.py's DeepSpeed engines take torch's Adam: DeepSpeed's FusedAdam is JIT-built on a CPU, and
    on a fresh machine that first build outlasted a check's time limit, whose alarm left it half done, so every family
    after it failed to import the op (afmoe timed out, apertus and the rest ImportError)."""
    from transformers import GPT2Config

    from dschat.models.training_engine import release_engine

    sys.path.insert(0, str(REPO / "bench"))
    import family_sweep

    config = GPT2Config(vocab_size=family_sweep.VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    engine = family_sweep.hybrid_engine(family_sweep.build_model(config))
    optimizer = type(engine._engine.optimizer)
    release_engine(engine)
    assert optimizer in (torch.optim.Adam, torch.optim.AdamW), optimizer


def test_family_sweep_builds_hybrid_families_tiny_and_tells_transformers_own_failures_from_dschats():
    """bench/family_sweep.py: LFM2-MoE's default layer_types (None) failed in its model's constructor and
    Nemotron-H's pattern cut to "ME" left no attention layer (HF's generate then fails on the cache): both now build
    a layer of each kind and pass. Where transformers itself fails (Dory's generate and forward on the tiny padded
    batch: its mask's length) the check is HF_ERROR, and where the engine's tokens are HF generate's over a
    StaticCache but not over its dynamic cache (Inkling with the LoRA weights) HF_STATIC: neither is counted as
    dschat's failure. xLSTM was HF_ERROR too, transformers' cache misfitting its tiny layers; with dschat's fix
    (``compat.xlstm_cache_fits_its_layers``) HF generate answers, and the engine refuses it, naming the way out."""
    sys.path.insert(0, str(REPO / "bench"))
    import family_sweep

    results = {family: family_sweep.sweep_family(family, timeout=300, verbose=False)
               for family in ("lfm2_moe", "nemotron_h", "dory", "xlstm", "inkling_text")}
    statuses = {family: [result[check][0] for check in family_sweep.CHECKS] for family, result in results.items()}
    assert statuses["lfm2_moe"] == statuses["nemotron_h"] == ["PASS"] * 3, results
    assert statuses["dory"][0] == statuses["dory"][2] == "HF_ERROR", results["dory"]
    assert "HF generate itself fails" in results["dory"]["generate"][1]
    assert statuses["xlstm"] == ["REFUSED", "HF_PADDING", "REFUSED"], results["xlstm"]
    assert "xLSTMCache" in results["xlstm"]["generate"][1]
    assert statuses["inkling_text"] == ["PASS", "PASS", "HF_STATIC"], results["inkling_text"]


def test_family_sweep_measures_peft_merges_in_float64_and_compares_the_engine_with_the_merged_model():
    """bench/family_sweep.py: HRM's reasoning cycles grew the fp32 rounding of PEFT's merge to 0.6 % of its logits,
    over the check's tolerance (0 in float64): the merge is measured on a float64 copy, where a wrong merge still
    shows. The same rounding makes PEFT's merged model generate another token than its unmerged one in one row: the
    engine's inference copy (merged) is compared with the merged model there, not failed."""
    sys.path.insert(0, str(REPO / "bench"))
    import family_sweep

    status, note = family_sweep.check_lora("hrm_text")
    assert status == "PASS" and "PEFT's merged model's tokens" in note, note


RECURRENT_ROWS_TINY = ["--device", "cpu", "--lengths", "5,1", "--rows_per_length", "2", "--new_tokens", "6"]


def test_recurrent_rows_finds_each_familys_rows_generated_together_equal_to_alone(tmp_path):
    """bench/recurrent_rows.py (the GPU check, in bf16 too, of step 3's HF generate of the recurrent families) on the
    CPU in float32: each family's rows of one prompt length generate in one call (2 calls for 4 rows of 2 lengths,
    not 4 of one row, where equality would say nothing) and every row's tokens equal its prompt's alone."""
    proc = run_bench("recurrent_rows.py", *RECURRENT_ROWS_TINY, "--dtypes", "float32", "--json", "rows.json",
                     OUT=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "rows.json").read_text())["results"]
    assert [r["family"] for r in results] == ["rwkv", "recurrent_gemma", "deepseek_v4", "xlstm"], results
    for r in results:
        assert (r["dtype"], r["rows"], r["groups"], r["equal"], r["first_difference"]) == ("float32", 4, 2, 4, None), r
        assert r["max_logit_delta"] < 1e-4, r
    assert "| xlstm | float32 | 4 | 2 | 4 | - |" in proc.stdout, proc.stdout


def test_recurrent_rows_fails_float32_rows_that_mix_and_reports_bfloat16_ones(tmp_path):
    """The script's equality is real: with transformers' RWKV one-token decode left as it is (it mixes a batch's rows;
    dschat's probe made to say it keeps them apart, so its mend never goes in), step 3's HF generate still takes the
    rows of one length together, and the script finds them unequal to alone. Unequal float32 rows fail the run;
    bf16 ones are reported only (batched bf16 matmuls may round otherwise than one row's on a GPU)."""
    code = """
import sys
sys.path.insert(0, sys.argv[1])
from dschat import compat
compat.rwkv_decode_keeps_rows_apart = lambda model: True
import recurrent_rows
recurrent_rows.main(sys.argv[2:])
"""
    proc = subprocess.run([sys.executable, "-c", code, str(REPO / "bench"), *RECURRENT_ROWS_TINY, "--families",
                           "rwkv", "--json", "rows.json"], env={**os.environ, "OMP_NUM_THREADS": "1",
                                                               "CUDA_VISIBLE_DEVICES": "", "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "rows.json").read_text())["results"]
    assert [(r["dtype"], r["groups"]) for r in results] == [("float32", 2), ("bfloat16", 2)], results
    assert all(r["equal"] < r["rows"] and r["max_logit_delta"] > 0.1 for r in results), results
    assert "failures (a crash, or float32 rows unequal to alone): rwkv float32\n" in proc.stdout, proc.stdout


def test_recurrent_rows_refuses_a_device_it_cannot_run_on_naming_the_flag():
    """--device went to torch.device as given: a typo was torch's traceback naming no flag ("Expected one of cpu, cuda,
    ... device type at start of device string: cuda0"), and a GPU torch does not see failed only once the models were
    built. Now each is a flag error, before any model is."""
    for device, said in (("cuda0", "'cuda0': not a device this check runs on (cpu, cuda or cuda:N)"),
                         ("meta", "'meta': not a device this check runs on"),
                         ("cuda:1", "'cuda:1': torch " + torch.__version__ + " sees 0 CUDA GPU(s)")):
        proc = run_bench("recurrent_rows.py", "--device", device)
        assert proc.returncode == 2 and f"argument --device: {said}" in proc.stderr, proc.stdout[-2000:] + \
            proc.stderr[-2000:]
