"""CUDA-graph decode (enable_cuda_graph): the CPU fallback, and the graph step's logic run eagerly through the same
buffers (capture_graphs=False), which must give the eager loop's tokens. Capture itself is checked on the GPU by
bench/graph_equality.py."""
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from hybrid_common import (PAD, answer_logprobs_and_live, early_token, hf_generate,  # noqa: E402
                           left_padded_batch, make_ds_engine, tiny_model, train_step)

from dschat.hybrid_engine import HybridEngine, HybridEngineConfig  # noqa: E402
from dschat.hybrid_engine.cache import KVCache  # noqa: E402
from dschat.hybrid_engine.graphs import GraphDecoder, bucket_for  # noqa: E402


def _engine(model, graphs=True, stage=0, **config):
    config.setdefault("max_out_tokens", 32)
    return HybridEngine(make_ds_engine(model, stage),
                        HybridEngineConfig(enabled=True, enable_cuda_graph=graphs, **config), pad_token_id=PAD)


def _uncaptured(engine):
    """The graph path with the step run eagerly instead of replayed: the same buffers, counters and bookkeeping."""
    engine.graph_decoder = GraphDecoder(engine.kv_cache, capture_graphs=False)
    return engine.graph_decoder


def _train_step(engine, sequences):
    train_step(engine, sequences)
    engine.eval()


def test_bucket_is_the_next_power_of_two():
    assert [bucket_for(b) for b in (1, 2, 3, 4, 5, 16, 17, 64, 65, 128)] == [1, 2, 4, 4, 8, 16, 32, 64, 128, 128]


def test_on_cpu_graphs_fall_back_to_eager_with_one_notice(caplog):
    model = tiny_model("llama", seed=1)
    engine = _engine(model)
    reference = _engine(tiny_model("llama", seed=1), graphs=False)
    ids, mask = left_padded_batch([5, 2, 4], seed=1)
    engine.eval()
    reference.eval()
    with caplog.at_level(logging.WARNING, logger="dschat.hybrid_engine.graphs"):
        first = engine.generate(ids, attention_mask=mask, max_new_tokens=10)
        second = engine.generate(ids, attention_mask=mask, max_new_tokens=10)
    notices = [r for r in caplog.records if "enable_cuda_graph" in r.getMessage()]
    assert len(notices) == 1 and "CUDA device" in notices[0].getMessage()
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=10)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert engine.graph_decoder.captures == 0


def test_a_failed_capture_decodes_eagerly_and_unmarks_the_generators_it_marked(monkeypatch, caplog):
    """A failed capture leaves torch's CUDA generators marked as capturing, and every later draw outside a graph
    (HF generate's sampling in the next step-3 run of the process) raised; the GPU side is
    tests/scripts/rng_after_graphs.py."""
    from dschat.hybrid_engine import graphs

    model = tiny_model("llama", seed=1)
    engine = _engine(model)
    decoder = _uncaptured(engine)
    decoder._rng = own = torch.Generator()
    unmarked = []
    monkeypatch.setattr(graphs, "unmark_capturing", lambda *gens: unmarked.append(gens))
    monkeypatch.setattr(GraphDecoder, "_capture", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("invalidated")))
    ids, mask = left_padded_batch([5, 2], seed=1)
    engine.eval()
    with caplog.at_level(logging.WARNING, logger="dschat.hybrid_engine.graphs"):
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(got, hf_generate(model, ids, mask, 8))
    assert unmarked == [(torch.default_generator, own)] and decoder._rng is None
    assert any("capturing the decode step failed (RuntimeError: invalidated)" in r.getMessage() for r in caplog.records)


