"""The hybrid engine's DeepSpeed-style latency stats (|E2E latency=... |Training time=... |AvgSamplesPerSec=...), driven
through its phase switches on a tiny real model, timed by a fake clock (the engine module's ``time``)."""
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from hybrid_common import PAD, left_padded_batch, make_ds_engine, tiny_model, train_step  # noqa: E402

import dschat.hybrid_engine.engine as engine_module  # noqa: E402
from dschat.hybrid_engine import HybridEngine, HybridEngineConfig  # noqa: E402

GATHER_S = 0.25  # each refresh of the inference weights (the first eval(), and the first after a step)


class Rig:
    """A HybridEngine whose clock moves only when told: a generation takes the seconds it is given, a weight refresh
    ``GATHER_S``."""

    def __init__(self, monkeypatch, ds_engine):
        self.now = 100.0
        monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=lambda: self.now))
        self.engine = HybridEngine(ds_engine, HybridEngineConfig(enabled=True, max_out_tokens=32), pad_token_id=PAD)
        self.engine.inference_weights._refresh = lambda: self.advance(GATHER_S)
        self._generate_s = 0.0
        real = engine_module.generate_tokens

        def timed_generate_tokens(*args, **kwargs):
            self.advance(self._generate_s)
            return real(*args, **kwargs)

        monkeypatch.setattr(engine_module, "generate_tokens", timed_generate_tokens)

    def advance(self, seconds):
        self.now += seconds

    def generate(self, seconds, rows=2):
        self._generate_s = seconds
        ids, mask = left_padded_batch([3] * rows, seed=rows)
        return self.engine.module.generate(ids, attention_mask=mask, max_new_tokens=4)  # DeepSpeed-Chat's call site

    def micro_batch(self, seconds, seq):
        """What the PPO trainer does per micro-batch: train(), forward, backward, step() (and the critic's)."""
        train_step(self.engine, seq)
        self.advance(seconds)

    def iteration(self, generate_s=2.0, experience_s=1.0, micro_s=(1.0,), rows=2):
        self.engine.eval()
        seq = self.generate(generate_s, rows)
        self.advance(experience_s)  # reference / critic / reward forwards: "Others"
        for s in micro_s:
            self.micro_batch(s, seq)


@pytest.fixture(scope="module")
def ds_engine():
    return make_ds_engine(tiny_model("gpt2", seed=8), 0)  # the slow part; each test wraps it in a new HybridEngine


@pytest.fixture
def rig(monkeypatch, ds_engine):
    return Rig(monkeypatch, ds_engine)


def _parts_sum(s):
    return s["gather_latency"] + s["generate_latency"] + s["training_latency"] + s["others"]


def test_training_time_is_the_sum_of_the_iterations_train_phases(rig, capsys):
    engine = rig.engine
    rig.iteration(generate_s=2.0, experience_s=1.0, micro_s=(0.5, 0.75, 1.25))  # train() before each micro-batch
    in_progress = engine.latency_stats()  # what step 3 prints after the PPO update, before the next eval()
    assert in_progress["training_latency"] == pytest.approx(2.5)
    engine.log_stats()
    assert "|Training time=2.50s" in capsys.readouterr().out
    rig.advance(0.5)  # between the update and the next rollout's eval(): still the last train phase
    engine.eval()
    s = engine.latency_stats(engine.last_iteration)
    assert (s["iteration"], s["gather_latency"], s["generate_latency"]) == (1, GATHER_S, 2.0)
    assert s["training_latency"] == pytest.approx(3.0)
    assert s["others"] == pytest.approx(1.0)
    assert s["e2e_latency"] == pytest.approx(GATHER_S + 2.0 + 3.0 + 1.0) == pytest.approx(_parts_sum(s))


def test_e2e_is_gather_generate_training_and_others_across_phase_switches(rig):
    engine = rig.engine
    engine.eval()
    seq = rig.generate(1.0)
    rig.micro_batch(2.5, seq)
    engine.train(False)  # leaves the train phase: the idle time after it is not training
    rig.advance(4.0)
    rig.micro_batch(1.0, seq)
    rig.generate(3.0)  # a generation without eval() (refreshing the weights) ends the train phase: none counted twice
    s = engine.latency_stats()
    assert (s["gather_latency"], s["generate_latency"]) == (2 * GATHER_S, 4.0)
    assert s["training_latency"] == pytest.approx(3.5)
    assert s["others"] == pytest.approx(4.0)
    assert s["e2e_latency"] == pytest.approx(2 * GATHER_S + 4.0 + 3.5 + 4.0) == pytest.approx(_parts_sum(s))