def test_generation_skips_deepspeeds_training_forward_hooks_and_training_keeps_them(monkeypatch):
    """DeepSpeed's module forward hooks start its throughput timer, which synchronizes the device after two optimizer
    steps: on the GPU every CUDA-graph capture after the second step (e.g. a resumed step-3 run's first) failed."""
    from deepspeed import DeepSpeedEngine

    calls = []
    prologue = DeepSpeedEngine._forward_prologue
    monkeypatch.setattr(DeepSpeedEngine, "_forward_prologue",
                        lambda self, *a, **k: calls.append("prologue") or prologue(self, *a, **k))
    model = tiny_model("llama", seed=4)
    engine = _engine(model)
    ids, mask = left_padded_batch([5, 3], seed=4)
    for _ in range(3):
        _train_step(engine, ids)
    assert engine._engine.tput_timer.global_step_count >= 2  # where its start() synchronizes
    calls.clear()
    engine.eval()
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=6)
    assert calls == [] and torch.equal(got, hf_generate(model, ids, mask, 6))
    engine.train()
    engine(input_ids=ids, attention_mask=mask)  # a training forward: DeepSpeed's hooks run again
    assert calls and set(calls) == {"prologue"}


def test_unmark_capturing_gives_cuda_generators_a_fresh_state_of_the_same_seed_and_offset():
    from dschat.hybrid_engine.graphs import unmark_capturing

    class Generator:
        def __init__(self, device):
            self.device, self.calls = torch.device(device), []

        def clone_state(self):
            return ("clone of", self)

        def graphsafe_set_state(self, state):
            self.calls.append(state)

    cuda, cpu = Generator("cuda"), Generator("cpu")
    unmark_capturing(cuda, None, cpu)
    assert cuda.calls == [("clone of", cuda)] and cpu.calls == []


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "opt", "gpt2", "bloom"])  # bloom: ALiBi's mask
def test_graph_step_logic_equals_hf_with_padding_rows_eos_and_min_new_tokens(family):
    model = tiny_model(family, seed=2)
    engine = _engine(model)
    graphs = _uncaptured(engine)
    ids, mask = left_padded_batch([7, 3, 5], seed=2)  # 3 rows -> bucket 4: one dummy row
    eos = early_token(hf_generate(model, ids, mask, 16)[0, 7:])
    engine.eval()
    for kwargs in ({}, {"min_new_tokens": 5}):
        expected = hf_generate(model, ids, mask, 16, eos_token_id=eos, **kwargs)
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=eos, **kwargs)
        assert torch.equal(got, expected), (kwargs, got, expected)
    assert graphs.captures == 2 and graphs.replays > 0  # one key each (min_new_tokens masks EOS in the step)


def test_graph_step_is_reused_across_generations_and_optimizer_steps():
    model = tiny_model("llama", seed=3)
    engine = _engine(model)
    graphs = _uncaptured(engine)
    ids, mask = left_padded_batch([6, 4], seed=3)
    engine.eval()
    first = engine.generate(ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(first, hf_generate(model, ids, mask, 12))
    _train_step(engine, first)
    after = engine.generate(ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(after, hf_generate(model, ids, mask, 12))
    # A shorter prompt and fewer new tokens fit the same cache, and a batch of 1 its first row: no new storage.
    short_ids, short_mask = left_padded_batch([3], seed=4)
    assert torch.equal(engine.generate(short_ids, attention_mask=short_mask, max_new_tokens=5),
                       hf_generate(model, short_ids, short_mask, 5))
    assert graphs.captures == 2 and engine.kv_cache.allocations == 1  # buckets 2 and 1


def test_moved_weights_are_captured_again():
    model = tiny_model("gpt2", seed=5)
    engine = _engine(model)
    graphs = _uncaptured(engine)
    ids, mask = left_padded_batch([4, 4], seed=5)
    engine.eval()
    engine.generate(ids, attention_mask=mask, max_new_tokens=6)
    with torch.no_grad():  # new storage for one weight: a captured graph would read the old address
        weight = engine.module.lm_head.weight
        weight.data = weight.data.clone() * 2
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=6)
    assert torch.equal(got, hf_generate(model, ids, mask, 6))
    assert graphs.captures == 2


def test_sampled_tokens_equal_eager_and_the_callers_generator_moves_on():
    engines = []
    for graphs in (True, False):
        model = tiny_model("qwen2", seed=6, vocab_size=24)
        with torch.no_grad():
            model.lm_head.weight.mul_(20)
        engines.append(_engine(model, graphs=graphs))
    _uncaptured(engines[0])
    ids, mask = left_padded_batch([5, 2, 4, 3], vocab_size=24, seed=6)  # 4 rows = the bucket: the same noise
    results = []
    for engine in engines:
        engine.eval()
        generator = torch.Generator().manual_seed(11)
        kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=True, top_k=8, top_p=0.9, generator=generator)
        results.append((engine.generate(ids, **kwargs), engine.generate(ids, **kwargs)))
    (graph_a, graph_b), (eager_a, eager_b) = results
    assert torch.equal(graph_a, eager_a) and torch.equal(graph_b, eager_b)
    assert not torch.equal(graph_a, graph_b)  # the generator advanced between the two calls


def test_row_views_share_one_storage():
    cache = KVCache(tiny_model("llama").config)
    full = cache.acquire_rows(4, 40, torch.float32, "cpu")
    half = cache.acquire_rows(2, 30, torch.float32, "cpu")
    assert cache.allocations == 1 and cache.max_len == 40
    assert half.layers[0].keys.data_ptr() == full.layers[0].keys.data_ptr()
    assert half.layers[0].keys.shape[0] == 2 and half.layers[0].keys.is_contiguous()
    assert cache.acquire_rows(2, 30, torch.float32, "cpu") is half  # same object: a graph on it stays valid
    cache.acquire_rows(8, 20, torch.float32, "cpu")  # more rows: the storage grows and keeps the longer length
    assert cache.allocations == 2 and cache.max_len == 40


@pytest.mark.parametrize("path", ["eager", "graph_logic"])
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_returned_logprobs_equal_the_training_forward(path, family):
    """``return_logprobs``: the decode step's log-probabilities of the sampled tokens are what a full forward over
    the finished sequences gives them (the unfiltered distribution at the sampling temperature, which step 3 scores
    them at), and 0 after a row's end."""
    model = tiny_model(family, seed=5)
    engine = _engine(model, graphs=path == "graph_logic")
    if path == "graph_logic":
        _uncaptured(engine)
    ids, mask = left_padded_batch([5, 2, 4], seed=5)
    engine.eval()
    sampling = dict(max_new_tokens=12, do_sample=True, temperature=0.7, top_k=20)
    # the same draws with and without an EOS: take one that row 0 samples early and the other rows never do
    no_eos = engine.generate(ids, attention_mask=mask, generator=torch.Generator().manual_seed(3), **sampling)
    eos = early_token(no_eos[0, ids.shape[1]:].tolist(), avoid=no_eos[1:, ids.shape[1]:].flatten().tolist())
    seq, logprobs = engine.generate(ids, attention_mask=mask, eos_token_id=eos, return_logprobs=True,
                                    generator=torch.Generator().manual_seed(3), **sampling)
    expected, live = answer_logprobs_and_live(model, seq, mask, eos, temperature=0.7)
    assert logprobs.shape == expected.shape and logprobs.dtype == torch.float32
    assert not live[0].all(), "row 0 should end early with this EOS"
    torch.testing.assert_close(logprobs[live], expected[live], atol=1e-4, rtol=1e-4)
    assert torch.all(logprobs[~live] == 0)  # after a row's EOS
    if path == "graph_logic":  # the graph step recorded them (its key says so), not an eager fallback
        assert [key.logprobs for key in engine.graph_decoder.decoders] == [False, True]