def test_an_evaluation_before_ppo_is_no_iteration_and_cur_equals_avg_after_the_first(rig, capsys):
    engine = rig.engine
    # step 3's held-out evaluation before PPO, as dschat/steps/ppo.py runs it: trainer.eval(), then generations
    engine.eval()
    for _ in range(2):
        rig.generate(3.0, rows=4)
    rig.advance(0.5)  # reward-model scoring
    rig.iteration(generate_s=2.0, micro_s=(1.0, 1.0))
    s = engine.latency_stats()
    assert s["iteration"] == 1
    assert s["avg_samples_per_sec"] == pytest.approx(s["samples_per_sec"]) and s["samples_per_sec"] > 0
    engine.log_stats()
    line = capsys.readouterr().out
    cur = line.split("|CurSamplesPerSec=")[1].split()[0]
    assert f"|AvgSamplesPerSec={cur}" in line, line
    engine.eval()
    last = engine.latency_stats(engine.last_iteration)
    assert last["iteration"] == 1 and last["avg_samples_per_sec"] == pytest.approx(last["samples_per_sec"])
    assert last["training_latency"] == pytest.approx(2.0)


def test_an_evaluation_block_stays_out_of_the_iterations(rig):
    engine = rig.engine
    with engine.evaluation():  # what the held-out evaluation wraps itself in
        engine.eval()
        for _ in range(2):
            rig.generate(3.0, rows=4)
        rig.advance(0.5)
    rig.iteration(generate_s=2.0, experience_s=1.0, micro_s=(1.0,))
    engine.eval()
    s = engine.latency_stats(engine.last_iteration)
    assert (s["iteration"], s["samples"], s["generate_latency"], s["gather_latency"]) == (1, 2, 2.0, 0.0)
    assert s["e2e_latency"] == pytest.approx(2.0 + 1.0 + 1.0)
    assert s["avg_samples_per_sec"] == pytest.approx(s["samples_per_sec"]) == pytest.approx(2 / 4.0)
    ev = engine.latency_stats(engine.last_evaluation)
    assert (ev["iteration"], ev["samples"], ev["generate_latency"], ev["gather_latency"]) == (None, 8, 6.0, GATHER_S)
    assert "avg_samples_per_sec" not in ev and ev["e2e_latency"] == pytest.approx(GATHER_S + 6.0 + 0.5)

    # an evaluation between the training and the next rollout: its time leaves the iteration in progress
    rig.iteration(generate_s=2.0, experience_s=1.0, micro_s=(1.0,))
    with engine.evaluation():
        engine.eval()
        rig.generate(3.0, rows=4)
    engine.eval()
    s = engine.latency_stats(engine.last_iteration)
    assert (s["iteration"], s["samples"], s["generate_latency"], s["gather_latency"]) == (2, 2, 2.0, GATHER_S)
    assert s["training_latency"] == pytest.approx(1.0)
    assert s["e2e_latency"] == pytest.approx(GATHER_S + 2.0 + 1.0 + 1.0)


def test_a_rollout_of_several_generation_batches_is_one_iteration(rig):
    engine = rig.engine
    engine.eval()
    rig.generate(2.0)
    rig.advance(1.0)
    engine.eval()  # --generation_batches 2: generate_experience calls eval() before each batch
    seq = rig.generate(2.0)
    rig.advance(1.0)
    rig.micro_batch(1.5, seq)
    engine.eval()
    s = engine.latency_stats(engine.last_iteration)
    assert (s["iteration"], s["samples"], s["generate_latency"]) == (1, 4, 4.0)
    assert s["e2e_latency"] == pytest.approx(GATHER_S + 4.0 + 2.0 + 1.5)


def test_avg_samples_per_sec_is_all_samples_over_all_iterations_time(rig):
    engine = rig.engine
    rig.iteration(generate_s=1.0, experience_s=1.0, micro_s=(2.0,))  # 2 samples in 4.25 s
    rig.iteration(generate_s=3.0, experience_s=2.0, micro_s=(6.0,))  # 2 samples in 11.25 s (with the gather)
    first_e2e, second_e2e = GATHER_S + 4.0, GATHER_S + 11.0
    s = engine.latency_stats()  # iteration 2, in progress (step 3 prints it before the next eval())
    assert s["iteration"] == 2
    assert s["samples_per_sec"] == pytest.approx(2 / second_e2e)
    assert s["avg_samples_per_sec"] == pytest.approx(4 / (first_e2e + second_e2e))
    engine.eval()
    second = engine.last_iteration
    assert engine.latency_stats(second)["avg_samples_per_sec"] == pytest.approx(4 / (first_e2e + second_e2e))
    rig.iteration(generate_s=1.0, experience_s=1.0, micro_s=(1.0,))
    engine.eval()
    assert engine.latency_stats(engine.last_iteration)["iteration"] == 3
    # a completed iteration keeps its own number and average (iterations 1..2), whatever came after it
    s = engine.latency_stats(second)
    assert s["iteration"] == 2 and s["avg_samples_per_sec"] == pytest.approx(4 / (first_e2e + second_e2e))