def _recording_compile(monkeypatch, fail_prefill=False):
    """torch.compile as the graph decoder calls it, with dynamo's eager backend (no inductor build on the CPU) recording
    the graphs it traces; returns {dynamic: (forwards run, backend)}. Can make the prefill's compiled module raise
    after its forward ran, as a failure late in the forward would."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    from dschat.hybrid_engine import graphs as graphs_module

    compiled_modules = {}
    real_compile = torch.compile

    def fake_compile(model, mode=None, dynamic=None):
        backend = EagerAndRecordGraphs()
        compiled = real_compile(model, backend=backend, dynamic=dynamic)
        calls = compiled_modules[dynamic] = {"forwards": 0, "backend": backend}

        def forward(*args, **kwargs):
            calls["forwards"] += 1
            out = compiled(*args, **kwargs)
            if fail_prefill and dynamic is None:  # the prefill's module (the decode step's is dynamic=False)
                # after the whole forward ran, as a failure in a later piece or an OOM would: the cache moved on
                raise RuntimeError("inductor could not compile this")
            return out
        return forward

    monkeypatch.setattr(graphs_module.torch, "compile", fake_compile)
    return compiled_modules


@pytest.mark.parametrize("family,fail_prefill", [("qwen2", False), ("opt", False), ("gpt2", False), ("llama", True)])
def test_compiled_prefill_gives_the_eager_tokens_or_falls_back_once(monkeypatch, caplog, family, fail_prefill):
    """With a compile mode the prefill is compiled too, with automatic dynamic shapes: three prompt lengths trace two
    whole-forward graphs (the first length static, then one for every length), the decode step one; a prefill that
    fails to compile is said once and runs eagerly. The tokens are HF's either way."""
    modules = _recording_compile(monkeypatch, fail_prefill)
    torch._dynamo.reset()
    model = tiny_model(family, seed=8)
    engine = _engine(model)
    engine.graph_decoder = GraphDecoder(engine.kv_cache, capture_graphs=False, compile_mode="default")
    engine.eval()
    try:
        with caplog.at_level(logging.WARNING, logger="dschat.hybrid_engine.graphs"):
            for lengths in ([6, 4], [9, 3], [5, 5]):  # three prompt lengths, one bucket
                ids, mask = left_padded_batch(lengths, seed=len(lengths) + max(lengths))
                got = engine.generate(ids, attention_mask=mask, max_new_tokens=8)
                assert torch.equal(got, hf_generate(model, ids, mask, 8)), lengths
    finally:
        torch._dynamo.reset()
    assert sorted(modules, key=str) == [False, None]  # a decode module (static shapes) and a prefill module
    prefill, decode = modules[None], modules[False]
    assert len(decode["backend"].graphs) == 1 and decode["forwards"] > 3 * 6
    failures = [r for r in caplog.records if "compiled prefill failed" in r.getMessage()]
    if fail_prefill:
        assert len(failures) == 1 and prefill["forwards"] == 1 and not engine.graph_decoder.compile_prefill
    else:
        assert not failures and prefill["forwards"] == 3
        assert len(prefill["backend"].graphs) == 2, "a recompilation per prompt length"


@pytest.mark.parametrize("stage", [0, 3])
def test_the_compiled_decode_is_reused_across_steps_and_buckets_and_compiles_every_shape(monkeypatch, stage):
    """The compiled decode step (static shapes: one graph per batch-size bucket and cache length) is traced once per
    shape: an optimizer step refreshing the inference copy in place (a LoRA actor's merged copy at ZeRO-0, the pinned
    copy of ZeRO-3's gathered shards) and a return to a bucket seen before trace nothing new. Dynamo's recompile limit
    (8) counted the prefill's graphs and the decode's together (one code object: the model's forward), so the ninth
    graph and every one after it ran eagerly without a word: a notebook generating at a few batch sizes and lengths
    lost the compiled decode. Every decode shape now compiles (the limit is set at 4 here, to need fewer shapes)."""
    import peft

    modules = _recording_compile(monkeypatch)
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 4)
    model = tiny_model("llama", seed=3)
    if stage == 0:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    engine = _engine(model, stage=stage, max_out_tokens=128)
    assert engine.inference_weights.kind == ("lora_copy" if stage == 0 else "pinned_copy")
    engine.graph_decoder = GraphDecoder(engine.kv_cache, capture_graphs=False, compile_mode="default",
                                        max_out_tokens=128)

    def generate(rows, new_tokens=8):
        engine.eval()
        ids, mask = left_padded_batch([3 + row % 3 for row in range(rows)], seed=rows)
        return engine.generate(ids, attention_mask=mask, max_new_tokens=new_tokens), ids, mask

    def decode_graphs():
        return len(modules[False]["backend"].graphs)

    try:
        train_step(engine, generate(2)[0])
        generate(2)
        assert decode_graphs() == 1, "an optimizer step's refresh compiled the decode step again"
        generate(3)  # bucket 4
        generate(2)
        assert decode_graphs() == 2, "a bucket seen before compiled again"
        got, ids, mask = generate(2, 70)  # cache length 128
        assert torch.equal(got, hf_generate(model, ids, mask, 70))
    finally:
        torch._dynamo.reset()
    assert decode_graphs() == 3 and len(modules[None]["backend"].graphs) > 1, \
        "a decode shape past dynamo's recompile limit ran eagerly"


def test_no_compiled_prefill_in_a_tensor_parallel_group():
    """A recompilation failing on one rank only, after some of the forward's all-reduces ran, would mismatch the
    group's collectives; the group's prefill stays eager."""
    kv_cache = KVCache(tiny_model("llama").config)
    assert GraphDecoder(kv_cache, compile_mode="default").compile_prefill
    assert not GraphDecoder(kv_cache, compile_mode="default", token_sync=lambda tokens: tokens).compile_prefill



def test_a_larger_bucket_frees_the_old_storage_before_allocating_the_new():
    import weakref

    model = tiny_model("llama", seed=4)
    engine = _engine(model, max_out_tokens=64)
    graphs = _uncaptured(engine)
    engine.eval()
    ids, mask = left_padded_batch([5, 3], seed=4)  # bucket 2
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=8), hf_generate(model, ids, mask, 8))
    assert graphs.captures == 1
    old = [weakref.ref(t) for t in engine.kv_cache.storages()]
    alive_at_allocation = []
    allocate = engine.kv_cache._allocate

    def spy(*args, **kwargs):
        alive_at_allocation.append(sum(ref() is not None for ref in old))
        return allocate(*args, **kwargs)

    engine.kv_cache._allocate = spy
    ids, mask = left_padded_batch([5, 3, 4, 6, 2], seed=5)  # bucket 8: new storage
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=8), hf_generate(model, ids, mask, 8))
    # the captured step of bucket 2 viewed the old storage: it was dropped before the new storage was allocated (else
    # both are alive at once, and the cache's out-of-memory retry cannot free the old one)
    assert alive_at_allocation == [0] and len(old) > 0
    assert engine.kv_cache._shape[0] == 8 and graphs.captures == 2 and graphs.replays > 0


def test_graph_cache_length_is_rounded_up_but_not_past_max_out_tokens():
    model = tiny_model("llama", seed=4)
    engine = _engine(model, max_out_tokens=40)
    engine.graph_decoder = graphs = GraphDecoder(engine.kv_cache, capture_graphs=False, max_out_tokens=40)
    engine.eval()
    ids, mask = left_padded_batch([5, 3], seed=4)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=8), hf_generate(model, ids, mask, 8))
    assert engine.kv_cache.max_len == 40  # 13 tokens, rounded up to 64, capped at 40
    ids, mask = left_padded_batch([8, 3, 6, 4, 2], seed=5)  # 8 + 32 tokens: exactly the cap
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=32), hf_generate(model, ids, mask, 32))
    assert engine.kv_cache.max_len == 40 and graphs.replays > 0
    # within the cap, lengths are still rounded up so that nearby prompt lengths share a graph; never below the
    # generation's own length; no cap when none is configured
    assert graphs.cache_len_for(13) == 40 and graphs.cache_len_for(40) == 40
    assert GraphDecoder(engine.kv_cache, max_out_tokens=200).cache_len_for(70) == 128
    assert GraphDecoder(engine.kv_cache, max_out_tokens=60).cache_len_for(70) == 70
    assert GraphDecoder(engine.kv_cache).cache_len_for(70) == 128


# -- repetition penalty ------------------------------------------------------------------------------------------------
def _eos_ending_row_0_early(answers):
    """A token row 0 generates in its first steps and another row never does: as EOS, row 0 ends early, that row
    runs on (finished rows keep feeding pads)."""
    for token in answers[0, :6].tolist():
        if token != PAD and any(token not in row for row in answers[1:].tolist()):
            return token
    raise AssertionError(f"no such token in {answers}")


@pytest.mark.parametrize("penalty", [1.3, 0.8])
@pytest.mark.parametrize("family", ["llama", "opt", "gpt2"])  # llama: GQA
@pytest.mark.parametrize("path", ["eager", "graph_logic"])
def test_repetition_penalty_greedy_equals_hf_with_padding_and_eos(path, family, penalty):
    """HF's RepetitionPenaltyLogitsProcessor over the prompt and the answer so far, on left-padded prompts of
    different lengths, with an EOS that ends a row early (its pads are marked seen too) and with min_new_tokens (the
    penalty comes before the EOS suppression), in the eager loop and in the graph step."""
    model = tiny_model(family, seed=14)  # a seed where both penalties change every family's answers
    engine = _engine(model, graphs=path == "graph_logic")
    graphs = _uncaptured(engine) if path == "graph_logic" else None
    ids, mask = left_padded_batch([7, 3, 5], seed=14)  # 3 rows -> bucket 4 in the graph path: one dummy row
    prompt_len = ids.shape[1]
    unpenalised = hf_generate(model, ids, mask, 16)
    penalised = hf_generate(model, ids, mask, 16, repetition_penalty=penalty)
    assert not torch.equal(penalised, unpenalised), "the penalty changed nothing: the test could not see it"
    eos = _eos_ending_row_0_early(penalised[:, prompt_len:])
    engine.eval()
    for kwargs in ({}, {"min_new_tokens": 4}):
        expected = hf_generate(model, ids, mask, 16, eos_token_id=eos, repetition_penalty=penalty, **kwargs)
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=eos,
                              repetition_penalty=penalty, **kwargs)
        assert torch.equal(got, expected), (kwargs, got, expected)
        if not kwargs:
            assert (expected[0, prompt_len:] == PAD).any() and (expected[1:, -1] != PAD).any()
    if graphs is not None:  # the graph step ran with the penalty in its key and a seen-token buffer
        assert [key.repetition_penalty for key in graphs.decoders] == [penalty, penalty] and graphs.replays > 0
        assert all(d.buffers.seen is not None for d in graphs.decoders.values())


def test_without_a_repetition_penalty_the_graph_step_keeps_no_seen_tokens():
    model = tiny_model("llama", seed=12)
    engine = _engine(model)
    graphs = _uncaptured(engine)
    ids, mask = left_padded_batch([5, 3], seed=12)
    engine.eval()
    for penalty in (None, 1.0):  # not given (nor in the generation_config), or HF's no-op value
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=6, repetition_penalty=penalty),
                           hf_generate(model, ids, mask, 6))
    (key, decoder), = graphs.decoders.items()
    assert key.repetition_penalty == 1.0 and decoder.buffers.seen is None


@pytest.mark.parametrize("path", ["eager", "graph_logic"])
def test_left_padding_counts_for_the_repetition_penalty_as_in_the_installed_transformers(monkeypatch, path):
    """transformers >= 5.23 leaves each row's left padding out of the penalty, earlier versions counted its pad
    tokens as seen. With a pad id the model would generate first, the two rules give different tokens: the engine's
    are HF's, and not those of the other rule."""
    from dschat.hybrid_engine import sampling

    model = tiny_model("llama", seed=13)
    ids, mask = left_padded_batch([7, 2, 4], seed=13)
    first = hf_generate(model, ids, mask, 1)[:, -1]
    pad = int(first[1])  # row 1's first token without a penalty: as the pad id, the rules disagree about it
    assert pad not in ids[1][mask[1] == 1].tolist()
    ids = ids.masked_fill(mask == 0, pad)
    expected = hf_generate(model, ids, mask, 8, pad_token_id=pad, repetition_penalty=1.5)
    results = []
    for skips in (sampling.hf_penalty_skips_left_padding(), not sampling.hf_penalty_skips_left_padding()):
        monkeypatch.setattr(sampling, "hf_penalty_skips_left_padding", lambda skips=skips: skips)
        engine = _engine(model, graphs=path == "graph_logic")
        if path == "graph_logic":
            _uncaptured(engine)
        engine.eval()
        results.append(engine.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=pad,
                                       repetition_penalty=1.5))
    assert torch.equal(results[0], expected), (results[0], expected)
    assert not torch.equal(results[1], expected), "the other rule gave the same tokens: the test could not see it"


def test_repetition_penalty_sampled_tokens_equal_eager_and_logprobs_are_unpenalised():
    """Sampled with a seed: the graph step's tokens are the eager loop's; ``return_logprobs`` stays the model's
    unpenalised distribution (what the training forward gives the tokens)."""
    engines, models = [], []
    for graphs in (True, False):
        model = tiny_model("qwen2", seed=6, vocab_size=24)
        with torch.no_grad():
            model.lm_head.weight.mul_(5)
        models.append(model)
        engines.append(_engine(model, graphs=graphs))
    _uncaptured(engines[0])
    ids, mask = left_padded_batch([5, 2, 4, 3], vocab_size=24, seed=6)
    results = []
    for engine in engines:
        engine.eval()
        generator = torch.Generator().manual_seed(11)
        kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=True, top_k=8, top_p=0.9, generator=generator,
                      repetition_penalty=1.4, return_logprobs=True)
        results.append((engine.generate(ids, **kwargs), engine.generate(ids, **kwargs)))
    (graph_a, graph_b), (eager_a, eager_b) = results
    for graph, eager in ((graph_a, eager_a), (graph_b, eager_b)):
        assert torch.equal(graph[0], eager[0])
        # the two paths' caches differ in length (rounded up for the graph): the same values up to float rounding
        torch.testing.assert_close(graph[1], eager[1], atol=1e-5, rtol=1e-5)
    assert not torch.equal(graph_a[0], graph_b[0])  # the generator advanced between the two calls
    # the penalty changed the draws (same seed, no penalty)
    unpenalised = engines[1].generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True, top_k=8, top_p=0.9,
                                      generator=torch.Generator().manual_seed(11))
    assert not torch.equal(unpenalised, eager_a[0])
    expected, _ = answer_logprobs_and_live(models[1], eager_a[0], mask, eos_token_id=-1)  # no EOS
    torch.testing.assert_close(eager_a[1], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(graph_a[1], expected, atol=1e-4, rtol=1e-4)


def test_a_prompt_that_fails_on_the_static_cache_on_the_graph_path_is_the_eager_paths_usage_error(monkeypatch):
    """The graph path runs the prompt's forward itself (outside the graph): a model whose one-token steps pass (so the
    capture succeeds) but whose prompt fails in the cache code is refused as the eager prefill refuses it, naming
    --no-enable_hybrid_engine, not with the bare RuntimeError of transformers' cache."""
    from transformers.cache_utils import StaticLayer

    from dschat.errors import UsageError

    update = StaticLayer.update

    def prompt_of_another_layout(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[-2] > 1:  # (a prompt's keys one head_dim short: index_copy_'s shape error)
            key_states, value_states = key_states[..., :-1], value_states[..., :-1]
        return update(self, key_states, value_states, *args, **kwargs)

    engine = _engine(tiny_model("llama", seed=1))
    decoder = _uncaptured(engine)
    engine.eval()
    ids, mask = left_padded_batch([5, 2, 4], seed=1)
    monkeypatch.setattr(StaticLayer, "update", prompt_of_another_layout)
    with pytest.raises(UsageError, match="static KV cache .*--no-enable_hybrid_engine") as refused:
        engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert isinstance(refused.value.__cause__, RuntimeError)
    assert decoder.captures == 1  # (the graph path's prefill refused it: its one-token steps were captured)


def test_a_compiled_prefill_whose_eager_retry_fails_says_only_the_eager_error(monkeypatch, caplog):
    """A compiled prefill that failed was said ("prefilling eagerly from now on") right before the eager retry raised
    its own UsageError (a model refusing the static cache): two messages, the first of a run that went on. The eager
    error alone is said now; the warning only once the eager prefill has run."""
    from transformers.cache_utils import StaticLayer

    from dschat.errors import UsageError

    def refused_prompt(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("index_copy_(): Source/destination tensor must have same slice shapes")

    def failing_compiled_prefill(*args, **kwargs):
        raise RuntimeError("inductor could not compile this")

    engine = _engine(tiny_model("llama", seed=1))
    decoder = GraphDecoder(engine.kv_cache, capture_graphs=False, compile_mode="default")
    engine.graph_decoder = decoder
    decoder._prefill_of = lambda model: failing_compiled_prefill  # (the compiled modules, without compiling them)
    decoder._forward_of = lambda model: model
    engine.eval()
    ids, mask = left_padded_batch([5, 2, 4], seed=1)
    monkeypatch.setattr(StaticLayer, "update", refused_prompt)
    with caplog.at_level(logging.WARNING, logger="dschat.hybrid_engine.graphs"):
        with pytest.raises(UsageError, match="static KV cache .*--no-enable_hybrid_engine"):
            engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert not [r for r in caplog.records if "compiled prefill failed" in r.getMessage()]
