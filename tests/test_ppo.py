"""Step 3: experience shapes and masks, the notebook API, LoRA, EMA, unsupervised mixing, resume, ZeRO-3."""
import json
import math
import os
import re
import shutil
import sys
import time

import pytest
import torch

from dschat.args import step1_parser, step3_parser
from dschat.rlhf import evaluation
from dschat.rlhf.trainer import answer_mask, pad_answers
from dschat.steps import ppo, reward, sft
from helpers import (PPO_FAST, RM_FAST, SFT_FAST, count_copy_refreshes, engines_alive, engines_made,
                     saved_tensors, spy_on_empty_query_rows, tiny_deepseek_v4_actor, tiny_recurrent_gemma_actor,
                     tiny_rwkv, tiny_xlstm)
from launch import REPO, run_deepspeed


@pytest.fixture(scope="module")
def trained(tmp_path_factory, distributed):
    """A briefly trained SFT model and reward model, shared by this module's tests."""
    root = tmp_path_factory.mktemp("steps12")
    sft.main(["--output_dir", str(root / "sft"), "--data_output_path", str(root / "data"), "--max_steps", "10",
              *SFT_FAST])
    reward.main(["--output_dir", str(root / "rm"), "--data_output_path", str(root / "data"), "--max_steps", "10",
                 *RM_FAST])
    return root


def ppo_args(trained, out, *extra):
    return ["--actor_model_name_or_path", str(trained / "sft"), "--critic_model_name_or_path", str(trained / "rm"),
            "--data_output_path", str(trained / "data"), "--output_dir", str(out), *PPO_FAST, *extra]


def test_answer_mask_stops_after_first_eos_when_pad_differs():
    answers = torch.tensor([[5, 6, 2, 0, 0], [5, 2, 0, 0, 0], [5, 6, 7, 8, 9], [2, 0, 0, 0, 0]])
    assert answer_mask(answers, eos_token_id=2).tolist() == [
        [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_answer_mask_keeps_a_pad_token_sampled_before_the_eos():
    # the decode step attended to it and sampled what follows given it: a real token, no hole in the mask
    answers = torch.tensor([[5, 0, 6, 2, 0], [0, 0, 7, 8, 9]])
    assert answer_mask(answers, eos_token_id=2).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_answer_mask_when_pad_equals_eos_keeps_the_first_eos():
    answers = torch.tensor([[5, 2, 2, 2], [2, 2, 2, 2]])
    assert answer_mask(answers, eos_token_id=2).tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]


def test_answers_cut_at_the_length_limit_are_counted_as_trls_clipped_ratio_is():
    """An answer with no EOS among its tokens hit --max_answer_seq_len: trained on and scored as it stands, it was
    counted nowhere (TRL logs the share as completions/clipped_ratio). Ended ones, with pad == EOS too, are not; nor is
    an EOS in a padding column past an unended answer (pad_answers' columns, mask 0)."""
    from types import SimpleNamespace

    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    fake = SimpleNamespace(eos_token_id=[2, 3])
    fake._is_eos = lambda tokens: DeepSpeedPPOTrainer._is_eos(fake, tokens)
    answers = torch.tensor([[5, 6, 2, 2, 2], [5, 6, 7, 8, 2], [5, 3, 0, 0, 0], [5, 6, 7, 8, 9], [2, 2, 2, 2, 2]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    assert DeepSpeedPPOTrainer._unended(fake, answers, mask).tolist() == [False, True, False, True, False]


# --- --mask_truncated_answers -------------------------------------------------------------------------------------
class _GradEngine:
    """A model engine as the PPO step calls it: backward runs autograd, never an optimizer boundary."""

    def backward(self, loss):
        loss.backward()

    def step(self):
        pass

    def is_gradient_accumulation_boundary(self):
        return False

    def train(self):
        pass


# answers of 4 tokens after 3-token prompts, EOS 2: rows 1 and 3 hit the length with no EOS
TRUNCATION_ANSWERS = torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8], [7, 2, 0, 0], [9, 9, 9, 9]])
TRUNCATION_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
KEPT, CUT = [0, 2], [1, 3]


def _truncation_experience(rows, zero_advantages=False):
    torch.manual_seed(0)
    answers, mask = TRUNCATION_ANSWERS[rows], TRUNCATION_MASK[rows]
    prompts = torch.full((len(rows), 3), 4)
    floats = [torch.randn(4, 4)[rows] for _ in range(5)]  # (a row's own numbers, whatever rows are taken)
    return {"prompts": prompts, "input_ids": torch.cat([prompts, answers], 1),
            "attention_mask": torch.cat([torch.ones_like(prompts), mask], 1), "action_mask": mask,
            "logprobs": floats[0] - 2, "ref_logprobs": floats[1] - 2, "value": floats[2], "rewards": floats[3][:, 0],
            "advantages": floats[4] * (0.0 if zero_advantages else 1.0), "returns": floats[2] + 1}


def _truncation_grads(monkeypatch, rows, estimator, mode, masked, zero_advantages=False, hand_loop=False,
                      batch=None, result=None):
    """(loss, {"logp", "entropy", "values": the gradient reaching them}) of one PPO step on ``rows`` of the answers
    above, with fake models whose log-probs, entropies and values are leaves (rows taken from fixed full-batch
    ones, so that a row's own tensors are the same whatever rows are given)."""
    from dschat.rlhf import trainer as trainer_module
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    torch.manual_seed(1)
    full = {"logp": torch.randn(4, 4) - 2, "entropy": torch.rand(4, 4), "values": torch.randn(4, 6)}
    leaves = {key: t[rows].clone().requires_grad_() for key, t in full.items()}
    exp = _truncation_experience(rows, zero_advantages)

    def of(seq, key):  # the rows of a micro-batch (``batch``), found by their distinct answers
        if len(seq) == len(rows):
            return leaves[key]
        return leaves[key][[next(i for i, row in enumerate(exp["input_ids"]) if row.equal(s)) for s in seq]]

    monkeypatch.setattr(trainer_module, "answer_token_stats",
                        lambda model, seq, *a, entropy=False, **kw: [of(seq, "logp"), of(seq, "entropy")] if entropy
                        else of(seq, "logp"))
    trainer = DeepSpeedPPOTrainer.__new__(DeepSpeedPPOTrainer)
    trainer.args = step3_args({"mask_truncated_answers": masked, "advantage_estimator": estimator, "loss_agg": mode,
                               "n_samples_per_prompt": 1 if estimator in ("gae", "reinforce_pp") else 2,
                               "entropy_coef": 0.01, "kl_in_reward": False, "kl_loss_coef": 0.1,
                               "max_answer_seq_len": 4, "per_device_training_batch_size": batch or len(rows)})
    trainer.actor_model, trainer.actor_ema, trainer.stats = _GradEngine(), None, {}
    trainer.critic_model = _GradEngine() if estimator == "gae" else None
    trainer.eos_token_id, trainer.device, trainer.align_overflow = 2, torch.device("cpu"), False
    trainer.cliprange = trainer.cliprange_value = 0.2
    trainer._layout = lambda mask, start: "shifted"  # (no masked-SDPA patching of the fake modules)
    trainer._values = lambda critic, seq, mask, layout: of(seq, "values")
    if hand_loop:
        loss = trainer.train_rlhf(exp)[0]
    else:
        returned = trainer.train_rollout([exp])
        loss = torch.tensor(returned["actor_loss"])
        if result is not None:  # (what the iteration reports, for a test of its stats)
            result.update(returned)
    return loss, {key: (t.grad if t.grad is not None else torch.zeros_like(t)) for key, t in leaves.items()}


ESTIMATORS = ["gae", "grpo", "rloo", "reinforce_pp"]
LOSS_AGGS = ["token_mean", "global_token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


@pytest.mark.parametrize("mode", LOSS_AGGS)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("zero_advantages", [False, True], ids=["policy", "kl_entropy_only"])
def test_mask_truncated_answers_takes_every_loss_term_of_a_truncated_answer_and_nothing_else(
        monkeypatch, estimator, mode, zero_advantages):
    """TRL's mask_truncated_completions: an answer cut at --max_answer_seq_len (no EOS) gives no gradient to the
    policy, entropy, KL (the only terms with zero advantages) or value loss with the flag, and does without it. The
    answers kept train as before: token means divide by the tokens kept (the kept rows alone give the same
    gradient), the answer means by every answer (the flag changes no kept row's gradient, as TRL's grpo/dr_grpo)."""
    def grads(rows, masked):
        return _truncation_grads(monkeypatch, rows, estimator, mode, masked, zero_advantages)[1]

    unmasked, masked = grads([0, 1, 2, 3], False), grads([0, 1, 2, 3], True)
    terms = ["logp", "entropy"] + (["values"] if estimator == "gae" else [])
    for term in terms:
        assert unmasked[term][CUT].abs().sum() > 0, term  # (the test can see a truncated answer's gradient)
        assert masked[term][CUT].abs().sum() == 0, term
        assert masked[term][KEPT].abs().sum() > 0, term
    like = grads(KEPT, False) if mode in ("token_mean", "global_token_mean") else \
        {key: g[KEPT] for key, g in unmasked.items()}
    for term in terms:
        got = masked[term][KEPT]
        assert torch.allclose(got[:, :4] if term == "values" else got, like[term][:, :4] if term == "values"
                              else like[term], atol=1e-6), term
    if mode == "global_token_mean":  # a hand loop's train_rlhf counts the tokens kept itself, as step 3 does
        hand = _truncation_grads(monkeypatch, [0, 1, 2, 3], estimator, mode, True, zero_advantages, hand_loop=True)[1]
        assert all(torch.allclose(hand[term], masked[term], atol=1e-6) for term in terms)


@pytest.mark.parametrize("mode", LOSS_AGGS)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("hand_loop", [False, True], ids=["train_rollout", "train_rlhf"])
def test_mask_truncated_answers_on_a_batch_of_truncated_answers_only_gives_a_finite_zero_loss(
        monkeypatch, estimator, mode, hand_loop):
    """Every answer cut: each divisor (the tokens kept: 0) gives a loss of 0 and no gradient, not NaN."""
    loss, grads = _truncation_grads(monkeypatch, CUT, estimator, mode, True, hand_loop=hand_loop)
    assert torch.isfinite(loss) and loss.item() == 0.0
    assert all(torch.isfinite(g).all() and g.abs().sum() == 0 for g in grads.values())


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_mask_truncated_answers_leaves_a_micro_batch_of_cut_answers_out_of_the_iterations_stats(monkeypatch,
                                                                                                estimator):
    """A micro-batch whose answers were all cut has no token in the loss: its kl_loss, clip fractions and approx_kl
    (masked means of nothing: 0) were counted in the iteration's mean over micro-batches, halving it here. Left out,
    the iteration reports what the kept micro-batch alone gives."""
    mixed, alone = {}, {}
    _truncation_grads(monkeypatch, CUT + KEPT, estimator, "token_mean", True, batch=2, result=mixed)
    _truncation_grads(monkeypatch, KEPT, estimator, "token_mean", True, batch=2, result=alone)
    stats = ["kl_loss", "approx_kl", "pg_clipfrac"] + (["vf_clipfrac"] if estimator == "gae" else [])
    assert alone["kl_loss"] > 0 and alone["approx_kl"] > 0  # (a 0 counted in would show)
    for key in stats:
        assert mixed[key] == pytest.approx(alone[key]), key
    everything_cut = {}
    _truncation_grads(monkeypatch, CUT, estimator, "token_mean", True, batch=2, result=everything_cut)
    assert all(everything_cut[key] is None for key in stats)  # (no kept token in the iteration: nothing measured)
    # the micro-batches the stats are means of, which the record weighs each rank's means by
    assert (mixed["stats_micro_batches"], alone["stats_micro_batches"], everything_cut["stats_micro_batches"]) == \
        (1, 1, 0)


def test_mask_truncated_answers_leaves_the_advantages_to_every_answers_score():
    """Only the loss leaves truncated answers out: GRPO's group statistics take every answer's score (TRL's)."""
    from dschat.rlhf import trainer as trainer_module
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    advantages = []
    for masked in (False, True):
        trainer = DeepSpeedPPOTrainer.__new__(DeepSpeedPPOTrainer)
        trainer.args = step3_args({"mask_truncated_answers": masked, "advantage_estimator": "grpo",
                                   "n_samples_per_prompt": 2})
        trainer.stats, trainer.clip_reward_value = {}, 5.0
        trainer.kl_ctl = trainer_module.algo.FixedKLController(0.1)
        exp = _truncation_experience([0, 1, 2, 3])
        del exp["advantages"], exp["returns"]
        trainer.compute_advantages([exp])
        advantages.append(exp["advantages"])
    assert torch.equal(*advantages) and advantages[1][1].abs().sum() > 0


@pytest.mark.parametrize("shifted", [False, True], ids=["masked", "shifted"])
@pytest.mark.parametrize("family", ["llama", "opt", "gpt2"])
def test_answer_token_stats_equal_a_full_masked_forward_and_run_the_head_on_answers_only(family, shifted):
    from dschat.rlhf.algorithms import entropy_from_logits, gather_log_probs
    from dschat.rlhf.layout import LeftAligned
    from dschat.rlhf.trainer import answer_token_stats
    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    from hybrid_common import tiny_model

    class Engine(torch.nn.Module):  # what the trainer calls: a module with .module, like a DeepSpeed engine
        def __init__(self, model):
            super().__init__()
            self.module = model

        def forward(self, **kwargs):
            self.kwargs = kwargs
            return self.module(**kwargs)

    model = tiny_model(family).eval()
    seq = torch.randint(3, 96, (3, 12))
    mask = torch.ones_like(seq)
    mask[0, :3] = 0  # left padding
    mask[1, :1] = 0
    mask[0, 10:] = 0  # an answer that ended (padding after it)
    engine = Engine(model)
    layout = LeftAligned.of(mask) if shifted else None
    head_rows = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: head_rows.append(out.shape[1]))
    with torch.no_grad():
        logp, entropy = answer_token_stats(engine, seq, mask, 7, layout, chunk_size=2, entropy=True)
        full = model(input_ids=seq, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    assert engine.kwargs["logits_to_keep"] == 5 + (3 if shifted else 0)  # the answers moved by up to 3 columns
    assert head_rows[0] == (4 if shifted else 5), "the LM head ran on more than the answer positions"
    assert (engine.kwargs["attention_mask"] is None) == shifted
    assert logp.shape == entropy.shape == (3, 4)
    real = mask[:, 8:].bool()  # answer tokens; padding after an answer is masked out of every loss
    torch.testing.assert_close(logp[real], gather_log_probs(full[:, 7:-1], seq[:, 8:])[real])
    torch.testing.assert_close(entropy[real], entropy_from_logits(full[:, 7:-1])[real])


def _tiny_config(family):
    import transformers as T

    small = dict(vocab_size=64, num_hidden_layers=2, num_attention_heads=4)
    return {"mistral_sliding_window": lambda: T.MistralConfig(hidden_size=32, intermediate_size=64,
                                                              num_key_value_heads=2, sliding_window=4, **small),
            "gemma2": lambda: T.Gemma2Config(hidden_size=32, intermediate_size=64, num_key_value_heads=2, head_dim=8,
                                             sliding_window=4, **small),
            "bloom_alibi": lambda: T.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=64),
            "falcon_alibi": lambda: T.FalconConfig(hidden_size=32, alibi=True, **small),
            "gpt_neox": lambda: T.GPTNeoXConfig(hidden_size=32, intermediate_size=64, **small),
            "phi3": lambda: T.Phi3Config(hidden_size=32, intermediate_size=64, num_key_value_heads=2, pad_token_id=0,
                                         **small)}[family]()


@pytest.mark.parametrize("multiple_of", [1, 8])
@pytest.mark.parametrize("family", ["mistral_sliding_window", "gemma2", "bloom_alibi", "falcon_alibi", "gpt_neox",
                                    "phi3"])
def test_shifted_rows_give_the_masked_answer_stats_where_the_mask_does_more_than_mask(family, multiple_of):
    """Sliding windows and ALiBi depend on distances between columns, which the shift keeps."""
    from transformers import AutoModelForCausalLM

    from dschat.rlhf.layout import LeftAligned
    from dschat.rlhf.trainer import answer_token_stats

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(family)).eval()
    engine = type("Engine", (), {"module": model, "__call__": lambda self, **kw: model(**kw)})()
    seq = torch.randint(3, 64, (4, 20))
    mask = torch.ones_like(seq)
    mask[0, :5] = mask[1, :2] = mask[2, 16:] = 0
    mask[3, :7] = mask[3, 18:] = 0
    with torch.no_grad():
        expected = answer_token_stats(engine, seq, mask, 9, None, 4, entropy=True)
        layout = LeftAligned.of(mask, multiple_of)
        got = answer_token_stats(engine, seq, mask, 9, layout, 4, entropy=True)
    assert layout.width == (18 if multiple_of == 1 else 20)  # rounded up (within the 20 columns) with a multiple
    real = mask[:, 10:].bool()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=1e-5)


def test_shifted_rows_are_cut_to_the_longest_so_positions_stay_in_the_table():
    """GPT-2's learned positions: 10 of them, rows of 12 columns with at most 9 real tokens (as after rounding up to
    --pad_to_multiple_of); the shifted forward must not ask for position 10 or 11."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from dschat.models.positions import position_limit
    from dschat.rlhf.layout import LeftAligned
    from dschat.rlhf.trainer import answer_token_stats

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2, n_positions=10)).eval()
    seq = torch.randint(3, 50, (2, 12))
    mask = torch.zeros_like(seq)
    mask[0, 3:12] = 1
    mask[1, 4:10] = 1
    engine = type("Engine", (), {"module": model, "__call__": lambda self, **kw: model(**kw)})()  # like DeepSpeed's
    assert LeftAligned.of(mask).width == 9
    layout = LeftAligned.of(mask, multiple_of=4, position_limit=position_limit(model))  # 12 rounded, 10 in the table
    assert layout.width == 10
    with torch.no_grad():
        got = answer_token_stats(engine, seq, mask, 5, layout, chunk_size=4)
        expected = answer_token_stats(engine, seq, mask, 5, None, chunk_size=4)
    real = mask[:, 6:].bool()
    torch.testing.assert_close(got[real], expected[real])
    assert LeftAligned.of(mask, multiple_of=4).width == 12  # no limit: rounded up to --pad_to_multiple_of, few shapes
    assert LeftAligned.of(mask, multiple_of=4, position_limit=8).width == 9  # never below the longest row


def test_position_limit_reads_position_tables_and_rope_scaling_switch_lengths():
    from types import SimpleNamespace as NS

    from dschat.models.positions import position_limit

    assert position_limit(NS(config=NS(max_position_embeddings=2048)), NS(config=NS(n_positions=1024))) == 1024
    longrope = NS(config=NS(max_position_embeddings=131072,
                            rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 4096}))
    assert position_limit(longrope) == 4096
    assert position_limit(NS(config=NS())) is None
    # transformers 5: one RoPE dict per layer type (Gemma-3 style); dynamic NTK keeps its stretched table cached
    nested = NS(config=NS(max_position_embeddings=32, rope_parameters={
        "full_attention": {"rope_type": "longrope", "original_max_position_embeddings": 16},
        "sliding_attention": {"rope_type": "default"}}))
    assert position_limit(nested) == 16
    assert position_limit(NS(config=NS(max_position_embeddings=16, rope_parameters={"rope_type": "dynamic"}))) == 15
    multimodal = NS(config=NS(get_text_config=lambda: NS(max_position_embeddings=64)))
    assert position_limit(multimodal) == 64


def test_an_lm_head_that_runs_twice_is_an_error_not_wrong_log_probs():
    from dschat.rlhf.layout import head_reads

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(4, 3)

        def get_output_embeddings(self):
            return self.head

        def forward(self, hidden):
            return self.head(hidden) + self.head(hidden)

    model = TwoHeads()
    with pytest.raises(RuntimeError, match="ran 2 times"):
        with head_reads(model, torch.zeros(2, 1, dtype=torch.long), window=2):
            model(torch.randn(2, 5, 4))


def test_layout_falls_back_to_the_mask_for_a_gap_an_empty_prompt_or_padded_forwards():
    from types import SimpleNamespace

    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    def layout(mask, start, padded=False):
        trainer = SimpleNamespace(args=SimpleNamespace(padded_forwards=padded), pad_to_multiple_of=1,
                                  position_limit=None)
        return DeepSpeedPPOTrainer._layout(trainer, torch.tensor(mask), start)

    assert layout([[0, 1, 1, 1], [1, 1, 1, 0]], start=1) is not None
    assert layout([[0, 1, 1, 1], [1, 1, 1, 0]], start=1, padded=True) is None
    assert layout([[0, 0, 1, 1], [1, 1, 1, 0]], start=1) is None  # a prompt of padding only: moved past its start
    assert layout([[1, 0, 1, 1], [1, 1, 1, 0]], start=1) is None  # a gap


def test_rows_with_a_gap_are_not_shifted_and_shifting_round_trips():
    from dschat.rlhf.layout import LeftAligned

    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    layout = LeftAligned.of(mask)
    assert layout.mask.tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1, 1, 1, 0, 0]] and layout.max_lead == 2
    x = torch.arange(18).view(3, 6)
    assert layout.align(x)[0, :3].tolist() == [2, 3, 4] and layout.align(x).shape == (3, 5)  # cut to the longest
    restored = layout.restore(layout.align(x))
    assert torch.equal(restored[mask.bool()], x[mask.bool()])
    assert LeftAligned.of(torch.tensor([[1, 1, 0, 1, 1, 0]])) is None  # a hole in the mask


def _engine_and_trainer(trained, tmp_path, **overrides):
    from dschat import DeepSpeedPPOTrainer, DeepSpeedRLHFEngine
    from dschat.models.loading import load_tokenizer

    args = {"critic_model_name_or_path": str(trained / "rm"), "dtype": "fp32", "max_prompt_seq_len": 40,
            "max_answer_seq_len": 10, "per_device_training_batch_size": 4, "num_warmup_steps": 0,
            "actor_learning_rate": 1e-4, "critic_learning_rate": 1e-4, **overrides}
    tokenizer = load_tokenizer(str(trained / "sft"), padding_side="left")
    engine = DeepSpeedRLHFEngine(actor_model_name_or_path=str(trained / "sft"), tokenizer=tokenizer, args=args)
    trainer = DeepSpeedPPOTrainer(engine=engine, args=args)
    return engine, trainer, tokenizer


def test_notebook_engine_refuses_a_generation_past_the_actors_local_window_before_any_model_loads(trained, tmp_path,
                                                                                                 monkeypatch):
    """GPT-Neo's local window bounds the hybrid engine's cache: step 3's settings check refuses a longer generation
    (87a8ae2), but a notebook's engine (and step 3 with a hub actor not yet in the cache) loaded every model and failed
    at the first generation."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    from dschat import DeepSpeedRLHFEngine
    from dschat.errors import UsageError
    from dschat.models.loading import load_tokenizer

    neo = tmp_path / "neo"
    GPTNeoForCausalLM(GPTNeoConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                                   max_position_embeddings=64, attention_types=[[["global", "local"], 1]],
                                   window_size=12)).save_pretrained(neo)
    load_tokenizer(str(trained / "sft")).save_pretrained(neo)
    monkeypatch.setattr("dschat.rlhf.engine.load_causal_lm", lambda *given, **kw: pytest.fail("a model loaded"))
    with pytest.raises(UsageError, match=r"local window of 12 tokens.* is 16"):
        DeepSpeedRLHFEngine(str(neo), str(trained / "rm"), None,
                            {"dtype": "fp32", "enable_hybrid_engine": True, "max_prompt_seq_len": 8,
                             "max_answer_seq_len": 8})


def test_notebook_engine_with_a_missing_model_folder_fails_before_any_model_loads(trained, tmp_path, monkeypatch):
    """From Python as from step 3's command line: not transformers' "Repo id must be in the form ..." after the actor
    and the reference have loaded, nor a minute of hub retries for the README's default output/step1_sft."""
    from dschat import DeepSpeedRLHFEngine
    from dschat.errors import MissingInputError
    from dschat.models.loading import load_tokenizer

    monkeypatch.setattr("dschat.rlhf.engine.load_causal_lm", lambda *given, **kw: pytest.fail("a model loaded"))
    tokenizer = load_tokenizer(str(trained / "sft"), padding_side="left")
    with pytest.raises(MissingInputError, match=r"--critic_model_name_or_path .*/rmx: no such folder"):
        DeepSpeedRLHFEngine(str(trained / "sft"), str(tmp_path / "rmx"), tokenizer, {"dtype": "fp32"})
    monkeypatch.chdir(tmp_path)  # no output/ here
    with pytest.raises(MissingInputError, match=r"the actor loads from --actor_model_name_or_path output/step1_sft"):
        DeepSpeedRLHFEngine(critic_model_name_or_path=str(trained / "rm"), tokenizer=tokenizer, args={})


def test_notebook_engine_warns_once_of_an_unfinished_model(trained, tmp_path, monkeypatch, capsys):
    """The notebook API trains from a folder an interrupted run left (training_args.json, no metrics.json): said once,
    before any model loads, as the step scripts say it."""
    import shutil

    from dschat import DeepSpeedRLHFEngine
    from dschat.models.loading import load_tokenizer

    sft = tmp_path / "sft"
    shutil.copytree(trained / "sft", sft)
    (sft / "training_args.json").write_text("{}")
    (sft / "metrics.json").unlink(missing_ok=True)

    class Loaded(Exception):
        pass

    def load(*given, **kw):
        raise Loaded

    monkeypatch.setattr("dschat.rlhf.engine.load_causal_lm", load)
    tokenizer = load_tokenizer(str(sft), padding_side="left")
    capsys.readouterr()
    with pytest.raises(Loaded):
        DeepSpeedRLHFEngine(str(sft), str(trained / "rm"), tokenizer, {"dtype": "fp32"})
    out = capsys.readouterr().out
    assert out.count(f"warning: {sft} is an unfinished step output") == 1 and str(trained / "rm") not in out
    # an unfinished critic folder, which is also the reward model (read from the critic's folder): said once too
    rm = tmp_path / "rm"
    shutil.copytree(trained / "rm", rm)
    (rm / "training_args.json").write_text("{}")
    (rm / "metrics.json").unlink(missing_ok=True)
    with pytest.raises(Loaded):
        DeepSpeedRLHFEngine(str(trained / "sft"), str(rm), tokenizer, {"dtype": "fp32"})
    out = capsys.readouterr().out
    assert out.count(f"warning: {rm} is an unfinished step output") == 1 and "warning: " + str(trained) not in out


def _prompt_batch(tokenizer, texts):
    from dschat.data import DataCollatorRLHF

    items = [{"prompt_input_ids": torch.tensor(tokenizer(t)["input_ids"]), "prompt_text": t} for t in texts]
    return DataCollatorRLHF(40, pad_token_id=tokenizer.pad_token_id)(items)


@pytest.mark.parametrize("hybrid", [False, True], ids=["hf_generate", "hybrid_engine"])
def test_rollouts_sample_without_the_actors_generation_config_repetition_penalty(trained, tmp_path, hybrid, capsys):
    """An actor whose generation_config asks for a repetition penalty (chat models' do) had it applied to every
    rollout by HF's generate and the hybrid engine alike, while PPO scores the answers without it: the answers came
    from another policy than the one trained. Step 3 samples at --repetition_penalty (1 unless given) and says so."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from dschat import DeepSpeedPPOTrainer, DeepSpeedRLHFEngine
    from dschat.models.loading import load_tokenizer

    actor = tmp_path / "actor"
    shutil.copytree(trained / "sft", actor)
    torch.manual_seed(0)  # random weights: greedy answers that run to their length and repeat tokens
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(actor)).save_pretrained(actor)
    config = GenerationConfig.from_pretrained(actor) if (actor / "generation_config.json").exists() \
        else GenerationConfig()
    config.repetition_penalty = 50.0
    config.save_pretrained(actor)
    args = {"critic_model_name_or_path": str(trained / "rm"), "dtype": "fp32", "max_prompt_seq_len": 40,
            "max_answer_seq_len": 12, "per_device_training_batch_size": 2, "greedy": True,
            "enable_hybrid_engine": hybrid}
    tokenizer = load_tokenizer(str(actor), padding_side="left")
    trainer = DeepSpeedPPOTrainer(engine=DeepSpeedRLHFEngine(str(actor), tokenizer=tokenizer, args=args), args=args)
    assert ("the actor's generation_config asks for repetition_penalty 50.0; the rollouts are sampled at "
            "--repetition_penalty 1.0") in capsys.readouterr().out
    batch = _prompt_batch(tokenizer, ["\n\nHuman: Say hi.\n\nAssistant:",
                                      "\n\nHuman: List three colors please, thanks.\n\nAssistant:"])
    seq = trainer.generate_experience(batch)["input_ids"]
    model = trainer.actor_model.module
    with torch.no_grad():
        def greedy(penalty):
            return model.generate(batch["prompt"], attention_mask=batch["prompt_att_mask"], max_new_tokens=12,
                                  do_sample=False, repetition_penalty=penalty, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
        unpenalized, penalized = greedy(1.0), greedy(50.0)
    assert not torch.equal(unpenalized, penalized), "the premise: the penalty changes these answers"
    width = min(seq.shape[1], unpenalized.shape[1])
    assert torch.equal(seq[:, :width], unpenalized[:, :width])


@pytest.mark.parametrize("hybrid", [False, True], ids=["hf_generate", "hybrid_engine"])
def test_rollouts_never_generate_the_ids_of_embedding_rows_the_tokenizer_has_no_token_for(trained, tmp_path, hybrid,
                                                                                          monkeypatch):
    """An actor with more embedding rows than its tokenizer has tokens (Qwen2.5: 151936 for 151665): an id sampled
    past the tokenizer decodes to nothing and no reward model has scored it. Here those rows' logits are raised to the
    most likely; the rollouts (HF's generate and the hybrid engine, greedy and sampled) and the held-out evaluation's
    answers never hold one."""
    import shutil
    from types import SimpleNamespace

    from dschat.steps import ppo

    from transformers import AutoModelForCausalLM

    from dschat import DeepSpeedPPOTrainer, DeepSpeedRLHFEngine
    from dschat.models.loading import load_tokenizer

    actor = tmp_path / "actor"
    shutil.copytree(trained / "sft", actor)
    tokenizer = load_tokenizer(str(actor), padding_side="left")
    tokens = len(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(actor)
    model.resize_token_embeddings(tokens + 8)
    model.save_pretrained(actor)
    args = {"critic_model_name_or_path": str(trained / "rm"), "dtype": "fp32", "max_prompt_seq_len": 40,
            "max_answer_seq_len": 6, "per_device_training_batch_size": 2, "enable_hybrid_engine": hybrid}
    batch = _prompt_batch(tokenizer, ["\n\nHuman: Say hi.\n\nAssistant:",
                                      "\n\nHuman: List three colors please, thanks.\n\nAssistant:"])
    for greedy in (True, False):
        trainer = DeepSpeedPPOTrainer(engine=DeepSpeedRLHFEngine(str(actor), tokenizer=tokenizer,
                                                                 args={**args, "greedy": greedy}),
                                      args={**args, "greedy": greedy})
        module = trainer.actor_model.module
        bias = torch.zeros(tokens + 8)
        bias[tokens:] = 50.0
        module.get_output_embeddings().register_forward_hook(lambda m, inputs, output: output + bias)
        with torch.no_grad():
            unsuppressed = type(module).generate(module, batch["prompt"], attention_mask=batch["prompt_att_mask"],
                                                 max_new_tokens=6, do_sample=False,
                                                 pad_token_id=tokenizer.pad_token_id)
        assert (unsuppressed[:, batch["prompt"].shape[1]:] >= tokens).all(), "the premise: those rows win"
        seq = trainer.generate_experience(batch)["input_ids"]
        assert (seq[:, batch["prompt"].shape[1]:] < tokens).all(), (greedy, seq)
    evaluated = {}
    monkeypatch.setattr(evaluation, "evaluate_policy",
                        lambda generate, *args, **kwargs: evaluated.update(generate=generate))
    ppo.held_out_eval(trainer, None, SimpleNamespace(eval_max_new_tokens=None, max_answer_seq_len=6, eval_prompts=0,
                                                     padded_forwards=False), trainer.device, None)
    with torch.no_grad():
        answers = evaluated["generate"](batch["prompt"], attention_mask=batch["prompt_att_mask"], max_new_tokens=6,
                                        do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert (answers[:, batch["prompt"].shape[1]:] < tokens).all(), answers


@pytest.mark.parametrize("hybrid", [False, True], ids=["hf_generate", "hybrid_engine"])
def test_notebook_api_generates_experience_with_consistent_masks(trained, tmp_path, hybrid):
    engine, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, enable_hybrid_engine=hybrid)
    batch = _prompt_batch(tokenizer, ["\n\nHuman: Say hi.\n\nAssistant:",
                                      "\n\nHuman: List three colors please, thanks.\n\nAssistant:"] * 2)
    assert batch["prompt_att_mask"][0, 0] == 0  # left-padded
    out = trainer.generate_experience(batch)
    prompt_len = batch["prompt"].shape[1]
    seq, mask, amask = out["input_ids"], out["attention_mask"], out["action_mask"]
    assert torch.equal(seq[:, :prompt_len], batch["prompt"])
    assert torch.equal(mask[:, prompt_len:], amask)
    assert out["logprobs"].shape == out["ref_logprobs"].shape == out["value"].shape == amask.shape
    assert out["rewards"].shape == (4,)
    # the actor equals the reference before any update
    assert torch.allclose(out["logprobs"] * amask, out["ref_logprobs"] * amask, atol=1e-5)
    # after the answer's end there is only padding
    ended = amask == 0
    assert (seq[:, prompt_len:][ended] == tokenizer.pad_token_id).all()
    actor_loss, critic_loss = trainer.train_rlhf(out)
    assert torch.isfinite(actor_loss) and torch.isfinite(critic_loss)
    out2 = trainer.generate_experience(batch)
    assert not torch.allclose(out2["logprobs"] * out2["action_mask"], out2["ref_logprobs"] * out2["action_mask"])


@pytest.mark.parametrize("hybrid", [False, True], ids=["hf_generate", "hybrid_engine"])
def test_a_notebooks_trainer_evaluates_its_policy_on_the_held_out_prompts_as_step_3_does(trained, tmp_path, hybrid):
    """A notebook's held-out prompts (prompt_loaders' second loader) had no public scoring: step 3's held_out_eval is
    internal and takes the step's args. DeepSpeedPPOTrainer.evaluate runs it, the trainer's args for its defaults:
    the actor's greedy answers, each scored by the reward model as the rollouts score rows, and by the rule scorer of
    the embedded data."""
    from dschat import prompt_loaders
    from dschat.errors import UsageError
    from dschat.rlhf.evaluation import answer_texts, hf_generate
    from dschat.rlhf.layout import forward_layout, reward_scores
    from dschat.tiny.scorer import rule_score

    engine, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, enable_hybrid_engine=hybrid,
                                                     data_output_path=str(trained / "data"),
                                                     per_device_generation_batch_size=3)
    held_out = prompt_loaders(trainer.args, tokenizer)[1]
    # (this briefly trained actor ends its answers at once: kept from ending, they run to their length)
    no_eos = torch.zeros(trainer.actor_model.module.get_output_embeddings().weight.shape[0])
    no_eos[tokenizer.eos_token_id] = -1e4
    trainer.actor_model.module.get_output_embeddings().register_forward_hook(lambda m, i, output: output + no_eos)
    result = trainer.evaluate(held_out, eval_prompts=3, eval_max_new_tokens=4)
    assert set(result) == {"reward_mean", "prompts", "examples", "rule_score_mean", "empty_answers"}
    assert result["prompts"] == 3 and result["empty_answers"] == 0 and trainer.args.eval_prompts == 64
    # recomputed: the actor's greedy answers of at most 4 tokens, the reward model's scores of them, their rule scores
    batch = next(iter(held_out))
    prompts, mask = batch["prompt"], batch["prompt_att_mask"]
    with torch.no_grad():
        seq = hf_generate(trainer.actor_model.module, tokenizer)(
            prompts, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=trainer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)
        answers = seq[:, prompts.shape[1]:]
        assert answers.shape[1] == 4
        amask = answer_mask(answers, trainer.eos_token_id)
        full_mask = torch.cat([mask.long(), amask], dim=1)
        layout = forward_layout(full_mask, prompts.shape[1] - 1, 1, trainer.position_limit)
        scores = reward_scores(trainer.reward_model.module, seq, full_mask, layout).tolist()
    texts = answer_texts(tokenizer, answers, amask)
    assert [e["answer"] for e in result["examples"]] == texts
    assert [e["reward"] for e in result["examples"]] == pytest.approx(scores, abs=1e-4)
    assert result["reward_mean"] == pytest.approx(sum(scores) / 3, abs=1e-4)
    rules = [rule_score(p, t) for p, t in zip(batch["prompt_text"], texts)]
    assert result["rule_score_mean"] == pytest.approx(sum(rules) / 3)
    trainer.args.eval_prompts = 3  # (the trainer's args: the counts when none is given)
    assert trainer.evaluate(held_out)["prompts"] == 3
    with pytest.raises(UsageError, match=r"trainer.evaluate\(eval_max_new_tokens=40\): .* would be 80, longer than "
                                         r"the 50 the engine's models were checked and sized for"):
        trainer.evaluate(held_out, eval_max_new_tokens=40)


def test_a_critic_a_notebook_saves_is_known_as_the_critic_wherever_it_is_saved(trained, tmp_path, capsys):
    """chat.py --path on step 3's critic saved from a notebook (save_reward_model(engine.critic, ...)) said "a reward
    model (step 2's output)": a critic was known by its place in a step-3 folder alone, and its files are a reward
    model's. The engine's critic is saved with its role in reward_model.json; the reward model is not."""
    from dschat import save_reward_model
    from dschat.errors import UsageError
    from dschat.tools import chat, rw_eval

    engine, trainer, tokenizer = _engine_and_trainer(trained, tmp_path)
    save_reward_model(engine.critic, tokenizer, str(tmp_path / "my_critic"))
    save_reward_model(engine.reward, tokenizer, str(tmp_path / "my_reward_model"))
    critic = str(tmp_path / "my_critic")
    with pytest.raises(UsageError, match=f"^--path {re.escape(critic)}: step 3's critic .*not a policy"):
        chat.main(["--path", critic, "--prompt", "hi"])
    with pytest.raises(UsageError, match=r": a reward model or critic \(a value-head model\), not a policy"):
        chat.main(["--path", str(tmp_path / "my_reward_model"), "--prompt", "hi"])
    capsys.readouterr()
    rw_eval.main(["--model_name_or_path", critic, "--prompt", "Say hi.", "--answer", "hi"])  # (scored as a reward)
    assert f"warning: {critic}: step 3's critic (the value model PPO trains beside the actor)" in capsys.readouterr().err


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_logprobs_from_generation_equal_the_actor_forward_and_skip_it(trained, tmp_path, temperature):
    """At --temperature T the decode step's log-probs and the training forward's are both of softmax(logits / T), the
    distribution the answers were drawn from (TRL's, OpenRLHF's, verl's; scored at 1, PPO trained another policy
    than the one that sampled)."""
    from dschat.models.reward_model import positions_from_mask

    engine, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, enable_hybrid_engine=True,
                                                     logprobs_from_generation=True, fuse_projections="on",
                                                     temperature=temperature, actor_dropout=0.0)
    batch = _prompt_batch(tokenizer, ["\n\nHuman: Say hi.\n\nAssistant:",
                                      "\n\nHuman: List three colors please, thanks.\n\nAssistant:"])
    forwarded = []
    logprobs_of = trainer._logprobs
    trainer._logprobs = lambda model, *args: forwarded.append(model) or logprobs_of(model, *args)
    out = trainer.generate_experience(batch)
    assert forwarded == [trainer.ref_model], "the actor's experience forward must be skipped"
    assert trainer.actor_model.fusion.groups, "--fuse_projections on: the decode step ran q/k/v as one GEMM"
    amask = out["action_mask"]
    with torch.no_grad():
        expected = logprobs_of(trainer.actor_model, out["input_ids"], out["attention_mask"],
                               batch["prompt"].shape[1] - 1)
    assert out["logprobs"].shape == expected.shape == amask.shape
    torch.testing.assert_close(out["logprobs"] * amask, expected * amask, atol=1e-4, rtol=0)
    seq, mask, start = out["input_ids"], out["attention_mask"], batch["prompt"].shape[1] - 1
    with torch.no_grad():
        logits = trainer.actor_model.module(input_ids=seq, attention_mask=mask,
                                            position_ids=positions_from_mask(mask)).logits[:, start:-1].float()
    naive = torch.log_softmax(logits / temperature, -1).gather(-1, seq[:, start + 1:, None]).squeeze(-1)
    torch.testing.assert_close(expected * amask, naive * amask, atol=1e-4, rtol=0)
    # the reference's too: the KL (reward penalty, loss term, the logged KL) is between the tempered distributions
    with torch.no_grad():
        ref_logits = trainer.ref_model.module(input_ids=seq, attention_mask=mask,
                                              position_ids=positions_from_mask(mask)).logits[:, start:-1].float()
    ref_naive = torch.log_softmax(ref_logits / temperature, -1).gather(-1, seq[:, start + 1:, None]).squeeze(-1)
    torch.testing.assert_close(out["ref_logprobs"] * amask, ref_naive * amask, atol=1e-4, rtol=0)
    actor_loss, _ = trainer.train_rlhf(out)
    assert torch.isfinite(actor_loss)
    # the training forward scores at T as well: before any step the ratio to the old log-probs is 1
    assert trainer.stats["approx_kl"] < 1e-6 and trainer.stats["pg_clipfrac"] == 0, trainer.stats


def test_pad_answers_rounds_up_with_masked_columns():
    seq, amask, logprobs = torch.arange(20).view(2, 10), torch.ones(2, 6, dtype=torch.long), torch.ones(2, 6)
    padded, padded_mask, padded_logprobs = pad_answers(seq, amask, -1, 8, logprobs)
    assert padded.shape == (2, 16) and padded_mask.shape == padded_logprobs.shape == (2, 12)
    assert torch.equal(padded[:, :10], seq) and padded[:, 10:].eq(-1).all()
    assert padded_mask[:, 6:].eq(0).all() and padded_logprobs[:, 6:].eq(0).all()
    assert pad_answers(seq, amask, -1, 5, logprobs)[0] is seq  # already a multiple: as it was


def test_logprobs_from_generation_needs_the_hybrid_engine(trained, tmp_path):
    with pytest.raises(ValueError, match="--logprobs_from_generation: read by the hybrid engine only, which is off"):
        _engine_and_trainer(trained, tmp_path, logprobs_from_generation=True)


# --- --pad_to_multiple_of: generated sequences right-padded to a multiple (few shapes for cuDNN's plans) ---

PADDED_PROMPTS = ["\n\nHuman: Say hi.\n\nAssistant:", "\n\nHuman: List three colors please, thanks.\n\nAssistant:",
                  "\n\nHuman: What is two plus two?\n\nAssistant:", "\n\nHuman: Name a fruit.\n\nAssistant:"]


def _trainer_pair(trained, tmp_path, variant, **second):
    """Two trainers over one engine, --pad_to_multiple_of 1 and the second with the ``second`` args; learning rates 0
    (an update changes no weight, so both train_rlhf calls see the same models), masked whitening and an entropy term
    (reductions over the padding columns), a reward function on the decoded answers (their texts)."""
    from argparse import Namespace

    from dschat import DeepSpeedPPOTrainer

    hybrid = variant == "logprobs_from_generation"
    reward_fn = tmp_path / "length_reward.py"
    reward_fn.write_text("def score(prompts, answers):\n    return [0.01 * len(a) for a in answers]\n")
    engine, plain, tokenizer = _engine_and_trainer(
        trained, tmp_path, enable_hybrid_engine=hybrid, logprobs_from_generation=hybrid,
        actor_learning_rate=0.0, critic_learning_rate=0.0, whiten_advantages=True, entropy_coef=0.01,
        reward_fn=f"{reward_fn}:score", pad_to_multiple_of=1)
    padded = DeepSpeedPPOTrainer(engine=engine, args=Namespace(**{**vars(plain.args), **second}))
    if variant == "pad_is_eos":  # a pad column after an answer that never ended must not pass for its EOS
        for trainer in (plain, padded):
            trainer.eos_token_id = trainer.pad_token_id
    return plain, padded, tokenizer


def _sampled_experience(trainer, batch):
    """Experience from sampled answers (greedy ones are all empty after 10 SFT steps), the same for every trainer."""
    torch.manual_seed(0)
    trainer.generator.manual_seed(0)  # HF generate and the hybrid engine both sample from the trainer's generator
    return trainer.generate_experience(batch)


@pytest.mark.parametrize("variant", ["hf_generate", "logprobs_from_generation", "pad_is_eos"])
def test_padded_experience_equals_the_unpadded_one_on_real_tokens(trained, tmp_path, variant):
    multiple = 16
    plain, padded, tokenizer = _trainer_pair(trained, tmp_path, variant, pad_to_multiple_of=multiple)
    batch = _prompt_batch(tokenizer, PADDED_PROMPTS)
    prompt_len = batch["prompt"].shape[1]
    exp = _sampled_experience(plain, batch)
    plain_stats = dict(plain.stats)
    got = _sampled_experience(padded, batch)
    length, answer_len = exp["input_ids"].shape[1], exp["input_ids"].shape[1] - prompt_len
    assert length % multiple, "the unpadded length is already a multiple: nothing would be tested"
    assert got["input_ids"].shape[1] == -(-length // multiple) * multiple
    amask = exp["action_mask"]
    ended = amask.sum(1) < answer_len
    assert amask.sum(1).gt(1).any() and (ended.any() or variant == "pad_is_eos"), "trivial answers: nothing tested"
    if variant == "pad_is_eos":
        assert not ended.all(), "every answer ended: a pad column after an unended one is not tested"
    # the real columns are unchanged, the new ones are padding
    assert torch.equal(got["input_ids"][:, :length], exp["input_ids"])
    assert (got["input_ids"][:, length:] == padded.pad_token_id).all()
    assert torch.equal(got["attention_mask"][:, :length], exp["attention_mask"])
    assert not got["attention_mask"][:, length:].any() and not got["action_mask"][:, answer_len:].any()
    assert torch.equal(got["action_mask"][:, :answer_len], amask)
    for key in ("logprobs", "ref_logprobs", "value"):
        assert got[key].shape == got["action_mask"].shape, key
        torch.testing.assert_close(got[key][:, :answer_len] * amask, exp[key] * amask, atol=1e-5, rtol=1e-5)
    if variant == "logprobs_from_generation":
        assert not got["logprobs"][:, answer_len:].any()  # the decode step's log-probs, zero-padded
    torch.testing.assert_close(got["rewards"], exp["rewards"], atol=1e-5, rtol=1e-5)
    for key in ("answer_length", "generated_tokens", "empty_answers", "truncated_answers"):
        assert padded.stats[key] == plain_stats[key], key
    # the same PPO losses (learning rates 0: the first update changes no weight)
    for a, b in zip(padded.train_rlhf(got), plain.train_rlhf(exp)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["hf_generate", "logprobs_from_generation"])
def test_shifted_forwards_equal_the_masked_ones_on_real_tokens(trained, tmp_path, variant, monkeypatch):
    """Default: step 3's forwards over rows shifted to column 0 with no attention mask; --padded_forwards: as they
    are, masked. Same log-probs, values, rewards and losses on the real tokens."""
    shifted, masked, tokenizer = _trainer_pair(trained, tmp_path, variant, padded_forwards=True)
    masks = []  # the attention mask of every forward of the experience (not generation: it uses the cache)
    attention = []  # and the attention function each one ran

    def record(module, args, kwargs):
        if kwargs.get("use_cache") is False:
            masks.append(kwargs.get("attention_mask"))
            attention.append(module.config._attn_implementation)

    for backbone in (shifted.actor_model.module, shifted.ref_model.module, shifted.critic_model.module.rwtransformer,
                     shifted.reward_model.module.rwtransformer):
        backbone.register_forward_pre_hook(record, with_kwargs=True)
    batch = _prompt_batch(tokenizer, PADDED_PROMPTS)
    assert not batch["prompt_att_mask"].all(), "prompts of one length: nothing would be shifted"
    exp = _sampled_experience(shifted, batch)
    shifted_calls = len(masks)
    empty_rows = spy_on_empty_query_rows(monkeypatch)  # per SDPA call: a query row with no key?
    got = _sampled_experience(masked, batch)
    assert any(empty_rows), "the masked experience forwards have left pads whose query rows see no key"
    assert shifted_calls and all(m is None for m in masks[:shifted_calls]), "the shifted forwards took a mask"
    assert all(m is not None for m in masks[shifted_calls:]), "--padded_forwards ran without the mask"
    amask = exp["action_mask"]
    assert torch.equal(got["input_ids"], exp["input_ids"]) and amask.sum(1).gt(1).any()
    assert (amask.sum(1) < amask.shape[1]).any(), "no answer ended: no padding after an answer tested"
    for key in ("logprobs", "ref_logprobs", "value"):
        torch.testing.assert_close(got[key] * amask, exp[key] * amask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["rewards"], exp["rewards"], atol=1e-5, rtol=1e-5)
    assert set(attention) == {"sdpa"}, "the experience's forwards keep SDPA (no backward through them)"
    masks.clear()
    attention.clear()
    empty_rows.clear()
    for a, b in zip(shifted.train_rlhf(exp), masked.train_rlhf(got)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(masks) == 4 and masks[0] is None and masks[1] is None, "train_rlhf's shifted forwards took a mask"
    assert masks[2] is not None and masks[3] is not None
    # the masked actor and critic train with no fully masked query row (cuDNN's backward: NaN for one), then go back
    assert attention == ["sdpa", "sdpa", "dschat_sdpa_rows", "dschat_sdpa_rows"]
    assert empty_rows and not any(empty_rows), "a masked training forward or backward ran SDPA with an empty row"
    assert masked.actor_model.module.config._attn_implementation == "sdpa"


def test_step3_prompt_batches_are_rounded_up_to_pad_to_multiple_of(trained, tokenizer):
    args = {"data_output_path": str(trained / "data"), "max_prompt_seq_len": 40, "pad_to_multiple_of": 16,
            "per_device_generation_batch_size": 4}
    train, held_out = ppo.prompt_loaders(args, tokenizer)
    lengths = {batch["prompt"].shape[1] for loader in (train, held_out) for batch in loader}
    assert lengths <= {16, 32, 40}  # 40: 48 capped at --max_prompt_seq_len
    assert len(lengths) > 1


def test_invalid_pad_to_multiple_of_is_a_clear_error(trained, tmp_path):
    with pytest.raises(ValueError, match="--pad_to_multiple_of must be a positive integer"):
        _engine_and_trainer(trained, tmp_path, pad_to_multiple_of=0)


def test_dir_of_the_package_lists_its_lazily_loaded_names():
    """dir(dschat), which a notebook's tab completion reads, listed none of the README's imports (they load lazily,
    through the module's __getattr__), so `dschat.<Tab>` offered nothing but __version__."""
    import dschat

    assert set(dschat.__all__) <= set(dir(dschat)) and "__version__" in dir(dschat)


def test_deepspeed_chat_positional_form(trained, tmp_path):
    """DeepSpeed-Chat's module paths and positional arguments."""
    import dschat
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer, DeepSpeedPPOTrainerUnsupervised
    from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine
    from dschat.models.loading import load_tokenizer
    from dschat.rlhf.config import step3_args

    args = step3_args({"dtype": "fp32", "max_answer_seq_len": 6, "per_device_training_batch_size": 2})
    tokenizer = load_tokenizer(str(trained / "sft"), padding_side="left")
    engine = DeepSpeedRLHFEngine(str(trained / "sft"), str(trained / "rm"), tokenizer, args, 10)
    trainer = DeepSpeedPPOTrainer(engine, args)
    assert trainer.generate_time == 0.0
    batch = _prompt_batch(tokenizer, ["\n\nHuman: Say hi.\n\nAssistant:"] * 2)
    generate = trainer._generate_sequence
    trainer._generate_sequence = lambda *a: (time.sleep(0.05), generate(*a))[1]  # (a generation of 50 ms at least)
    out = trainer.generate_experience(batch["prompt"], batch["prompt_att_mask"], 0)
    assert out["input_ids"].shape[0] == 2
    # its loop's throughput line reads the generation's seconds
    assert trainer.generate_time == trainer.stats["generation_time"] >= 0.05
    assert (DeepSpeedRLHFEngine, DeepSpeedPPOTrainer, DeepSpeedPPOTrainerUnsupervised) == (
        dschat.DeepSpeedRLHFEngine, dschat.DeepSpeedPPOTrainer, dschat.DeepSpeedPPOTrainerUnsupervised)


def test_print_answers_prints_in_a_notebooks_loop_at_its_interval_and_in_step_3_once_per_iteration(trained, tmp_path,
                                                                                                    capsys):
    """DeepSpeed-Chat's generate_experience(prompts, mask, step) prints the first answer with --print_answers; a
    notebook's print_answers printed nothing (step 3's loop alone read it)."""
    engine, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, print_answers=True, print_answers_interval=2)
    batch = _prompt_batch(tokenizer, ["\n\nHuman: Say hi.\n\nAssistant:"] * 2)
    capsys.readouterr()
    for step in (0, 1, 2, None):
        trainer.generate_experience(batch["prompt"], batch["prompt_att_mask"], step)
    trainer.generate_experience(batch["prompt"], batch["prompt_att_mask"])  # (no step: no print)
    trainer.generate_experience(batch["prompt"], batch["prompt_att_mask"], 4, print_answer=False)  # (the caller's)
    printed = capsys.readouterr().out
    assert re.findall(r"\[step3\] step (\d+):\n  prompt: '.*Say hi.*'\n  answer: '", printed) == ["0", "2"]
    engine.release()
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "2", "--print_answers", "--generation_batches", "2"))
    assert capsys.readouterr().out.count("  prompt: ") == 2  # (per iteration, not per generation batch)


@pytest.mark.parametrize("hybrid", [False, True], ids=["hf_generate", "hybrid_engine"])
def test_generate_experience_takes_a_tokenizers_output_and_refuses_right_padding_or_no_mask(trained, tmp_path,
                                                                                          hybrid):
    from dschat.models.loading import load_tokenizer

    engine, trainer, left = _engine_and_trainer(trained, tmp_path, enable_hybrid_engine=hybrid)
    texts = ["\n\nHuman: Say hi.\n\nAssistant:", "\n\nHuman: List three colors please, thanks.\n\nAssistant:"]
    out = trainer.generate_experience(left(texts, return_tensors="pt", padding=True))
    assert out["input_ids"].shape[0] == 2 and torch.isfinite(out["rewards"]).all()
    right = load_tokenizer(str(trained / "sft"))(texts, return_tensors="pt", padding=True)  # right: the default
    with pytest.raises(ValueError, match=r"LEFT-padded, but row\(s\) \[0\].*padding_side='left'"):
        trainer.generate_experience(right)
    with pytest.raises(ValueError, match="LEFT-padded"):
        trainer.generate_experience(right["input_ids"], right["attention_mask"])
    with pytest.raises(ValueError, match="attention mask is missing; pass it as mask"):
        trainer.generate_experience(right["input_ids"])


def test_generate_experience_names_the_callers_right_padded_rows_under_answer_groups(trained, tmp_path):
    """With --n_samples_per_prompt 2 the refusal named the rows of the repeated batch ([0, 1] for the caller's row 0,
    [2, 3] for its row 1): the rows named are the caller's."""
    from dschat.models.loading import load_tokenizer

    _, trainer, _ = _engine_and_trainer(trained, tmp_path, advantage_estimator="grpo", n_samples_per_prompt=2)
    texts = ["\n\nHuman: List three colors please, thanks.\n\nAssistant:", "\n\nHuman: Say hi.\n\nAssistant:"]
    right = load_tokenizer(str(trained / "sft"))(texts, return_tensors="pt", padding=True)  # row 1 alone is padded
    with pytest.raises(ValueError, match=r"LEFT-padded, but row\(s\) \[1\] of"):
        trainer.generate_experience(right)


def test_notebook_train_rlhf_with_global_token_mean_counts_the_experiences_tokens(trained, tmp_path):
    """Step 3 sets each micro-batch's "num_tokens_global"; an experience from generate_experience has none."""
    from dschat.errors import UsageError

    engine, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, loss_agg="global_token_mean")
    out = trainer.generate_experience(_prompt_batch(tokenizer, ["\n\nHuman: Say hi.\n\nAssistant:"] * 2))
    spent = {k: v.clone() for k, v in out.items()}
    actor_loss, critic_loss = trainer.train_rlhf(out)
    assert torch.isfinite(actor_loss) and torch.isfinite(critic_loss)
    # (an engine that accumulates: which micro-batches share its step, only the caller knows)
    _, trainer, _ = _engine_and_trainer(trained, tmp_path, loss_agg="global_token_mean", gradient_accumulation_steps=2)
    with pytest.raises(UsageError, match=r"--gradient_accumulation_steps 2: .*num_tokens_global"):
        trainer.train_rlhf(spent)


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_a_hand_loops_answer_means_give_step_3s_gradient_or_say_why_not(monkeypatch, capsys, mode):
    """A notebook's own loop of train_rlhf per micro-batch (DeepSpeed-Chat's) took --loss_agg's answer means over each
    micro-batch alone, where step 3 divides by the optimizer step's answers on all ranks (num_seqs_global): on ranks
    holding unequal batches each answer of the smaller one weighed more. Now its divisor counts the micro-batch's
    answers on all ranks: the gradient DeepSpeed applies (1/accum per micro-batch, averaged over ranks) is step 3's and
    the unsplit batch's answer mean's, over ranks and micro-batches; where the micro-batches of one step hold unequal
    counts (which no divisor known at the first one's backward can mend) the loop is told once what to give."""
    from dschat.rlhf import trainer as trainer_module
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    agg_loss = trainer_module.algo.agg_loss

    def trainer_of(accum):
        trainer = DeepSpeedPPOTrainer.__new__(DeepSpeedPPOTrainer)
        trainer.args = step3_args({"loss_agg": mode, "gradient_accumulation_steps": accum, "max_answer_seq_len": 6})
        trainer.device = torch.device("cpu")
        return trainer

    torch.manual_seed(0)
    ranks = [[(torch.rand(rows, 6) > 0.3).float() for rows in micro_rows] for micro_rows in ([2], [4])]
    per_token = [[torch.randn(m.shape, requires_grad=True) for m in masks] for masks in ranks]
    other_ranks = [0]  # what the other simulated rank adds to a count summed over the ranks
    monkeypatch.setattr(trainer_module, "_summed_over_ranks", lambda count, device: count + other_ranks[0])

    def applied(aggs_of, accum):
        """Each simulated rank's per-token gradients as DeepSpeed applies them."""
        monkeypatch.setattr(trainer_module, "get_world_size", lambda: len(ranks))
        grads = []
        for rank, (masks, tokens) in enumerate(zip(ranks, per_token)):
            aggs = aggs_of(rank, masks)
            grads.append([torch.autograd.grad(agg_loss(t, m, **agg), t)[0] / (accum * len(ranks))
                          for t, m, agg in zip(tokens, masks, aggs)])
        return grads

    def hand_loop(rank, masks):
        trainer, aggs = trainer_of(1), []
        for index, mask in enumerate(masks):
            other_ranks[0] = ranks[1 - rank][index].shape[0]
            aggs.append(trainer._loss_agg({"action_mask": mask}))
        return aggs

    def step_3(rank, masks):
        trainer = trainer_of(1)
        other_ranks[0] = sum(m.shape[0] for m in ranks[1 - rank])
        counts = trainer._accumulation_group_counts([{"action_mask": m} for m in masks])
        return [trainer._loss_agg({"action_mask": m, **counts}) for m in masks]

    unsplit = torch.cat([t for tokens in per_token for t in tokens])
    whole = torch.autograd.grad(agg_loss(unsplit, torch.cat([m for masks in ranks for m in masks]),
                                         loss_agg=mode, max_length=6), unsplit)[0]
    for got, want in zip(applied(hand_loop, 1), applied(step_3, 1)):
        assert all(torch.allclose(g, w) for g, w in zip(got, want)), (got, want)
    assert torch.allclose(torch.cat([g for grads in applied(hand_loop, 1) for g in grads]), whole)

    # one rank, two micro-batches per optimizer step: as many answers in each is step 3's; unequal ones are said once
    monkeypatch.setattr(trainer_module, "get_world_size", lambda: 1)
    other_ranks[0] = 0
    trainer = trainer_of(2)
    masks = [(torch.rand(rows, 6) > 0.3).float() for rows in (2, 2, 2, 1, 3, 1)]
    counts = trainer_of(2)._accumulation_group_counts([{"action_mask": m} for m in masks[:2]])
    assert [trainer._loss_agg({"action_mask": m})["num_seqs_global"] for m in masks[:2]] == \
        [counts["num_seqs_global"]] * 2
    assert "train_rlhf" not in capsys.readouterr().out
    for mask in masks[2:]:
        trainer._loss_agg({"action_mask": mask})
    out = capsys.readouterr().out
    assert out.count("[step3] train_rlhf: the micro-batches of an optimizer step hold 2 + 1 answers") == 1, out
    assert "inputs['num_seqs_global'] = dschat.rlhf.trainer.global_row_count(" in out


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_loss_agg_sequence_means_reach_every_loss_of_the_ppo_step(trained, tmp_path, monkeypatch, mode):
    """--loss_agg's answer-level means (TRL's loss_type "grpo" and "dr_grpo"; the math: test_algorithms) are what
    the policy, value and KL losses aggregate with, Dr. GRPO's over --max_answer_seq_len."""
    from dschat.args import step3_parser
    from dschat.rlhf import trainer as trainer_module

    assert step3_parser().parse_args(["--loss_agg", mode]).loss_agg == mode
    seen = []
    agg_loss = trainer_module.algo.agg_loss
    monkeypatch.setattr(trainer_module.algo, "agg_loss", lambda per_token, mask, *args: seen.append(args) or
                        agg_loss(per_token, mask, *args))
    engine, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, loss_agg=mode, kl_in_reward=False)
    out = trainer.generate_experience(_prompt_batch(tokenizer, ["\n\nHuman: Say hi.\n\nAssistant:",
                                                                "\n\nHuman: Name a fruit.\n\nAssistant:"]))
    actor_loss, critic_loss = trainer.train_rlhf(out)
    assert torch.isfinite(actor_loss) and torch.isfinite(critic_loss)
    max_length = 10 if mode == "seq_mean_token_sum_norm" else None  # (_engine_and_trainer's --max_answer_seq_len)
    assert len(seen) == 3, seen  # policy, KL term, value
    assert all(args[0] == mode and args[4] == max_length for args in seen), seen


def test_step3_runs_and_reports_held_out_scores(trained, tmp_path):
    metrics = ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "2", "--enable_hybrid_engine"))
    assert metrics["iterations"] == 2
    for key in ("eval_before", "eval_after"):
        assert {"reward_mean", "rule_score_mean"} <= set(metrics[key])
    log = [json.loads(line) for line in (tmp_path / "ppo" / "step3_log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and {"reward", "kl", "actor_loss", "critic_loss", "samples_per_s"} <= set(log[0])
    assert (tmp_path / "ppo" / "actor" / "config.json").exists()
    assert (tmp_path / "ppo" / "critic" / "value_head.safetensors").exists()
    # the step-3 check, given only the models, scores the same held-out prompts the same way: it takes the data
    # flags, batch, prompt count and answer length from the run's training_args.json (PPO_FAST: 8 prompts of at
    # most 40 tokens, 12-token answers; the tool's own defaults are 64, 256 and 256)
    from dschat.tools import ppo_eval

    results = ppo_eval.main(["--policy", str(tmp_path / "ppo"), "--reward_model", str(trained / "rm")])
    assert results["policy"]["prompts"] == 8
    assert max(len(e["answer"].split()) for e in results["policy"]["examples"]) <= 12
    for key in ("reward_mean", "rule_score_mean"):
        assert results["policy"][key] == pytest.approx(metrics["eval_after"][key], abs=1e-4)
    # another batch size scores the same first 8 prompts (the last batch cut), not whole batches of 3 (9)
    rebatched = ppo_eval.main(["--policy", str(tmp_path / "ppo"), "--reward_model", str(trained / "rm"),
                               "--per_device_generation_batch_size", "3", "--num_examples", "8"])["policy"]
    assert rebatched["prompts"] == 8
    assert rebatched["rule_score_mean"] == pytest.approx(metrics["eval_after"]["rule_score_mean"], abs=1e-4)
    given = ppo_eval.parse_args(["--policy", str(tmp_path / "ppo"), "--reward_model", "x", "--num_prompts", "4"])
    assert (given.num_prompts, given.max_new_tokens, given.data_path) == (4, 12, ["tiny"])


def test_step3_and_a_released_notebook_engine_leave_their_engines_free_to_go(trained, tmp_path, monkeypatch):
    """DeepSpeed kept every ZeRO engine of a process that goes on (a notebook building another, pytest: a worker grew
    to 40 GB of ZeRO buckets). Step 3 releases its engines as it ends; a notebook's, at ``release()``; one whose
    later model fails to load, its earlier ones."""
    from dschat import DeepSpeedRLHFEngine

    made = engines_made(monkeypatch)
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "1", "--actor_zero_stage", "3",
                      "--critic_zero_stage", "2", "--enable_hybrid_engine"))
    assert len(made) == 4 and engines_alive(made) == 0  # actor, reference, critic, reward model
    zero = {"actor_zero_stage": 3, "critic_zero_stage": 2, "enable_hybrid_engine": True}
    engine, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, **zero)
    batch = _prompt_batch(tokenizer, ["\n\nHuman: Say hi.\n\nAssistant:"] * 4)
    trainer.train_rollout([trainer.generate_experience(batch)])
    engine.release()
    del engine, trainer
    assert len(made) == 8 and engines_alive(made) == 0
    monkeypatch.setattr(DeepSpeedRLHFEngine, "_init_reward", lambda self: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        _engine_and_trainer(trained, tmp_path, **zero)
    assert len(made) == 11 and engines_alive(made) == 0


def test_a_trainer_of_a_released_engine_lets_go_of_its_models_and_refuses_to_train(trained, tmp_path, monkeypatch):
    """A notebook's trainer held the engines itself (actor_model, ref_model, critic_model, reward_model, actor_ema):
    after engine.release() or the with block's end, its models and optimizer states stayed for as long as the
    ``trainer`` variable did, and a trainer used afterwards failed inside DeepSpeed's destroyed state. It reads them
    through its engine, which lets go of them at release: a trainer, or the engine, used afterwards says it was
    released."""
    import gc
    import weakref

    from dschat import DeepSpeedPPOTrainer
    from dschat.errors import UsageError

    made = engines_made(monkeypatch)
    engine, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, enable_hybrid_engine=True, enable_ema=True)
    batch = _prompt_batch(tokenizer, ["\n\nHuman: Say hi.\n\nAssistant:"] * 4)
    exp = trainer.generate_experience(batch)
    actor = weakref.ref(trainer.actor_model.module)
    with engine:
        pass
    gc.collect()
    assert actor() is None and len(made) == 5 and engines_alive(made) == 0  # actor, reference, EMA, critic, reward
    released = r"this DeepSpeedRLHFEngine was released \(release\(\), or the end of its with block\)"
    for use in (lambda: trainer.generate_experience(batch), lambda: trainer.train_rlhf(exp),
                lambda: trainer.train_rollout([exp]), lambda: engine.actor,
                lambda: DeepSpeedPPOTrainer(engine=engine)):
        with pytest.raises(UsageError, match=released):
            use()


def test_step3_with_fewer_prompts_than_one_iteration_is_an_error_not_a_run_that_trains_nothing(trained, tmp_path):
    with pytest.raises(ValueError, match=r"step3: \d+ training prompts make no iteration: one takes "
                                         r"--per_device_generation_batch_size 100000"):
        ppo.main(ppo_args(trained, tmp_path / "ppo", "--per_device_generation_batch_size", "100000"))
    assert not (tmp_path / "ppo" / "actor").exists()


def test_lora_actor_and_critic_with_ema(trained, tmp_path):
    metrics = ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "2", "--actor_lora_dim", "4",
                                "--critic_lora_dim", "4", "--enable_ema", "--ema_beta", "0.5",
                                "--enable_hybrid_engine"))
    assert metrics["iterations"] == 2
    from transformers import AutoModelForCausalLM

    ema = AutoModelForCausalLM.from_pretrained(tmp_path / "ppo" / "actor_ema").state_dict()
    sft_model = AutoModelForCausalLM.from_pretrained(trained / "sft").state_dict()
    actor = AutoModelForCausalLM.from_pretrained(tmp_path / "ppo" / "actor").state_dict()
    moved = [k for k in actor if not torch.equal(actor[k], sft_model[k])]
    assert moved, "LoRA training changed no merged weight"
    k = moved[0]
    # the EMA lies strictly between the SFT start and the trained actor for a weight that moved
    assert not torch.equal(ema[k], sft_model[k]) and not torch.equal(ema[k], actor[k])


def test_unsupervised_mixing_reports_its_loss(trained, tmp_path, capsys):
    from dschat.errors import UsageError

    text = tmp_path / "unsup.jsonl"
    text.write_text("".join(json.dumps({"text": f"plain text number {i} for language modelling."}) + "\n"
                            for i in range(64)))
    args = ppo_args(trained, tmp_path / "ppo", "--max_steps", "2", "--unsupervised_dataset_name", f"jsonl:{text}",
                    "--unsup_coef", "0.5", "--save_interval", "1")
    ppo.main(args)
    log = [json.loads(line) for line in (tmp_path / "ppo" / "step3_log.jsonl").read_text().splitlines()]
    assert all("unsup_loss" in r and r["unsup_loss"] > 0 for r in log)
    assert re.search(r"\[step3\] unsupervised data jsonl:.*: \d+ blocks of 52 tokens, \d+ batches per rank",
                     capsys.readouterr().out)
    # its checkpoints count unsupervised batches of this text: an edited file resumed at that count of other blocks
    # without a word (the prompt files were compared, this one not)
    recorded = json.loads((tmp_path / "ppo" / "training_args.json").read_text())["unsupervised_data"]
    assert list(recorded["files"]) == [str(text)] and recorded["hub"] == {}
    os.utime(text, (1, 1))  # new times, the same content: resumed
    assert ppo.main([*args, "--resume"])["iterations"] == 2
    with text.open("a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    with pytest.raises(UsageError, match=rf"saved with other settings: its unsupervised data changed since: {text}\. "
                                         rf".*without --resume"):
        ppo.main([*args, "--resume"])


def test_unsupervised_steps_follow_each_ppo_micro_batch_as_in_deepspeed_chat(trained, tmp_path, monkeypatch):
    from dschat.rlhf.trainer import DeepSpeedPPOTrainerUnsupervised

    text = tmp_path / "unsup.jsonl"
    text.write_text("".join(json.dumps({"text": f"plain text number {i} for language modelling."}) + "\n"
                            for i in range(64)))
    calls = []
    real_rlhf, real_unsup = DeepSpeedPPOTrainerUnsupervised._ppo_step, DeepSpeedPPOTrainerUnsupervised.train_unsupervised
    monkeypatch.setattr(DeepSpeedPPOTrainerUnsupervised, "_ppo_step",
                        lambda self, m, *rest: calls.append(("ppo", m["input_ids"].shape[0]))
                        or real_rlhf(self, m, *rest))
    monkeypatch.setattr(DeepSpeedPPOTrainerUnsupervised, "train_unsupervised", lambda self, b, coef: calls.append(
        ("lm", b["input_ids"].shape[0], b["input_ids"].data_ptr())) or real_unsup(self, b, coef))
    from dschat.rlhf import engine, trainer

    configs, real_init = [], engine.initialize_engine
    monkeypatch.setattr(engine, "initialize_engine",
                        lambda *a, **k: configs.append((a[1]["gradient_accumulation_steps"], a[7])) or real_init(*a, **k))
    boundaries, real_step = [], trainer.optimizer_step
    monkeypatch.setattr(trainer, "optimizer_step",
                        lambda engine_, name, skip=False: boundaries.append(name) if real_step(engine_, name, skip)
                        else None)
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "1", "--unsupervised_dataset_name", f"jsonl:{text}",
                      "--unsup_coef", "0.5", "--per_device_training_batch_size", "2", "--ppo_epochs", "2"))
    # 4 prompts, training batches of 2, 2 PPO epochs: each PPO micro-batch is followed by 2 rows of language modelling
    assert [c[:2] for c in calls] == [("ppo", 2), ("lm", 2)] * 4
    # DeepSpeed-Chat's structure: a PPO micro-step and its language-model micro-step make one actor step, so the actor
    # steps as often as the critic, on the same schedule (4 steps: 2 micro-batches x 2 PPO epochs)
    assert configs == [(2, 4), (1, 4)]
    assert boundaries.count("actor") == boundaries.count("critic") == 4
    slices = [c[2] for c in calls if c[0] == "lm"]
    assert slices[0] != slices[1] and slices[:2] == slices[2:]  # the two halves of one batch, again in epoch 2
    # with accumulation over 2 PPO micro-batches: the actor's window holds both pairs, both models step once per 2 micro-batches
    configs.clear(), boundaries.clear()
    ppo.main(ppo_args(trained, tmp_path / "ppo2", "--max_steps", "1", "--unsupervised_dataset_name", f"jsonl:{text}",
                      "--unsup_coef", "0.5", "--per_device_training_batch_size", "2", "--ppo_epochs", "2",
                      "--gradient_accumulation_steps", "2"))
    assert configs == [(4, 2), (2, 2)]
    assert boundaries.count("actor") == boundaries.count("critic") == 2
    # --n_samples_per_prompt 2: twice the PPO micro-batches, each followed by blocks of its own (one batch was cycled,
    # each block trained twice per PPO epoch)
    calls.clear()
    ppo.main(ppo_args(trained, tmp_path / "ppo3", "--max_steps", "1", "--unsupervised_dataset_name", f"jsonl:{text}",
                      "--unsup_coef", "0.5", "--per_device_training_batch_size", "2", "--ppo_epochs", "2",
                      "--n_samples_per_prompt", "2", "--advantage_estimator", "grpo"))
    assert [c[:2] for c in calls] == [("ppo", 2), ("lm", 2)] * 8
    slices = [c[2] for c in calls if c[0] == "lm"]
    assert len(set(slices[:4])) == 4 and slices[:4] == slices[4:]  # 4 slices of 2 batches, again in epoch 2


def test_ptx_actors_tensorboard_samples_count_the_ppo_samples_as_the_critics_do(trained, tmp_path):
    """PPO-ptx doubles the actor's train_batch_size (a PPO micro-step and its language-model micro-step accumulate
    into one step), and DeepSpeed's sample count, its Train/Samples axis, counted both: the actor's learning rate
    was drawn at 8, 16 where the critic's, after the same steps on the same 4 answers each, was at 4, 8."""
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "2", "--unsupervised_dataset_name", "tiny",
                      "--enable_tensorboard", "--tensorboard_path", str(tmp_path / "tb")))
    steps = {role: _deepspeed_lr_steps(tmp_path / "tb", role) for role in ("actor", "critic")}
    assert steps == {"actor": [4, 8], "critic": [4, 8]}, steps


def test_resumed_run_matches_uninterrupted_run(trained, tmp_path, capsys):
    # dropout draws from torch's global RNG even where the hybrid engine samples with its own generator
    common = ["--enable_hybrid_engine", "--save_interval", "2", "--actor_dropout", "0.1", "--critic_dropout", "0.1"]
    ppo.main(ppo_args(trained, tmp_path / "full", "--max_steps", "4", "--resume", "--test_stop_step", "2",
                      *common))  # nothing to resume; and no test mode, so --test_stop_step stops nothing (said)
    out = capsys.readouterr().out
    assert "--resume: no complete checkpoint in" in out
    assert "--test_stop_step 2 has no effect without --enable_test_mode" in out
    # stopped after iteration 3, one past the last checkpoint: its log line is dropped and iteration 3 runs again
    ppo.main(ppo_args(trained, tmp_path / "split", "--max_steps", "4", "--enable_test_mode", "--test_stop_step", "3",
                      *common))
    log = tmp_path / "split" / "step3_log.jsonl"
    assert len(log.read_text().splitlines()) == 3
    log.write_text(log.read_text() + '{"iteration": 4, "rew')  # a line cut off when the run was killed
    # the step's seconds count every process that ran it: the checkpoint's (made large here) and the resumed one's
    state_file = tmp_path / "split" / "checkpoints" / "trainer" / "iter_0000002" / "state.json"
    state = json.loads(state_file.read_text())
    assert state["seconds"] > 0 and state["total"] == 4  # (a resume of another length says so)
    state_file.write_text(json.dumps({**state, "seconds": 1000.0}))
    assert ppo.main(ppo_args(trained, tmp_path / "split", "--max_steps", "4", "--resume", *common))["seconds"] > 1000
    full = [json.loads(x) for x in (tmp_path / "full" / "step3_log.jsonl").read_text().splitlines()]
    split = [json.loads(x) for x in (tmp_path / "split" / "step3_log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in split] == [r["iteration"] for r in full] == [1, 2, 3, 4]
    for a, b in zip(full[2:], split[2:]):
        for key in ("reward", "kl", "actor_loss", "critic_loss", "answer_length"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def _record_fp16_steps(monkeypatch):
    """{"actor"/"critic": [(applied, skipped steps, loss scaler state) after each of its optimizer steps]}."""
    import deepspeed

    steps, real_step = {"actor": [], "critic": []}, deepspeed.DeepSpeedEngine.step

    def recorded(engine, *args, **kwargs):
        result = real_step(engine, *args, **kwargs)
        scaler = engine.optimizer.loss_scaler
        steps["critic" if hasattr(engine.module, "v_head") else "actor"].append(
            (engine.was_step_applied(), engine.skipped_steps,
             (scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis)))
        return result

    monkeypatch.setattr(deepspeed.DeepSpeedEngine, "step", recorded)
    return steps


def test_fp16_overflows_skip_both_models_and_a_resume_keeps_the_loss_scalers(trained, tmp_path, monkeypatch, capsys):
    """Step 3 in fp16 (DeepSpeed's CPU accelerator trains it on CPUs with AVX512-FP16 or AMX-FP16) at ZeRO-2: the
    critic's gradients overflow at the default scale (2**16) from iteration 2 on, --align_overflow skips the actor's
    steps with them, and a run resumed from iteration 2's checkpoint goes on with the loss scalers it had (the scale,
    hysteresis and last overflow the overflows left), as the uninterrupted run does."""
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        pytest.skip(f"DeepSpeed's {get_accelerator().device_name()} accelerator cannot train in fp16 (a CPU needs "
                    "AVX512-FP16 or AMX-FP16)")
    common = ["--dtype", "fp16", "--align_overflow", "--actor_zero_stage", "2", "--critic_zero_stage", "2",
              "--max_steps", "3", "--save_interval", "1"]
    steps = _record_fp16_steps(monkeypatch)
    ppo.main(ppo_args(trained, tmp_path / "full", *common))
    full = {name: list(records) for name, records in steps.items()}
    assert [applied for applied, *_ in full["critic"]] == [True, False, False], "the premise: the critic overflows"
    out = capsys.readouterr().out
    assert "OVERFLOW: critic overflow, skipping both actor and critic steps" in out
    # each iteration's skipped steps, logged and said (the loss scaler's own skips print nothing)
    logged = [json.loads(line) for line in (tmp_path / "full" / "step3_log.jsonl").read_text().splitlines()]
    assert [(r["actor_skipped_steps"], r["critic_skipped_steps"]) for r in logged] == [(0, 0), (1, 1), (1, 1)]
    assert out.count("(optimizer steps skipped on inf/NaN gradients: actor 1 of 1, critic 1 of 1)") == 2
    for role in ("actor", "critic"):  # 2 of 3 skipped: the warning of steps 1 and 2, with the model's flag
        assert f"warning: [step3 {role}] DeepSpeed skipped 2 of the run's 3 optimizer steps on inf/NaN gradients: " \
               f"it applied only 1 of them. fp16's loss scaler skips each step whose scaled gradients overflow, and " \
               f"lowers its scale: lower --{role}_learning_rate" in out
    for actor, critic in zip(full["actor"], full["critic"]):
        assert actor[:2] == critic[:2], "both models step, or skip, together"
    assert full["critic"][1][2] != full["critic"][0][2] != full["critic"][2][2], "each overflow moved the scaler"
    ppo.main(ppo_args(trained, tmp_path / "split", *common, "--enable_test_mode", "--test_stop_step", "2"))
    for records in steps.values():
        records.clear()
    ppo.main(ppo_args(trained, tmp_path / "split", *common, "--resume"))
    assert steps == {name: records[2:] for name, records in full.items()}, "iteration 3 as in the uninterrupted run"
    logs = [[json.loads(line) for line in (tmp_path / run / "step3_log.jsonl").read_text().splitlines()]
            for run in ("full", "split")]
    for key in ("reward", "kl", "actor_loss", "critic_loss"):
        assert logs[1][2][key] == pytest.approx(logs[0][2][key], rel=1e-4, abs=1e-6), key


def test_a_resume_whose_iterations_take_other_step_counts_ends_its_schedules_at_their_end(trained, tmp_path,
                                                                                       monkeypatch, capsys):
    """A checkpoint after 1 of 3 iterations of 2 PPO epochs (schedules of 6 steps, 2 taken), resumed with 1 PPO epoch
    (schedules of 3 steps): the schedulers are moved to step 1 of 3, so the last iteration applies a third of the rate
    (restored at step 2, they reached the linear schedule's end, 0, before the last iteration)."""
    from dschat.rlhf import trainer

    common = ["--max_steps", "3", "--save_interval", "1", "--lr_scheduler_type", "linear"]
    ppo.main(ppo_args(trained, tmp_path / "ppo", *common, "--ppo_epochs", "2", "--enable_test_mode",
                      "--test_stop_step", "1"))
    applied, real_step = [], trainer.optimizer_step
    monkeypatch.setattr(trainer, "optimizer_step", lambda engine, name, skip=False:
                        applied.append((name, engine.get_lr()[0])) or real_step(engine, name, skip))
    ppo.main(ppo_args(trained, tmp_path / "ppo", *common, "--ppo_epochs", "1", "--resume"))
    for name in ("actor", "critic"):
        assert [lr for model, lr in applied if model == name] == [pytest.approx(2e-4 / 3), pytest.approx(1e-4 / 3)]
    assert "an iteration of this run takes 1 optimizer steps, its checkpoint's run's 2" in capsys.readouterr().out


def test_a_resume_whose_iterations_count_other_prompts_is_refused_naming_the_flag(trained, tmp_path, capsys):
    """A checkpoint after iteration 1 of --generation_batches 2 (its place: batch 2 of the epoch) resumed with 1 went
    on as iteration 2 from batch 2, an iteration count behind its prompts: its schedules, sized for twice the
    iterations, never reached their end, and resumed with more batches an iteration, the run stopped before the
    epoch's last prompts."""
    from dschat.errors import UsageError

    common = ["--max_steps", "2", "--save_interval", "1"]
    ppo.main(ppo_args(trained, tmp_path / "ppo", *common, "--generation_batches", "2", "--enable_test_mode",
                      "--test_stop_step", "1"))
    with pytest.raises(UsageError, match=r"iter_0000001 in .* is at iteration 1, and its place in the prompts "
                                         r"\(epoch 1's generation batch 2 on each rank\) is iteration 2 of this run: "
                                         r"its iterations took --generation_batches 2, this run's 1\..*resume with "
                                         r"--generation_batches 2$"):
        ppo.main(ppo_args(trained, tmp_path / "ppo", *common, "--generation_batches", "1", "--resume"))
    capsys.readouterr()
    ppo.main(ppo_args(trained, tmp_path / "ppo", *common, "--generation_batches", "2", "--resume"))
    assert "resumed from iteration 1" in capsys.readouterr().out


def test_a_resume_with_another_actor_tokenizer_than_the_checkpoints_is_refused_naming_both(trained, tmp_path):
    """The actor's folder gives step 3 its tokenizer again on --resume (its weights come from the checkpoint); one
    whose tokenizer was replaced since (the same step-1 run id, so the actor check passed) resumed silently, its
    prompts tokenized otherwise than the checkpoint's actor and critic were trained on. Refused, naming both."""
    from dschat.errors import UsageError
    from dschat.models.loading import load_tokenizer

    shutil.copytree(trained / "sft", tmp_path / "sft")
    flags = [*ppo_args(trained, tmp_path / "ppo", "--max_steps", "2", "--save_interval", "1"),
             "--actor_model_name_or_path", str(tmp_path / "sft")]
    ppo.main([*flags, "--enable_test_mode", "--test_stop_step", "1"])
    tokenizer = load_tokenizer(str(tmp_path / "sft"))
    tokenizer.pad_token = "<unk>"  # (the prompts' left padding: the format the reward model scores stays the same)
    tokenizer.save_pretrained(str(tmp_path / "sft"))
    with pytest.raises(UsageError, match=r"--resume: checkpoint iter_0000001 in .*ppo/checkpoints was trained with "
                                         r"another tokenizer than --actor_model_name_or_path .*sft holds now: \d+ "
                                         r"tokens \(.*pad '<pad>'.*\) then, \d+ tokens \(.*pad '<unk>'"):
        ppo.main([*flags, "--resume"])


def test_a_refused_iteration_count_of_a_checkpoint_without_its_batches_names_the_flag_that_fits(distributed):
    """A checkpoint saved before step 3 recorded its batch sizes, at another --generation_batches on as many ranks, was
    refused saying "its iterations took --generation_batches of the checkpoint's run ... resume with
    --generation_batches of the checkpoint's run": the count that puts it at its iteration is named instead (9
    generation batches an epoch: batch 2 is iteration 1 with 2 an iteration alone), or the counts that do."""
    from types import SimpleNamespace

    from dschat.errors import UsageError
    from dschat.rlhf.checkpointing import check_iteration_count

    args = SimpleNamespace(generation_batches=1)
    with pytest.raises(UsageError, match=r"is at iteration 1, and its place in the prompts \(epoch 1's generation "
                                         r"batch 2 on each rank\) is iteration 2 of this run: its iterations took "
                                         r"another --generation_batches than this run's 1 \(the checkpoint, saved "
                                         r"before step 3 recorded its batch sizes, does not say which\)\. .*: resume "
                                         r"with --generation_batches 2, the one that puts it at iteration 1$"):
        check_iteration_count({"iteration": 1, "epoch": 0, "batch": 2}, 1, 9, args, "x")
    # the end of epoch 1 is iteration 1 with 5 to 9 batches an iteration
    with pytest.raises(UsageError, match=r"resume with the --generation_batches its run was given \(5 or 6 or 7 or 8 "
                                         r"or 9 put it at iteration 1\)$"):
        check_iteration_count({"iteration": 1, "epoch": 0, "batch": 9}, 1, 9, args, "x")
    with pytest.raises(UsageError, match=r"\. .*: resume with the --generation_batches its run was given$"):
        check_iteration_count({"iteration": 7, "epoch": 0, "batch": 3}, 1, 9, args, "x")  # (no count fits)


def test_a_notebooks_resume_checks_the_iteration_count_as_step_3s_does(tmp_path):
    """A notebook resuming step 3's checkpoint with ``load_checkpoint(trainer, root)`` (no plan: step 3's entry point
    alone makes one) was never checked for its iteration count: a checkpoint of --generation_batches 1 (iteration 1,
    batch 1) resumed with 2 loaded, half an iteration into its prompts. Given the prompts' loader, it is checked as
    ``plan_resume`` checks step 3's, before DeepSpeed loads anything."""
    from dschat.errors import UsageError
    from dschat.rlhf.checkpointing import load_checkpoint

    _save_flags_checkpoint(tmp_path)
    loader = type("Loader", (), {"dataset": range(36), "__len__": lambda self: 9})()
    with pytest.raises(UsageError, match=r"iter_0000001 in .* is at iteration 1, and its place in the prompts \(epoch "
                                         r"1's generation batch 1 on each rank\) is within an iteration of this run: "
                                         r"its iterations took --generation_batches 1, this run's 2\..*resume with "
                                         r"--generation_batches 1$"):
        load_checkpoint(_flags_trainer(tmp_path, "--generation_batches", "2"), str(tmp_path), train_loader=loader)
    with pytest.raises(Loaded, match="loaded"):  # the checkpoint's count: the checks pass and DeepSpeed loads
        load_checkpoint(_flags_trainer(tmp_path), str(tmp_path), train_loader=loader)


def test_a_notebook_loads_a_checkpoint_step_3_saved(tmp_path):
    """``load_checkpoint(trainer, "<output_dir>/checkpoints", train_loader=prompt_dataloader)`` of a checkpoint step 3
    saved (its prompts read through its own settings, ``prompt_loaders``' ``take_data_files``) was refused: "saved with
    other settings: --data_files_flags ['data_path'] -> ['data_path', 'sft_only_data_path']": the notebook's engine and
    trainer complete their settings apart from the copy its prompt_loaders read, and so counted step 1's
    --sft_only_data_path among the data flags step 3 reads. Step 3's settings name the one it reads from the start."""
    from dschat.rlhf.checkpointing import load_checkpoint, save_checkpoint
    from dschat.steps.common import take_data_files

    saving = _flags_trainer(tmp_path)
    take_data_files(saving.args, 3)  # (step 3's run: prompt_loaders on the settings its engine is built from)
    save_checkpoint(saving, str(tmp_path), {"iteration": 1, "epoch": 0, "batch": 1, "unsup_batches": 0})
    with pytest.raises(Loaded, match="loaded"):  # a notebook's trainer, its settings never taken: the checks pass
        load_checkpoint(_flags_trainer(tmp_path), str(tmp_path))


def test_a_notebooks_resume_without_the_prompts_loader_refuses_another_generation_batches(tmp_path):
    """Without ``train_loader=`` the iteration count was not checked at all: a checkpoint of --generation_batches 1
    resumed with 2 loaded, half an iteration into its prompts. The count cannot be known without the loader's batches,
    so another --generation_batches than the checkpoint's is refused, saying how to have it checked; the checkpoint's
    own loads as before."""
    from dschat.errors import UsageError
    from dschat.rlhf.checkpointing import load_checkpoint

    _save_flags_checkpoint(tmp_path)
    # (a notebook's call, which gave no --resume: the message said "--resume: ..., or resume with --generation_batches")
    with pytest.raises(UsageError, match=r"^load_checkpoint: checkpoint iter_0000001 in .* is at iteration 1 of "
                                         r"iterations of generation_batches 1, this trainer's take 2: "
                                         r".*\(train_loader=None\); pass train_loader=<the prompts' loader> to have it "
                                         r"checked, or load it into a trainer of generation_batches 1$"):
        load_checkpoint(_flags_trainer(tmp_path, "--generation_batches", "2"), str(tmp_path))
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path), str(tmp_path))


def test_a_notebook_loading_from_step_3s_output_dir_is_pointed_to_its_checkpoints_folder(tmp_path):
    """``load_checkpoint(trainer, "<output_dir>")`` where step 3 saved into ``<output_dir>/checkpoints`` returned None,
    as for a run with no checkpoint yet: the notebook went on training afresh from the SFT model, without a word."""
    from dschat.errors import UsageError
    from dschat.rlhf.checkpointing import load_checkpoint

    _save_flags_checkpoint(tmp_path / "checkpoints")
    inner = str(tmp_path / "checkpoints")
    with pytest.raises(UsageError, match=f"{tmp_path} holds no checkpoint; its checkpoints folder does .*give "
                                         f"load_checkpoint\\(trainer, '{inner}'\\)"):
        load_checkpoint(_flags_trainer(tmp_path), str(tmp_path))
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path), inner)
    assert load_checkpoint(_flags_trainer(tmp_path), str(tmp_path / "new")) is None  # (no checkpoint yet: none)


def test_a_resume_on_other_ranks_whose_epochs_make_other_iteration_counts_is_refused(distributed):
    """39 prompts in iterations of 8 (batches of 4 x 1 on 2 ranks, of 4 x 2 on 1): DistributedSampler pads them to 40
    on 2 ranks, 5 iterations an epoch, and 1 rank makes 4; resumed at the end of epoch 1, iteration 5 would have been
    this run's iteration 4 (its schedules spanned 4 an epoch, and it stopped 1 iteration before the end
    of the next epoch). Within the first epoch the counts agree."""
    from types import SimpleNamespace

    from dschat.errors import UsageError
    from dschat.rlhf.checkpointing import check_iteration_count

    args = SimpleNamespace(generation_batches=2)
    batches = {"per_device_generation_batch_size": 4, "generation_batches": 1}
    with pytest.raises(UsageError, match=r"is at iteration 5, and its place in the prompts \(the end of epoch 1 on "
                                         r"each rank\) is iteration 4 of this run: an epoch of its 2 rank\(s\) made "
                                         r"another number .*: resume on 2 rank\(s\)$"):
        check_iteration_count({"iteration": 5, "epoch": 0, "batch": 10, "batches": batches}, 2, 9, args, "x")
    check_iteration_count({"iteration": 3, "epoch": 0, "batch": 6, "batches": batches}, 2, 9, args, "x")


def test_the_score_before_ppo_is_kept_across_resumes_by_the_same_function():
    """A checkpoint from before the function's identity was kept: its score is taken, and the resumed run's identity
    saved with its next checkpoints (it was saved as None, and the next resume left the score out as another
    function's); "tiny" and its module path are one function; a notebook's function cannot be compared."""
    from types import SimpleNamespace

    before = {"reward_fn_mean": 0.5, "examples": [{"reward_fn": 0.5}]}
    tiny = SimpleNamespace(reward_fn="tiny")
    resumed = ppo.before_scored_alike({"eval_before": before}, tiny)
    assert resumed["eval_before"] == before and resumed["eval_reward_fn"] == ppo.reward_fn_identity(tiny)
    again = ppo.before_scored_alike(resumed, SimpleNamespace(reward_fn="dschat.tiny.scorer:score_batch"))
    assert again["eval_before"]["reward_fn_mean"] == 0.5

    def notebook_score(prompts, answers):
        return [0.0] * len(answers)

    assert ppo.reward_fn_identity(SimpleNamespace(reward_fn=notebook_score)) == "unknown"
    kept = ppo.before_scored_alike(resumed, SimpleNamespace(reward_fn=notebook_score))
    assert kept["eval_before"]["reward_fn_mean"] == 0.5


def test_a_resume_scored_by_another_reward_model_is_said_and_leaves_its_score_before_ppo_out(tmp_path, capsys):
    """A --resume with another reward model folder trained the rest of the run on its rewards without a word, and the
    held-out reward_mean before PPO (the checkpoint run's model's) was set beside this run's after PPO."""
    from dschat.steps.common import model_identity

    models = {}
    for name in ("rm_a", "rm_b"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "name": name}))
        (folder / "model.safetensors").write_bytes(name.encode() * 8)
        models[name] = str(folder)
    before = {"reward_mean": 1.5, "rule_score_mean": 0.5, "examples": [{"reward": 1.5, "rule_score": 0.5}]}
    position = {"eval_before": before, "inputs": {models["rm_a"]: model_identity(models["rm_a"])}}
    assert ppo.reward_model_scored_alike(position, models["rm_a"]) == position
    assert ppo.reward_model_scored_alike(position, "org/hub-model") == position  # (not compared)
    assert ppo.reward_model_scored_alike(position, None) == position  # (--reward_model_weight 0: none scores)
    assert "reward model" not in capsys.readouterr().out
    other = ppo.reward_model_scored_alike(position, models["rm_b"])
    assert other["eval_before"]["reward_mean"] is None and other["eval_before"]["rule_score_mean"] == 0.5
    assert other["eval_before"]["examples"] == [{"rule_score": 0.5}]
    said = capsys.readouterr().out
    assert f"the reward model {models['rm_b']} is none of the models the checkpoint's run loaded" in said
    assert "reward_mean before PPO (the other model's) is left out" in said
    unscored = {**position, "eval_before": None}  # (no held-out evaluation before PPO: no score to leave out)
    assert ppo.reward_model_scored_alike(unscored, models["rm_b"]) == unscored
    said = capsys.readouterr().out
    assert "rewards train the rest of the run\n" in said and "left out" not in said, said


def test_a_resume_with_another_reward_function_leaves_its_score_before_ppo_out(trained, tmp_path, capsys):
    """The held-out reward_fn_mean before PPO came from the checkpoint, scored by the interrupted run's function: it
    was reported beside the resumed run's score after PPO, by another function, as if comparable."""
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text("def score(prompts, answers):\n    return [5.0] * len(answers)\n")
    second.write_text("def score(prompts, answers):\n    return [1.0] * len(answers)\n")
    grpo = ["--advantage_estimator", "grpo", "--n_samples_per_prompt", "2", "--reward_model_weight", "0",
            "--save_interval", "1"]
    out = tmp_path / "ppo"
    assert ppo.main(ppo_args(trained, out, *grpo, "--reward_fn", f"{first}:score", "--max_steps", "1"))[
        "eval_before"]["reward_fn_mean"] == 5.0
    same = ppo.main(ppo_args(trained, out, *grpo, "--reward_fn", f"{first}:score", "--max_steps", "2", "--resume"))
    assert same["eval_before"]["reward_fn_mean"] == 5.0 and "left out" not in capsys.readouterr().out
    metrics = ppo.main(ppo_args(trained, out, *grpo, "--reward_fn", f"{second}:score", "--max_steps", "3",
                                "--resume"))
    assert metrics["eval_before"]["reward_fn_mean"] is None and metrics["eval_after"]["reward_fn_mean"] == 1.0
    assert all("reward_fn" not in example for example in metrics["eval_before"]["examples"])
    assert "[step3] the held-out reward_fn_mean before PPO was scored by the checkpoint's run's reward function" in \
        capsys.readouterr().out


def test_a_resumed_runs_tensorboard_curves_hold_each_iteration_once(trained, tmp_path):
    """The interrupted run's events of the iterations after its last checkpoint stayed beside the ones the resumed run
    logs for them again: TensorBoard drew two points per such iteration (the jsonl log drops its copies)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    common = ["--save_interval", "2", "--max_steps", "4", "--enable_tensorboard", "--tensorboard_path",
              str(tmp_path / "tb")]
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--enable_test_mode", "--test_stop_step", "3", *common))
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--resume", *common))
    events = EventAccumulator(str(tmp_path / "tb" / "step3"))
    events.Reload()
    assert [e.step for e in events.Scalars("step3/reward")] == [1, 2, 3, 4]
    # DeepSpeed's own writer (its monitor, at sample counts) too: each iteration's learning rate once, the
    # checkpoint's own (iteration 2's, at its sample count) kept
    resumed = _deepspeed_lr_steps(tmp_path / "tb")
    assert len(resumed) == 4 and resumed == sorted(set(resumed)), resumed
    # a fresh run into the same folder: the earlier run's curves end where the new one begins
    ppo.main(ppo_args(trained, tmp_path / "ppo", *common, "--max_steps", "2"))
    events = EventAccumulator(str(tmp_path / "tb" / "step3"))
    events.Reload()
    assert [e.step for e in events.Scalars("step3/reward")] == [1, 2]
    fresh = _deepspeed_lr_steps(tmp_path / "tb")
    assert len(fresh) == 2 and fresh == sorted(set(fresh)) and fresh[0] == resumed[0], (fresh, resumed)


def _deepspeed_lr_steps(tb_path, role="actor"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_path / "ds_tensorboard_logs" / f"step3_{role}_tensorboard"))
    events.Reload()
    return [e.step for e in events.Scalars("Train/Samples/lr")]


def test_step3_hands_its_engines_to_the_save_helpers(trained, tmp_path, monkeypatch):
    """Under ZeRO-3 only an engine can release the parameters its last evaluation left prefetched
    (checkpoint.settled_module); given the bare module, the save's gather failed on a GPU."""
    from dschat.hybrid_engine import HybridEngine
    from dschat.models import checkpoint
    from deepspeed import DeepSpeedEngine

    given, real = [], checkpoint.settled_module
    monkeypatch.setattr(checkpoint, "settled_module", lambda model: given.append(type(model)) or real(model))
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "1", "--enable_ema"))
    # each of the three saves (actor, critic, EMA) is handed an engine, then gathers from its model
    assert sum(issubclass(t, (DeepSpeedEngine, HybridEngine)) for t in given) == 3, given


def test_step3_removes_the_critic_and_ema_actor_an_earlier_run_left_in_its_folder(tmp_path, monkeypatch, capsys):
    """A run without EMA (or without a critic: GRPO) into a folder where an earlier run saved them: kept, they would
    sit beside this run's actor as if this run had written them."""
    from types import SimpleNamespace

    saved = []
    monkeypatch.setattr(ppo, "save_causal_lm", lambda engine, tokenizer, path: saved.append((engine, path)))
    monkeypatch.setattr(ppo, "save_reward_model", lambda engine, tokenizer, path: saved.append((engine, path)))
    for folder in ("actor", "critic", "actor_ema"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text("{}")
    args = SimpleNamespace(output_dir=str(tmp_path))
    ppo.save_models(SimpleNamespace(actor_model="actor", critic_model="critic", actor_ema=None, tokenizer=None), args)
    assert saved == [("actor", str(tmp_path / "actor")), ("critic", str(tmp_path / "critic"))]
    assert not (tmp_path / "actor_ema").exists() and (tmp_path / "critic").exists()
    assert "removed " + str(tmp_path / "actor_ema") in capsys.readouterr().out
    ppo.save_models(SimpleNamespace(actor_model="actor", critic_model=None, actor_ema=None, tokenizer=None), args)
    assert not (tmp_path / "critic").exists() and (tmp_path / "actor").exists()
    # a folder this run loaded a model from stays (GRPO's reward model may default to the critic's path)
    (tmp_path / "critic").mkdir()
    loaded = SimpleNamespace(output_dir=str(tmp_path), reward_model_name_or_path=str(tmp_path / "critic"))
    ppo.save_models(SimpleNamespace(actor_model="actor", critic_model=None, actor_ema=None, tokenizer=None), loaded)
    assert (tmp_path / "critic").is_dir()


def test_every_rank_waits_for_rank_0_to_remove_an_earlier_model_even_where_it_sees_none(tmp_path, monkeypatch,
                                                                                         capsys):
    """Rank 0 removes; another rank that looked after the removal (or on node-local storage, never sees the folder)
    skipped the barrier, and its next collective met rank 0's barrier: a hang or a crash."""
    from types import SimpleNamespace

    waits = []
    monkeypatch.setattr(ppo, "save_causal_lm", lambda *given: None)
    monkeypatch.setattr(ppo, "is_rank_0", lambda: False)
    monkeypatch.setattr(ppo, "barrier", lambda: waits.append(1))
    (tmp_path / "actor_ema").mkdir()  # seen by this rank too: still rank 0's to remove
    ppo.save_models(SimpleNamespace(actor_model="actor", critic_model=None, actor_ema=None, tokenizer=None),
                    SimpleNamespace(output_dir=str(tmp_path)))
    assert len(waits) == 2 and (tmp_path / "actor_ema").is_dir()
    # rank 0 failing to remove it says so and still reaches the barrier
    monkeypatch.setattr(ppo, "is_rank_0", lambda: True)
    monkeypatch.setattr("shutil.rmtree", lambda path: (_ for _ in ()).throw(PermissionError("read-only")))
    ppo.save_models(SimpleNamespace(actor_model="actor", critic_model=None, actor_ema=None, tokenizer=None),
                    SimpleNamespace(output_dir=str(tmp_path)))
    assert len(waits) == 4 and "removing it failed (read-only)" in capsys.readouterr().out


class Loaded(Exception):
    """Raised by a test's engine where DeepSpeed would load a checkpoint: the checks let the run resume."""


def _saved_checkpoint(root, ranks=1, critic=True, ema=False):
    """The files ``save_checkpoint`` leaves for tag iter_0000002 (contents beside the point)."""
    from dschat.utils.checkpoints import LATEST

    tag = "iter_0000002"
    state = root / "trainer" / tag
    state.mkdir(parents=True)
    (state / "state.json").write_text(json.dumps({"iteration": 2, "epoch": 0, "batch": 2}))
    for rank in range(ranks):
        (state / f"rng_rank{rank}.pt").write_bytes(b"")
    if ema:
        (state / "ema.pt").write_bytes(b"")
    for model in ("actor", "critic") if critic else ("actor",):
        (root / model / tag).mkdir(parents=True)
        (root / model / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (root / LATEST).write_text(json.dumps({"tag": tag}))


@pytest.mark.parametrize("saved, resumed, message", [
    ({"ema": False}, {"ema": True}, r"has no EMA copy .*--enable_ema"),
    ({"ranks": 2, "ema": True}, {"ema": True}, r"saved by 2 rank\(s\), this run has 1.*resume on 2 rank"),
    ({"critic": False}, {"critic": True}, r"has no critic .*--advantage_estimator"),
])
def test_resume_from_a_checkpoint_of_another_setup_is_a_usage_error_before_deepspeed_loads(tmp_path, saved, resumed,
                                                                                         message):
    """A checkpoint saved without EMA resumed with --enable_ema was a FileNotFoundError traceback on rank 0 while the
    other ranks waited in a gather; another rank count or a critic the checkpoint lacks were DeepSpeed tracebacks."""
    from types import SimpleNamespace

    from dschat.errors import UsageError
    from dschat.rlhf.checkpointing import load_checkpoint

    class NotLoaded:
        def load_checkpoint(self, *args, **kwargs):
            raise Loaded("the checks must come before DeepSpeed loads anything")

    _saved_checkpoint(tmp_path, **saved)
    trainer = SimpleNamespace(actor_model=NotLoaded(), critic_model=NotLoaded() if resumed.get("critic", True) else None,
                              actor_ema=SimpleNamespace() if resumed.get("ema") else None)
    with pytest.raises(UsageError, match=message):
        load_checkpoint(trainer, str(tmp_path))
    # the same checkpoint resumed by a run set up as the one that saved it passes the checks
    same = SimpleNamespace(actor_model=NotLoaded(), critic_model=NotLoaded() if saved.get("critic", True) else None,
                           actor_ema=SimpleNamespace() if saved.get("ema") else None)
    if saved.get("ranks", 1) == 1:
        with pytest.raises(Loaded, match="before DeepSpeed loads"):
            load_checkpoint(same, str(tmp_path))


@pytest.mark.parametrize("part", ["actor", "trainer"])
def test_resume_with_a_checkpoint_folder_missing_names_the_folder(tmp_path, part):
    """``latest`` naming a tag whose trainer folder was gone was a FileNotFoundError traceback from os.listdir."""
    import shutil
    from types import SimpleNamespace

    from dschat.errors import UsageError
    from dschat.rlhf.checkpointing import load_checkpoint

    _saved_checkpoint(tmp_path, critic=False)
    shutil.rmtree(tmp_path / part / "iter_0000002")
    trainer = SimpleNamespace(actor_model=None, critic_model=None, actor_ema=None)
    with pytest.raises(UsageError, match=rf"no {part}/iter_0000002 folder"):
        load_checkpoint(trainer, str(tmp_path))


def test_resume_of_an_enable_ema_checkpoint_whose_ema_file_is_gone_names_the_file(tmp_path):
    """Its ema.pt gone, a checkpoint saved with --enable_ema was said to come from a run without it ("resume without
    --enable_ema"), which would drop the EMA copy the run had kept."""
    from types import SimpleNamespace

    from dschat.errors import UsageError
    from dschat.rlhf.checkpointing import load_checkpoint

    _saved_checkpoint(tmp_path, critic=False)
    state = tmp_path / "trainer" / "iter_0000002" / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "flags": {"enable_ema": True}}))
    trainer = SimpleNamespace(actor_model=None, critic_model=None, actor_ema=SimpleNamespace())
    with pytest.raises(UsageError, match=r"checkpoint iter_0000002 in .* has no trainer/iter_0000002/ema.pt \(the EMA "
                                         r"copy of its --enable_ema run; removed or copied in part\?\): restore it; "
                                         r"or start afresh without --resume"):
        load_checkpoint(trainer, str(tmp_path))


def test_resume_of_a_gae_checkpoint_whose_critic_folder_is_gone_names_the_folder(tmp_path):
    """Its critic folder gone, a checkpoint of a run with a critic (--advantage_estimator gae, its flags say) was said
    to come from a critic-free run ("resume with that run's --advantage_estimator"), the one both runs had."""
    import shutil
    from types import SimpleNamespace

    from dschat.errors import UsageError
    from dschat.rlhf.checkpointing import load_checkpoint

    _saved_checkpoint(tmp_path)
    shutil.rmtree(tmp_path / "critic" / "iter_0000002")
    state = tmp_path / "trainer" / "iter_0000002" / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "flags": {"advantage_estimator": "gae"}}))
    trainer = SimpleNamespace(actor_model=None, critic_model=SimpleNamespace(), actor_ema=None)
    with pytest.raises(UsageError, match=r"checkpoint iter_0000002 in .* has no critic/iter_0000002 folder \(the "
                                         r"critic of its gae run; removed or copied in part\?\): restore it; or start "
                                         r"afresh without --resume"):
        load_checkpoint(trainer, str(tmp_path))


def test_resume_of_a_checkpoint_state_without_its_place_names_the_file(tmp_path):
    """A state.json that is a JSON object but holds no epoch (edited) failed with a bare KeyError."""
    from types import SimpleNamespace

    from dschat.errors import UsageError
    from dschat.rlhf.checkpointing import load_checkpoint

    _saved_checkpoint(tmp_path, critic=False)
    (tmp_path / "trainer" / "iter_0000002" / "state.json").write_text(json.dumps({"iteration": 2}))
    trainer = SimpleNamespace(actor_model=None, critic_model=None, actor_ema=None)
    with pytest.raises(UsageError, match=r"checkpoint iter_0000002 in .* has a damaged trainer/iter_0000002/state.json "
                                         r"\(no 'epoch', 'batch': its place in the run; edited\?\)"):
        load_checkpoint(trainer, str(tmp_path))


@pytest.mark.parametrize("part", ["actor", "critic"])
def test_resume_with_an_engines_model_states_missing_names_the_file(tmp_path, part):
    """DeepSpeed's load failed on a missing model-states file with a bare AssertionError ("a file of it is damaged
    or missing", naming none); the critic's folder was not looked into at all."""
    from types import SimpleNamespace

    from dschat.errors import UsageError
    from dschat.rlhf.checkpointing import load_checkpoint

    class NotLoaded:
        def load_checkpoint(self, *args, **kwargs):
            raise Loaded("the checks must come before DeepSpeed loads anything")

    _saved_checkpoint(tmp_path)
    (tmp_path / part / "iter_0000002" / "mp_rank_00_model_states.pt").unlink()
    trainer = SimpleNamespace(actor_model=NotLoaded(), critic_model=NotLoaded(), actor_ema=None)
    with pytest.raises(UsageError, match=rf"checkpoint iter_0000002 in .* has no {part}/iter_0000002/mp_rank_00_model_"
                                         rf"states.pt \(DeepSpeed's states of its {part}, saved by 1 rank\(s\)"):
        load_checkpoint(trainer, str(tmp_path))


def test_resume_from_an_unreadable_checkpoint_file_names_the_checkpoint(tmp_path, monkeypatch):
    """Step 3's loads (the engines', the EMA copy's, the RNG states') failing on a damaged file: one UsageError naming
    the checkpoint, with no earlier one to offer here, instead of torch's or DeepSpeed's traceback."""
    from types import SimpleNamespace

    from dschat.errors import UsageError
    from dschat.rlhf.checkpointing import load_checkpoint

    class Truncated:
        def load_checkpoint(self, *args, **kwargs):
            raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory. "
                               "This is an internal miniz error.")

    _saved_checkpoint(tmp_path, critic=False)
    trainer = SimpleNamespace(actor_model=Truncated(), critic_model=None, actor_ema=None)
    with pytest.raises(UsageError, match=r"checkpoint iter_0000002 in .* cannot be loaded \(RuntimeError: "
                                         r"PytorchStreamReader failed reading zip archive: failed finding central "
                                         r"directory\); a file of it is damaged or missing .*: restore it; or start "
                                         r"afresh without --resume"):
        load_checkpoint(trainer, str(tmp_path))
    # another rank failing to load (its own error names its file): this rank's collective error is not blamed on the
    # checkpoint
    from dschat.utils import checkpoints, dist

    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        with checkpoints.reading(str(tmp_path), "iter_0000002"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:35202")


def _flags_trainer(tmp_path, *given):
    """A trainer as the checkpoint code sees it, with step 3's flags ``given``: engines that save an empty tag folder
    and raise "loaded" when DeepSpeed would load (so a test sees whether the checks let the run resume)."""
    from types import SimpleNamespace

    from dschat.rlhf.algorithms import get_kl_controller
    from dschat.rlhf.config import step3_args

    args = step3_args(step3_parser().parse_args(list(given)))

    class Engine:
        def __init__(self, stage):
            self.stage = stage

        def save_checkpoint(self, folder, tag, save_latest):
            (tmp_path / folder / tag).mkdir(parents=True)
            (tmp_path / folder / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
            if self.stage:  # (ZeRO-1/2/3: the optimizer's partition, as DeepSpeed names it)
                prefix = "bf16_" if args.dtype == "bf16" else ""
                (tmp_path / folder / tag / f"{prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")

        def load_checkpoint(self, *args, **kwargs):
            raise Loaded("loaded")

    return SimpleNamespace(actor_model=Engine(args.actor_zero_stage), critic_model=Engine(args.critic_zero_stage),
                           actor_ema=None, generator=torch.Generator(), args=args,
                           kl_ctl=get_kl_controller("fixed", 0.1))


def _save_flags_checkpoint(tmp_path, *given):
    from dschat.rlhf.checkpointing import save_checkpoint

    save_checkpoint(_flags_trainer(tmp_path, *given), str(tmp_path),
                    {"iteration": 1, "epoch": 0, "batch": 1, "unsup_batches": 0})


@pytest.mark.parametrize("saved, resumed, named", [
    ([], ["--actor_lora_dim", "4"], r"--actor_lora_dim 0 -> 4"),
    ([], ["--critic_lora_dim", "2", "--only_optimize_lora"],
     r"--only_optimize_lora False -> True; --critic_lora_dim 0 -> 2"),
    ([], ["--actor_zero_stage", "2", "--dtype", "fp32"], r"--actor_zero_stage 0 -> 2; --dtype 'bf16' -> 'fp32'"),
    (["--zero_stage", "2"], ["--zero_stage", "2", "--offload"], r"--offload False -> True"),
    ([], ["--per_device_generation_batch_size", "8"], r"--per_device_generation_batch_size 4 -> 8"),
    (["--data_split", "4,4,2"], ["--data_split", "2,4,4", "--max_prompt_seq_len", "40"],
     r"--data_split '4,4,2' -> '2,4,4'; --max_prompt_seq_len 256 -> 40"),
    ([], ["--data_path", "tiny", "jsonl:more.jsonl"], r"--data_path ['tiny'] -> ['tiny', 'jsonl:more.jsonl']"),
    ([], ["--eval_prompts", "32"], r"--eval_prompts 64 -> 32"),  # "before" is the checkpoint's, on its prompts
    ([], ["--advantage_estimator", "reinforce_pp"], r"--advantage_estimator 'gae' -> 'reinforce_pp'"),  # critic-free
    (["--unsupervised_dataset_name", "tiny"], ["--unsupervised_dataset_name", "tiny", "--max_answer_seq_len", "64"],
     r"--max_answer_seq_len 256 -> 64"),  # the unsupervised stream's blocks are prompt + answer lengths long
    (["--actor_lora_dim", "4"], ["--actor_lora_dim", "4", "--lora_alpha", "16"], r"--lora_alpha None -> 16.0"),
])
def test_resume_with_a_flag_the_checkpoint_is_bound_to_changed_is_a_usage_error_naming_it(tmp_path, saved, resumed,
                                                                                         named):
    """Another LoRA layout, ZeRO stage or dtype was DeepSpeed's traceback (a state-dict key mismatch, a missing
    optim_states file) after every model had loaded, --offload added a KeyError in the first optimizer step (CPU Adam
    given AdamW's state); another --per_device_generation_batch_size resumed silently at the saved batch index,
    skipping prompts the checkpoint had never trained on (or repeating ones it had), and other data flags resumed at
    that index of another prompt set (its held-out share too)."""
    import re

    from dschat.errors import UsageError
    from dschat.rlhf.checkpointing import load_checkpoint

    batch = ["--per_device_generation_batch_size", "4"]
    _save_flags_checkpoint(tmp_path, *batch, *saved)
    with pytest.raises(UsageError, match=rf"saved with other settings: {re.escape(named)}\. .*without --resume"):
        load_checkpoint(_flags_trainer(tmp_path, *batch, *resumed), str(tmp_path))
    # flags a checkpoint does not depend on may change: the checks pass and DeepSpeed loads
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, *batch, *saved, "--per_device_training_batch_size", "2",
                                       "--max_steps", "9"), str(tmp_path))


def test_a_learning_rate_changed_on_resume_is_said_to_have_no_effect(tmp_path, capsys):
    """DeepSpeed restores the optimizer's learning rates and schedule from the checkpoint: a new --actor_learning_rate
    was silently ignored. A new dropout was silently taken."""
    from dschat.rlhf.checkpointing import load_checkpoint

    _save_flags_checkpoint(tmp_path)
    with pytest.raises(Loaded, match="loaded"):  # the checks pass: the run resumes
        load_checkpoint(_flags_trainer(tmp_path, "--actor_learning_rate", "3e-6"), str(tmp_path))
    assert "--actor_learning_rate 3e-06 (the checkpoint's: 9.65e-06): no effect" in capsys.readouterr().out
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path), str(tmp_path))
    assert "no effect" not in capsys.readouterr().out
    with pytest.raises(Loaded, match="loaded"):  # LoRA's parameter group's rate too
        load_checkpoint(_flags_trainer(tmp_path, "--actor_lora_learning_rate", "0.05"), str(tmp_path))
    assert "--actor_lora_learning_rate 0.05 (the checkpoint's: 0.0005): no effect" in capsys.readouterr().out
    # the dropouts bind nothing the checkpoint holds: another one is said, and applies from here
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--actor_dropout", "0.0", "--critic_dropout", "0.2"), str(tmp_path))
    assert "--actor_dropout (the model's own) -> 0.0, --critic_dropout (the model's own) -> 0.2: the rest of the run " \
           "trains with the new value" in capsys.readouterr().out
    # so do the loss coefficients and the sampling settings (they went unsaid: another objective than the log said)
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--cliprange", "0.1", "--temperature", "0.7"), str(tmp_path))
    assert "--cliprange 0.2 -> 0.1, --temperature 1.0 -> 0.7: the rest of the run trains with the new value" in \
        capsys.readouterr().out
    # and where the KL goes, how the advantages are normalized, the loss aggregated and which answers it takes
    # (unsaid too; the EMA's decay: test_an_ema_beta_changed_on_resume_is_said_only_where_an_ema_copy_uses_it)
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--kl_in_reward", "0", "--whiten_advantages", "--loss_agg",
                                       "global_token_mean", "--mask_truncated_answers"), str(tmp_path))
    assert "--kl_in_reward 1 -> 0, --whiten_advantages False -> True, --loss_agg 'token_mean' -> " \
           "'global_token_mean', --mask_truncated_answers False -> True: the rest of the run trains with the new " \
           "value" in capsys.readouterr().out


def test_a_checkpoint_of_grpo_norm_by_std_1_or_0_resumes_as_group_or_none(tmp_path, capsys):
    """--grpo_norm_by_std took 1 and 0 before its batch scope, and checkpoints recorded those; they are the scopes
    group and none, so a resume with this run's default is no change to say, and one with batch is said as one."""
    import json

    from dschat.rlhf.checkpointing import load_checkpoint

    _save_flags_checkpoint(tmp_path, "--advantage_estimator", "grpo")
    state_path = next(tmp_path.glob("**/state.json"))
    state = json.loads(state_path.read_text())
    assert state["flags"]["grpo_norm_by_std"] == "group"  # (the scope's name is what this run records)
    state["flags"]["grpo_norm_by_std"] = 1
    state_path.write_text(json.dumps(state))
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--advantage_estimator", "grpo"), str(tmp_path))
    assert "grpo_norm_by_std" not in capsys.readouterr().out
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--advantage_estimator", "grpo", "--grpo_norm_by_std", "batch"),
                        str(tmp_path))
    assert "--grpo_norm_by_std 'group' -> 'batch': the rest of the run trains with the new value" \
        in capsys.readouterr().out
    state["flags"]["grpo_norm_by_std"] = 0
    state_path.write_text(json.dumps(state))
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--advantage_estimator", "grpo", "--grpo_norm_by_std", "0"),
                        str(tmp_path))
    assert "grpo_norm_by_std" not in capsys.readouterr().out


def test_an_ema_beta_changed_on_resume_is_said_only_where_an_ema_copy_uses_it(tmp_path, capsys):
    """--ema_beta changed on a resume of a run without --enable_ema was said ("--ema_beta 0.992 -> 0.9: the rest of
    the run trains with the new value") although no EMA copy reads it, in either run; so were the other flags this
    run's settings leave unread (GRPO's --grpo_norm_by_std under GAE, the sampling settings with --greedy)."""
    from dschat.rlhf.checkpointing import load_checkpoint

    _save_flags_checkpoint(tmp_path)
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--ema_beta", "0.9", "--grpo_norm_by_std", "0"), str(tmp_path))
    assert "the rest of the run trains with the new value" not in capsys.readouterr().out
    _save_flags_checkpoint(tmp_path, "--greedy")
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--greedy", "--temperature", "0.7"), str(tmp_path))
    assert "the rest of the run trains with the new value" not in capsys.readouterr().out
    _save_flags_checkpoint(tmp_path, "--advantage_estimator", "grpo")
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--advantage_estimator", "grpo", "--grpo_norm_by_std", "0"),
                        str(tmp_path))
    assert "--grpo_norm_by_std 'group' -> 'none': the rest of the run trains with the new value" \
        in capsys.readouterr().out
    _save_flags_checkpoint(tmp_path, "--enable_ema")
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--enable_ema", "--ema_beta", "0.9"), str(tmp_path))
    assert "--ema_beta 0.992 -> 0.9: the rest of the run trains with the new value" in capsys.readouterr().out


def test_a_training_batch_size_or_accumulation_changed_on_resume_is_said(tmp_path, capsys):
    """On as many ranks, a resume may take another --per_device_training_batch_size or --gradient_accumulation_steps
    (its position counts generation batches; another number of optimizer steps an iteration moves the schedules, and
    is said): another split of an optimizer step's rows went on unsaid. It is said as the other free flags are."""
    from dschat.rlhf.checkpointing import load_checkpoint

    _save_flags_checkpoint(tmp_path, "--per_device_training_batch_size", "4")
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--per_device_training_batch_size", "2",
                                       "--gradient_accumulation_steps", "2"), str(tmp_path))
    assert ("[step3] --resume: --per_device_training_batch_size 4 -> 2, --gradient_accumulation_steps 1 -> 2: the "
            "rest of the run trains with the new value") in capsys.readouterr().out
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--per_device_training_batch_size", "4"), str(tmp_path))
    assert "the rest of the run trains with the new value" not in capsys.readouterr().out


def test_a_resume_without_enable_ema_says_it_leaves_the_checkpoints_ema_copy_behind(tmp_path, capsys):
    """A checkpoint of an --enable_ema run resumed without the flag went on without its EMA copy, unsaid: the run's
    output had no actor_ema (an earlier one in the folder was removed as "an earlier run's model"). The other way, a
    checkpoint without an EMA copy resumed with --enable_ema, is refused (``check_resumable``)."""
    from dschat.rlhf.checkpointing import load_checkpoint

    _save_flags_checkpoint(tmp_path, "--enable_ema")
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path), str(tmp_path))
    out = capsys.readouterr().out
    assert "--enable_ema True -> False: the rest of the run trains with the new value" in out
    assert "the EMA copy in " in out and "is not loaded, and this run saves no actor_ema" in out


def test_a_resumed_kl_controller_goes_on_from_its_coefficient_with_this_runs_settings(tmp_path, capsys):
    """The checkpoint's controller state overrode the flags: a fixed --kl_ctl changed on resume, and an adaptive
    controller's --kl_target or --kl_horizon, were silently the checkpoint's. An adaptive controller goes on from the
    coefficient it had come to; the settings are this run's, and a change is said."""
    from dschat.rlhf.algorithms import get_kl_controller
    from dschat.rlhf.checkpointing import load_checkpoint, restore_kl_controller

    fixed = get_kl_controller("fixed", 0.2)
    restore_kl_controller(fixed, {"value": 0.1})
    assert fixed.value == 0.2
    adaptive = get_kl_controller("adaptive", 0.1, 6.0, 10000)
    restore_kl_controller(adaptive, {"value": 0.137, "target": 3.0, "horizon": 500})
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.137, 6.0, 10000)
    _save_flags_checkpoint(tmp_path)
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--kl_ctl", "0.2"), str(tmp_path))
    assert "--kl_ctl 0.1 -> 0.2: the rest of the run trains with the new value" in capsys.readouterr().out


def _controller_trainer(tmp_path, given=()):
    """A DeepSpeedPPOTrainer (its kl_ctl setter) of step 3's flags ``given`` on engines that save an empty tag
    folder and load nothing, so that a checkpoint's round trip reaches the KL controller's restore."""
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer, kl_controller_of

    class Engine:
        def save_checkpoint(self, folder, tag, save_latest):
            (tmp_path / folder / tag).mkdir(parents=True)
            (tmp_path / folder / tag / "mp_rank_00_model_states.pt").write_bytes(b"")

        def load_checkpoint(self, *args, **kwargs):
            return None, {}

    trainer = DeepSpeedPPOTrainer.__new__(DeepSpeedPPOTrainer)
    trainer.args = step3_args(step3_parser().parse_args(list(given)))
    trainer.actor_model, trainer.critic_model, trainer.actor_ema = Engine(), Engine(), None
    trainer.generator = torch.Generator()
    trainer.kl_ctl = kl_controller_of(trainer.args)
    return trainer


def test_a_resumed_run_keeps_its_count_of_the_steps_skipped_for_no_token_in_the_loss(tmp_path):
    """DeepSpeed's checkpoint keeps its skip count, which includes the steps skipped for no token in the loss
    (--mask_truncated_answers); the trainer's count of those went back to 0 on resume, and the end-of-run warning then
    took them for skips on inf/NaN gradients. A checkpoint from before the count resumes with none."""
    from dschat.rlhf.checkpointing import load_checkpoint, save_checkpoint

    trainer = _controller_trainer(tmp_path)
    trainer.no_token_skips = {"actor": 3, "critic": 4}
    save_checkpoint(trainer, str(tmp_path), {"iteration": 1, "epoch": 0, "batch": 1, "unsup_batches": 0})
    resumed = _controller_trainer(tmp_path)
    assert "no_token_skips" not in load_checkpoint(resumed, str(tmp_path))
    assert resumed.no_token_skips == {"actor": 3, "critic": 4}
    state_file = next((tmp_path / "trainer").glob("*/state.json"))
    state = json.loads(state_file.read_text())
    del state["no_token_skips"]
    state_file.write_text(json.dumps(state))
    resumed.no_token_skips = {"actor": 9}  # (a notebook's trainer that trained before it loads)
    load_checkpoint(resumed, str(tmp_path))
    assert resumed.no_token_skips == {}


def test_a_kl_controller_assigned_to_the_trainer_is_the_runs_and_resumes_as_it_trained(tmp_path, capsys):
    """trainer.kl_ctl = AdaptiveKLController(...) on a run without --adaptive_kl trained a fixed coefficient (the
    updates follow args.adaptive_kl), and a controller assigned was not recorded as a float is: the checkpoint's flags
    were the run's (--kl_ctl 0.1, no --adaptive_kl), so a resume made that controller again and dropped the assigned
    one's coefficient, target and horizon unsaid. A controller assigned now sets args' KL settings, checked as the
    flags are; the checkpoint records them, and a resume with the same controller (or those flags) goes on from it."""
    from types import SimpleNamespace

    from dschat.errors import UsageError
    from dschat.rlhf.algorithms import AdaptiveKLController, FixedKLController
    from dschat.rlhf.checkpointing import load_checkpoint, resume_flags, save_checkpoint

    trainer = _controller_trainer(tmp_path)
    trainer.kl_ctl = AdaptiveKLController(0.2, target=3.0, horizon=500)
    a = trainer.args
    assert (a.adaptive_kl, a.kl_ctl, a.kl_target, a.kl_horizon) == (True, 0.2, 3.0, 500)
    assert type(a.kl_horizon) is int  # (as the flag takes it)
    trainer.kl_ctl.update(10.0, 50)  # (above target: the coefficient grows, as train_rollout's update does)
    adapted = trainer.kl_ctl.value
    assert adapted > 0.2
    save_checkpoint(trainer, str(tmp_path), {"iteration": 1, "epoch": 0, "batch": 1, "unsup_batches": 0})
    for resumed in (_controller_trainer(tmp_path, ["--adaptive_kl", "--kl_ctl", "0.2", "--kl_target", "3",
                                                   "--kl_horizon", "500"]), _controller_trainer(tmp_path)):
        if not resumed.args.adaptive_kl:  # (a notebook's: the same assignment before load_checkpoint)
            resumed.kl_ctl = AdaptiveKLController(0.2, target=3.0, horizon=500)
        capsys.readouterr()
        load_checkpoint(resumed, str(tmp_path))
        assert resumed.kl_ctl.value == adapted and (resumed.kl_ctl.target, resumed.kl_ctl.horizon) == (3.0, 500)
        assert "-> " not in capsys.readouterr().out  # (no flag said changed)
    # a fixed one on an adaptive run: fixed, its coefficient the checkpoints' --kl_ctl, the adaptive settings unset
    trainer.kl_ctl = FixedKLController(0.3)
    assert (a.adaptive_kl, a.kl_ctl, a.kl_target, a.kl_horizon) == (False, 0.3, 6.0, 10000)
    assert resume_flags(trainer)["kl_ctl"] == 0.3
    with pytest.raises(UsageError, match=r"trainer.kl_ctl = AdaptiveKLController\(0.0, target=3.0, horizon=500.0\): "
                                         r"--adaptive_kl with --kl_ctl 0"):
        trainer.kl_ctl = AdaptiveKLController(0.0, target=3.0, horizon=500)
    with pytest.raises(UsageError, match=r"kl_horizon: .*integer"):
        trainer.kl_ctl = AdaptiveKLController(0.1, target=3.0, horizon=0.5)
    assert (a.adaptive_kl, a.kl_ctl, trainer.kl_ctl.value) == (False, 0.3, 0.3)  # (a refused one changes nothing)

    class Halving(FixedKLController):
        def update(self, current_kl, n_steps):
            self.value /= 2

    with pytest.raises(UsageError, match=r"a subclass of FixedKLController, which a resumed run would make from"):
        trainer.kl_ctl = Halving(0.3)
    with pytest.raises(TypeError, match=r"expected the KL coefficient .* or a KL controller"):
        trainer.kl_ctl = SimpleNamespace(value=0.1, update=print, state_dict=dict, load_state_dict=print)
    grpo = _controller_trainer(tmp_path, ["--advantage_estimator", "grpo", "--n_samples_per_prompt", "2"])
    with pytest.raises(UsageError, match=r"trainer.kl_ctl = AdaptiveKLController.*: --adaptive_kl adapts the "
                                         r"per-token reward's KL coefficient"):
        grpo.kl_ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    grpo.kl_ctl = FixedKLController(grpo.args.kl_ctl)  # (the one it has: nothing changes)


def test_a_checkpoints_restored_learning_rate_stands_for_the_engines_in_the_trainers_check(tmp_path):
    """load_checkpoint sets the learning rates DeepSpeed restored on trainer.args, and records them on the engine,
    whose optimizers run at them: the trainers' check that their args keep the engine's build settings
    (``_check_engine_settings_kept``, and a new trainer's) takes them in place of the engine's args'."""
    from dschat.rlhf.checkpointing import load_checkpoint, save_checkpoint
    from dschat.rlhf.engine import BuiltArgs, DeepSpeedRLHFEngine

    saved = _controller_trainer(tmp_path)
    save_checkpoint(saved, str(tmp_path), {"iteration": 1, "epoch": 0, "batch": 1, "unsup_batches": 0})
    resumed = _controller_trainer(tmp_path, ["--actor_learning_rate", "3e-6"])
    resumed.rlhf_engine = engine = DeepSpeedRLHFEngine.__new__(DeepSpeedRLHFEngine)
    engine.args = BuiltArgs.of(resumed.args)
    load_checkpoint(resumed, str(tmp_path))
    rate = saved.args.actor_learning_rate
    assert resumed.args.actor_learning_rate == rate != 3e-6 == engine.args.actor_learning_rate
    assert engine.restored_settings == {"actor_learning_rate": rate}
    assert DeepSpeedRLHFEngine.restored_settings == {}  # (the class default: replaced on the engine, not changed)
    resumed._check_engine_settings_kept("train_rollout")


def test_a_fixed_coefficient_changed_in_place_is_the_one_a_checkpoint_records(tmp_path, capsys):
    """trainer.kl_ctl.value = 0.05 on a fixed controller trained with 0.05 while args kept --kl_ctl 0.1: the
    checkpoint recorded 0.1, and a resume with the flags' 0.1 went on with it, the change unsaid."""
    from dschat.rlhf.checkpointing import load_checkpoint, save_checkpoint

    trainer = _controller_trainer(tmp_path)
    trainer.kl_ctl.value = 0.05
    save_checkpoint(trainer, str(tmp_path), {"iteration": 1, "epoch": 0, "batch": 1, "unsup_batches": 0})
    assert trainer.args.kl_ctl == 0.05
    saved = json.loads(next(tmp_path.rglob("state.json")).read_text())
    assert saved["flags"]["kl_ctl"] == 0.05
    capsys.readouterr()
    load_checkpoint(_controller_trainer(tmp_path), str(tmp_path))
    assert "--kl_ctl 0.05 -> 0.1: the rest of the run trains with the new value" in capsys.readouterr().out


def test_resuming_an_adaptive_run_whose_checkpoint_fed_its_controller_k1_says_so(tmp_path, capsys):
    """The adaptive controller now follows the reward penalty's estimator (kl_per_answer); a checkpoint of before
    (no record of it) fed it the k1 sum, and its resume went on measuring the KL another way unsaid (k2's and abs'
    means are not k1's), kl_per_answer changing meaning in the log. A checkpoint records what it fed; a resume of one
    without the record, with a non-k1 penalty, says so; one that records it, or a k1 penalty, says nothing."""
    from dschat.rlhf.checkpointing import KL_TRACKED, load_checkpoint

    flags = ["--adaptive_kl", "--kl_estimator", "abs"]
    _save_flags_checkpoint(tmp_path, *flags)
    state_file = tmp_path / "trainer" / "iter_0000001" / "state.json"
    state = json.loads(state_file.read_text())
    assert state[KL_TRACKED] == "abs"
    old = {key: value for key, value in state.items() if key != KL_TRACKED}
    note = ("checkpoint iter_0000001's adaptive KL controller was fed the k1 KL per answer (a dschat of before it "
            "followed the reward penalty's estimator); from here it is fed --kl_estimator abs's")
    for saved, given, said in ((state, flags, False), (old, flags, True), (old, ["--adaptive_kl"], False)):
        state_file.write_text(json.dumps(saved))
        with pytest.raises(Loaded, match="loaded"):
            load_checkpoint(_flags_trainer(tmp_path, *given), str(tmp_path))
        out = capsys.readouterr().out
        assert (note in out) == said, out


def test_resume_with_another_actor_model_is_an_error_and_a_moved_one_resumes(tmp_path):
    """The actor model is step 3's frozen reference: resuming with another one silently changed what the KL penalty
    measured against. Compared by the recorded identity of the model, not its path."""
    import shutil

    from dschat.errors import UsageError
    from dschat.rlhf.checkpointing import load_checkpoint

    for name, layers in (("sft", 2), ("other_sft", 3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    given = ["--critic_model_name_or_path", str(tmp_path / "sft"), "--reward_model_weight", "0"]
    _save_flags_checkpoint(tmp_path, "--actor_model_name_or_path", str(tmp_path / "sft"), *given)
    with pytest.raises(UsageError, match=r"saved by a run whose actor started from another model than "
                                         r"--actor_model_name_or_path .*other_sft, which is the reference model"):
        load_checkpoint(_flags_trainer(tmp_path, "--actor_model_name_or_path", str(tmp_path / "other_sft"), *given),
                        str(tmp_path))
    shutil.move(tmp_path / "sft", tmp_path / "moved_sft")  # the same model elsewhere (a moved run folder)
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--actor_model_name_or_path", str(tmp_path / "moved_sft"), *given),
                        str(tmp_path))
    # a copy with new modification times (plain cp) is refused, and the error says how such a model is recognised
    (tmp_path / "copied_sft").mkdir()
    shutil.copyfile(tmp_path / "moved_sft" / "config.json", tmp_path / "copied_sft" / "config.json")
    os.utime(tmp_path / "copied_sft" / "config.json", ns=(1, 1))
    with pytest.raises(UsageError, match=r"measures against \(a model made outside dschat is recognised by its files' "
                                         r"names, sizes and modification times.*cp -p keeps them"):
        load_checkpoint(_flags_trainer(tmp_path, "--actor_model_name_or_path", str(tmp_path / "copied_sft"), *given),
                        str(tmp_path))


def test_a_checkpoint_recording_its_actor_as_dschat_did_before_it_counted_tokenizer_files_resumes(tmp_path):
    """Checkpoints from before the tokenizer files counted in a model's identity recorded "files:..." for a model made
    elsewhere: the reference check must read them as holds_model does, not refuse the same model."""
    from dschat.steps.common import check_same_start, model_identity

    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "config.json").write_text("{}")
    (tmp_path / "sft" / "tokenizer.json").write_text("{}")
    legacy = model_identity(str(tmp_path / "sft"), tokenizer_files=False)
    assert legacy.startswith("files:") and legacy != model_identity(str(tmp_path / "sft"))
    check_same_start({str(tmp_path / "sft"): legacy}, str(tmp_path / "sft"), "--actor_model_name_or_path", "iter_1",
                     str(tmp_path), "whose actor started", "the reference model its KL penalty measures against")


def test_lora_alpha_binds_a_checkpoint_only_where_lora_reads_it(tmp_path, capsys):
    """Without LoRA, --lora_alpha is said to be ignored; it must not also refuse the resume."""
    from dschat.rlhf.checkpointing import load_checkpoint

    _save_flags_checkpoint(tmp_path)
    with pytest.raises(Loaded, match="loaded"):
        load_checkpoint(_flags_trainer(tmp_path, "--lora_alpha", "16"), str(tmp_path))


TIMINGS = ("generation_time", "experience_time", "training_time", "samples_per_s", "tokens_per_s",
           "answer_tokens_per_s")


def test_resumed_run_matches_uninterrupted_run_with_dropout_hf_sampling_and_ptx(trained, tmp_path):
    """Dropout in both models, answers sampled by HF generate (no hybrid engine) and PPO-ptx all draw from torch's
    global RNG, which the checkpoint restores: the resumed run must draw exactly what the uninterrupted one drew (a
    DataLoader iterator started on resume, for the prompts or the unsupervised stream, must not take a draw of its
    own)."""
    common = ["--actor_dropout", "0.1", "--critic_dropout", "0.1", "--unsupervised_dataset_name", "tiny",
              "--max_steps", "3", "--save_interval", "1"]
    ppo.main(ppo_args(trained, tmp_path / "full", *common))
    ppo.main(ppo_args(trained, tmp_path / "split", "--enable_test_mode", "--test_stop_step", "1", *common))
    ppo.main(ppo_args(trained, tmp_path / "split", "--resume", *common))
    full = [json.loads(x) for x in (tmp_path / "full" / "step3_log.jsonl").read_text().splitlines()]
    split = [json.loads(x) for x in (tmp_path / "split" / "step3_log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in split] == [1, 2, 3]
    for a, b in zip(full, split):
        assert set(a) == set(b) and "unsup_loss" in a
        for key in set(a) - set(TIMINGS):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["iteration"], key)


def test_a_save_killed_between_its_checkpoint_files_resumes_from_the_one_before_as_the_uninterrupted_run(
        trained, tmp_path, monkeypatch):
    """GRPO with an EMA copy, a LoRA actor and --offload, killed while it saved iteration 2's checkpoint: the actor's
    DeepSpeed files written, its EMA copy not, nor the trainer state that marks a checkpoint complete. The resume
    takes iteration 1's (the one ``latest`` names), saves iteration 2's over the partial one, and ends with the
    uninterrupted run's log and models. (Swept by hand too: killed between the DeepSpeed files, before the trainer
    state, before ``latest``, in the final model saves; each of EMA, LoRA, --offload and GRPO alone and with PPO's
    critic.)"""
    import dschat.rlhf.checkpointing as checkpointing
    from safetensors.torch import load_file

    score = tmp_path / "score.py"
    score.write_text("def score(prompts, answers):\n    return [float(len(a) % 7) for a in answers]\n")
    common = ["--advantage_estimator", "grpo", "--n_samples_per_prompt", "2", "--reward_model_weight", "0",
              "--reward_fn", f"{score}:score", "--enable_ema", "--actor_lora_dim", "4", "--zero_stage", "2",
              "--offload", "--max_steps", "2", "--save_interval", "1"]
    ppo.main(ppo_args(trained, tmp_path / "full", *common))
    real_save = torch.save

    def killed_at_iteration_2s_ema(state, path, *args, **kwargs):
        if str(path).endswith(os.path.join("iter_0000002", "ema.pt")):
            raise KeyboardInterrupt
        return real_save(state, path, *args, **kwargs)

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(checkpointing.torch, "save", killed_at_iteration_2s_ema)
        ppo.main(ppo_args(trained, tmp_path / "split", *common))
    checkpoints = tmp_path / "split" / "checkpoints"
    assert (checkpoints / "actor" / "iter_0000002").is_dir()
    assert not (checkpoints / "trainer" / "iter_0000002" / "state.json").exists()
    ppo.main(ppo_args(trained, tmp_path / "split", "--resume", *common))
    full, split = ([json.loads(x) for x in (tmp_path / run / "step3_log.jsonl").read_text().splitlines()]
                   for run in ("full", "split"))
    assert [r["iteration"] for r in split] == [r["iteration"] for r in full] == [1, 2]
    for a, b in zip(full, split):
        for key in ("reward", "actor_loss", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["iteration"], key)
    for model in ("actor", "actor_ema"):
        saved = [load_file(tmp_path / run / model / "model.safetensors") for run in ("full", "split")]
        assert saved[0].keys() == saved[1].keys() and all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])


def test_resumed_run_continues_the_unsupervised_data_where_it_stopped(trained, tmp_path):
    text = tmp_path / "unsup.jsonl"
    # 8 distinct blocks: 2 batches a pass, so the checkpoint after 3 iterations is 1 batch into the second pass
    text.write_text("".join(json.dumps({"text": f"plain text number {i} " + "word " * (i % 7) + "for language "
                                                "modelling."}) + "\n" for i in range(16)))
    common = ["--enable_hybrid_engine", "--save_interval", "3", "--max_steps", "5", "--unsupervised_dataset_name",
              f"jsonl:{text}", "--unsup_coef", "0.5"]
    ppo.main(ppo_args(trained, tmp_path / "full", *common))
    ppo.main(ppo_args(trained, tmp_path / "split", "--enable_test_mode", "--test_stop_step", "3", *common))
    state = json.loads((tmp_path / "split" / "checkpoints" / "trainer" / "iter_0000003" / "state.json").read_text())
    assert state["unsup_batches"] == 3
    ppo.main(ppo_args(trained, tmp_path / "split", "--resume", *common))
    full = [json.loads(x) for x in (tmp_path / "full" / "step3_log.jsonl").read_text().splitlines()]
    split = [json.loads(x) for x in (tmp_path / "split" / "step3_log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in split] == [1, 2, 3, 4, 5]
    for a, b in zip(full, split):
        for key in ("unsup_loss", "reward", "kl", "actor_loss", "critic_loss", "answer_length"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["iteration"], key)


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [1, 2], ids=["no_tp", "inference_tp2"])
def test_step3_with_zero3_on_two_ranks_and_different_answer_lengths(trained, tmp_path, tp):
    out = tmp_path / "ppo"
    proc = run_deepspeed(REPO / "training" / "step3_ppo" / "main.py", *ppo_args(
        trained, out, "--max_steps", "2", "--actor_zero_stage", "3", "--critic_zero_stage", "3",
        "--enable_hybrid_engine", "--inference_tp_size", str(tp), "--max_answer_seq_len", "16"), timeout=900)
    log = [json.loads(x) for x in (out / "step3_log.jsonl").read_text().splitlines()]
    assert len(log) == 2
    assert all(abs(r["actor_loss"]) < 1e3 and r["kl"] == r["kl"] for r in log)
    assert "held-out after PPO" in proc.stdout
    if tp == 2:
        assert ("generates from a persistent copy of the weights, refreshed after each optimizer step, each rank its "
                "slice: inference tensor-parallel groups of 2 ranks") in proc.stdout


# Step 3 generates from one set of weights per PPO iteration: the held-out evaluation before PPO, the first rollout, a
# refresh after each iteration's actor steps (the next rollout, the evaluation after PPO). What dschat itself does
# between generations (the EMA's gather, gradient checkpointing, PPO-ptx's step, a checkpoint's gather, the critic)
# must not look like an in-place write into the actor (weights.write_mark): a refresh per generation batch would cost
# a LoRA merge, or a gather of the whole actor under ZeRO-3, each time.
REFRESH_RUNS = {"lora": ["--actor_lora_dim", "4", "--enable_ema", "--actor_gradient_checkpointing",
                         "--generation_batches", "2", "--print_answers", "--unsupervised_dataset_name", "tiny"],
                "zero3_grpo": ["--actor_zero_stage", "3", "--enable_ema", "--advantage_estimator", "grpo",
                               "--n_samples_per_prompt", "2", "--save_interval", "1"]}


@pytest.mark.parametrize("run", sorted(REFRESH_RUNS))
def test_step3_refreshes_the_hybrid_engines_copy_once_per_iteration_and_never_for_its_own_writes(trained, tmp_path,
                                                                                                monkeypatch, run):
    counts = count_copy_refreshes(monkeypatch.setattr)
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--enable_hybrid_engine", "--max_steps", "3", *REFRESH_RUNS[run]))
    assert counts == {"refreshes": 3 + 1, "by_writes": 0}


def test_step3_under_zero3_meets_the_other_ranks_in_an_order_its_iterations_alone_fix(trained, tmp_path, monkeypatch):
    """Under ZeRO-3 on several ranks the hybrid engine's calls are meetings of the world (``_MEETINGS``: eval(),
    generate's two, and the train() that begins a train phase, which met nobody before), so every rank must make them
    in one order. Step 3 makes them in an order its iterations alone fix, whatever differs between ranks (their rows,
    answers, which rank writes a checkpoint): the held-out evaluation's generations, then each iteration's rollout
    and one train() for all its micro-batches (gradient accumulation, PPO-ptx's language-model steps, the EMA, GRPO's
    samples, a checkpoint each iteration), a --test_stop_step early stop, and a resumed run the same from its
    checkpoint. One rank on ZeRO-3's several-rank path (the meetings are all-reduces of a world of one here)."""
    from dschat.hybrid_engine import engine as hybrid

    meetings, agree = [], hybrid._ranks_agree_on

    def ranks_agree_on(meeting, *args, **kwargs):
        meetings.append(meeting)
        return agree(meeting, *args, **kwargs)

    monkeypatch.setattr(hybrid, "_ranks_agree_on", ranks_agree_on)
    monkeypatch.setattr(hybrid, "_zero3_world", lambda ds_engine: ds_engine.zero_optimization_stage() == 3)
    flags = ["--enable_hybrid_engine", "--actor_zero_stage", "3", "--enable_ema", "--advantage_estimator", "grpo",
             "--n_samples_per_prompt", "2", "--gradient_accumulation_steps", "2", "--unsupervised_dataset_name", "tiny",
             "--save_interval", "1", "--max_steps", "3"]
    generation = ["generate()", "generate()'s weight check"]
    held_out = ["eval()", *generation * 2]  # (--eval_prompts 8: two batches of 4)
    iteration = ["eval()", *generation, "train()"]
    ppo.main(ppo_args(trained, tmp_path / "ppo", *flags, "--enable_test_mode", "--test_stop_step", "2"))
    assert meetings == [*held_out, *iteration * 2, *held_out], meetings
    meetings.clear()
    ppo.main(ppo_args(trained, tmp_path / "ppo", *flags, "--resume"))
    assert meetings == [*iteration, *held_out], meetings


@pytest.mark.multirank
def test_step3_with_zero3_on_two_ranks_refreshes_once_per_iteration_and_never_for_its_own_writes(trained, tmp_path):
    """As above on 2 ranks, where the ranks also agree on the staleness at each generation: a LoRA actor under ZeRO-3
    with the EMA, PPO-ptx, --print_answers, two generation batches and the held-out evaluation."""
    # 2 iterations, not the 3 of the one-rank runs: the refresh between two iterations is there all the same, and a
    # 2-rank launch of each iteration cost seconds on a loaded 2-core machine
    proc = run_deepspeed(REPO / "tests" / "scripts" / "step3_refreshes.py", *ppo_args(
        trained, tmp_path / "ppo", "--enable_hybrid_engine", "--max_steps", "2", "--zero_stage", "3",
        *REFRESH_RUNS["lora"]), timeout=600)
    for rank in (0, 1):
        assert f"rank {rank} refreshes={2 + 1} by_writes=0" in proc.stdout, proc.stdout[-3000:]


def test_readme_notebook_snippet_runs_as_written(trained, tmp_path, monkeypatch):
    import re

    readme = (REPO / "README.md").read_text()
    snippet = re.search(r"<!-- notebook-snippet -->\n```python\n(.*?)```", readme, re.S).group(1)
    # run it where "output/" holds this module's trained step-1/2 folders, on fewer prompts
    (tmp_path / "output").mkdir()
    for name, src in (("step1_sft", trained / "sft"), ("step2_rm", trained / "rm")):
        (tmp_path / "output" / name).symlink_to(src)
    monkeypatch.chdir(tmp_path)
    from dschat.models import training_engine

    released, release = [], training_engine.release_engine
    monkeypatch.setattr(training_engine, "release_engine", lambda engine: (released.append(engine), release(engine)))
    snippet = snippet.replace('"num_warmup_steps": 2}', '"num_warmup_steps": 2, "data_split": "2,4,4", '
                                                        f'"max_steps": 2, "data_output_path": "{trained / "data"}", '
                                                        '"eval_prompts": 4}')
    namespace = {}
    exec(compile(snippet.replace("for prompt_batch in prompt_dataloader:",
                                 "for i, prompt_batch in zip(range(2), prompt_dataloader):"), "README", "exec"),
         namespace)
    assert math.isfinite(namespace["trained"]["actor_loss"]) and math.isfinite(namespace["trained"]["critic_loss"])
    scores = namespace["scores"]  # (the trained policy's, on its first whole batch of held-out prompts)
    assert scores["prompts"] == 32 and math.isfinite(scores["reward_mean"]) and "rule_score_mean" in scores
    # the snippet sets what the demo's step 3 sets, with the demo's values (without its rates the critic hardly learnt)
    from dschat.pipeline import TINY_RECIPE

    # (flag -> value; a switch such as --enable_hybrid_engine has none, so the words do not pair up two by two)
    given = {word: value for word, value in zip(TINY_RECIPE[3], TINY_RECIPE[3][1:]) if not value.startswith("--")}
    written = eval(re.search(r"args = (\{.*?\})\n", readme, re.S).group(1))  # (as the README has it)
    # (and its held-out prompts: with step 3's default 64 its scores were of another set than the report's 120)
    for name in ("actor_learning_rate", "critic_learning_rate", "max_prompt_seq_len", "max_answer_seq_len",
                 "per_device_generation_batch_size", "per_device_training_batch_size", "eval_prompts"):
        assert float(written[name]) == float(given["--" + name]), name
    assert written["data_split"] == given["--data_split"]
    from transformers import AutoModelForCausalLM

    from dschat.models.lora import unwrap_peft

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "output" / "step3_notebook")  # the trained actor
    # its with block released its engines (DeepSpeed would keep them otherwise): actor, reference, critic, reward
    from dschat.hybrid_engine import HybridEngine

    assert len(released) == 4 and isinstance(released[0], HybridEngine), released
    trained_weights = unwrap_peft(released[0].module).get_input_embeddings().weight
    assert torch.equal(saved.get_input_embeddings().weight, trained_weights.detach().cpu())
    with pytest.raises(ValueError, match="this DeepSpeedRLHFEngine was released"):  # (and it holds them no more)
        namespace["engine"].actor


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_critic_free_estimators_run_without_a_critic(trained, tmp_path, estimator):
    metrics = ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "2", "--advantage_estimator", estimator,
                                "--n_samples_per_prompt", "2", "--enable_hybrid_engine"))
    assert metrics["iterations"] == 2
    assert not (tmp_path / "ppo" / "critic").exists()
    log = [json.loads(x) for x in (tmp_path / "ppo" / "step3_log.jsonl").read_text().splitlines()]
    # no critic, so no critic loss: not a 0 that reads as a perfect critic
    assert all("critic_loss" not in r for r in log) and all(abs(r["actor_loss"]) < 1e3 for r in log)


def test_grpo_with_rule_reward_function_and_no_reward_model(trained, tmp_path, capsys):
    metrics = ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "2", "--advantage_estimator", "grpo",
                                "--n_samples_per_prompt", "2", "--reward_fn", "tiny", "--reward_model_weight", "0",
                                "--critic_lora_dim", "4", "--critic_learning_rate", "5e-6", "--lam", "0.5"))
    # a critic's flag, which no critic reads, is said to be ignored (a default given explicitly is not), as is GAE's
    out = capsys.readouterr().out
    assert "[step3] --critic_lora_dim 4: the critic's only, and no critic is trained; ignored" in out
    assert "[step3] --lam 0.5 (read only with --advantage_estimator gae): ignored" in out
    assert "[step3] held-out before GRPO:" in out and "[step3] held-out after GRPO:" in out  # (not "PPO")
    assert re.search(r"\[step3\] --critic_model_name_or_path \S+: neither a critic nor a reward model is built "
                     r"\(--advantage_estimator grpo, --reward_model_weight 0\); not loaded", out)
    assert metrics["eval_after"]["reward_mean"] is None and "rule_score_mean" in metrics["eval_after"]
    assert all(e["reward"] is None for e in metrics["eval_after"]["examples"]), "no reward model: no reward, not 0"
    for key in ("eval_before", "eval_after"):  # what is trained on is measured: the function's held-out score
        assert 0.0 <= metrics[key]["reward_fn_mean"] <= 1.0
        assert metrics[key]["reward_fn_mean"] == pytest.approx(metrics[key]["rule_score_mean"])  # tiny = the rules'
        assert all(0.0 <= e["reward_fn"] <= 1.0 for e in metrics[key]["examples"])
    # eval.py on this run, given only the policy: no reward model (the run had none), the run's reward function
    from dschat.tools import ppo_eval

    results = ppo_eval.main(["--policy", str(tmp_path / "ppo")])["policy"]
    assert results["reward_mean"] is None and results["prompts"] == 8
    for key in ("reward_fn_mean", "rule_score_mean"):
        assert results[key] == pytest.approx(metrics["eval_after"][key], abs=1e-4)
    log = [json.loads(x) for x in (tmp_path / "ppo" / "step3_log.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["reward"] <= 1.0 for r in log)  # the rule scorer's range: no reward model added
    # the groups whose two answers scored alike (no advantage): logged, and printed
    assert all(0.0 <= r["frac_reward_zero_std"] <= 1.0 for r in log) and "frac_reward_zero_std=" in out


def test_the_fraction_of_groups_scored_alike_is_what_grpo_cannot_learn_from():
    """TRL's frac_reward_zero_std: a GRPO run whose every group scored alike trained nothing, silently."""
    from dschat.rlhf.algorithms import grpo_advantages, zero_std_fraction

    scores = torch.tensor([1.0, 1.0, 0.0, 2.0, 3.0, 3.0000002, 0.5, 0.5])  # (3.0000002: a reward model's last bits)
    assert zero_std_fraction(scores, 2) == 0.75 and zero_std_fraction(scores, 4) == 0.0
    advantages, _ = grpo_advantages(scores, 2, torch.ones(8, 3))
    assert torch.all(advantages[[0, 1, 6, 7]] == 0) and torch.all(advantages[[2, 3]] != 0)  # (exactly alike: 0)


def test_reward_settings_that_cannot_train_fail_before_anything_loads(tmp_path, monkeypatch, distributed):
    monkeypatch.chdir(tmp_path)  # the defaults output/step1_sft, output/step2_rm do not exist here
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Human: hi Assistant:", "chosen": "a", "rejected": "b"}\n')
    own_data = ["--data_path", f"jsonl:{tmp_path / 'prompts.jsonl'}"]
    with pytest.raises(ValueError, match="--reward_fn tiny .* every other one, but --data_path is jsonl:"):
        ppo.main(["--reward_fn", "tiny", "--reward_model_weight", "0", *own_data])
    with pytest.raises(ValueError, match="--reward_model_weight 0 without --reward_fn"):
        ppo.main(["--reward_model_weight", "0", "--actor_model_name_or_path", "tiny-llama"])
    with pytest.raises(FileNotFoundError, match="the reward model loads from --critic_model_name_or_path "
                                                "output/step2_rm.*--reward_model_weight 0"):
        ppo.main(["--actor_model_name_or_path", "tiny-llama", "--advantage_estimator", "grpo", "--n_samples_per_prompt",
                  "2", "--reward_fn", "tiny"])
    with pytest.raises(FileNotFoundError, match="the actor loads from --actor_model_name_or_path output/step1_sft"):
        ppo.main([])
    # PPO rewarded by the function alone: step 2 is no step of it, a critic may start from the actor
    with pytest.raises(FileNotFoundError, match=r"the critic loads from --critic_model_name_or_path output/step2_rm.*"
                                                r"\(a critic may start from the actor, --critic_model_name_or_path "
                                                r"tiny-llama, with a new value head\), or use a critic-free"):
        ppo.main(["--actor_model_name_or_path", "tiny-llama", "--reward_fn", "tiny", "--reward_model_weight", "0"])
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.reward_fn import check_reward_sources

    check_reward_sources(step3_args({"reward_fn": "tiny", "reward_model_weight": 0, "data_path": "tiny"}))  # notebook


def test_a_reward_function_weighted_0_without_a_reward_model_is_refused():
    """Every score 0, so every advantage 0: the run trained nothing, silently, calling the function each batch."""
    from dschat.errors import UsageError
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.reward_fn import check_reward_sources

    with pytest.raises(UsageError, match="--reward_fn_weight 0 with --reward_model_weight 0 leaves no reward"):
        check_reward_sources(step3_args({"reward_fn": "tiny", "reward_fn_weight": 0, "reward_model_weight": 0,
                                         "data_path": "tiny"}))
    check_reward_sources(step3_args({"reward_fn": "tiny", "reward_fn_weight": 0, "data_path": "tiny"}))  # monitored


def test_train_py_grpo_on_own_data_asks_for_a_reward_function(tmp_path, distributed):
    import runpy

    from dschat import pipeline

    parse = runpy.run_path(str(REPO / "train.py"))["parse_args"]
    data = tmp_path / "mine.jsonl"  # there: the data paths are checked too
    data.write_text("".join(json.dumps({"prompt": f"Human: hi {i} Assistant:", "chosen": " hello"}) + "\n"
                            for i in range(100)))  # (enough for one step-3 iteration: train.py counts them first)
    args = parse(["--recipe", "grpo", "--data-path", f"jsonl:{data}", "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--reward_fn tiny .*inside --step3-args"):
        pipeline.check_step_args([1, 3], args, True, {1: step1_parser, 3: step3_parser})
    (tmp_path / "mine.py").write_text("def score(prompts, answers):\n    return [0.0] * len(prompts)\n")
    own = parse(["--recipe", "grpo", "--data-path", f"jsonl:{data}", "--output-dir", str(tmp_path),
                 "--step3-args", f"--reward_fn {tmp_path / 'mine.py'}:score"])
    pipeline.check_step_args([1, 3], own, True, {1: step1_parser, 3: step3_parser})  # the user's function replaces
    # the rule scorer


def test_a_notebooks_reward_function_may_be_the_function_itself(trained, tmp_path, capsys):
    """``args["reward_fn"]`` a Python function, as TRL's reward_funcs: it failed in the trainer, after every model
    had loaded, with "argument of type 'function' is not iterable"."""
    seen, prompts_seen = [], []

    def length_score(prompts, answers):
        seen.append(len(answers))
        prompts_seen.append(prompts)
        return [float(len(a)) for a in answers]

    engine, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, enable_hybrid_engine=True,
                                                     advantage_estimator="grpo", n_samples_per_prompt=2,
                                                     reward_fn=length_score, reward_model_weight=0)
    out = trainer.generate_experience(_prompt_batch(tokenizer, ["\n\nHuman: Say hi.\n\nAssistant:"] * 2))
    assert seen == [4] and engine.critic is None and engine.reward is None
    # no num_total_iters nor max_steps: the schedule's assumed length is said (a notebook loop barely decayed it)
    assert "[step3] the learning-rate schedule spans 10000 optimizer steps" in capsys.readouterr().out
    texts = [tokenizer.decode(row[m.bool()], skip_special_tokens=True).strip()
             for row, m in zip(out["input_ids"][:, out["prompts"].shape[1]:], out["action_mask"])]
    assert out["rewards"].tolist() == [float(len(t)) for t in texts]
    assert torch.isfinite(trainer.train_rlhf(out)[0])
    # the function gets the same prompt text from a loader's batch, a (prompts, mask) pair and a tokenizer's output,
    # special tokens (a chat template's markers) kept: the latter two dropped them
    marked = [f"\n\nHuman: Say hi.{tokenizer.eos_token}\n\nAssistant:", "\n\nHuman: Go on.\n\nAssistant:"]
    batch = _prompt_batch(tokenizer, marked)
    tokenizer.padding_side = "left"
    for given in (batch, (batch["prompt"], batch["prompt_att_mask"]), tokenizer(marked, padding=True,
                                                                                return_tensors="pt")):
        prompts_seen.clear()
        trainer.generate_experience(*given) if isinstance(given, tuple) else trainer.generate_experience(given)
        assert prompts_seen == [[text for text in marked for _ in range(2)]]


def test_failing_reward_function_stops_with_the_prompt(trained, tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def score(prompts, answers):\n    raise ValueError('cannot score this')\n")
    with pytest.raises(ValueError, match=r"--reward_fn 'score' failed \(ValueError: cannot score this, at "
                                         r"bad_reward.py:2\).*Human:"):
        ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "1", "--reward_fn", f"{bad}:score"))


def test_a_reward_function_failing_on_one_rank_stops_every_rank(trained, tmp_path, monkeypatch):
    """A function that raised on one rank stopped that rank alone, and the others waited in the next collective: the
    ranks now agree after each call (as on refused prompts), and the others say another rank's function failed."""
    from dschat.errors import UsageError
    from dschat.hybrid_engine import tensor_parallel
    from dschat.utils import dist as dist_utils

    def score(prompts, answers):
        if fail:
            raise ValueError("cannot score this")
        return [1.0] * len(answers)

    _, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, advantage_estimator="grpo", n_samples_per_prompt=2,
                                                reward_fn=score, reward_model_weight=0)
    agreed = []  # what this rank told the others after each reward-function call (the prompt check's too)
    monkeypatch.setattr(dist_utils, "get_world_size", lambda: 2)  # (read by tensor_parallel.together)
    scoring = lambda: len(agreed) % 2 == 0  # noqa: E731 (each batch: the prompts' check, then the scores')
    monkeypatch.setattr(tensor_parallel, "ranks_agree",
                        lambda ok, device: agreed.append(ok) or (ok and not (other_failed and scoring())))
    batch = _prompt_batch(tokenizer, ["\n\nHuman: Say hi.\n\nAssistant:"] * 2)
    fail, other_failed = False, True
    with pytest.raises(UsageError, match="the reward function failed on another rank .* every rank stops"):
        trainer.generate_experience(batch)
    fail, other_failed = True, False
    with pytest.raises(UsageError, match=r"'score' failed \(ValueError: cannot score this"):
        trainer.generate_experience(batch)
    assert agreed == [True, True, True, False]  # (prompts, scores) twice: this rank's failure was told the others
    # the held-out evaluation's calls too (a fresh run's first call), a rank of padding rows alone included
    from dschat.rlhf.evaluation import _agreed_scored_rows

    agreed.clear()
    monkeypatch.setattr(tensor_parallel, "ranks_agree", lambda ok, device: agreed.append(ok) or (ok and not other_failed))
    batch = {"prompt_text": ["p1", "p2"]}
    fail, other_failed = False, True
    with pytest.raises(UsageError, match="held-out evaluation: the reward function failed on another rank"):
        _agreed_scored_rows(score, batch, ["a", "b"], [0.0, 0.0], "cpu")  # (padding rows: not called, still agrees)
    fail, other_failed = True, False
    with pytest.raises(UsageError, match=r"'score' failed \(ValueError"):
        _agreed_scored_rows(score, batch, ["a", "b"], [1.0, 1.0], "cpu")
    assert agreed == [True, False]
    # a generator's body runs when its scores are read: its failure is the function's, said as such
    with pytest.raises(UsageError, match=r"'lazy' failed \(ZeroDivisionError"):
        _agreed_scored_rows(lambda_free_lazy, batch, ["a", "b"], [1.0, 1.0], "cpu")


ONE_RANK_QUITS = """
import sys

from dschat.utils.cli import run_script


def main():
    from dschat.rlhf.evaluation import _agreed_scored_rows
    from dschat.utils.dist import ensure_distributed

    rank, _ = ensure_distributed()

    def score(prompts, answers):
        if rank == 1:
            sys.exit(0)
        return [1.0] * len(answers)

    _agreed_scored_rows(score, {"prompt_text": ["p1"]}, ["a"], [1.0], "cpu")
    print(f"rank {rank} scored")


run_script(main)
"""


def test_a_reward_function_calling_sys_exit_on_one_rank_stops_every_rank_with_its_error(tmp_path):
    """Two CPU ranks, the function calls sys.exit(0) on rank 1 only: that rank ended with status 0 and no word, rank 0
    stopped on the closed connection saying only that another rank stopped. Rank 1 now says the function failed,
    rank 0 that it failed on another rank, and the launch fails."""
    script = tmp_path / "one_rank_quits.py"
    script.write_text(ONE_RANK_QUITS)
    proc = run_deepspeed(script, check=False, timeout=240)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said[-3000:]
    assert "error: --reward_fn 'score' failed (SystemExit: 0, at one_rank_quits.py:" in said, said[-3000:]
    assert "the reward function failed on another rank" in said, said[-3000:]
    assert "scored" not in said


def lambda_free_lazy(prompts, answers):
    return (1 / 0 for _ in answers)


lambda_free_lazy.__name__ = "lazy"


def test_the_notebook_api_checks_its_settings_before_any_model_loads(monkeypatch):
    """``temperature=0`` from a notebook failed at the first generation, after every model had loaded (the command
    line refuses it at once); a list of reward functions (TRL's reward_funcs) with "unhashable type: 'list'"."""
    from dschat.errors import UsageError
    from dschat.rlhf import engine

    monkeypatch.setattr(engine, "setup_run", lambda *a, **k: pytest.fail("went on past the settings"))
    for settings, message in (({"temperature": 0}, r"--temperature 0: sampling needs a temperature > 0"),
                              ({"kl_ctl": -1}, r"kl_ctl: expected a number >= 0, got -1"),
                              ({"repetition_penalty": 0}, r"--repetition_penalty 0: must be a finite number > 0"),
                              ({"repetition_penalty": float("nan")}, r"--repetition_penalty nan: must be"),
                              ({"reward_fn": [len, len]}, r"reward_fn is a list: give one function")):
        with pytest.raises(UsageError, match=message):
            engine.DeepSpeedRLHFEngine(args={"actor_model_name_or_path": "x", **settings})
    from types import SimpleNamespace

    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    with pytest.raises(UsageError, match=r"--temperature 0: sampling needs"):  # the trainer's settings of its own
        DeepSpeedPPOTrainer(engine=SimpleNamespace(actor=None), args={"temperature": 0})


@pytest.mark.parametrize("template", [None, "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
                                                "{{ m['content'] }}\n{% endfor %}<|assistant|>"], ids=["plain", "chat"])
def test_prompt_texts_from_ids_are_the_loaders_prompt_text(template):
    """What the reward function gets from a (prompts, mask) pair equals the loader's prompt_text: the BOS the tokenizer
    adds is not in it, the one a chat template writes is, and the template's markers are kept."""
    from tokenizers.processors import TemplateProcessing

    from dschat.data import DataCollatorRLHF
    from dschat.data.formatting import format_prompt, uses_chat_template
    from dschat.data.pipeline import tokenize_texts
    from dschat.rlhf.trainer import prompt_texts
    from dschat.tiny import load_tiny_tokenizer

    tokenizer = load_tiny_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.convert_tokens_to_ids("<s>")
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                             special_tokens=[("<s>", bos)])
    tokenizer.chat_template = template
    texts = [format_prompt([{"role": "user", "content": content}], tokenizer)
             for content in (f"Say hi.{tokenizer.eos_token}", "Go on.")]
    ids = tokenize_texts(tokenizer, texts, add_special_tokens=not uses_chat_template(tokenizer))
    assert all(row[0] == bos for row in ids)
    batch = DataCollatorRLHF(40, pad_token_id=tokenizer.pad_token_id)([{"prompt_input_ids": torch.tensor(row), "prompt_text": text}
                                                          for row, text in zip(ids, texts)])
    assert prompt_texts(tokenizer, batch["prompt"], batch["prompt_att_mask"]) == texts


def test_a_reward_function_that_takes_the_id_of_one_gone_still_gets_its_renamed_columns_note(capsys):
    """The note that a data column comes to the reward function as extra_<name> was said once per id(fn): a function
    made after an earlier one was freed (a notebook cell run again) often takes its id, and its note was never said.
    Each new function gets it (once), and a function's entry goes with it."""
    import gc

    from dschat.rlhf import reward_fn

    def made():
        def score(prompts, answers):
            return [0.0] * len(answers)
        return score

    ids = []
    for _ in range(20):  # (CPython gives a freed function's memory to the next one: the id comes again)
        fn = made()
        ids.append(id(fn))
        for _ in range(2):
            reward_fn.call_reward_fn(fn, ["p"], ["a"], {"answers": ["reference"]})
        assert capsys.readouterr().out.count("the data's column(s) answers come to 'score' as extra_answers") == 1
        del fn
        gc.collect()
        assert not set(ids) & set(reward_fn._RENAMED_SAID)
    assert len(set(ids)) < len(ids), "the premise: a new function took a freed one's id"


def test_reward_function_columns_named_as_its_arguments_and_a_file_run_once(tmp_path, capsys):
    """A column named as the function's positional parameter collided with it ("got multiple values for argument
    'answers'"); a reward file was run once for each check and load (four times a step-3 run)."""
    import os

    from dschat.errors import UsageError
    from dschat.rlhf.reward_fn import call_reward_fn, load_reward_fn

    def trl_style(prompts, completions, **columns):
        return [float(len(c) + len(ref) + len(other)) for c, ref, other in
                zip(completions, columns["extra_completions"], columns["answers"])]

    extras = {"completions": ["x", "yyy"], "answers": ["u", "vv"]}
    assert call_reward_fn(trl_style, ["p1", "p2"], ["a", "bb"], extras) == [3.0, 7.0]
    call_reward_fn(trl_style, ["p1", "p2"], ["a", "bb"], extras)  # said once, not each batch
    assert capsys.readouterr().out.count("[reward_fn] the data's column(s) completions come to 'trl_style' as "
                                         "extra_completions: it is called as fn(prompts=, completions=") == 1
    assert call_reward_fn(lambda prompts, answers, extra_answers: [len(x) for x in extra_answers], ["p1", "p2"],
                          ["a", "bb"], extras) == [1.0, 2.0]

    def accuracy(completions, solution, **kwargs):  # TRL's accuracy_reward: called by keyword, as TRL calls it
        assert kwargs["prompts"] == ["p1", "p2"]
        return [float(s in c) for c, s in zip(completions, solution)]

    assert call_reward_fn(accuracy, ["p1", "p2"], ["it is 4", "5"], {"solution": ["4", "6"]}) == [1.0, 0.0]
    assert call_reward_fn(lambda completions, **kw: [len(c) for c in completions], ["p1"], ["abc"]) == [3.0]
    with pytest.raises(UsageError, match=r"--reward_fn '<lambda>' cannot be called as fn\(prompts, answers, "
                                         r"\*\*columns\): too many positional arguments"):
        call_reward_fn(lambda texts: [0.0] * len(texts), ["p1"], ["abc"])
    log = tmp_path / "runs.log"
    source = tmp_path / "my_rewards.py"
    source.write_text(f"open({str(log)!r}, 'a').write('run\\n')\ndef score(p, a):\n    return [0.0] * len(a)\n")
    for _ in range(3):
        load_reward_fn(f"{source}:score")
    assert log.read_text() == "run\n"
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))  # edited: run again
    load_reward_fn(f"{source}:score")
    assert log.read_text() == "run\nrun\n"


def test_a_reward_function_taking_a_column_the_prompts_lack_is_refused_before_the_models_load(tmp_path):
    """A function with a parameter no column of the prompts gives (TRL's ``solution=`` on data without it, a misspelt
    name) failed at the first reward, after the models had loaded and the first answers were generated. Step 3's
    prompt loaders (ppo_eval's too) refuse it, naming the function, the split and the columns it has."""
    from dschat.errors import UsageError
    from dschat.tiny import load_tiny_tokenizer

    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Add 1 and {i}.", "solution": str(i + 1)}) + "\n"
                            for i in range(8)))
    args = {"data_path": [f"{data},{data}"], "data_split": "0,0,1", "data_output_path": str(tmp_path / "data"),
            "per_device_generation_batch_size": 2}
    tokenizer = load_tiny_tokenizer()

    def misspelt(prompts, completions, solutions):
        return [0.0] * len(prompts)

    said = (r"--reward_fn 'misspelt' cannot be called as fn\(prompts=, completions=, \*\*columns\) \(TRL's way\) "
            r"on the {} prompts, which have columns solution: missing a required argument: 'solutions'")
    with pytest.raises(UsageError, match=said.format("training")):
        ppo.prompt_loaders({**args, "reward_fn": misspelt}, tokenizer)
    with pytest.raises(UsageError, match=said.format("held-out")):
        ppo.prompt_loaders({**args, "reward_fn": misspelt}, tokenizer, held_out_only=True)
    for fn in (lambda prompts, completions, solution: [0.0], lambda prompts, answers, hint=None, **columns: [0.0]):
        train, held_out = ppo.prompt_loaders({**args, "reward_fn": fn}, tokenizer)
        assert len(train) and len(held_out)


def test_a_reward_function_gets_prompts_and_answers_by_their_parameters_names_not_swapped():
    """Called by position, score(answers, prompts) scored each prompt as the answer and the other way round, and
    OpenRLHF's reward_func(queries, prompts, labels) (with a labels column) got the answers as its prompts: both
    silently. Parameters named prompts and answers now get them by name, in any order (keyword-only too); a second
    parameter named prompts that would get the answers is an error."""
    from dschat.errors import UsageError
    from dschat.rlhf.reward_fn import call_reward_fn

    def swapped(answers, prompts):
        return [float(a == "right answer" and p == "the prompt") for a, p in zip(answers, prompts)]

    def keyword_only(*, prompts, answers, solution):
        return [float(a == s and p == "the prompt") for p, a, s in zip(prompts, answers, solution)]

    assert call_reward_fn(swapped, ["the prompt"], ["right answer"]) == [1.0]
    assert call_reward_fn(keyword_only, ["the prompt"], ["right answer"], {"solution": ["right answer"]}) == [1.0]
    assert call_reward_fn(lambda prompts, answers: [float(p < a) for p, a in zip(prompts, answers)], ["a"], ["b"]) \
        == [1.0]  # (the documented order: unchanged)
    assert call_reward_fn(lambda p, a: [float(p[0] < a[0])], ["a"], ["b"]) == [1.0]  # (other names: by position)

    def reward_func(queries, prompts, labels):
        return [0.0] * len(queries)

    with pytest.raises(UsageError, match=r"--reward_fn 'reward_func': its second parameter is named 'prompts' but "
                                         r"would get the answers: .*by position.*\(OpenRLHF's queries are prompt \+ "
                                         r"answer"):
        call_reward_fn(reward_func, ["p1"], ["a1"], {"labels": ["4"]})
    with pytest.raises(UsageError, match=r"--reward_fn '<lambda>': its second parameter is named 'prompts'"):
        call_reward_fn(lambda texts, prompts: [0.0], ["p1"], ["a1"])


def test_a_reward_function_module_that_does_not_exist_names_the_flag(tmp_path, monkeypatch):
    from dschat.rlhf.reward_fn import load_reward_fn

    with pytest.raises(ModuleNotFoundError, match=r"--reward_fn 'no_such_scorer:score': no module 'no_such_scorer'"):
        load_reward_fn("no_such_scorer:score")
    (tmp_path / "needs_more.py").write_text("import needs\ndef score(p, a):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="^No module named 'needs'"):  # a missing dependency says so itself
        load_reward_fn("needs_more:score")
    broken = tmp_path / "broken.py"  # a syntax error: one line naming the file and line, not a traceback
    broken.write_text("def score(p, a):\n    return [0.0 for x in a\n")
    from dschat.errors import UsageError

    with pytest.raises(UsageError, match=rf"--reward_fn file {broken}: {broken} line 2: .*'return \[0.0 for x in a'"):
        load_reward_fn(f"{broken}:score")
    importer = tmp_path / "imports_broken.py"  # the error is in the module it imports: that file is named
    importer.write_text("import broken\ndef score(p, a):\n    return [0.0] * len(a)\n")
    with pytest.raises(UsageError, match=rf"--reward_fn file {importer}: {broken} line 2"):
        load_reward_fn(f"{importer}:score")
    # given as a module, the same one line (it was importlib's SyntaxError traceback)
    (tmp_path / "unparsed_module.py").write_text(broken.read_text())
    with pytest.raises(UsageError, match=rf"--reward_fn module unparsed_module: {tmp_path / 'unparsed_module.py'} "
                                         rf"line 2: .*'return \[0.0 for x in a'"):
        load_reward_fn("unparsed_module:score")


def test_a_reward_function_file_calling_sys_exit_as_it_loads_is_a_usage_error_naming_its_line(tmp_path, monkeypatch):
    """A reward file with script code outside `if __name__ == "__main__":` (a self-test ending in sys.exit(0), an
    argparse parser reading the step's command line) ended the run as it loaded, with status 0 and no word for
    sys.exit(0): the step had not trained. It is a UsageError naming the file, its line and the way out."""
    from dschat.errors import UsageError
    from dschat.rlhf.reward_fn import load_reward_fn

    script = tmp_path / "self_testing.py"
    script.write_text("import sys\n\n\ndef score(prompts, answers):\n    return [1.0] * len(answers)\n\n\n"
                      "assert score(['p'], ['a']) == [1.0]\nsys.exit(0)\n")
    with pytest.raises(UsageError, match=rf"^--reward_fn file {script} called sys.exit\(0\) while it loaded, at "
                                         r"self_testing.py:9: .*`if __name__ == \"__main__\":`$"):
        load_reward_fn(f"{script}:score")
    parsing = tmp_path / "parsing_rewards.py"  # (argparse exits from its own file: the line of the user's is said)
    parsing.write_text("import argparse\nparser = argparse.ArgumentParser()\nparser.add_argument('--scale')\n"
                       "flags = parser.parse_args(['--no_such_flag'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match=r"^--reward_fn module parsing_rewards called sys.exit\(2\) while it loaded, "
                                         r"at parsing_rewards.py:4: "):
        load_reward_fn("parsing_rewards:score")
    assert "parsing_rewards" not in sys.modules


def test_a_reward_function_file_loads_as_an_imported_module_would(tmp_path):
    """A file's module was in no sys.modules: a dataclass under `from __future__ import annotations` failed to load
    ("'NoneType' object has no attribute '__dict__'"), and pickling the file's functions (a multiprocessing pool of a
    math checker) failed in the function."""
    import pickle

    from dschat.rlhf.reward_fn import call_reward_fn, load_reward_fn

    source = tmp_path / "typed_rewards.py"
    source.write_text("from __future__ import annotations\nimport dataclasses, pickle\n\n\n@dataclasses.dataclass\n"
                      "class Weights:\n    length: float = 0.5\n\n\ndef check(answer):\n    return len(answer)\n\n\n"
                      "def score(prompts, answers):\n    check_again = pickle.loads(pickle.dumps(check))\n"
                      "    return [Weights().length * check_again(a) for a in answers]\n")
    fn = load_reward_fn(f"{source}:score")
    assert call_reward_fn(fn, ["p1", "p2"], ["ab", "abcd"]) == [1.0, 2.0]
    assert pickle.loads(pickle.dumps(fn)) is fn


def test_a_reward_function_file_that_fails_to_load_leaves_no_module_in_sys_modules(tmp_path):
    """A file's module is registered in sys.modules while it runs: one that raised (or did not parse) is taken out
    again, as a failed import's is, so no half-run module is left for pickle or a later lookup to find."""
    from dschat.errors import UsageError
    from dschat.rlhf.reward_fn import load_reward_fn

    before = set(sys.modules)
    raising = tmp_path / "raising_rewards.py"
    raising.write_text("raise RuntimeError('no scorer here')\ndef score(p, a):\n    return [0.0] * len(a)\n")
    with pytest.raises(RuntimeError, match="no scorer here"):
        load_reward_fn(f"{raising}:score")
    unparsed = tmp_path / "unparsed_rewards.py"
    unparsed.write_text("def score(p, a):\n    return [0.0 for x in a\n")
    with pytest.raises(UsageError, match="line 2"):
        load_reward_fn(f"{unparsed}:score")
    assert not [name for name in set(sys.modules) - before if name.startswith("dschat_reward_fn_")]


def test_a_reward_functions_errors_quote_a_long_prompt_and_answer_by_their_ends():
    """The errors about a reward function's value or failure quoted the whole prompt and answer, thousands of
    characters of a long one (a document to summarize), around the point of the message. Each now comes as its start
    and end (the end of a formatted prompt holds its last question) and its length."""
    from dschat.errors import UsageError, excerpt
    from dschat.rlhf.reward_fn import call_reward_fn, weighted_scores

    prompt = "\n\nHuman: Summarize this: " + "word " * 2000 + "What is it about?\n\nAssistant:"
    answer = "It is about " + "words, " * 1000 + "in the end."
    short = excerpt(prompt)
    assert short.startswith("'\\n\\nHuman: Summarize this: word") and short.endswith("about?\\n\\nAssistant:'")
    assert f"({len(prompt):,} characters in all)" in short and len(short) < 200
    assert excerpt("Say hi.") == "'Say hi.'" and excerpt(list(range(1000))).startswith("[0, 1, 2")

    def failing(prompts, answers):
        raise ValueError("no judge")

    def nan(prompts, answers):
        return [float("nan")] * len(answers)

    def wrong_count(prompts, answers):
        return []

    for fn in (failing, nan, wrong_count):
        with pytest.raises(UsageError) as raised:
            call_reward_fn(fn, [prompt], [answer])
        said = str(raised.value)
        assert short in said and len(said) < 600, said
    with pytest.raises(UsageError) as raised:
        call_reward_fn(nan, [prompt], [answer])
    assert f"for prompt {short} and answer {excerpt(answer)}: each score" in str(raised.value)
    with pytest.raises(UsageError) as raised:
        weighted_scores(nan, [1e39], 1.0, [prompt], [answer])
    assert f"for prompt {short} and answer {excerpt(answer)}: 1e+39" in str(raised.value)


def test_a_failing_reward_function_is_a_usage_error_naming_it_and_the_prompt(tmp_path):
    """The user's function needs the fix: one "error:" line and exit status 2 from the entry points (it was a
    RuntimeError and a traceback through dschat), naming the function, the prompt and where it raised."""
    from dschat.errors import UsageError
    from dschat.rlhf.reward_fn import call_reward_fn, load_reward_fn

    def nan_second(prompts, answers):
        return [1.0, float("nan")]

    def raises(prompts, answers):
        return [1 / 0 for _ in answers]

    def strings(prompts, answers):
        return ["1"] * len(answers)

    cases = ((nan_second, r"--reward_fn 'nan_second' returned nan for prompt 'p2'"),
             (raises, r"--reward_fn 'raises' failed \(ZeroDivisionError: .*, at test_ppo.py:\d+\) on a batch "
                      r"starting with prompt 'p1'"),
             (lambda p, a: [1.0], r"returned 1 score for 2 answers \(one per answer\) on a batch starting with "
                                  r"prompt 'p1'"),
             (strings, r"--reward_fn 'strings' returned '1' for prompt 'p1'.*must be a finite number"),
             (lambda p, a: None, r"returned NoneType None, not a list of 2 numbers \(one score per answer\)"),
             (lambda p, a: 0.5, r"returned float 0.5, not a list of 2 numbers"),
             (lambda p, a: {"rewards": [1.0, 0.0], "scores": [1.0, 0.0], "extra_logs": {}},
              r"returned dict \{'rewards'.*not a list of 2 numbers"),
             (lambda p, a: torch.ones(2, 1), r"returned Tensor of shape \(2, 1\), not a list of 2 numbers"))
    for fn, message in cases:
        with pytest.raises(UsageError, match=message) as raised:
            call_reward_fn(fn, ["p1", "p2"], ["a1", "a2"])
        assert "\n" not in str(raised.value)  # printed as one line
    with pytest.raises(UsageError, match=r"returned 2 scores for 1 answer \(one per answer\)"):  # (not "1 answers")
        call_reward_fn(lambda p, a: [1.0, 0.0], ["p1"], ["a1"])
    with pytest.raises(UsageError, match=r"returned NoneType None, not a list of 1 number \(one score per answer\)"):
        call_reward_fn(lambda p, a: None, ["p1"], ["a1"])
    for several in ([nan_second, raises], (nan_second,)):  # TRL's reward_funcs habit
        with pytest.raises(UsageError, match=r"reward_fn is a (list|tuple): give one function .*not several"):
            load_reward_fn(several)
    assert call_reward_fn(lambda p, a: [1, torch.tensor(0.5)], ["p1", "p2"], ["a1", "a2"]) == [1.0, 0.5]
    assert call_reward_fn(lambda p, a: torch.tensor([1.0, 0.5]), ["p1", "p2"], ["a1", "a2"]) == [1.0, 0.5]
    assert call_reward_fn(lambda p, a: (0, 1), ["p1", "p2"], ["a1", "a2"]) == [0.0, 1.0]
    assert call_reward_fn(lambda p, a: (len(x) for x in a), ["p1", "p2"], ["a", "bb"]) == [1.0, 2.0]


def test_an_async_reward_function_is_awaited_in_one_loop_kept_between_calls():
    """TRL's reward functions may be ``async def`` (a judge model over HTTP): one was refused as "returned coroutine
    ..., not a list" (and warned "never awaited"). It is now awaited, in the same event loop at each call (a client
    kept by the function stays usable), also from a caller that runs an event loop itself (a notebook)."""
    import asyncio

    from dschat.errors import UsageError
    from dschat.rlhf.reward_fn import call_reward_fn

    loops = []

    async def judge(prompts, completions, **kwargs):
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]

    async def failing(prompts, answers):
        await asyncio.sleep(0)
        raise ValueError("judge unreachable")

    assert call_reward_fn(judge, ["p1", "p2"], ["a", "bb"]) == [1.0, 2.0]

    async def notebook_cell():
        return call_reward_fn(judge, ["p1"], ["ccc"])

    assert asyncio.run(notebook_cell()) == [3.0]
    assert len(loops) == 2 and loops[0] is loops[1] and loops[0].is_running()
    with pytest.raises(UsageError, match=r"--reward_fn 'failing' failed \(ValueError: judge unreachable, at "
                                         r"test_ppo.py:\d+\) on a batch starting with prompt 'p1'"):
        call_reward_fn(failing, ["p1"], ["a"])


def test_a_reward_functions_error_names_the_line_of_its_own_code(tmp_path):
    """An exception raised in a library the function called (json.loads) was said "at decoder.py:355", not at the
    function's line that called it; an async function's timeout (a judge model's request) came as "TimeoutError: , at
    _base.py:401" (run_coroutine_threadsafe gives asyncio's TimeoutError and CancelledError as new exceptions, without
    their traceback), and its CancelledError (a BaseException) escaped as a traceback. Each names the function's own
    line ("from FILE:LINE" where the innermost frame is elsewhere); an exception without a message, its type alone."""
    from dschat.errors import UsageError
    from dschat.rlhf.reward_fn import call_reward_fn, load_reward_fn

    source = tmp_path / "rewards.py"
    source.write_text("import asyncio\nimport json\n\n\n"
                      "def parse(prompts, answers):\n    return [float(json.loads(a)) for a in answers]\n\n\n"
                      "async def judge(prompts, answers):\n    await asyncio.wait_for(asyncio.sleep(10), 0.01)\n\n\n"
                      "async def cancelled(prompts, answers):\n    raise asyncio.CancelledError()\n")
    said = {"parse": r"JSONDecodeError: Expecting value: line 1 column 1 \(char 0\), at decoder.py:\d+, from "
                     r"rewards.py:6",
            "judge": r"TimeoutError, at \w+.py:\d+, from rewards.py:10",
            "cancelled": r"CancelledError, at rewards.py:14"}
    for name, error in said.items():
        with pytest.raises(UsageError, match=rf"^--reward_fn '{name}' failed \({error}\) on a batch starting with "
                                             r"prompt 'p1'$"):
            call_reward_fn(load_reward_fn(f"{source}:{name}"), ["p1"], ["not json"])


def test_a_reward_function_calling_sys_exit_fails_as_the_function_and_ctrl_c_still_interrupts():
    """sys.exit() in a reward function (SystemExit, not an Exception) escaped dschat's wrapping: that rank ended alone
    (with status 0 for sys.exit(0)) while the others hung in the next collective, which agrees on UsageErrors only;
    in an async one it ended dschat's loop thread and the call waited forever. It is now the function's error, naming
    it and the prompt; a KeyboardInterrupt still interrupts, and the loop goes on for the next call."""
    import concurrent.futures

    from dschat.errors import UsageError
    from dschat.rlhf.reward_fn import call_reward_fn

    def quits(prompts, answers):
        sys.exit(0)

    async def quits_async(prompts, answers):
        sys.exit("no judge")

    async def interrupted(prompts, answers):
        raise KeyboardInterrupt

    async def fine(prompts, answers):
        return [1.0] * len(answers)

    with pytest.raises(UsageError, match=r"^--reward_fn 'quits' failed \(SystemExit: 0, at test_ppo.py:\d+\) on a "
                                         r"batch starting with prompt 'p1'$"):
        call_reward_fn(quits, ["p1"], ["a"])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # (a hang fails the test instead of stopping the suite)
        with pytest.raises(UsageError, match=r"'quits_async' failed \(SystemExit: no judge"):
            pool.submit(call_reward_fn, quits_async, ["p1"], ["a"]).result(timeout=20)
        with pytest.raises(KeyboardInterrupt):
            pool.submit(call_reward_fn, interrupted, ["p1"], ["a"]).result(timeout=20)
        assert pool.submit(call_reward_fn, fine, ["p1"], ["a"]).result(timeout=20) == [1.0]


def test_an_async_reward_function_interrupted_while_awaited_is_cancelled(monkeypatch):
    """Ctrl-C while an async reward function was awaited left its coroutine running on dschat's loop thread (a judge
    request going on after the run stopped); it is cancelled."""
    import asyncio
    import concurrent.futures
    import threading

    from dschat.rlhf.reward_fn import call_reward_fn

    started, cancelled = threading.Event(), threading.Event()

    async def slow_judge(prompts, answers):
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return [1.0] * len(answers)

    def ctrl_c_while_waiting(self, timeout=None):
        started.wait(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(concurrent.futures.Future, "result", ctrl_c_while_waiting)
    with pytest.raises(KeyboardInterrupt):
        call_reward_fn(slow_judge, ["p1"], ["a"])
    assert cancelled.wait(10)


def test_a_reward_too_large_for_a_float_is_refused_as_not_finite():
    """An int past float's range raised a bare OverflowError from dschat, naming neither the function nor the answer."""
    from dschat.errors import UsageError
    from dschat.rlhf.reward_fn import call_reward_fn

    with pytest.raises(UsageError, match=r"returned 1000\d+ \.\.\. \(401 characters in all\) \.\.\. 000+ for prompt "
                                         r"'p2' and answer 'a2': each score must be a finite number"):
        call_reward_fn(lambda p, a: [1, 10 ** 400], ["p1", "p2"], ["a1", "a2"])


def test_a_reward_past_float32s_range_is_the_functions_error_naming_the_answer(trained, tmp_path):
    """1e39 is a finite Python float but inf as step 3's float32 reward: generate_experience raised "reward scores is
    not finite" (FloatingPointError), naming neither the function nor the answer; so did a score the weight took
    past the range."""
    from dschat.errors import UsageError
    from dschat.rlhf.reward_fn import weighted_scores

    def score(prompts, answers):
        return [1e39 if i == 1 else 0.0 for i in range(len(answers))]

    _, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, advantage_estimator="grpo", n_samples_per_prompt=2,
                                                reward_fn=score, reward_model_weight=0)
    with pytest.raises(UsageError, match=r"--reward_fn 'score' returned 1e\+39 for prompt '.*Say hi.*and "
                                         r"answer .*: 1e\+39 is past the range of step 3's float32 rewards"):
        trainer.generate_experience(_prompt_batch(tokenizer, ["\n\nHuman: Say hi.\n\nAssistant:"] * 2))
    with pytest.raises(UsageError, match=r"returned 1e\+37 for prompt 'p2' and answer 'a2': 1e\+37 times "
                                         r"--reward_fn_weight 100.0 is past the range"):
        weighted_scores(score, [0.5, 1e37], 100.0, ["p1", "p2"], ["a1", "a2"])
    held = weighted_scores(score, [0.5, 3e38], 1.0, ["p1", "p2"], ["a1", "a2"])
    assert held.dtype == torch.float32 and held.tolist() == pytest.approx([0.5, 3e38])


def test_a_complex_or_unreadable_reward_is_refused_as_no_finite_number():
    """numpy's complex scores trained on their real part alone (float() drops the imaginary one with a warning);
    torch's, and a tensor on the meta device, raised a bare RuntimeError from dschat naming neither function nor
    answer."""
    import numpy as np

    from dschat.errors import UsageError
    from dschat.rlhf.reward_fn import call_reward_fn

    # (numpy 1 writes a complex scalar as (1+2j), numpy 2 as np.complex128(1+2j))
    for returned, shown in ((lambda: [0.5, np.complex128(1 + 2j)], r"\S*1\+2j\)? for prompt 'p2'"),
                            (lambda: [0.5, np.complex64(1 + 2j)], r"\S*1\+2j\)? for prompt 'p2'"),
                            (lambda: torch.tensor([0.5, 1 + 2j]), r"tensor\(0.5000\+0.j\) for prompt 'p1'"),
                            (lambda: [0.5, 1 + 0j], r"\(1\+0j\) for prompt 'p2'"),
                            (lambda: torch.zeros(2, device="meta"), r"tensor\(..., device='meta', size=\(\)\) for "
                                                                    r"prompt 'p1'")):
        with pytest.raises(UsageError, match=rf"--reward_fn 'score' returned {shown} and answer 'a\d': each score "
                                             rf"must be a finite number"):
            call_reward_fn(_named_score(returned), ["p1", "p2"], ["a1", "a2"])
    assert call_reward_fn(_named_score(lambda: torch.tensor([0.5, 1.0], dtype=torch.bfloat16)), ["p1", "p2"],
                          ["a1", "a2"]) == [0.5, 1.0]


def _named_score(returned):
    def score(prompts, answers):
        return returned()

    return score


def test_advantages_are_whitened_over_the_whole_rollout_not_each_training_micro_batch(trained, tmp_path):
    """REINFORCE++ whitens returns: per micro-batch of one row that would leave no reward signal at all."""
    from dschat.rlhf import algorithms as algo

    _, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, advantage_estimator="reinforce_pp",
                                                per_device_training_batch_size=1, actor_learning_rate=0.0)
    torch.manual_seed(0)
    rollout = [trainer.generate_experience(_prompt_batch(tokenizer, texts))
               for texts in (PADDED_PROMPTS[:2], PADDED_PROMPTS[2:5])]
    for exp in rollout:  # distinct scores, so that whitening has something to keep
        exp["rewards"] = torch.arange(exp["rewards"].shape[0], dtype=torch.float) * 2.0 - 1.0
    widths = [e["action_mask"].shape[1] for e in rollout]
    trainer.train_rollout(rollout)
    width = max(widths)
    pad = [torch.nn.functional.pad(e[k], (0, width - e[k].shape[1])) for e in rollout for k in ("action_mask",)]
    mask = torch.cat(pad).float()
    logp = torch.cat([torch.nn.functional.pad(e["logprobs"], (0, width - e["logprobs"].shape[1])) for e in rollout])
    ref = torch.cat([torch.nn.functional.pad(e["ref_logprobs"], (0, width - e["ref_logprobs"].shape[1]))
                     for e in rollout])
    rewards = algo.kl_penalized_rewards(logp, ref, torch.cat([e["rewards"] for e in rollout]), mask,
                                        trainer.kl_ctl.value, trainer.clip_reward_value, "k1")
    expected, _ = algo.reinforce_pp_advantages(rewards, mask, trainer.args.gamma)
    got = torch.cat([torch.nn.functional.pad(e["advantages"], (0, width - w)) for e, w in zip(rollout, widths)])
    assert [e["advantages"].shape[1] for e in rollout] == widths
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)
    first_tokens = got[:, 0]
    assert first_tokens.abs().min() > 0.1  # one row per micro-batch whitened alone would be all zeros


UPDATE_SETTINGS = {"gae": {"advantage_estimator": "gae"},
                   "grpo": {"advantage_estimator": "grpo", "n_samples_per_prompt": 2},
                   "rloo": {"advantage_estimator": "rloo", "n_samples_per_prompt": 2},
                   "reinforce_pp": {"advantage_estimator": "reinforce_pp"},
                   "gae_lora": {"advantage_estimator": "gae", "actor_lora_dim": 4, "only_optimize_lora": True,
                                "actor_lora_learning_rate": 1e-5}}


@pytest.mark.parametrize("settings", UPDATE_SETTINGS.values(), ids=UPDATE_SETTINGS.keys())
def test_an_update_makes_answers_with_positive_advantage_likelier_and_values_nearer_their_returns(trained, tmp_path,
                                                                                                  settings):
    """The direction of PPO's step, which no comparison with a formula checks (a flipped sign, advantages on the wrong
    tokens or a frozen actor would pass those): one small step raises sum_t A_t * log pi(a_t) over the experience, the
    surrogate's first-order change, for every estimator; answers scored +1 become likelier than those scored -1; the
    critic's values move toward the returns."""
    _, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, actor_learning_rate=1e-5,
                                                critic_learning_rate=1e-5, actor_dropout=0.0, critic_dropout=0.0,
                                                **settings)
    torch.manual_seed(0)
    out = trainer.generate_experience(_prompt_batch(tokenizer, PADDED_PROMPTS), advantages=False)
    rows = out["rewards"].shape[0]
    out["rewards"] = torch.tensor([1.0, -1.0] * (rows // 2))  # each GRPO/RLOO group of two: one of each
    seq, mask, amask = out["input_ids"], out["attention_mask"], out["action_mask"].float()
    start = out["prompts"].shape[1] - 1

    def answer_logprobs():
        with torch.no_grad():
            return trainer._logprobs(trainer.actor_model, seq, mask, start) * amask

    def values():
        with torch.no_grad():
            return trainer._values(trainer.critic_model, seq, mask)[:, start:] * amask

    before = answer_logprobs()
    values_before = values() if trainer.critic_model is not None else None
    trainer.train_rollout([out])
    change = answer_logprobs() - before
    assert (out["advantages"] * change).sum() > 0
    per_answer = change.sum(1)
    assert per_answer[out["rewards"] > 0].mean() > per_answer[out["rewards"] < 0].mean()
    if values_before is not None:
        moved = values() - values_before
        assert ((out["returns"] - values_before) * amask * moved).sum() > 0


@pytest.mark.parametrize("generation_batches", [1, 2])
def test_advantages_are_computed_once_per_rollout(trained, tmp_path, monkeypatch, generation_batches):
    """Not once per generation batch too: with --generation_batches > 1 those would be thrown away."""
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    rollouts, real = [], DeepSpeedPPOTrainer.compute_advantages
    monkeypatch.setattr(DeepSpeedPPOTrainer, "compute_advantages",
                        lambda self, experiences: rollouts.append(len(experiences)) or real(self, experiences))
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "1", "--generation_batches", str(generation_batches)))
    assert rollouts == [generation_batches]


def test_prompt_batches_that_make_no_whole_iteration_are_skipped_not_generated(trained, tmp_path, monkeypatch,
                                                                               capsys):
    """Three batches of prompts with --generation_batches 2, two epochs: the first epoch's third batch was generated,
    and its rollout thrown away at the epoch's end (the iteration never filled)."""
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    prompts = tmp_path / "prompts.jsonl"
    # a single file's seeded 90% trains: 12 or 13 prompts, 3 batches of 4
    prompts.write_text("".join(json.dumps({"prompt": f"Say word {i}."}) + "\n" for i in range(14)))
    calls, real = [], DeepSpeedPPOTrainer.generate_experience
    monkeypatch.setattr(DeepSpeedPPOTrainer, "generate_experience",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    metrics = ppo.main(ppo_args(trained, tmp_path / "ppo", "--data_path", f"jsonl:{prompts}", "--data_split", "0,0,1",
                                "--generation_batches", "2", "--num_train_epochs", "2", "--eval_prompts", "0"))
    assert metrics["iterations"] == 2 and len(calls) == 4
    out = capsys.readouterr().out
    assert re.search(r"each epoch trains on 8 of its 1[23] training prompts \(an iteration takes --generation_batches "
                     r"2 x --per_device_generation_batch_size 4 x 1 rank\(s\)\); the other [45]", out), out[:600]


def test_rollout_generation_stats_sum_counts_and_times_and_weigh_answer_length_by_answers():
    batches = [{"generation_time": 1.0, "experience_time": 0.5, "empty_answers": 1, "generated_tokens": 12,
                "answer_length": 3.0, "truncated_answers": 2},
               {"generation_time": 2.0, "experience_time": 0.25, "empty_answers": 0, "generated_tokens": 16,
                "answer_length": 8.0, "truncated_answers": 1}]
    stats = ppo.rollout_generation_stats(batches, [4, 2])
    assert stats == {"generation_time": 3.0, "experience_time": 0.75, "empty_answers": 1, "truncated_answers": 3,
                     "answer_length": 28 / 6}


def test_iteration_records_of_several_generation_batches_cover_all_of_them(trained, tmp_path, monkeypatch):
    """Each record is its iteration's: times and counts over every generation batch, not the last one's alone.
    tokens_per_s counts prompt + answer tokens, as steps 1 and 2 (and TRL's num_tokens) count a sequence's; it counted
    the answers' alone, which answer_tokens_per_s now does."""
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    batches, real = [], DeepSpeedPPOTrainer.generate_experience

    def generate_experience(self, *args, **kwargs):
        exp = real(self, *args, **kwargs)
        # the sequence's tokens: the prompt's (left padding not counted) and the answer's
        prompt_tokens = int((exp["prompts"] != self.tokenizer.pad_token_id).sum())
        batches.append(dict(self.stats, sequence_tokens=prompt_tokens + self.stats["generated_tokens"]))
        return exp

    monkeypatch.setattr(DeepSpeedPPOTrainer, "generate_experience", generate_experience)
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "2", "--generation_batches", "2"))
    log = [json.loads(x) for x in (tmp_path / "ppo" / "step3_log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and len(batches) == 4
    for record, pair in zip(log, (batches[:2], batches[2:])):
        samples = 2 * 4  # 2 generation batches of 4 prompts
        tokens = sum(b["generated_tokens"] for b in pair)
        for key in ("generation_time", "experience_time"):
            assert record[key] == pytest.approx(sum(b[key] for b in pair)), key
        assert record["empty_answers"] == sum(b["empty_answers"] for b in pair)
        assert record["truncated_answers"] == sum(b["truncated_answers"] for b in pair)
        assert record["answer_length"] == pytest.approx(tokens / samples)
        assert record["answer_tokens_per_s"] / record["samples_per_s"] == pytest.approx(tokens / samples)
        sequence_tokens = sum(b["sequence_tokens"] for b in pair)
        assert sequence_tokens > tokens
        assert record["tokens_per_s"] / record["samples_per_s"] == pytest.approx(sequence_tokens / samples)
        # the rate's clock runs over both generation batches and the training that follows them
        wall = samples / record["samples_per_s"]
        assert wall >= sum(b["generation_time"] + b["experience_time"] for b in pair) + record["training_time"]


def test_train_rollout_is_step3s_iteration_and_a_hand_loop_hears_what_train_rlhf_leaves_out(trained, tmp_path,
                                                                                              capsys):
    """A notebook's own loop of train_rlhf(out) neither updates the adaptive KL controller nor runs ppo_epochs or
    micro-batches (they were checked, then silently unused); train_rollout does all three, as step 3 does."""
    _, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, adaptive_kl=True, kl_target=0.01, ppo_epochs=2,
                                                per_device_training_batch_size=2, actor_learning_rate=0.0,
                                                critic_learning_rate=0.0)
    exp = trainer.generate_experience(_prompt_batch(tokenizer, PADDED_PROMPTS[:4]))
    calls = []
    real = trainer._ppo_step
    trainer._ppo_step = lambda m, *rest: calls.append(m["input_ids"].shape[0]) or real(m, *rest)
    coef = trainer.kl_ctl.value
    trained_once = trainer.train_rollout([exp])
    assert calls == [2, 2, 2, 2]  # 2 epochs x 2 micro-batches of 2 rows
    assert trained_once["kl_per_answer"] == pytest.approx(trainer.answer_kl_to_reference(exp).item())
    assert trainer.kl_ctl.value != coef and set(trained_once) >= {"actor_loss", "critic_loss", "kl"}
    assert "train_rlhf(out)" not in capsys.readouterr().out
    trainer.train_rlhf(exp)  # a hand loop's call: what it leaves out is said once
    trainer.train_rlhf(exp)
    out = capsys.readouterr().out
    assert out.count("[step3] train_rlhf(out) is one update on the rows it is given") == 1
    assert "ppo_epochs 2, adaptive_kl, per_device_training_batch_size 2 (< the 4 rows given) act through " \
           "trainer.train_rollout([out, ...])" in out


def test_train_rollout_reports_its_micro_batches_mean_clip_fractions_and_kl(trained, tmp_path):
    """pg_clipfrac / approx_kl / vf_clipfrac in step 3's log are the iteration's means over its PPO micro-batches and
    epochs (they were the last micro-batch's alone: the second epoch's last, after the policy had moved most)."""
    _, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, ppo_epochs=2, per_device_training_batch_size=2,
                                                actor_learning_rate=5e-3, critic_learning_rate=5e-3)
    exp = trainer.generate_experience(_prompt_batch(tokenizer, PADDED_PROMPTS[:4]))
    seen = []
    real = trainer._ppo_step
    trainer._ppo_step = lambda m, *rest: (real(m, *rest), seen.append(dict(trainer.stats)))[0]
    result = trainer.train_rollout([exp])
    assert len(seen) == 4
    for key in ("pg_clipfrac", "pg_clipfrac_low", "pg_clipfrac_high", "approx_kl", "vf_clipfrac"):
        assert result[key] == pytest.approx(sum(s[key] for s in seen) / len(seen))
    # the clip fraction's two sides (TRL's clip_ratio/low_mean and high_mean) add up to it
    assert result["pg_clipfrac_low"] + result["pg_clipfrac_high"] == pytest.approx(result["pg_clipfrac"])
    assert len({s["approx_kl"] for s in seen}) > 1  # the steps differ, so the mean is not the last step's
    frozen = trainer.train_rollout([exp], train_actor=False)
    assert frozen["pg_clipfrac"] is None and frozen["approx_kl"] is None and frozen["vf_clipfrac"] is not None
    assert frozen["pg_clipfrac_low"] is None and frozen["pg_clipfrac_high"] is None


def test_grpo_logs_the_kl_its_loss_term_uses_beside_the_rollouts_k1(trained, tmp_path, monkeypatch):
    """GRPO's loss penalises k3 (or --kl_estimator) of the actor to the reference, while its log showed only "kl",
    the rollout's k1, which a few answers' tokens can take below 0. "kl_loss" is the term's estimator per answer
    token (verl's actor/kl_loss, TRL's GRPO kl), the mean over the iteration's micro-batches; none where there is no
    such term (PPO's KL in the reward)."""
    from types import SimpleNamespace

    from dschat.rlhf import algorithms as algo

    def score(prompts, answers):
        return [float(len(answer)) for answer in answers]

    _, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, advantage_estimator="grpo", n_samples_per_prompt=2,
                                                reward_fn=score, reward_model_weight=0, ppo_epochs=2,
                                                per_device_training_batch_size=2, actor_learning_rate=5e-3,
                                                kl_estimator="k2")
    terms = []
    real_term = algo.kl_loss_term
    monkeypatch.setattr(algo, "kl_loss_term", lambda logp, ref_logp, mask, kind, **agg: terms.append(
        (logp.detach(), ref_logp, mask, kind)) or real_term(logp, ref_logp, mask, kind, **agg))
    exp = trainer.generate_experience(_prompt_batch(tokenizer, PADDED_PROMPTS[:2]))
    seen = []
    real_step = trainer._ppo_step
    trainer._ppo_step = lambda m, *rest: (real_step(m, *rest), seen.append(trainer.stats["kl_loss"]))[0]
    result = trainer.train_rollout([exp])
    assert len(seen) == len(terms) == 4 and {kind for *_, kind in terms} == {"k2"}
    for logged, (logp, ref_logp, mask, _) in zip(seen, terms):  # the loss term's estimator, per answer token
        expected = torch.where(mask != 0, 0.5 * (logp - ref_logp) ** 2, 0.0).sum() / mask.sum()
        assert logged == pytest.approx(expected.item(), rel=1e-5)
    assert result["kl_loss"] == pytest.approx(sum(seen) / len(seen)) and result["kl_loss"] > 0
    assert result["kl"] != pytest.approx(result["kl_loss"])  # (the rollout's k1 stays as it was)
    _, ppo_trainer, _ = _engine_and_trainer(trained, tmp_path / "ppo")  # GAE: the KL is in the reward, no term
    assert ppo_trainer.train_rollout([ppo_trainer.generate_experience(
        _prompt_batch(tokenizer, PADDED_PROMPTS[:4]))])["kl_loss"] is None
    # the iteration's line (and so its record and TensorBoard's step3/ scalars) carries it, named, beside kl
    lines = []
    bar = SimpleNamespace(update=lambda n: None, set_postfix=lambda **kwargs: None, write=lines.append)
    ppo._log_iteration({"iteration": 1, "reward": 0.5, "kl": -0.002, "kl_loss": 0.003}, str(tmp_path / "log.jsonl"),
                       None, bar, SimpleNamespace(print_answers=False, mask_truncated_answers=False, adaptive_kl=False),
                       SimpleNamespace(actor_model=object()), [])
    assert "kl=-0.0020, kl_loss=0.0030" in lines[0]


def test_freezing_actor_steps_train_the_critic_alone_first(trained, tmp_path, monkeypatch, capsys):
    """OpenRLHF's --freezing_actor_steps: a critic started from the reward model first learns values while the actor
    waits; the log says which iterations did so, and critic-free estimators refuse the flag."""
    from dschat.errors import UsageError

    _, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, per_device_training_batch_size=4)
    exp = trainer.generate_experience(_prompt_batch(tokenizer, PADDED_PROMPTS[:4]))
    actor_before = {k: v.clone() for k, v in trainer.actor_model.module.state_dict().items()}
    critic_before = {k: v.clone() for k, v in trainer.critic_model.module.state_dict().items()}
    frozen = trainer.train_rollout([exp], train_actor=False)
    assert frozen["actor_loss"] is None and frozen["critic_loss"] is not None
    assert trainer.actor_model.global_steps == 0 and trainer.critic_model.global_steps == 1
    assert all(torch.equal(v, trainer.actor_model.module.state_dict()[k]) for k, v in actor_before.items())
    assert not all(torch.equal(v, trainer.critic_model.module.state_dict()[k]) for k, v in critic_before.items())
    assert trainer.train_rollout([exp])["actor_loss"] is not None and trainer.actor_model.global_steps == 1
    sized = []
    real_engine = ppo.DeepSpeedRLHFEngine
    monkeypatch.setattr(ppo, "DeepSpeedRLHFEngine", lambda *a, **kw: sized.append(kw) or real_engine(*a, **kw))
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "2", "--freezing_actor_steps", "1"))
    log = [json.loads(x) for x in (tmp_path / "ppo" / "step3_log.jsonl").read_text().splitlines()]
    assert log[0].get("actor_frozen") and "actor_loss" not in log[0] and "critic_loss" in log[0]
    assert "actor_frozen" not in log[1] and "actor_loss" in log[1]
    assert "(actor frozen: --freezing_actor_steps)" in capsys.readouterr().out
    # the actor's learning-rate schedule spans the iterations it trains (its warmup would take the frozen ones)
    assert sized[0]["actor_total_iters"] * 2 == sized[0]["num_total_iters"]
    with pytest.raises(UsageError, match="--freezing_actor_steps trains the critic alone first, and "
                                         "--advantage_estimator grpo has no critic"):
        ppo.main(ppo_args(trained, tmp_path / "grpo", "--freezing_actor_steps", "1", "--advantage_estimator", "grpo",
                          "--n_samples_per_prompt", "2"))


def test_a_notebook_engines_max_steps_sizes_the_schedule_in_optimizer_steps(trained, tmp_path):
    """Without num_total_iters, max_steps (PPO iterations) sizes the learning-rate schedules: an iteration of 2 PPO
    epochs over 2 micro-batches takes 4 optimizer steps, so 2 iterations span 8 (taken as 2 steps, a linear schedule
    reached 0 halfway through the first iteration and the second trained nothing)."""
    engine, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, max_steps=2, ppo_epochs=2,
                                                     per_device_generation_batch_size=4,
                                                     per_device_training_batch_size=2, lr_scheduler_type="linear")
    assert engine.num_total_iters == engine.actor_total_iters == 8
    trainer.train_rollout([trainer.generate_experience(_prompt_batch(tokenizer, PADDED_PROMPTS))])
    for model in (engine.actor, engine.critic):
        assert model.global_steps == 4 and model.get_lr() == [pytest.approx(5e-5)]


def test_a_notebook_engines_max_steps_of_none_is_no_limit(trained, tmp_path):
    """max_steps=None (no limit, as 0) leaves the schedules at their default length: sized in optimizer steps
    (0e24882), None x the steps of an iteration was a TypeError before any model loaded."""
    engine, _, _ = _engine_and_trainer(trained, tmp_path, max_steps=None)
    assert engine.num_total_iters == engine.actor_total_iters == 10000


def test_notebook_calls_that_would_train_wrongly_are_refused(trained, tmp_path):
    """From a notebook as from step 3's flags: an optimizer step may not span rollouts (the first rollout trained
    nothing and each later step mixed two); one experience given bare, or none, says what train_rollout takes."""
    from dschat.errors import UsageError

    _, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, per_device_training_batch_size=2,
                                                gradient_accumulation_steps=3)
    exp = trainer.generate_experience(_prompt_batch(tokenizer, PADDED_PROMPTS[:4]))
    with pytest.raises(UsageError, match="makes 2 micro-batches .* not a multiple of gradient_accumulation_steps 3"):
        trainer.train_rollout([exp])
    assert trainer.actor_model.global_steps == 0 and trainer.actor_model.micro_steps == 0
    with pytest.raises(UsageError, match=r"train_rollout\(\[out\]\)"):
        trainer.train_rollout(exp)
    with pytest.raises(UsageError, match="no experiences"):
        trainer.train_rollout([])
    # train_rollout's list given to train_rlhf failed with "list indices must be integers or slices, not str"
    with pytest.raises(UsageError, match=r"train_rlhf takes one generate_experience output \(a dict\), not a list: "
                                         r"train_rlhf\(out\); a list of them is .* train_rollout\(\[out, ...\]\)"):
        trainer.train_rlhf([exp])
    with pytest.raises(TypeError, match="the engine given is a dict, not a DeepSpeedRLHFEngine"):
        type(trainer)({"dtype": "fp32"}, None)
    # prompts beyond max_prompt_seq_len (40) ran past GPT-2's positions or hybrid_engine.max_out_tokens; malformed
    # ones failed deep in a model
    long = tokenizer(["word " * 60], return_tensors="pt")
    with pytest.raises(UsageError, match="a prompt of 6. tokens is longer than max_prompt_seq_len 40"):
        trainer.generate_experience(long["input_ids"], long["attention_mask"])
    ids = torch.tensor([[5, 6, 7]])
    for prompts, mask in ((ids[:0], ids[:0]), (ids[0], ids[0]), (ids, ids[:, :2])):
        with pytest.raises(UsageError, match="prompts must be \\(rows, tokens\\) ids"):
            trainer.generate_experience(prompts, torch.ones_like(mask))


def test_a_trainers_own_args_may_not_change_what_the_engine_was_built_with(trained, tmp_path):
    """``DeepSpeedPPOTrainer(engine, args)`` with other args than the engine's: the hybrid engine's switch called HF's
    generate with its arguments ("model_kwargs are not used by the model: ['generator', 'return_logprobs']"), GAE on
    a critic-free engine failed in train_rlhf (KeyError 'value'), and GRPO on a GAE engine, another learning rate,
    an EMA or longer answers were taken without a word (the engine's models trained with their own). What the
    trainer alone reads may change, and a copy of the engine's settings with it reads as they do."""
    from dschat import DeepSpeedPPOTrainer
    from dschat.errors import UsageError

    engine, _, tokenizer = _engine_and_trainer(trained, tmp_path)
    settings = {"critic_model_name_or_path": str(trained / "rm"), "dtype": "fp32", "max_prompt_seq_len": 40,
                "max_answer_seq_len": 10, "per_device_training_batch_size": 4, "num_warmup_steps": 0,
                "actor_learning_rate": 1e-4, "critic_learning_rate": 1e-4}  # (the engine's, as _engine_and_trainer)
    refused = {"enable_hybrid_engine": True, "actor_learning_rate": 1e-5, "enable_ema": True,
               "advantage_estimator": "grpo", "max_answer_seq_len": 20}
    for name, value in refused.items():
        extra = {"n_samples_per_prompt": 2} if name == "advantage_estimator" else {}
        with pytest.raises(UsageError, match="args differ from the settings the engine's models, optimizers and "
                                             f".*{'max_answer_seq_len' if name.startswith('max') else name} "):
            DeepSpeedPPOTrainer(engine, {**settings, name: value, **extra})
    with pytest.raises(UsageError, match="dtype 'bf16' \\(the engine's: 'fp32'\\)"):
        DeepSpeedPPOTrainer(engine, {"ppo_epochs": 2})  # (every other setting its default)
    trainer = DeepSpeedPPOTrainer(engine, {**vars(engine.args), "ppo_epochs": 2, "cliprange": 0.1,
                                           "max_answer_seq_len": 6})
    exp = trainer.generate_experience(_prompt_batch(tokenizer, PADDED_PROMPTS[:4]))
    assert exp["action_mask"].shape[1] <= 6 and trainer.args.ppo_epochs == 2
    assert math.isfinite(trainer.train_rollout([exp])["actor_loss"])


def test_a_trainers_own_args_may_not_change_how_the_engine_built_its_models(trained, tmp_path):
    """Settings the engine built its models with beyond 190a760's list (gradient checkpointing, the critic's fp32 value
    head, the reference's offload, ...) were taken from a trainer's own args without a word, the engine's models
    running with their own, where the README says another value of such a setting is an error naming it."""
    from dschat import DeepSpeedPPOTrainer
    from dschat.errors import UsageError

    engine, _, _ = _engine_and_trainer(trained, tmp_path)
    for name, value in (("actor_gradient_checkpointing", True), ("compute_fp32_loss", True),
                        ("offload_reference_model", True)):
        with pytest.raises(UsageError, match=f"args differ from the settings .*: {name} {value!r} \\(the engine's: "
                                             f"{getattr(engine.args, name)!r}\\)"):
            DeepSpeedPPOTrainer(engine, {**vars(engine.args), name: value})


def test_a_rollout_after_one_stopped_within_an_optimizer_step_is_refused(trained, tmp_path, monkeypatch):
    """A train_rollout stopped after the first of an optimizer step's 2 micro-batches (a notebook's interrupt, an error)
    left the actor's gradients of it in DeepSpeed: the next rollout's first step applied them with its own first
    micro-batch, and its second micro-batch's waited for the rollout after, every step spanning two rollouts."""
    from dschat.errors import UsageError

    _, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, per_device_training_batch_size=2,
                                                gradient_accumulation_steps=2)
    exp = trainer.generate_experience(_prompt_batch(tokenizer, PADDED_PROMPTS[:4]))
    real_step = type(trainer)._ppo_step

    def stopped_after_one(self, inputs, train_actor=True):
        real_step(self, inputs, train_actor)
        raise RuntimeError("stopped")

    monkeypatch.setattr(type(trainer), "_ppo_step", stopped_after_one)
    with pytest.raises(RuntimeError, match="stopped"):
        trainer.train_rollout([exp])
    monkeypatch.undo()
    assert trainer.actor_model.global_steps == 0
    with pytest.raises(UsageError, match="the actor's DeepSpeed engine holds the gradients of 1 of the 2 micro-batches "
                                         "of an optimizer step that an earlier call did not finish"):
        trainer.train_rollout([exp])
    assert trainer.actor_model.global_steps == 0 and trainer.actor_model.micro_steps == 1  # (nothing trained)


def test_text_prompts_are_said_to_need_tokenizing_not_a_mask():
    """generate_experience(["Say hi."]) said "the prompts' attention mask is missing": given a mask, the texts were
    then refused as no tensor; the first error now says the texts need tokenizing."""
    from dschat.errors import UsageError
    from dschat.rlhf.trainer import prompt_batch

    for given in (["Say hi."], {"prompt": ["Say hi."]}, "Say hi."):
        with pytest.raises(UsageError, match="the prompts are a (list|str), not a tensor of token ids; tokenize texts"):
            prompt_batch(given)
    with pytest.raises(ValueError, match="the prompts' attention mask is missing"):
        prompt_batch(torch.tensor([[5, 6]]))


def test_an_ids_and_mask_pair_is_said_to_go_as_two_arguments():
    """generate_experience((ids, mask)), the README's "(prompts, mask)" read as one tuple (or a TensorDataset's [ids,
    mask] batch), was told to "tokenize texts first", though it was tokenized: it is now told to pass the two as
    two arguments."""
    from dschat.errors import UsageError
    from dschat.rlhf.trainer import prompt_batch

    ids, mask = torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]])
    for given in ((ids, mask), [ids, mask]):
        with pytest.raises(UsageError, match=r"of two tensors; pass the token ids and their attention mask as two "
                                             r"arguments, generate_experience\(prompts, mask\)"):
            prompt_batch(given)
    assert prompt_batch(ids, mask)["prompt"] is ids


def test_a_ptx_actors_rollout_without_unsupervised_batches_is_refused(trained, tmp_path):
    """An engine built for PPO-ptx doubles the actor's accumulation (a PPO micro-step and a language-model one per
    micro-batch): a train_rollout without unsup_batches took no actor step on a rollout of one accumulation group,
    left half a step behind, and the next rollout was refused as if an earlier call had been interrupted."""
    from dschat.errors import UsageError

    _, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, unsupervised_dataset_name="tiny")
    exp = trainer.generate_experience(_prompt_batch(tokenizer, PADDED_PROMPTS[:4]))
    with pytest.raises(UsageError, match="train_rollout: the engine's actor was built for PPO-ptx "
                                         "\\(unsupervised_dataset_name 'tiny'\\), .* give a "
                                         "DeepSpeedPPOTrainerUnsupervised unsup_batches="):
        trainer.train_rollout([exp])
    assert trainer.actor_model.micro_steps == 0  # (refused before anything trained)
    assert trainer.train_rollout([exp], train_actor=False)["critic_loss"] is not None  # (the critic alone: no LM step)


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_loss_agg_sequence_means_are_over_the_optimizer_steps_answers_not_each_micro_batchs(trained, tmp_path,
                                                                                            monkeypatch, mode):
    """One optimizer step over micro-batches of 4 + 2 answers: its loss (what DeepSpeed's 1/accumulation makes of
    the micro-batches' losses) is the mean over all 6 answers, as over the batch at once. Each micro-batch's own mean
    weighed the 2 answers of the second as much as the 4 of the first (seq_mean_token_mean: -5.5 for -4 here)."""
    _, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, advantage_estimator="grpo", n_samples_per_prompt=3,
                                                per_device_training_batch_size=4, gradient_accumulation_steps=2,
                                                actor_learning_rate=0.0, actor_dropout=0.0, kl_loss_coef=0.0,
                                                loss_agg=mode)
    exp = trainer.generate_experience(_prompt_batch(tokenizer, PADDED_PROMPTS[:2]))  # 6 answers
    mask = exp["action_mask"].float()
    assert (mask.sum(1) > 0).all()
    exp["advantages"] = torch.tensor([1.0, 1.0, 1.0, 1.0, 10.0, 10.0])[:, None] * mask
    losses = []
    backward = trainer.actor_model.backward
    monkeypatch.setattr(trainer.actor_model, "backward",
                        lambda loss, *given, **kw: losses.append(loss.item()) or backward(loss, *given, **kw))
    trainer.train_rollout([exp])
    # the ratio is 1 (a learning rate of 0): each answer's loss is minus its advantage's token mean (sum / 10)
    per_answer = -exp["advantages"].sum(1) / (mask.sum(1) if mode == "seq_mean_token_mean" else 10)
    assert len(losses) == 2
    assert sum(losses) / 2 == pytest.approx(per_answer.mean().item(), abs=1e-4)


def test_grpo_groups_stay_whole_whatever_the_training_batch(trained, tmp_path):
    _, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, advantage_estimator="grpo", n_samples_per_prompt=3,
                                                per_device_training_batch_size=4, actor_learning_rate=0.0)
    exp = trainer.generate_experience(_prompt_batch(tokenizer, PADDED_PROMPTS[:2]))  # 6 answers, groups of 3
    exp["rewards"] = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])
    trainer.compute_advantages([exp])  # again, for these scores
    trainer.train_rollout([exp])  # micro-batches of 4 + 2 rows: no error
    first = exp["advantages"][:, 0] / exp["action_mask"][:, 0].clamp(min=1)
    torch.testing.assert_close(first, torch.tensor([-1.0, 0.0, 1.0, -0.57735, -0.57735, 1.1547]), atol=1e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("hybrid", [False, True], ids=["hf_generate", "hybrid_engine"])
def test_a_notebook_engines_own_tokenizer_pads_prompts_on_the_left_as_step_3s(distributed, hybrid):
    """A DeepSpeedRLHFEngine given no tokenizer loaded the actor's padding on the right (load_tokenizer's default, for
    training), unlike step 3's: prompts tokenized with engine.tokenizer(texts, padding=True) were refused by
    generate_experience as right-padded. It pads on the left now, and those prompts make experience."""
    from dschat import DeepSpeedPPOTrainer, DeepSpeedRLHFEngine

    args = {"actor_model_name_or_path": "tiny-llama", "dtype": "fp32", "max_prompt_seq_len": 40,
            "max_answer_seq_len": 4, "per_device_training_batch_size": 2, "num_warmup_steps": 0, "max_steps": 1,
            "advantage_estimator": "grpo", "n_samples_per_prompt": 2, "reward_model_weight": 0,
            "enable_hybrid_engine": hybrid, "reward_fn": lambda prompts, answers: [0.0] * len(answers)}
    with DeepSpeedRLHFEngine(args=args) as engine:
        batch = engine.tokenizer(["\n\nHuman: Say hi.\n\nAssistant:",
                                  "\n\nHuman: List three colors please, thanks.\n\nAssistant:"],
                                 return_tensors="pt", padding=True)
        lengths = batch["attention_mask"].sum(1).tolist()
        assert lengths[0] < lengths[1]  # (the premise: the first row is padded)
        out = DeepSpeedPPOTrainer(engine=engine, args=args).generate_experience(batch)
        assert out["input_ids"].shape[0] == 4  # (2 answers to each prompt)


def test_hf_generate_samples_from_the_trainers_per_rank_generator(tmp_path, distributed):
    """Without the hybrid engine, HF's generate drew from torch's global generator, which set_seed seeds alike on every
    rank: on 2 ranks each rank's answers took the same noise (a prompt on both ranks, e.g. a sampler's padding repeat,
    was answered alike token for token). It now samples from the trainer's generator (seed + 1000 x rank), as the
    hybrid engine does, and leaves torch's global generator where it was."""
    from dschat import DeepSpeedPPOTrainer, DeepSpeedRLHFEngine

    args = {"actor_model_name_or_path": "tiny-llama", "dtype": "fp32", "max_prompt_seq_len": 40,
            "max_answer_seq_len": 8, "per_device_training_batch_size": 4, "num_warmup_steps": 0, "max_steps": 1,
            "advantage_estimator": "grpo", "n_samples_per_prompt": 4, "reward_model_weight": 0,
            "reward_fn": lambda prompts, answers: [0.0] * len(answers)}
    engine = DeepSpeedRLHFEngine(args=args)
    trainer = DeepSpeedPPOTrainer(engine=engine, args=args)
    batch = engine.tokenizer(["\n\nHuman: Say hi.\n\nAssistant:"], return_tensors="pt")

    def answers(rank):
        torch.manual_seed(1234)  # the global generator as set_seed leaves it, alike on every rank
        trainer.generator.manual_seed(1234 + 1000 * rank)  # the trainer's, as __init__ seeds it on that rank
        out = trainer.generate_experience(batch)["input_ids"]
        return out, torch.get_rng_state()

    (rank0, after), (rank1, _) = answers(0), answers(1)
    assert len({tuple(row.tolist()) for row in rank0}) == 4  # the group's answers differ
    assert not torch.equal(rank0, rank1)  # and the ranks'
    assert torch.equal(answers(0)[0], rank0)  # the trainer's seed reproduces them
    torch.manual_seed(1234)
    assert torch.equal(after, torch.get_rng_state())  # (dropout and the rest draw as without the generation)


def test_accumulation_groups_may_not_span_ppo_epochs():
    from argparse import Namespace

    from dschat.errors import UsageError
    from dschat.rlhf.config import check_accumulation

    args = Namespace(per_device_generation_batch_size=6, n_samples_per_prompt=1, per_device_training_batch_size=2,
                     generation_batches=1, ppo_epochs=2, gradient_accumulation_steps=2)
    with pytest.raises(UsageError, match="3 PPO micro-batches per PPO epoch .* give --generation_batches 2 or "
                                         "--per_device_training_batch_size 3, or a --gradient_accumulation_steps "
                                         "that divides 3"):
        check_accumulation(args)  # 6 in all would divide, but one step would mix two epochs
    args.per_device_training_batch_size = 3
    check_accumulation(args)


def test_the_rollouts_kl_per_token_is_the_mean_over_all_its_answer_tokens(monkeypatch):
    """A rollout of several generation batches logged as its "kl" the mean of the batches' own token means: the one
    token of a batch of short answers weighed as much as all the tokens of another batch."""
    from types import SimpleNamespace

    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    short = {"logprobs": torch.tensor([[1.0, 5.0], [0.0, 5.0]]), "ref_logprobs": torch.zeros(2, 2),
             "action_mask": torch.tensor([[1, 0], [0, 0]])}  # one answer token, log-ratio 1
    long = {"logprobs": torch.zeros(2, 2), "ref_logprobs": torch.zeros(2, 2), "action_mask": torch.ones(2, 2)}
    trainer = SimpleNamespace(device="cpu", args=SimpleNamespace(kl_estimator=None, advantage_estimator="gae",
                                                                 kl_in_reward=1))
    trainer.answer_kl_to_reference = DeepSpeedPPOTrainer.answer_kl_to_reference.__get__(trainer)
    kl = DeepSpeedPPOTrainer.rollout_kl(trainer, [short, long])
    assert kl["kl"] == pytest.approx(1.0 / 5)  # 5 answer tokens, one of them 1 nat from the reference
    assert kl["kl_per_answer"] == pytest.approx(1.0 / 4)  # 4 answers
    # the same batches on two ranks (rank 1's long, rank 0's short): the tokens of every rank weigh alike, not each
    # rank's own mean (the all-reduce sums rank 1's tensor into rank 0's)
    from dschat.rlhf import trainer as trainer_module

    held = []

    def two_ranks(tensor):
        if not held:  # rank 1's call: what it holds
            held.append(tensor.clone())
        else:
            tensor += held[0]
        return tensor

    monkeypatch.setattr(trainer_module, "all_reduce", two_ranks)
    monkeypatch.setattr(trainer_module, "get_world_size", lambda: 2)
    DeepSpeedPPOTrainer.rollout_kl(trainer, [long])
    kl = DeepSpeedPPOTrainer.rollout_kl(trainer, [short])
    assert kl["kl"] == pytest.approx(1.0 / 5) and kl["kl_per_answer"] == pytest.approx(1.0 / 4)


def test_the_adaptive_kl_controller_is_fed_the_kl_per_answer(trained, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    exp = {"logprobs": torch.tensor([[0.5, 0.5, 9.0], [0.25, 0.0, 0.0]]), "ref_logprobs": torch.zeros(2, 3),
           "action_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
    k1_penalty = SimpleNamespace(args=SimpleNamespace(kl_estimator=None, advantage_estimator="gae", kl_in_reward=1))
    assert DeepSpeedPPOTrainer.answer_kl_to_reference(k1_penalty, exp).item() == pytest.approx((1.0 + 0.25) / 2)
    # answers 12 nats from the reference, tokens far less: TRL's target of 6 per answer is exceeded, so it rises
    monkeypatch.setattr(DeepSpeedPPOTrainer, "answer_kl_to_reference", lambda self, e: torch.tensor(12.0))
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "2", "--adaptive_kl", "--kl_horizon", "10"))
    log = [json.loads(x) for x in (tmp_path / "ppo" / "step3_log.jsonl").read_text().splitlines()]
    assert log[-1]["kl_coef"] > 0.1  # fed the per-token KL (logged as "kl", far below 6) it would fall
    assert log[-1]["kl_per_answer"] == 12.0  # logged in the controller's unit beside the per-token "kl"


def test_kl_per_answer_is_the_reward_penaltys_estimator_and_kl_stays_k1():
    """With --kl_estimator k3 in the reward, the penalty was k3 but kl_per_answer (the adaptive controller's unit)
    was the k1 sum, which can fall below 0 where k3's is above it. It is now the penalty's estimator, summed over each
    answer's tokens (TRL's objective/kl); "kl" stays the rollout's k1 per token. Where the KL is a loss term the
    reward carries none, and kl_per_answer is k1 whatever the loss term's estimator."""
    from types import SimpleNamespace

    from dschat.rlhf.algorithms import kl_estimate
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    logp, ref = torch.tensor([[-1.0, 0.5, 7.0], [0.25, -0.25, 0.0]]), torch.zeros(2, 3)
    exp = {"logprobs": logp, "ref_logprobs": ref, "action_mask": torch.tensor([[1, 1, 0], [1, 1, 0]])}
    k3_sums = (kl_estimate(logp, ref, "k3")[:, :2]).sum(dim=1)
    for estimator, advantage, in_reward, per_answer in (("k3", "gae", 1, k3_sums.mean().item()),
                                                         ("k3", "reinforce_pp", 1, k3_sums.mean().item()),
                                                         (None, "gae", 1, -0.25), ("k3", "gae", 0, -0.25),
                                                         ("k3", "grpo", 1, -0.25)):
        args = SimpleNamespace(kl_estimator=estimator, advantage_estimator=advantage, kl_in_reward=in_reward)
        trainer = SimpleNamespace(device="cpu", args=args)
        trainer.answer_kl_to_reference = DeepSpeedPPOTrainer.answer_kl_to_reference.__get__(trainer)
        kl = DeepSpeedPPOTrainer.rollout_kl(trainer, [exp])
        assert kl["kl"] == pytest.approx(-0.5 / 4)  # k1 per answer token, whatever the penalty's estimator
        assert kl["kl_per_answer"] == pytest.approx(per_answer), (estimator, advantage, in_reward)
    assert k3_sums.mean().item() > 0.4  # (k1's per-answer mean is -0.25: the two differ in sign)


def test_the_adaptive_controller_tracks_the_k3_the_reward_penalises(trained, tmp_path):
    """--adaptive_kl with --kl_estimator k3: every answer token 1 nat less likely under the actor than the reference
    is a k1 of -1 a token (below any target: the coefficient would fall) and a k3 of e - 2 (above the target: it
    rises). The controller follows the k3 that the reward penalises."""
    _, trainer, tokenizer = _engine_and_trainer(trained, tmp_path, adaptive_kl=True, kl_target=0.01,
                                                kl_horizon=10, kl_estimator="k3", actor_learning_rate=0.0,
                                                critic_learning_rate=0.0)
    exp = trainer.generate_experience(_prompt_batch(tokenizer, PADDED_PROMPTS[:4]))
    mask = exp["action_mask"].bool()
    exp["ref_logprobs"] = torch.where(mask, exp["logprobs"] + 1.0, exp["ref_logprobs"])
    coef = trainer.kl_ctl.value
    trained_once = trainer.train_rollout([exp])
    per_answer = (math.e - 2) * mask.sum(dim=1).double().mean().item()
    assert trained_once["kl"] == pytest.approx(-1.0)  # the rollout's k1 per token
    assert trained_once["kl_per_answer"] == pytest.approx(per_answer, rel=1e-5)
    assert trainer.kl_ctl.value == pytest.approx(coef * (1 + 0.2 * 4 / 10))  # above target: +20% of 4/10


def test_an_adaptive_runs_iteration_line_says_what_moves_its_kl_coefficient(tmp_path):
    """With --adaptive_kl the line said the rollout's k1 "kl" alone, neither the per-answer KL of the reward's
    estimator that moves the coefficient (k3's above the target while k1's is below 0) nor the coefficient."""
    from types import SimpleNamespace

    record = {"iteration": 1, "reward": 0.5, "kl": -0.002, "kl_per_answer": 0.25, "kl_coef": 0.102}
    for adaptive, said in ((True, "kl=-0.0020, kl_per_answer=0.2500, kl_coef=0.1020"), (False, "kl=-0.0020")):
        lines = []
        bar = SimpleNamespace(update=lambda n: None, set_postfix=lambda **kwargs: None, write=lines.append)
        args = SimpleNamespace(print_answers=False, mask_truncated_answers=False, adaptive_kl=adaptive)
        ppo._log_iteration(dict(record), str(tmp_path / "log.jsonl"), None, bar, args,
                           SimpleNamespace(actor_model=object()), [])
        assert lines[0] == "[step3] iter 1: reward=0.5000, " + said


def test_a_ptx_runs_iteration_line_says_its_unsupervised_loss(tmp_path):
    """With --unsupervised_dataset_name the line left out unsup_loss (step3_log.jsonl had it): the PTX loss a user
    watches, which DeepSpeed-Chat's step 3 prints beside the actor's and critic's, was not on the console."""
    from types import SimpleNamespace

    for record, said in (({"unsup_loss": 2.5}, "critic_loss=1.0000, unsup_loss=2.5000"), ({}, "critic_loss=1.0000")):
        lines = []
        bar = SimpleNamespace(update=lambda n: None, set_postfix=lambda **kwargs: None, write=lines.append)
        args = SimpleNamespace(print_answers=False, mask_truncated_answers=False, adaptive_kl=False)
        ppo._log_iteration({"iteration": 1, "reward": 0.5, "kl": 0.0, "critic_loss": 1.0, **record},
                           str(tmp_path / "log.jsonl"), None, bar, args, SimpleNamespace(actor_model=object()), [])
        assert lines[0] == "[step3] iter 1: reward=0.5000, kl=0.0000, " + said


def test_each_iteration_logs_the_kl_coefficient_its_rewards_took(trained, tmp_path, monkeypatch):
    """With --adaptive_kl, step3_log.jsonl's kl_coef was read after the iteration's controller update: each record
    gave the next iteration's coefficient (iteration 1 not --kl_ctl's), not the one its rewards were penalized with."""
    from dschat.rlhf import algorithms
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    used = []
    penalized = algorithms.kl_penalized_rewards

    def spy(log_probs, ref_log_probs, reward_score, action_mask, kl_coef, *args, **kwargs):
        used.append(kl_coef)
        return penalized(log_probs, ref_log_probs, reward_score, action_mask, kl_coef, *args, **kwargs)

    monkeypatch.setattr(algorithms, "kl_penalized_rewards", spy)
    monkeypatch.setattr(DeepSpeedPPOTrainer, "answer_kl_to_reference", lambda self, e: torch.tensor(12.0))
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "3", "--adaptive_kl", "--kl_horizon", "10"))
    log = [json.loads(x) for x in (tmp_path / "ppo" / "step3_log.jsonl").read_text().splitlines()]
    assert len(used) == 3 and used[0] == 0.1 and used[1] > 0.1  # one rollout per iteration; the controller moved
    assert [record["kl_coef"] for record in log] == used


def test_a_fresh_run_removes_an_earlier_runs_checkpoints_and_resumes_its_own(trained, tmp_path, capsys):
    out = tmp_path / "ppo"
    ppo.main(ppo_args(trained, out, "--max_steps", "3", "--save_interval", "1"))  # leaves iter 2 and 3
    ppo.main(ppo_args(trained, out, "--max_steps", "2", "--save_interval", "2"))  # afresh, into the same folder
    assert "removed an earlier run's checkpoints" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "checkpoints" / "trainer").iterdir()) == ["iter_0000002"]
    ppo.main(ppo_args(trained, out, "--max_steps", "4", "--resume"))  # no --save_interval: the resumed run's 2
    printed = capsys.readouterr().out
    assert "resumed from iteration 2" in printed and "checkpointing every 2 iterations, as the resumed run" in printed
    assert sorted(p.name for p in (out / "checkpoints" / "actor").iterdir() if p.is_dir()) == \
        ["iter_0000002", "iter_0000004"]
    ppo.main(ppo_args(trained, out, "--max_steps", "5", "--save_interval", "1", "--resume"))  # a given one wins
    assert sorted(p.name for p in (out / "checkpoints" / "actor").iterdir() if p.is_dir()) == \
        ["iter_0000004", "iter_0000005"]


def test_step_3_and_step_1_refuse_each_others_checkpoints_in_one_output_dir(trained, tmp_path, capsys):
    """Every step keeps its checkpoints in <output_dir>/checkpoints: step 3 --resume in step 1's folder was refused
    for "no actor/step_0000001 folder (removed or copied in part?)", and step 1 in step 3's for "no model/iter_0000001
    folder", as if the checkpoint were damaged; step 3 recorded no step name, so steps 1, 2 and DPO could not tell."""
    from dschat.errors import UsageError

    sft_flags = ["--data_output_path", str(trained / "data"), "--max_steps", "1", *SFT_FAST]
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "1", "--save_interval", "1"))
    state = json.loads((tmp_path / "ppo" / "checkpoints" / "trainer" / "iter_0000001" / "state.json").read_text())
    assert state["step_name"] == "step3"
    with pytest.raises(UsageError, match=r"\(iter_0000001\) was saved by step3, not step1: give step1 its own "):
        sft.main(["--output_dir", str(tmp_path / "ppo"), "--resume", *sft_flags])
    sft.main(["--output_dir", str(tmp_path / "sft"), "--save_interval", "1", *sft_flags])
    with pytest.raises(UsageError, match=r"\(step_0000001\) was saved by step1, not step3: give step3 its own "):
        ppo.main(ppo_args(trained, tmp_path / "sft", "--max_steps", "1", "--resume"))
    for name in ("ppo", "sft"):  # a checkpoint from before steps were recorded: told by its tag's unit
        state_file = next((tmp_path / name / "checkpoints" / "trainer").iterdir()) / "state.json"
        state_file.write_text(json.dumps({k: v for k, v in json.loads(state_file.read_text()).items()
                                          if k != "step_name"}))
    with pytest.raises(UsageError, match=r"was saved by step3, not step1"):
        sft.main(["--output_dir", str(tmp_path / "ppo"), "--resume", *sft_flags])
    with pytest.raises(UsageError, match=r"was saved by step 1, 2 or DPO, not step3"):
        ppo.main(ppo_args(trained, tmp_path / "sft", "--max_steps", "1", "--resume"))
    capsys.readouterr()
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "1", "--resume"))  # its own, older, still resumes
    assert "resumed from iteration 1" in capsys.readouterr().out


def test_a_run_stopped_before_its_first_checkpoint_does_not_resume_an_earlier_run(trained, tmp_path, capsys):
    out = tmp_path / "ppo"
    ppo.main(ppo_args(trained, out, "--max_steps", "1", "--save_interval", "1"))
    ppo.main(ppo_args(trained, out, "--max_steps", "3", "--save_interval", "2", "--enable_test_mode",
                      "--test_stop_step", "1"))  # afresh, stopped after iteration 1: no checkpoint of its own yet
    capsys.readouterr()
    ppo.main(ppo_args(trained, out, "--max_steps", "1", "--save_interval", "2", "--resume"))
    assert "--resume: no complete checkpoint" in capsys.readouterr().out


def test_a_reward_model_without_a_trained_value_head_is_refused_before_any_model_loads(trained, tmp_path,
                                                                                       monkeypatch):
    # a step-1 folder (or any hub model) as reward model: PPO would maximise a random head's score
    from dschat.errors import UsageError

    monkeypatch.setattr("dschat.rlhf.engine.load_causal_lm", lambda *given, **kw: pytest.fail("a model loaded"))
    with pytest.raises(UsageError, match="has no trained value head"):
        _engine_and_trainer(trained, tmp_path, reward_model_name_or_path=str(trained / "sft"))
    with pytest.raises(UsageError, match="has no trained value head"):  # the critic's folder scores when none is given
        _engine_and_trainer(trained, tmp_path, critic_model_name_or_path=str(trained / "sft"))
    with pytest.raises(UsageError, match="the reward model tiny-gpt2 has no trained value head"):  # a preset: a folder
        _engine_and_trainer(trained, tmp_path, critic_model_name_or_path="tiny-gpt2")


def test_a_critic_without_a_trained_value_head_starts_from_a_new_one(trained, tmp_path, capsys):
    engine, _, _ = _engine_and_trainer(trained, tmp_path, critic_model_name_or_path=str(trained / "sft"),
                                       reward_model_name_or_path=str(trained / "rm"))
    assert "has no trained value head" in capsys.readouterr().out and engine.critic is not None


def test_a_notebooks_tokenizer_must_be_the_actors(trained, tmp_path, monkeypatch):
    """Another tokenizer's ids were read by the actor as other text (and ids past its vocabulary grew it random
    embedding rows), or were blamed on the critic; a path in its place failed as an AttributeError."""
    import json
    import shutil

    from dschat import DeepSpeedRLHFEngine
    from dschat.errors import UsageError
    from dschat.models.loading import load_tokenizer

    monkeypatch.setattr("dschat.rlhf.engine.load_causal_lm", lambda *given, **kw: pytest.fail("a model loaded"))
    other = tmp_path / "other_tokenizer"
    shutil.copytree(trained / "sft", other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    args = {"critic_model_name_or_path": str(trained / "rm"), "dtype": "fp32"}
    with pytest.raises(UsageError, match=r"the tokenizer given is not the actor's .* 2 of the actor's tokens"):
        DeepSpeedRLHFEngine(actor_model_name_or_path=str(trained / "sft"),
                            tokenizer=load_tokenizer(str(other), padding_side="left"), args=args)
    with pytest.raises(UsageError, match="tokenizer is a str, not a tokenizer"):
        DeepSpeedRLHFEngine(actor_model_name_or_path=str(trained / "sft"), tokenizer=str(trained / "sft"), args=args)




def test_step3s_iteration_plan_says_a_count_of_one_in_the_singular(capsys):
    """The plan's notes read "the other 1, drawn anew each epoch, are skipped", "the run trains all 1 iterations" and
    "this run's 1 PPO iterations" for a run of one iteration with one prompt left over; said in the singular now."""
    from dschat.args import step3_parser
    from dschat.rlhf.config import step3_args

    args = step3_args(step3_parser().parse_args(["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c",
                                                 "--per_device_generation_batch_size", "2", "--test_stop_step", "2",
                                                 "--freezing_actor_steps", "1"]))

    class Loader(list):  # (one batch of 2 of the 3 prompts: one left over)
        dataset = [0, 1, 2]

    assert ppo.plan_iterations(args, Loader([0])).total == 1
    out = " ".join(capsys.readouterr().out.split())
    for said in ("each epoch trains on 2 of its 3 training prompts", "the other one, drawn anew each epoch, is skipped",
                 "the run trains 1 iteration (--max_steps", "--freezing_actor_steps 1 >= this run's 1 PPO iteration:"):
        assert said in out, (said, out)

def test_the_refusal_of_a_notebooks_non_tokenizer_quotes_a_pathlib_actor_path_as_a_plain_string(tmp_path):
    """The call it suggests, load_tokenizer(ACTOR, ...), quoted a pathlib.Path actor as PosixPath('...'), which fails
    as copied (PosixPath not imported): it is now the plain path's string."""
    from pathlib import Path

    from dschat.errors import UsageError
    from dschat.rlhf.engine import check_given_tokenizer

    actor = Path(tmp_path) / "actor"
    with pytest.raises(UsageError) as refused:
        check_given_tokenizer(str(actor), actor)
    assert f"load_tokenizer({str(actor)!r}, padding_side='left')" in str(refused.value)
    assert "PosixPath" not in str(refused.value)


def test_a_notebooks_tokenizer_with_one_token_of_another_id_is_refused_in_the_singular(tmp_path, monkeypatch):
    """One of the actor's tokens with another id in the given tokenizer read "1 of the actor's tokens have": now
    "1 of the actor's tokens has"."""
    import shutil

    from dschat.errors import UsageError
    from dschat.models.loading import load_tokenizer, resolve_model_path
    from dschat.rlhf import engine

    actor = shutil.copytree(resolve_model_path("tiny-llama"), tmp_path / "actor")
    monkeypatch.setattr(engine, "tokens_with_other_ids", lambda reference, other: ["a"])
    with pytest.raises(UsageError, match=r"1 of the actor's tokens has another id or none in it \(e.g. 'a'\)"):
        engine.check_given_tokenizer(load_tokenizer("tiny-llama"), str(actor))

def test_a_reward_model_with_another_tokenizer_is_refused(trained, tmp_path):
    # step 3 feeds the actor's token ids to the reward model: another vocabulary would score other text
    import json
    import shutil

    from dschat.errors import UsageError

    other = tmp_path / "rm_other_tokenizer"
    shutil.copytree(trained / "rm", other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # the same tokens, two of them under each other's id
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UsageError, match="has another tokenizer than the actor .* 2 of the actor's tokens"):
        _engine_and_trainer(trained, tmp_path, reward_model_name_or_path=str(other))
    # the same ids, another chat template: step 2 trained it on other text than the actor writes (a base model's
    # reward model under an instruct actor), and it scored the actor's text without a word
    templated = tmp_path / "rm_templated"
    shutil.copytree(trained / "rm", templated)
    config = json.loads((templated / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
    (templated / "tokenizer_config.json").write_text(json.dumps(config))
    said = (".* formats a conversation otherwise than the actor .* trains \\(or was trained\\) on text like "
            + re.escape(repr("<|user|>Name a color.\n<|assistant|>Blue.<|endoftext|>")) + ", and would score the actor's "
            + re.escape(repr("\n\nHuman: Name a color.\n\nAssistant: Blue.<|endoftext|>")))
    with pytest.raises(UsageError, match=said):
        _engine_and_trainer(trained, tmp_path, reward_model_name_or_path=str(templated))


def test_the_ema_copy_is_kept_in_fp32_so_that_its_small_steps_are_not_rounded_away(trained, tmp_path):
    # in bf16, lerp by 1 - 0.992 rounds back to the old weight: the EMA never moved from the SFT weights
    from dschat.rlhf.ema import moving_average

    engine, _, _ = _engine_and_trainer(trained, tmp_path, dtype="bf16", enable_ema=True)
    actor, ema = engine.actor.module, engine.actor_ema.module
    assert {p.dtype for p in ema.parameters()} == {torch.float32}
    name, weight = next((n, p) for n, p in actor.named_parameters() if p.ndim == 2)
    start = dict(ema.named_parameters())[name].detach().clone()
    with torch.no_grad():
        weight.mul_(1.5)
    for _ in range(10):
        moving_average(actor, ema, beta=0.992)
    moved = (dict(ema.named_parameters())[name] - start).abs().sum() / (weight.float() - start).abs().sum()
    assert abs(moved.item() - (1 - 0.992 ** 10)) < 0.01


def test_deepspeed_chats_moving_average_of_the_engines_says_the_trainer_already_updates_the_ema(trained, tmp_path):
    """DeepSpeed-Chat's loop calls ``moving_average(rlhf_engine.actor, rlhf_engine.actor_ema, zero_stage=...)`` after
    each step: here a TypeError (zero_stage), then a KeyError on the engines' "module." names; and the trainer
    updates the EMA itself, so a second average per step would be wrong."""
    from dschat.errors import UsageError
    from dschat.rlhf.ema import moving_average

    engine, _, _ = _engine_and_trainer(trained, tmp_path, enable_ema=True, enable_hybrid_engine=True)
    ema = engine.actor_ema.module
    before = {name: p.detach().clone() for name, p in ema.named_parameters()}
    for actor in (engine.actor, engine.actor.module):  # the hybrid engine, or the model with the EMA's engine
        with pytest.raises(UsageError, match=r"trainer already updates engine\.actor_ema .*drop this call"):
            moving_average(actor, engine.actor_ema, zero_stage=0)
    assert all(torch.equal(p, before[name]) for name, p in ema.named_parameters())
    with torch.no_grad():
        next(p for p in engine.actor.module.parameters() if p.ndim == 2).add_(1.0)
    moving_average(engine.actor.module, ema, beta=0.5, device="cpu", zero_stage=0)  # modules: averaged
    assert not all(torch.equal(p, before[name]) for name, p in ema.named_parameters())
    engine.release()


def test_the_ema_actor_is_saved_in_the_actors_dtype(trained, tmp_path):
    # averaged in fp32, but a bf16 run's actor_ema folder is a bf16 model as its actor folder is (not twice its size)
    from safetensors import safe_open

    ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "1", "--enable_ema", "--dtype", "bf16"))
    for folder in ("actor", "actor_ema"):
        with safe_open(str(tmp_path / "ppo" / folder / "model.safetensors"), "pt") as weights:
            assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.bfloat16}, folder
        assert json.loads((tmp_path / "ppo" / folder / "config.json").read_text())["dtype"] == "bfloat16", folder


def test_a_notebooks_save_of_the_ema_actor_is_in_the_actors_dtype_as_step_3s(trained, tmp_path):
    """``save_causal_lm(engine.actor_ema, ...)`` from a notebook wrote the fp32 copy it averages in: a bf16 run's EMA
    actor twice the size of step 3's, and loading as fp32."""
    from safetensors import safe_open

    from dschat import save_causal_lm

    engine, _, tokenizer = _engine_and_trainer(trained, tmp_path, dtype="bf16", enable_ema=True)
    saved = {"engine": engine.actor_ema, "module": engine.actor_ema.module}
    for name, model in saved.items():
        save_causal_lm(model, tokenizer, str(tmp_path / name))
    save_causal_lm(engine.actor_ema, tokenizer, str(tmp_path / "asked"), dtype=torch.float32)  # (asked: kept)
    for name, dtype in {"engine": torch.bfloat16, "module": torch.bfloat16, "asked": torch.float32}.items():
        with safe_open(str(tmp_path / name / "model.safetensors"), "pt") as weights:
            assert {weights.get_tensor(k).dtype for k in weights.keys()} == {dtype}, name
        assert json.loads((tmp_path / name / "config.json").read_text())["dtype"] == str(dtype)[6:], name
    assert {p.dtype for p in engine.actor_ema.module.parameters()} == {torch.float32}  # (still averaged in fp32)
    engine.release()


def test_the_ema_actor_is_saved_with_the_actors_config_its_dropout_too(trained, tmp_path):
    # the EMA copy was loaded without --actor_dropout: its folder said the SFT model's dropout beside the actor's
    ppo.main(ppo_args(trained, tmp_path / "ppo", "--max_steps", "1", "--enable_ema", "--actor_dropout", "0.1"))
    configs = [json.loads((tmp_path / "ppo" / folder / "config.json").read_text()) for folder in ("actor", "actor_ema")]
    assert configs[0]["attention_dropout"] == 0.1
    assert configs[1] == configs[0]


def test_a_wrong_reward_function_is_a_usage_error_before_anything_loads(tmp_path):
    from dschat.errors import MissingModuleError, UsageError
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.engine import check_step3_settings

    (tmp_path / "my_rewards.py").write_text("def score(prompts, answers):\n    return [0.0] * len(prompts)\n")
    settings = {"reward_model_weight": 0, "actor_model_name_or_path": "tiny-llama"}
    with pytest.raises(MissingModuleError, match="no module 'my_rewardz'"):
        check_step3_settings(step3_args({**settings, "reward_fn": "my_rewardz:score"}), 1)
    with pytest.raises(UsageError, match="has no function 'scor'"):
        check_step3_settings(step3_args({**settings, "reward_fn": f"{tmp_path / 'my_rewards.py'}:scor"}), 1)
    check_step3_settings(step3_args({**settings, "reward_fn": f"{tmp_path / 'my_rewards.py'}:score"}), 1)


@pytest.mark.parametrize("given, used", [
    ({"advantage_estimator": "grpo"}, (0.001, "k3")),  # unset: the k3 KL-in-loss default
    ({"advantage_estimator": "grpo", "kl_loss_coef": 0.0, "kl_estimator": "k1"}, (0.0, "k1")),  # 0: no KL term
    ({"advantage_estimator": "rloo", "kl_loss_coef": 0.01, "kl_estimator": "k2"}, (0.01, "k2")),
    ({}, (0.0, "k1")),  # gae: KL in the reward, DeepSpeed-Chat's k1
    ({"kl_loss_coef": 0.0}, (0.0, "k1")),  # 0 beside the reward's KL: no loss term, as asked (a sweep's 0 passes)
    ({"kl_in_reward": 0, "kl_loss_coef": 0.1}, (0.1, "k3")),
    ({"kl_in_reward": 0, "kl_loss_coef": 0.1, "kl_estimator": "k2"}, (0.1, "k2")),
    # --kl_in_reward 0 took a weight of 0 unless --kl_loss_coef was given: a run without any KL, said nowhere
    ({"advantage_estimator": "reinforce_pp", "kl_in_reward": 0}, (0.001, "k3")),
])
def test_kl_loss_coef_and_estimator_are_honoured_as_given_for_every_estimator(given, used):
    from types import SimpleNamespace

    from dschat.rlhf.config import check_kl_settings, step3_args
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    check_kl_settings(step3_args(given))
    assert DeepSpeedPPOTrainer._kl_loss_settings(SimpleNamespace(args=step3_args(given))) == used


def test_the_logged_kl_coefficient_is_the_one_in_use():
    """A GRPO run logged --kl_ctl (the reward penalty's, unused) as its kl_coef, not the loss term's weight."""
    from types import SimpleNamespace

    from dschat.rlhf.config import step3_args
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    def logged(given):
        trainer = SimpleNamespace(args=step3_args(given), kl_ctl=SimpleNamespace(value=given.get("kl_ctl", 0.1)))
        trainer._kl_loss_settings = lambda: DeepSpeedPPOTrainer._kl_loss_settings(trainer)
        return DeepSpeedPPOTrainer.kl_coef.fget(trainer)

    assert logged({"advantage_estimator": "grpo", "n_samples_per_prompt": 2, "kl_ctl": 0.5}) == 0.001
    assert logged({"kl_in_reward": 0, "kl_loss_coef": 0.05}) == 0.05
    assert logged({"kl_ctl": 0.3}) == 0.3


def test_k1_as_the_kl_loss_term_is_warned(capsys):
    from dschat.rlhf.config import check_kl_settings, step3_args

    check_kl_settings(step3_args({"kl_in_reward": 0, "kl_estimator": "k1"}))
    assert "--kl_estimator k1 as the KL loss term: its gradient" in capsys.readouterr().out
    check_kl_settings(step3_args({"kl_estimator": "k1"}))  # the reward penalty's estimator: DeepSpeed-Chat's
    assert "warning" not in capsys.readouterr().out


@pytest.mark.parametrize("given, said", [
    ({"kl_loss_coef": 0.1}, "--kl_loss_coef weighs a KL loss term, and --advantage_estimator gae with --kl_in_reward 1 "
                            "puts the KL in the per-token reward instead"),
    ({"advantage_estimator": "reinforce_pp", "kl_loss_coef": 0.01}, "--advantage_estimator reinforce_pp with"),
    ({"kl_in_reward": 0, "adaptive_kl": True}, "--adaptive_kl adapts the per-token reward's KL coefficient "
                                               "(--kl_ctl), which --kl_in_reward 0 does not use"),
    ({"advantage_estimator": "grpo", "n_samples_per_prompt": 2, "adaptive_kl": True},
     "which --advantage_estimator grpo does not use"),
    ({"adaptive_kl": True, "kl_ctl": 0.0}, "--adaptive_kl with --kl_ctl 0: the controller scales the coefficient"),
    ({"advantage_estimator": "grpo", "n_samples_per_prompt": 2, "kl_ctl": 0.5},
     "--kl_ctl 0.5 weighs the per-token reward's KL, which --advantage_estimator grpo does not use"),
    ({"kl_in_reward": 0, "kl_ctl": 0.0}, "--kl_ctl 0.0 weighs the per-token reward's KL, which --kl_in_reward 0"),
    ({"kl_target": 3.0}, "--kl_target 3.0 sets the adaptive KL controller, which runs only with --adaptive_kl"),
    ({"kl_horizon": 500, "advantage_estimator": "rloo", "n_samples_per_prompt": 2},
     "--kl_horizon 500 sets the adaptive KL controller"),
])
def test_kl_flags_the_chosen_kl_does_not_read_are_errors(given, said):
    """They were silently ignored: a run with another KL than asked for."""
    from dschat.errors import UsageError
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.engine import check_settings

    with pytest.raises(UsageError, match=re.escape(said)):
        check_settings(step3_args(given))


@pytest.mark.parametrize("flag", ["clip_reward_value", "cliprange", "cliprange_value"])
def test_a_clip_bound_of_0_or_below_is_an_error_not_a_clamp_that_flattens(flag, capsys):
    """torch.clamp with crossed bounds flattens: --clip_reward_value -5 made every score -5 (PPO trained on the KL
    alone), --cliprange -0.2 gave the tokens with a positive advantage no gradient."""
    from dschat.errors import UsageError
    from dschat.rlhf.config import step3_args

    for value in ("-5", "0", "nan"):
        with pytest.raises(SystemExit):
            step3_parser().parse_args([f"--{flag}", value])
        assert f"--{flag}: expected a number > 0 (inf: no clipping), got {value}" in capsys.readouterr().err
        with pytest.raises(UsageError, match=f"{flag}: expected a number > 0"):
            step3_args({flag: float(value)})
    assert getattr(step3_parser().parse_args([f"--{flag}", "inf"]), flag) == math.inf  # no clipping
    assert getattr(step3_args({flag: 0.5}), flag) == 0.5


@pytest.mark.parametrize("flag", ["gamma", "lam"])
def test_a_discount_or_gae_lambda_outside_0_1_is_an_error(flag, capsys):
    """--lam 9.5 (0.95 mistyped) made an 8-token answer's first advantage 9.5^7 = 6983373; --gamma -1 flipped the sign
    of every other token's return."""
    from dschat.errors import UsageError
    from dschat.rlhf.config import step3_args

    for value in ("9.5", "-1", "nan"):
        with pytest.raises(SystemExit):
            step3_parser().parse_args([f"--{flag}", value])
        assert f"--{flag}: expected a number in [0, 1], got {value}" in capsys.readouterr().err
        with pytest.raises(UsageError, match=rf"{flag}: expected a number in \[0, 1\]"):
            step3_args({flag: float(value)})
    for value in (0.0, 0.9, 1.0):
        assert getattr(step3_args({flag: value}), flag) == value


def test_an_adaptive_kl_target_of_0_or_below_is_an_error_before_any_model_loads(capsys):
    """It passed the settings checks: 0 or -6 failed once all four models had loaded, in the controller's ValueError
    that named no flag, and nan made the KL coefficient nan after the first update."""
    from dschat.errors import UsageError
    from dschat.rlhf.config import step3_args

    for value in ("0", "-6", "nan"):
        with pytest.raises(SystemExit):
            step3_parser().parse_args(["--adaptive_kl", "--kl_target", value])
        assert f"--kl_target: expected a number > 0, got {value}" in capsys.readouterr().err
        with pytest.raises(UsageError, match="kl_target: expected a number > 0"):
            step3_args({"adaptive_kl": True, "kl_target": float(value)})
    assert step3_args({"adaptive_kl": True, "kl_target": 3.0}).kl_target == 3.0


@pytest.mark.parametrize("world, given, per_rank", [(1, 8, 8), (2, 8, 4), (2, 9, 5), (4, 0, 0)])
def test_eval_prompts_counts_over_all_ranks(world, given, per_rank, monkeypatch):
    # each rank scores its share of the held-out prompts, so that 8 over 2 ranks are the 8 that eval.py scores
    import inspect
    from types import SimpleNamespace

    from dschat.steps import ppo

    seen = {}
    monkeypatch.setattr(evaluation, "get_world_size", lambda: world)
    signature = inspect.signature(evaluation.evaluate_policy)
    monkeypatch.setattr(evaluation, "evaluate_policy", lambda *args, **kwargs: seen.update(
        signature.bind(*args, **kwargs).arguments))
    monkeypatch.setattr(evaluation, "hf_generate", lambda model, tokenizer: model.generate)
    trainer = SimpleNamespace(hybrid=False, actor_model=SimpleNamespace(module=SimpleNamespace(generate=None)),
                              eval=lambda: None, reward_model=None, tokenizer=None, z3_enabled=False,
                              pad_to_multiple_of=1, reward_fn=None, eos_token_id=0)
    args = SimpleNamespace(eval_max_new_tokens=None, max_answer_seq_len=4, eval_prompts=given, padded_forwards=False)
    ppo.held_out_eval(trainer, None, args, "cpu", None)
    assert seen["max_prompts"] == per_rank


def test_the_held_out_evaluations_hf_generate_is_told_to_suppress_the_ids_past_the_tokenizer(monkeypatch):
    """held_out_eval wrapped HF's generate with the trainer's own copy of its arguments (hf_generate_kwargs), apart
    from rlhf.evaluation.hf_generate, the one place that builds them (what eval.py and the tools score with): a trainer
    whose copy missed the untokenized rows evaluated answers that could hold them. Its HF generate call now gets
    suppress_tokens for every embedding row past the tokenizer's ids."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 32, "eos_token_id": 1, "pad_token_id": 0})()
    calls = []
    model.generate = lambda *args, **kwargs: calls.append(kwargs)
    monkeypatch.setattr(evaluation, "evaluate_policy", lambda generate, *args, **kwargs: generate(None))
    trainer = SimpleNamespace(hybrid=False, actor_model=SimpleNamespace(module=model), eval=lambda: None,
                              reward_model=None, tokenizer=tokenizer, z3_enabled=False, pad_to_multiple_of=1,
                              reward_fn=None, eos_token_id=1)
    args = SimpleNamespace(eval_max_new_tokens=None, max_answer_seq_len=4, eval_prompts=0, padded_forwards=False)
    ppo.held_out_eval(trainer, None, args, "cpu", None)
    assert [call.get("suppress_tokens") for call in calls] == [list(range(32, 40))]


def test_rollouts_and_the_held_out_evaluation_build_hf_generates_arguments_in_one_place(distributed, monkeypatch):
    """Without the hybrid engine the rollouts called HF's generate with the trainer's copy of its arguments
    (hf_generate_kwargs, taken once when the trainer was built) while the held-out evaluation built them with
    rlhf.evaluation.hf_generate at each call: a tokenizer given tokens for the model's spare embedding rows after the
    trainer was built (tokenizer.add_tokens) could then be answered with them in the evaluation, never in the
    rollouts. Both now go through hf_generate: the same suppress_tokens, the ids the tokenizer has no token for now."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from dschat.rlhf.config import step3_args
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    size = [32]
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: size[0], "eos_token_id": 1, "pad_token_id": 0})()
    args = step3_args({"max_answer_seq_len": 4, "enable_hybrid_engine": False, "actor_zero_stage": 0})
    engine = SimpleNamespace(actor=SimpleNamespace(module=model), ref=SimpleNamespace(module=model), critic=None,
                             reward=SimpleNamespace(module=model), actor_ema=None, tokenizer=tokenizer, args=args)
    trainer = DeepSpeedPPOTrainer(engine)
    trainer.eval = lambda: None
    calls = []
    model.generate = lambda prompts, **kwargs: calls.append(kwargs.get("suppress_tokens")) or prompts
    monkeypatch.setattr(evaluation, "evaluate_policy", lambda generate, *args, **kwargs: generate(None))
    eval_args = SimpleNamespace(eval_max_new_tokens=None, max_answer_seq_len=4, eval_prompts=0, padded_forwards=False)
    prompts = torch.tensor([[5, 6]])
    for grown in (32, 36):  # the tokenizer's 4 new tokens get the spare rows 32..35
        size[0] = grown
        trainer._generate_sequence(prompts, torch.ones_like(prompts))
        ppo.held_out_eval(trainer, None, eval_args, "cpu", None)
    assert calls == [list(range(32, 40))] * 2 + [list(range(36, 40))] * 2, calls


@pytest.mark.parametrize("weighted", [False, True])
def test_a_resume_on_other_ranks_scores_after_ppo_the_prompts_scored_before(weighted, distributed, monkeypatch, capsys):
    """Each rank scores its share of --eval_prompts in whole generation batches: a checkpoint of 2 ranks scored the
    first 8 held-out prompts before PPO (--eval_prompts 8 --per_device_generation_batch_size 32 in the tiny run: 64),
    and its resume on 1 rank scored the first 4 (32) after PPO; the report set the two side by side as the SFT and
    PPO policies' scores of the same prompts."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, SequentialSampler

    from dschat.data.samplers import EvalWeighted, PaddingMarkedSampler, weighted_collator

    prompts = [{"id": i} for i in range(20)]
    ids = lambda items: {"id": [item["id"] for item in items]}  # noqa: E731
    batch, eval_prompts = 4, 2
    # the checkpoint's 2 ranks: each its first whole batch covering its share (1 prompt), interleaved
    scored_before = set()
    for rank in range(2):
        for position, (index, _) in enumerate(PaddingMarkedSampler(prompts, num_replicas=2, rank=rank,
                                                                   shuffle=False)):
            if position < ppo.step3_eval_prompts(eval_prompts, batch, 2) // 2:
                scored_before.add(index)
    assert scored_before == set(range(8)) and ppo.step3_eval_prompts(eval_prompts, batch, 1) == 4
    if weighted:
        loader = DataLoader(EvalWeighted(prompts), batch_size=batch,
                            sampler=PaddingMarkedSampler(prompts, shuffle=False), collate_fn=weighted_collator(ids))
    else:
        loader = DataLoader(prompts, batch_size=batch, sampler=SequentialSampler(prompts), collate_fn=ids)
    args = SimpleNamespace(eval_prompts=eval_prompts, advantage_estimator="gae", seed=1234)
    after, flags = ppo.held_out_as_before(loader, {"prompts": 8}, args, 1)
    scored_after = [i for b in after for i in b["id"]]
    assert scored_after == list(range(8)) and flags.eval_prompts == 0 and args.eval_prompts == eval_prompts
    assert "[step3] held-out after PPO: the first 8 held-out prompts, as the checkpoint's run scored before PPO on " \
           "its ranks (--eval_prompts 2 on 1 rank(s) would score 4)" in capsys.readouterr().out
    # as many as this run scores (the same ranks), or no held-out scores before: as it was
    assert ppo.held_out_as_before(loader, {"prompts": 4}, args, 1) == (loader, args)
    assert ppo.held_out_as_before(loader, None, args, 1) == (loader, args)
    assert ppo.held_out_as_before(loader, {"prompts": 8}, args, 2) == (loader, args)


def test_the_held_out_evaluation_runs_outside_the_hybrid_engines_iterations(monkeypatch):
    # the engine's latency line counts PPO iterations; the evaluation's generations must not make one
    import contextlib
    import types

    seen = []

    class Actor:
        inside = False

        @contextlib.contextmanager
        def evaluation(self):
            self.inside = True
            yield self
            self.inside = False

        def generate(self, *a, **k):
            pass

    actor = Actor()
    trainer = types.SimpleNamespace(hybrid=True, actor_model=actor, eval=lambda: seen.append(("eval", actor.inside)),
                                    reward_model=None, tokenizer=None, z3_enabled=False, pad_to_multiple_of=None,
                                    reward_fn=None, eos_token_id=0)
    monkeypatch.setattr(evaluation, "evaluate_policy", lambda *a, **k: seen.append(("generate", actor.inside)) or "result")
    args = types.SimpleNamespace(eval_max_new_tokens=4, max_answer_seq_len=4, eval_prompts=2, padded_forwards=False)
    assert ppo.held_out_eval(trainer, None, args, "cpu", None) == "result"
    assert seen == [("eval", True), ("generate", True)] and not actor.inside


def test_the_unsupervised_step_trains_on_the_scaled_loss_and_reports_it_unscaled(monkeypatch):
    """As DeepSpeed-Chat's ``train_unsupervised``: backward on unsup_coef x the LM loss, the LM loss returned (so the
    logged unsup_loss compares across coefficients)."""
    from types import SimpleNamespace

    from dschat.rlhf.trainer import DeepSpeedPPOTrainerUnsupervised

    trainer = DeepSpeedPPOTrainerUnsupervised.__new__(DeepSpeedPPOTrainerUnsupervised)
    trainer.actor_model = lambda **inputs: SimpleNamespace(loss=torch.tensor(2.5, requires_grad=True))
    trained_on = []
    monkeypatch.setattr(trainer, "train", lambda: None)
    monkeypatch.setattr(trainer, "_backward_and_step_actor", lambda loss: trained_on.append(float(loss)))
    batch = {name: torch.ones(1, 3, dtype=torch.long) for name in ("input_ids", "attention_mask", "labels")}
    assert float(trainer.train_unsupervised(batch, 27.8)) == 2.5
    assert trained_on == [pytest.approx(2.5 * 27.8)]


def test_shifted_forwards_do_not_warn_of_padding_without_a_mask():
    # GPT-2 warned "We strongly recommend passing in an `attention_mask`" in every step-3 run: the shifted rows'
    # padding follows their real tokens, which do not attend to it; other forwards keep the warning
    import logging

    from dschat.rlhf.layout import LeftAligned

    logger = logging.getLogger("transformers.modeling_utils")
    warned = logger.makeRecord(logger.name, logging.WARNING, __file__, 0, "We strongly recommend passing in an "
                               "`attention_mask` since your input_ids may be padded.", (), None)
    other = logger.makeRecord(logger.name, logging.WARNING, __file__, 0, "Some other warning.", (), None)
    seen = []

    def forward(input_ids, attention_mask):
        seen.append((bool(logger.filter(warned)), bool(logger.filter(other)), input_ids.tolist(), attention_mask))
        return "out"

    assert LeftAligned.of(torch.tensor([[0, 1, 1]])).forward(forward, torch.tensor([[0, 5, 6]])) == "out"
    assert seen == [(False, True, [[5, 6]], None)]
    assert logger.filter(warned)  # outside the shifted forward


class _TwoRankCollectives:
    """Two ranks as two threads of this process, whose all-reduces (``dschat.utils.dist``'s, and the names modules
    imported of it) sum the tensors the two hand in: a rank that makes more collective calls than the other waits for
    a partner that never comes (the barrier breaks), as a real rank hangs or pairs another call's numbers."""

    def __init__(self, monkeypatch, *modules):
        import threading

        from dschat.utils import dist

        self.local, self.barrier, self.held = threading.local(), threading.Barrier(2, timeout=5), [None, None]
        for module in (dist, *modules):
            monkeypatch.setattr(module, "all_reduce", self.all_reduce, raising=False)
            monkeypatch.setattr(module, "get_world_size", lambda: 2)

    def all_reduce(self, tensor, op="sum", group=None):
        self.held[self.local.rank] = tensor.clone()
        self.barrier.wait()
        total = self.held[0] + self.held[1]
        self.barrier.wait()
        return tensor.copy_(total)

    def run(self, fn):
        """``fn(rank)`` on both ranks at once: their results, or the first error."""
        import threading

        results, errors = [None, None], []

        def rank_body(rank):
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except Exception as error:  # (the other rank's wait ends too)
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=rank_body, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        return results


def _record_on_two_ranks(monkeypatch, trained_of_rank):
    from types import SimpleNamespace

    ranks = _TwoRankCollectives(monkeypatch, ppo)
    buffer = [{"rewards": torch.zeros(2), "input_ids": torch.zeros(2, 3),
               "attention_mask": torch.ones(2, 3), "action_mask": torch.ones(2, 2)}]
    gen_stats = {"answer_length": 2.0, "empty_answers": 0, "truncated_answers": 0, "generation_time": 0.1,
                 "experience_time": 0.1}
    base = {"kl": 0.0, "kl_per_answer": 0.0, "kl_coef": 0.1, "actor_loss": 0.0, "critic_loss": 0.0,
            "unsup_loss": None}
    return ranks.run(lambda rank: ppo._iteration_record(0, buffer, SimpleNamespace(stats={}, kl_coef=0.1), gen_stats,
                                                        {**base, **trained_of_rank[rank]}, 0.1, 1.0, "cpu"))


def test_iteration_record_takes_the_policy_and_value_stats_over_all_ranks(monkeypatch):
    """pg_clipfrac, approx_kl and vf_clipfrac in step3_log.jsonl were rank 0's own on several ranks (on 2 CPU ranks
    approx_kl 4e-05 logged where rank 1 had 5e-05), while every other number of the record is over all ranks: the
    mean over every rank's micro-batches measured (here rank 1 measured 3, rank 0 one)."""
    own = {"pg_clipfrac": 0.25, "approx_kl": 0.1, "vf_clipfrac": 0.3, "stats_micro_batches": 1}
    other = {"pg_clipfrac": 0.5, "approx_kl": 0.3, "vf_clipfrac": 0.1, "stats_micro_batches": 3}
    records = _record_on_two_ranks(monkeypatch, [own, other])
    for key in ("pg_clipfrac", "approx_kl", "vf_clipfrac"):
        assert records[0][key] == records[1][key] == pytest.approx((own[key] + 3 * other[key]) / 4), key
    assert "kl_loss" not in records[0]  # (no rank has a KL loss term)


def test_a_rank_whose_answers_were_all_cut_makes_the_same_collectives_as_the_others(monkeypatch):
    """--mask_truncated_answers: a rank whose every answer was cut measures no step stat (None), where another rank
    measured them. Its record made one collective less per stat than the other rank's, so the ranks' next
    collectives paired up apart (here: the other rank waits for ever). The stats are the ranks' that measured them."""
    measured = {"pg_clipfrac": 0.5, "pg_clipfrac_low": 0.2, "pg_clipfrac_high": 0.3, "approx_kl": 0.3,
                "kl_loss": 0.02, "vf_clipfrac": 0.1, "stats_micro_batches": 2}
    all_cut = {**{key: None for key in measured}, "stats_micro_batches": 0}
    records = _record_on_two_ranks(monkeypatch, [all_cut, measured])
    for key in ppo.PPO_STEP_STATS:
        assert records[0][key] == records[1][key] == pytest.approx(measured[key]), key
    nothing = _record_on_two_ranks(monkeypatch, [all_cut, all_cut])  # (no rank measured: no such key)
    assert not set(ppo.PPO_STEP_STATS) & set(nothing[0])


def test_the_iteration_line_says_when_every_groups_answers_scored_alike(tmp_path):
    """GRPO / RLOO: an iteration whose every group scored alike (frac_reward_zero_std 1.0) trained nothing, and its
    line says so; a part of the groups alike, or no groups (PPO), adds nothing to the line."""
    from types import SimpleNamespace

    class Bar:
        def __init__(self):
            self.lines = []

        def update(self, n):
            pass

        def set_postfix(self, **kwargs):
            pass

        def write(self, line):
            self.lines.append(line)

    trainer = SimpleNamespace(actor_model=object())
    args = SimpleNamespace(print_answers=False, mask_truncated_answers=False, adaptive_kl=False)
    notice = "every group's answers scored alike: every advantage is 0"
    said = {}
    for name, extra in {"all": {"frac_reward_zero_std": 1.0}, "half": {"frac_reward_zero_std": 0.5},
                        "ppo": {}}.items():
        bar = Bar()
        record = {"iteration": 0, "reward": 0.5, "kl": 0.0, **extra}
        ppo._log_iteration(record, str(tmp_path / "step3_log.jsonl"), None, bar, args, trainer, [])
        said[name] = bar.lines[0]
    assert said["all"].endswith(f"({notice})") and "frac_reward_zero_std=" in said["all"]
    assert notice not in said["half"] and "frac_reward_zero_std=" in said["half"]
    assert notice not in said["ppo"] and "frac_reward_zero_std" not in said["ppo"]


@pytest.mark.parametrize("hybrid", [False, True], ids=["hf_generate", "hybrid_engine"])
def test_step3_answers_stop_at_every_eos_id_of_the_actors_generation_config(tmp_path, distributed, hybrid):
    """A generation_config listing a second EOS id (Llama-3-Instruct's <|end_of_text|> beside <|eot_id|>): step 3's
    rollouts and held-out answers end there, as HF's generate and the tools' answers do; they ran on past it."""
    from argparse import Namespace

    from transformers import AutoModelForCausalLM

    from dschat import DeepSpeedPPOTrainer, DeepSpeedRLHFEngine
    from dschat.models.loading import load_tokenizer
    from dschat.steps.ppo import held_out_eval
    from dschat.tiny.presets import create_tiny_model

    folder = str(tmp_path / "actor")
    create_tiny_model("tiny-gpt2", folder)
    tokenizer = load_tokenizer(folder, padding_side="left")
    batch = _prompt_batch(tokenizer, ["\n\nHuman: Say hi.\n\nAssistant:"] * 2)
    model = AutoModelForCausalLM.from_pretrained(folder)
    first = int(model.generate(batch["prompt"], attention_mask=batch["prompt_att_mask"], max_new_tokens=1,
                               do_sample=False, pad_token_id=tokenizer.pad_token_id)[0, -1])
    assert first != tokenizer.eos_token_id
    config_file = tmp_path / "actor" / "generation_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "eos_token_id": [tokenizer.eos_token_id, first]}))
    reward_fn = tmp_path / "zero.py"
    reward_fn.write_text("def score(prompts, answers):\n    return [0.0] * len(answers)\n")
    args = {"critic_model_name_or_path": folder, "dtype": "fp32", "max_prompt_seq_len": 40, "max_answer_seq_len": 6,
            "per_device_training_batch_size": 2, "num_warmup_steps": 0, "greedy": True, "reward_model_weight": 0,
            "reward_fn": f"{reward_fn}:score", "enable_hybrid_engine": hybrid}
    engine = DeepSpeedRLHFEngine(actor_model_name_or_path=folder, tokenizer=tokenizer, args=args)
    trainer = DeepSpeedPPOTrainer(engine=engine, args=args)
    exp = trainer.generate_experience(batch)
    answers = exp["input_ids"][:, batch["prompt"].shape[1]:]
    assert answers[:, 0].tolist() == [first, first]
    assert exp["action_mask"].sum(1).tolist() == [1, 1]  # the answer is its EOS
    held_out = held_out_eval(trainer, [batch], Namespace(**{**vars(trainer.args), "eval_prompts": 2}), "cpu", None)
    assert [e["answer"] for e in held_out["examples"]] == [tokenizer.decode([first]).strip()] * 2


def test_offload_reference_model_puts_the_ema_copy_on_the_cpu_too_and_it_still_averages(trained, tmp_path):
    """DeepSpeed-Chat's EMA copy follows --offload_reference_model; ours was never offloaded: a full fp32 copy of the
    actor stayed on the GPU beside an offloaded reference."""
    from dschat.rlhf.ema import moving_average
    from dschat.models.zero3 import gathered

    engine, _, _ = _engine_and_trainer(trained, tmp_path, actor_zero_stage=3, offload_reference_model=True,
                                       enable_ema=True)
    for copy in (engine.ref, engine.actor_ema):
        assert copy.zero_optimization_stage() == 3 and copy.zero_offload_param().device == "cpu"
    actor, ema = engine.actor.module, engine.actor_ema.module
    name, weight = next((n, p) for n, p in actor.named_parameters() if len(p.ds_shape) == 2)  # (ZeRO-3: partitioned)
    with gathered([weight], modifier_rank=0):
        start = weight.detach().clone()
        weight.data.mul_(2.0)
    moving_average(actor, ema, beta=0.5)
    ema_weight = dict(ema.named_parameters())[name]
    with gathered([ema_weight]):
        assert torch.allclose(ema_weight.data.float(), 1.5 * start.float(), atol=1e-6)


def test_a_critic_and_reward_model_with_fewer_embeddings_than_the_actor_read_every_id_it_samples(tmp_path, capsys,
                                                                                              distributed):
    """One family's sizes share a tokenizer but not the embedding rows past its ids (Qwen2.5-7B's 152064, 0.5B's
    151936): an id the actor sampled past the critic's rows stopped step 3 mid-run with an IndexError in the critic's
    forward (a device-side assert on a GPU). The critic and the reward model grow to the actor's rows, said."""
    from transformers import AutoModelForCausalLM

    from dschat import DeepSpeedRLHFEngine
    from dschat.models.checkpoint import save_reward_model
    from dschat.models.loading import embedding_rows, load_tokenizer
    from dschat.models.reward_model import create_critic_model
    from dschat.tiny.presets import tiny_llama_config

    tokenizer = load_tokenizer("tiny-llama")
    config = tiny_llama_config()
    config.vocab_size = len(tokenizer) + 9  # rows past the tokenizer's ids, as a padded vocabulary has
    actor = tmp_path / "actor"
    AutoModelForCausalLM.from_config(config).save_pretrained(actor)
    tokenizer.save_pretrained(actor)
    scorer = create_critic_model("tiny-llama", tokenizer)  # (a reward model of the tokenizer's rows)
    save_reward_model(scorer, tokenizer, str(tmp_path / "rm"))
    capsys.readouterr()
    engine = DeepSpeedRLHFEngine(str(actor), "tiny-llama", args={"dtype": "fp32",
                                                                  "reward_model_name_or_path": str(tmp_path / "rm")})
    out = capsys.readouterr().out
    past = torch.tensor([[5, 6, config.vocab_size - 1]])  # the actor's last id, past the tokenizer's
    for role, model, path in (("critic", engine.critic.module, "tiny-llama"),
                              ("reward model", engine.reward.module, tmp_path / "rm")):
        assert embedding_rows(model.rwtransformer) >= config.vocab_size, role
        assert torch.isfinite(model.forward_value(past, torch.ones_like(past), return_value_only=True)).all(), role
        assert (f"[step3] the {role} {path} has {len(tokenizer)} token embeddings, the actor {config.vocab_size}: "
                f"grown to {embedding_rows(model.rwtransformer)} (new rows)") in out, out


def _notebook_engine_releasing_into(released, monkeypatch, failing=()):
    """A DeepSpeedRLHFEngine of named stand-in engines whose release appends the name to ``released`` (raises for
    those in ``failing``)."""
    from dschat import DeepSpeedRLHFEngine
    from dschat.models import training_engine

    def release(engine):
        if engine in failing:
            raise RuntimeError(f"CUDA error: device-side assert triggered ({engine})")
        released.append(engine)

    monkeypatch.setattr(training_engine, "release_engine", release)
    engine = object.__new__(DeepSpeedRLHFEngine)
    engine.actor, engine.ref, engine.actor_ema, engine.critic, engine.reward = "actor", "ref", None, "critic", "reward"
    return engine


def test_a_notebook_engine_in_a_with_block_is_released_at_its_end_once(monkeypatch):
    """A notebook had to call release() by hand; ``with DeepSpeedRLHFEngine(...) as engine:`` now does at the end."""
    released = []
    notebook = _notebook_engine_releasing_into(released, monkeypatch)
    with notebook as engine:
        assert engine is notebook and released == []
    assert released == ["actor", "ref", "critic", "reward"]
    with notebook:
        notebook.release()  # (by hand inside the block too: released once)
    notebook.release()
    assert released == ["actor", "ref", "critic", "reward"]


def test_a_with_block_that_fails_releases_its_engine_and_keeps_its_own_error(monkeypatch):
    released = []
    with pytest.raises(ValueError, match="the rollout failed"):
        with _notebook_engine_releasing_into(released, monkeypatch, failing=("actor",)):
            raise ValueError("the rollout failed")  # not replaced by the release's own error
    assert released == ["ref", "critic", "reward"]
    # a block that ended well says why its release failed
    with pytest.raises(RuntimeError, match=r"device-side assert triggered \(critic\)"):
        with _notebook_engine_releasing_into(released, monkeypatch, failing=("critic",)):
            pass
    # Ctrl-C on several ranks: each rank stops at its own point, and a release could wait on a collective
    monkeypatch.setattr("dschat.utils.dist.get_world_size", lambda: 2)
    released.clear()
    with pytest.raises(KeyboardInterrupt):
        with _notebook_engine_releasing_into(released, monkeypatch):
            raise KeyboardInterrupt
    assert released == []


def test_a_notebook_engine_releases_each_of_its_engines_though_one_fails_to(monkeypatch):
    """DeepSpeedRLHFEngine.release() stopped at the first engine whose release raised (on a GPU, destroy()
    synchronizes: a device-side assert of the failed rollout again), leaving the rest held for good."""
    from dschat import DeepSpeedRLHFEngine
    from dschat.models import training_engine
    from dschat.rlhf import engine as rlhf_engine

    released = []

    def release(engine):
        if engine == "actor":
            raise RuntimeError("CUDA error: device-side assert triggered")
        released.append(engine)

    monkeypatch.setattr(training_engine, "release_engine", release)
    monkeypatch.setattr(rlhf_engine, "release_engine", release, raising=False)  # (where it was called before)
    engine = object.__new__(DeepSpeedRLHFEngine)
    engine.actor, engine.ref, engine.actor_ema, engine.critic, engine.reward = "actor", "ref", None, "critic", "reward"
    with pytest.raises(RuntimeError, match="device-side assert"):
        engine.release()
    assert released == ["ref", "critic", "reward"]


def test_a_notebook_engine_inside_a_released_engines_block_destroys_each_engine_once():
    """``with DeepSpeedRLHFEngine(...)`` inside a caller's released_engines block (which its build hands the engines
    to) released each engine at the with block's end and again at the outer block's, so DeepSpeed's destroy() ran
    twice (harmless on the CPU at DeepSpeed 0.19.8, ZeRO-0/2/3, which does not promise it); as did release_engine
    called twice. A released engine's second release does nothing."""
    from dschat import DeepSpeedRLHFEngine
    from dschat.models import training_engine

    destroyed = []

    class Engine:
        def __init__(self, name):
            self.name, self.module = name, torch.nn.Linear(1, 1)

        def destroy(self):
            destroyed.append(self.name)

    actor, critic = Engine("actor"), Engine("critic")
    notebook = object.__new__(DeepSpeedRLHFEngine)
    notebook.actor, notebook.ref, notebook.actor_ema, notebook.critic, notebook.reward = actor, None, None, critic, None
    with training_engine.released_engines():
        training_engine._made(actor)  # (as the engine's build hands them to the enclosing block)
        training_engine._made(critic)
        with notebook:
            pass
        assert destroyed == ["actor", "critic"]
    assert destroyed == ["actor", "critic"]
    training_engine.release_engine(critic)
    assert destroyed == ["actor", "critic"]


def test_grpo_iterations_log_the_groups_score_std_as_trl_does(monkeypatch):
    """TRL's GRPO logs reward_std, the mean of each prompt's answers' score std (how far a group's answers are told
    apart, what GRPO learns from); step 3 logged only the fraction of groups scored alike, not how far the rest were
    apart."""
    from types import SimpleNamespace

    from dschat.rlhf.algorithms import group_reward_std
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    scores = torch.tensor([1.0, 1.0, 0.0, 2.0, 3.0, 3.0, 0.5, 1.5])  # group stds 0, sqrt(2), 0, sqrt(0.5)
    expected = (2 ** 0.5 + 0.5 ** 0.5) / 4
    assert group_reward_std(scores, 2) == pytest.approx(expected)
    assert group_reward_std(torch.full((4,), 1000.7), 4) == 0.0  # (alike: exactly 0, not the mean's rounding)
    trainer = SimpleNamespace(stats={}, args=SimpleNamespace(advantage_estimator="grpo", n_samples_per_prompt=2,
                                                              grpo_norm_by_std=1))
    DeepSpeedPPOTrainer.critic_free_advantages(trainer, scores, None, torch.ones(8, 3))
    assert trainer.stats["reward_std"] == pytest.approx(expected)
    monkeypatch.setattr(ppo, "rank_mean", lambda value, device: value)
    buffer = [{"rewards": scores, "input_ids": torch.zeros(8, 3), "attention_mask": torch.ones(8, 3),
               "action_mask": torch.ones(8, 2)}]
    trained = {"kl": 0.0, "kl_per_answer": 0.0, "kl_coef": 0.1, "actor_loss": 0.0, "critic_loss": None,
               "unsup_loss": None, "pg_clipfrac": 0.0, "approx_kl": 0.0, "vf_clipfrac": None}
    gen_stats = {"answer_length": 2.0, "empty_answers": 0, "truncated_answers": 0, "generation_time": 0.1,
                 "experience_time": 0.1}
    trainer.kl_coef = 0.001
    record = ppo._iteration_record(0, buffer, trainer, gen_stats, trained, 0.1, 1.0, "cpu")
    assert record["reward_std"] == pytest.approx(expected) and record["frac_reward_zero_std"] == 0.5


def test_realigned_schedules_keep_each_models_lag_of_skipped_steps(monkeypatch, capsys):
    """A resume whose iterations take another number of optimizer steps moves each scheduler to this run's steps at
    the checkpoint's iteration. DeepSpeed does not move a scheduler on a skipped step (fp16's overflow, the forced
    skips), so the checkpoint's schedules lag the steps taken by each model's skips; they were moved to the steps
    alone: the actor's schedule jumped 3 steps ahead and the critic's did not (they skip apart without
    --align_overflow)."""
    from types import SimpleNamespace

    def engine(restored_step, skipped):  # (a linear schedule as DeepSpeed's checkpoint restores it)
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 100)
        ppo.move_scheduler(scheduler, restored_step)
        return SimpleNamespace(lr_scheduler=scheduler, skipped_steps=skipped)

    # 2 iterations of 4 steps each: the actor skipped 3 of its 8, the critic none
    trainer = SimpleNamespace(actor_model=engine(8 - 3, 3), critic_model=engine(8, 0))
    monkeypatch.setattr(ppo, "optimizer_steps_per_iteration", lambda args: 2)  # this run: 2 steps an iteration
    ppo.realign_schedules(trainer, {"steps_per_iteration": 4, "iteration": 2}, SimpleNamespace(freezing_actor_steps=0))
    assert trainer.actor_model.lr_scheduler.last_epoch == 2 * 2 - 3
    assert trainer.critic_model.lr_scheduler.last_epoch == 2 * 2
    assert trainer.actor_model.lr_scheduler.get_last_lr() == [pytest.approx(1 - 1 / 100)]
    assert "an iteration of this run takes 2 optimizer steps, its checkpoint's run's 4" in capsys.readouterr().out
    # an actor frozen for both iterations (--freezing_actor_steps) took no step, and skipped none
    trainer = SimpleNamespace(actor_model=engine(0, 0), critic_model=None)
    ppo.realign_schedules(trainer, {"steps_per_iteration": 4, "iteration": 2}, SimpleNamespace(freezing_actor_steps=2))
    assert trainer.actor_model.lr_scheduler.last_epoch == 0


def test_hf_generate_of_a_one_token_prompt_is_the_same_after_another_generation():
    """RecurrentGemma keeps its convolution state in its modules, which HF generate (handing the model a cache) never
    sets up again: a one-token prompt's prefill, taken for a decode step, went on from the previous call's state, and
    hf_generate (step 3 without the hybrid engine, its held-out evaluation, the tools), which takes such a model's rows
    one at a time, answered prompt 18 with [18, 18, ...] after another prompt, [89, 49, ...] before. Each call starts
    from fresh states."""
    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    from hybrid_common import tiny_recurrent_gemma

    from dschat.rlhf.trainer import hf_generate

    model = tiny_recurrent_gemma().eval()
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": 0})()
    one, other = torch.tensor([[18]]), torch.tensor([[40, 51, 9, 77, 23]])
    call = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        first = hf_generate(model, tokenizer)(one, attention_mask=torch.ones_like(one), **call)
        hf_generate(model, tokenizer)(other, attention_mask=torch.ones_like(other), **call)
        again = hf_generate(model, tokenizer)(one, attention_mask=torch.ones_like(one), **call)
    assert torch.equal(again, first) and first[0, 1:].tolist()[:2] == [89, 49]


def _left_padded(prompts, width):
    """(ids, attention mask) of ``prompts`` (lists of token ids) left-padded with 0 to ``width``."""
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = torch.tensor(prompt), 1
    return ids, mask


def test_an_actor_whose_outputs_left_padding_moves_generates_each_row_without_its_padding(capsys, monkeypatch):
    """RWKV's recurrence reads no attention mask (transformers' modelling): from a left-padded batch HF's generate
    answered otherwise than from each prompt alone, while step 3 scores the answers' log-probs on rows shifted to start
    at their first token, so the answers were not sampled from the policy it trains. hf_generate (step 3's rollouts
    without the hybrid engine, its held-out evaluation, the tools) now generates each row as it would alone, unpadded
    (rows 2 and 3, of one length, together: RWKV's batched decode keeps rows apart with dschat's fix, tested below),
    and returns them as one batched call would; where it cannot (a prompt with a hole), it generates as before and
    says so once."""
    from dschat.models import left_padding
    from dschat.rlhf.trainer import hf_generate

    monkeypatch.setattr(left_padding, "_WARNED_LEFT_PADDING", set())
    model = tiny_rwkv()
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": 0})()
    prompts = [[10, 11, 12, 13, 14], [20], [30, 31, 32], [40, 41, 42]]
    ids, mask = _left_padded(prompts, 5)
    call = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        alone = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                **call)[0, len(p):] for p in prompts]
        padded = model.generate(ids, attention_mask=mask, **call)
        seq = hf_generate(model, tokenizer)(ids, attention_mask=mask, **call)
    assert capsys.readouterr().out == ""
    assert torch.equal(seq[:, :5], ids) and seq.shape == (4, 9)
    assert torch.equal(seq[:, 5:], torch.stack(alone))
    assert not torch.equal(padded[:, 5:], seq[:, 5:])  # (what the padding moved)
    holed = mask.clone()
    holed[0, 2] = 0
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(hf_generate(model, tokenizer)(ids, attention_mask=holed, **call),
                               model.generate(ids, attention_mask=holed, **call))
    said = capsys.readouterr().out
    assert said.count("warning: the actor on RwkvForCausalLM generates from left-padded prompts otherwise") == 1
    assert "its recurrent layers read no attention mask" in said
    # (what it says dschat does where it can is what the call above did: it said "HF generate takes each row alone")
    assert "dschat's HF generate and hybrid engine take the rows of each prompt length together" in said


@pytest.mark.parametrize("rows_apart", [True, False])
def test_rwkv_rows_of_one_prompt_length_generate_together_where_its_decode_keeps_them_apart(monkeypatch, rows_apart):
    """transformers' RWKV one-token decode step mixes a batch's rows (5.25: ``compat.rwkv_decode_keeps_rows_apart``),
    so HF generate took an RWKV actor's left-padded prompts one call per row. With dschat's fix in, the rows of one
    prompt length generate together (3 calls for 4 prompts, two of one length), each row's answer as its prompt's
    alone; where the fix would not keep the rows apart (here: the probe made to say so), one row at a time again."""
    from dschat import compat
    from dschat.rlhf.trainer import hf_generate

    if not rows_apart:
        monkeypatch.setattr(compat, "rwkv_decode_keeps_rows_apart", lambda model: False)
    model = tiny_rwkv()
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": 0})()
    prompts = [[10, 11, 12, 13, 14], [30, 31, 32], [20], [40, 41, 42]]
    ids, mask = _left_padded(prompts, 5)
    call = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        alone = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                **call)[0, len(p):] for p in prompts]
        batches, generate = [], model.generate
        monkeypatch.setattr(model, "generate", lambda input_ids, **kw: batches.append(len(input_ids)) or
                            generate(input_ids, **kw))
        seq = hf_generate(model, tokenizer)(ids, attention_mask=mask, **call)
    assert sorted(batches) == ([1, 1, 2] if rows_apart else [1, 1, 1, 1])
    assert torch.equal(seq[:, :5], ids) and torch.equal(seq[:, 5:], torch.stack(alone))


@pytest.mark.parametrize("family", ["rwkv", "xlstm"])
@pytest.mark.parametrize("fallback", ["no pad id", "no mask"])
def test_a_batch_generated_as_it_is_gets_rwkvs_and_xlstms_mends_too(family, fallback, transformers_rwkv_steps,
                                                                      transformers_xlstm_cache):
    """Where HF generate takes the batch as it is (no pad id, no mask; a hole alike), RWKV's decode
    and xLSTM's cache were mended only if an earlier call had taken rows apart in this process: RWKV's batch answers
    then mixed the rows, and xLSTM's call failed ("matC_old has wrong shape"). The mends now go in at every call, and
    unpadded rows generated together answer as each alone."""
    from dschat.rlhf.trainer import hf_generate

    model = {"rwkv": tiny_rwkv, "xlstm": tiny_xlstm}[family]()
    pad_id = None if fallback == "no pad id" else 0
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": pad_id})()
    ids = torch.tensor([[10, 11, 12, 13], [30, 31, 32, 33], [50, 51, 52, 53]])
    mask = None if fallback == "no mask" else torch.ones_like(ids)
    call = dict(max_new_tokens=4, do_sample=False, pad_token_id=pad_id)
    with torch.no_grad():
        seq = hf_generate(model, tokenizer)(ids, attention_mask=mask, **call)
        alone = [model.generate(ids[row:row + 1], attention_mask=torch.ones_like(ids[:1]), **call) for row in range(3)]
    assert torch.equal(seq, torch.cat(alone))


def test_under_synced_gpus_padded_rows_generate_apart_and_a_rank_makes_as_many_calls_as_its_peers(monkeypatch):
    """Under ``synced_gpus`` (ZeRO-3 on several ranks) HF generate took a left-padded RWKV batch as it was, padding and
    all, so that every rank made one call. Now each rank takes its rows of each prompt length together, as on one
    rank, after agreeing with the others on the most calls any makes (here a peer said to make 3: the all-reduce
    stood in for), and makes the calls it lacks on one row, discarding them. One process; the 2-rank run:
    ``test_rwkv_under_zero3_on_two_ranks_answers_each_prompt_as_alone``."""
    from dschat.rlhf.trainer import hf_generate
    from dschat.utils import dist

    model = tiny_rwkv()
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": 0})()
    prompts = [[10, 11, 12, 13], [30, 31], [40, 41, 42, 43]]
    ids, mask = _left_padded(prompts, 4)
    call = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    agreed = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, op: agreed.append((t.tolist(), op)) or t.fill_(3))
    with torch.no_grad():
        alone = [model.generate(torch.tensor([p]), **call)[0, len(p):] for p in prompts]
        batches, generate = [], model.generate
        # (HF's own synced_gpus needs a process group: the calls here go without it)
        monkeypatch.setattr(model, "generate", lambda input_ids, synced_gpus, **kw: batches.append(
            input_ids.tolist()) or generate(input_ids, **kw))
        seq = hf_generate(model, tokenizer)(ids, attention_mask=mask, synced_gpus=True, **call)
    assert agreed == [([2], "max")]  # (this rank's 2 prompt lengths)
    assert batches == [[[30, 31]], [[10, 11, 12, 13], [40, 41, 42, 43]], [[30, 31]]]  # (the last one discarded)
    assert torch.equal(seq[:, :4], ids) and torch.equal(seq[:, 4:], torch.stack(alone))


def _tiny_generator(family):
    """A one-layer Llama of 96 ids or a tiny RWKV (``tiny_rwkv``): the two HF-generate paths, batched and row
    by row."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=2))
    return tiny_rwkv()


@pytest.mark.parametrize("family", ["llama", "rwkv"])
def test_hf_generate_syncs_a_zero3_model_on_several_ranks_when_the_caller_leaves_synced_gpus_unsaid(family,
                                                                                                    monkeypatch):
    """evaluate_policy's ``synced_gpus`` left unsaid is None, HF's default: ZeRO-3 on several ranks, seen only while an
    HfDeepSpeedConfig is alive, which dschat's loaders let go once the model is built. So a ZeRO-3 model (its
    parameters partitioned) on several ranks generated unsynced, and the ranks hung once one's answers ended first.
    hf_generate now tells HF outright: synced where the model is partitioned and there are several ranks, as the
    caller says where it says."""
    from dschat.models.loading import model_load_context
    from dschat.rlhf import trainer
    from dschat.rlhf.trainer import hf_generate

    model = _tiny_generator(family)
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": 0})()
    ids, mask = _left_padded([[10, 11], [30, 31]], 2)
    said = []
    model.generate = lambda input_ids, synced_gpus="unsaid", **kw: said.append(synced_gpus) or input_ids
    monkeypatch.setattr("dschat.utils.dist.all_reduce", lambda t, op: t)  # (the calls' agreement: one rank here)
    keep_alive = model_load_context({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    del keep_alive  # (as dschat's loaders: gone once the model is built)

    def synced_gpus(world, partitioned, **call):
        monkeypatch.setattr(trainer, "get_world_size", lambda: world)
        first = next(model.parameters())
        if partitioned:
            first.ds_id = 0  # (what a ZeRO-3-partitioned parameter carries)
        elif hasattr(first, "ds_id"):
            del first.ds_id
        said.clear()
        hf_generate(model, tokenizer)(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, **call)
        return set(said)

    assert synced_gpus(2, partitioned=True) == {True}
    assert synced_gpus(2, partitioned=True, synced_gpus=None) == {True}  # (as evaluate_policy passes it unsaid)
    assert synced_gpus(2, partitioned=True, synced_gpus=False) == {False}  # (the caller's word)
    assert synced_gpus(1, partitioned=True) == {False}
    assert synced_gpus(2, partitioned=False) == {False}


def test_hf_generate_says_synced_gpus_only_to_a_generate_that_takes_it(monkeypatch):
    """hf_generate passed ``synced_gpus`` to every model's generate, from the tools on one rank too: a remote-code
    model whose own generate takes no such argument (nor ``**kwargs``) failed with a TypeError at every call. Now it
    is said only where generate takes it; where the ranks must sync (ZeRO-3 on several ranks) and it cannot, a
    clear error names the model's class."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dschat.errors import UsageError
    from dschat.rlhf import trainer
    from dschat.rlhf.trainer import hf_generate

    class OwnGenerate(LlamaForCausalLM):  # (a remote-code model's generate, with its own fixed arguments)
        def generate(self, input_ids, attention_mask=None, max_new_tokens=20, do_sample=False, pad_token_id=None):
            return super().generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                    do_sample=do_sample, pad_token_id=pad_token_id)

    model = OwnGenerate(LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=2))
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": 0})()
    ids, call = torch.tensor([[10, 11, 12]]), dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        alone = LlamaForCausalLM.generate(model, ids, **call)
        assert torch.equal(hf_generate(model, tokenizer)(ids, attention_mask=torch.ones_like(ids), **call), alone)
        assert torch.equal(hf_generate(model, tokenizer)(ids, attention_mask=torch.ones_like(ids), synced_gpus=False,
                                                         **call), alone)
        with pytest.raises(UsageError, match=r"OwnGenerate\.generate takes no synced_gpus.*--actor_zero_stage 2"):
            hf_generate(model, tokenizer)(ids, attention_mask=torch.ones_like(ids), synced_gpus=True, **call)
        monkeypatch.setattr(trainer, "get_world_size", lambda: 2)
        next(model.parameters()).ds_id = 0  # (ZeRO-3 on 2 ranks, synced_gpus unsaid: it must sync)
        with pytest.raises(UsageError, match=r"OwnGenerate\.generate takes no synced_gpus"):
            hf_generate(model, tokenizer)(ids, attention_mask=torch.ones_like(ids), **call)


def test_hf_generate_asks_a_lora_actors_base_model_whether_its_generate_takes_synced_gpus(monkeypatch):
    """A LoRA actor is a PEFT model (``apply_lora``), whose generate takes ``*args, **kwargs`` and hands them to its
    base model's: ``synced_gpus`` was said through it to a base generate that takes no such argument, a TypeError at
    every call. The base model's generate is asked; the error where the ranks must sync names its class."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dschat.errors import UsageError
    from dschat.models.lora import apply_lora
    from dschat.rlhf import trainer
    from dschat.rlhf.trainer import hf_generate

    class OwnGenerate(LlamaForCausalLM):  # (a generate with its own fixed arguments)
        def generate(self, input_ids, attention_mask=None, max_new_tokens=20, do_sample=False, pad_token_id=None):
            return super().generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                    do_sample=do_sample, pad_token_id=pad_token_id)

    base = OwnGenerate(LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2))
    model = apply_lora(base, 2)
    assert model is not base  # (a PEFT model)
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": 0})()
    ids, call = torch.tensor([[10, 11, 12]]), dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        alone = LlamaForCausalLM.generate(base, ids, **call)  # (LoRA's B starts at 0: the base's answer)
        assert torch.equal(hf_generate(model, tokenizer)(ids, attention_mask=torch.ones_like(ids), **call), alone)
        monkeypatch.setattr(trainer, "get_world_size", lambda: 2)
        next(model.parameters()).ds_id = 0  # (ZeRO-3 on 2 ranks, synced_gpus unsaid: it must sync)
        with pytest.raises(UsageError, match=r"^OwnGenerate\.generate takes no synced_gpus"):
            hf_generate(model, tokenizer)(ids, attention_mask=torch.ones_like(ids), **call)
        said = []  # (a generate set on the PEFT model itself, as the hybrid engine routes it, takes it itself)
        model.generate = lambda input_ids, **kw: said.append(kw.get("synced_gpus")) or input_ids
        hf_generate(model, tokenizer)(ids, attention_mask=torch.ones_like(ids), **call)
        assert said == [True]


def test_whether_a_generate_takes_synced_gpus_is_read_from_its_signature_at_each_call(monkeypatch):
    """``synced_gpus_said`` reads ``generate``'s signature at each call (each rollout, each held-out batch): ~0.1 ms on
    a CPU, where HF's generate reads signatures 7 times a call itself. (Session 65 kept them in a WeakKeyDictionary
    under each generate's function: more machinery than that saves.) Each generate gives its own answer: a class's
    for all its instances, a generate set on an instance (as the hybrid engine routes one) or a partial its own, and
    nothing read outlives the model."""
    import functools
    import gc
    import inspect
    import weakref

    from dschat.errors import UsageError
    from dschat.rlhf.trainer import synced_gpus_said

    read = []
    signature = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda fn, **kw: read.append(fn) or signature(fn, **kw))

    class Takes:
        def generate(self, input_ids, synced_gpus=None):
            return input_ids

    class TakesNot:
        def generate(self, input_ids):
            return input_ids

    first, second = Takes(), Takes()
    for model in (first, second, first):
        assert synced_gpus_said(model, True) == {"synced_gpus": True}
    assert len(read) == 3  # (once a call: nothing kept)
    assert synced_gpus_said(TakesNot(), False) == {}
    with pytest.raises(UsageError, match=r"TakesNot\.generate takes no synced_gpus"):
        synced_gpus_said(TakesNot(), True)
    routed = Takes()
    # (an instance's own generate, holding its model as the hybrid engine's route does: its own answer)
    routed.generate = lambda input_ids, **kwargs: routed and input_ids
    assert synced_gpus_said(routed, True) == {"synced_gpus": True}
    assert synced_gpus_said(routed, False) == {"synced_gpus": False}
    gone = weakref.ref(routed)
    del routed
    gc.collect()
    assert gone() is None  # (nothing read keeps the generate, nor its model, alive)
    partial = TakesNot()
    partial.generate = functools.partial(lambda input_ids, extra: input_ids, extra=1)
    assert synced_gpus_said(partial, False) == {}
    assert len(read) == 8  # (3 + 2 TakesNot + 2 routed + 1 partial)


def test_hf_generate_leaves_a_plain_model_unsynced_while_an_hf_deepspeed_config_lives(monkeypatch):
    """``syncs_ranks`` also asked HF's ``is_deepspeed_zero3_enabled()``, true while an HfDeepSpeedConfig is alive in
    the process: a model loaded without ZeRO (a policy of the tools, a reward model loaded plain) synced on several
    ranks where one outlived its load, which may be on one rank alone (kept in a cycle until that rank's garbage
    collection), and that rank waited in HF's per-step all-reduce for peers that never came. Now the model alone
    decides: partitioned (ZeRO-3) or FSDP-managed, on several ranks."""
    from dschat.models.loading import model_load_context
    from dschat.rlhf import trainer
    from dschat.rlhf.trainer import hf_generate

    model = _tiny_generator("llama")
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": 0})()
    said = []
    model.generate = lambda input_ids, synced_gpus="unsaid", **kw: said.append(synced_gpus) or input_ids
    monkeypatch.setattr(trainer, "get_world_size", lambda: 2)
    alive = model_load_context({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        hf_generate(model, tokenizer)(torch.tensor([[10, 11]]), attention_mask=torch.ones(1, 2, dtype=torch.long),
                                      max_new_tokens=2, pad_token_id=0)
    finally:
        del alive  # (as dschat's loaders: gone, for the other tests)
    assert said == [False]


@pytest.mark.parametrize("family", ["llama", "rwkv"])
@pytest.mark.parametrize("synced_gpus", [None, True])
def test_hf_generate_refuses_a_batch_of_no_row_by_name(family, synced_gpus, monkeypatch):
    """A batch of no row failed deep in the model's forward (Llama: "cannot reshape tensor of 0 elements"), and under
    ``synced_gpus`` such a rank's spare calls took its first row, of which there is none. dschat's callers never make
    one (step 3 refuses it; the held-out loaders give every rank at least one row a batch): a clear error says so."""
    from dschat.errors import UsageError
    from dschat.rlhf.trainer import hf_generate

    model = _tiny_generator(family)
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": 0})()
    monkeypatch.setattr("dschat.utils.dist.all_reduce", lambda t, op: t.fill_(2))  # (a peer makes 2 calls)
    ids = torch.zeros(0, 3, dtype=torch.long)
    with torch.no_grad(), pytest.raises(UsageError, match=r"a batch of no prompt \(input_ids \(0, 3\)\)"):
        hf_generate(model, tokenizer)(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                                      pad_token_id=0, synced_gpus=synced_gpus)


@pytest.mark.parametrize("synced_gpus", [None, True])
def test_hf_generate_refuses_no_input_ids_by_name_for_a_model_generated_row_by_row(synced_gpus, monkeypatch):
    """``hf_generate(model, tok)(None, ...)``, HF's generation from BOS, failed for the families generated row by row
    (RWKV here) with "'NoneType' object has no attribute 'shape'"; it is refused by name, with the prompt to give.
    A model generated as one batch (Llama) passes None on to HF."""
    from dschat.errors import UsageError
    from dschat.rlhf.trainer import hf_generate

    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": 0})()
    monkeypatch.setattr("dschat.utils.dist.all_reduce", lambda t, op: t.fill_(1))
    with torch.no_grad(), pytest.raises(UsageError, match=r"^hf_generate: no input_ids, for RwkvForCausalLM, which "
                                                          r"generates row by row.*torch.tensor\(\[\[tokenizer"):
        hf_generate(_tiny_generator("rwkv"), tokenizer)(None, max_new_tokens=2, do_sample=False, pad_token_id=0,
                                                        synced_gpus=synced_gpus)
    model = _tiny_generator("llama")
    given = []
    model.generate = lambda input_ids, **kw: given.append(input_ids)
    hf_generate(model, tokenizer)(None, max_new_tokens=2, synced_gpus=synced_gpus)
    assert given == [None]


def test_under_synced_gpus_a_rank_whose_peer_has_no_row_is_refused_with_it_in_their_agreement(monkeypatch):
    """A rank given a batch of no row raised alone (``check_rows_to_generate``) before the ranks' agreement on their
    generate calls, so its peers waited in the agreement's all-reduce for ever. It now says so in that same
    all-reduce (a count above any, ``dist.NO_CALLS``), and every rank is refused there together, before any call:
    here the peer's word stood in for by the all-reduce, the rank with rows refused naming the other's batch, and
    the rank of no row naming its own. Two ranks: ``test_rwkv_under_zero3_on_two_ranks_answers_each_prompt_as_alone``."""
    from dschat.errors import UsageError
    from dschat.rlhf.trainer import hf_generate
    from dschat.utils import dist

    model = tiny_rwkv()
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": 0})()
    said, generated = [], []
    monkeypatch.setattr(dist, "all_reduce", lambda t, op: said.append(t.tolist()) or t.fill_(dist.NO_CALLS))
    monkeypatch.setattr(model, "generate", lambda input_ids, **kw: generated.append(input_ids) or input_ids)
    ids, mask = _left_padded([[10, 11, 12], [30, 31]], 3)
    call = dict(max_new_tokens=2, do_sample=False, pad_token_id=0, synced_gpus=True)
    with pytest.raises(UsageError, match=r"^hf_generate: another rank's batch of no prompt \(every rank stops"):
        hf_generate(model, tokenizer)(ids, attention_mask=mask, **call)
    assert said == [[2]] and generated == []  # (this rank's 2 prompt lengths said; no call made)
    for no_row_mask in (torch.ones(0, 3, dtype=torch.long), None):  # (None: the batch taken as it is)
        with pytest.raises(UsageError, match=r"^hf_generate: a batch of no prompt \(input_ids \(0, 3\)\)"):
            hf_generate(model, tokenizer)(ids[:0], attention_mask=no_row_mask, **call)
    assert said == [[2], [dist.NO_CALLS], [dist.NO_CALLS]] and generated == []


@pytest.mark.parametrize("where", ["call", "generation_config"])
def test_rows_generated_without_their_padding_get_the_new_tokens_a_max_length_gives_the_batch(where):
    """HF's ``max_length`` counts the prompt, padding included: a padded row of an actor whose outputs left padding
    moves, generated without its padding, took the padding's place in new tokens (max_length 8, prompts padded to 4:
    the 2-token prompt got 6, the batch 4), and the answers came back wider than max_length. Now each row gets the
    batch's count, from the call's max_length or the model's generation_config's."""
    from dschat.rlhf.trainer import hf_generate

    model = tiny_rwkv()
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": 0})()
    prompts = [[10, 11, 12, 13], [30, 31]]
    ids, mask = _left_padded(prompts, 4)
    call = dict(do_sample=False, pad_token_id=0)
    if where == "call":
        call["max_length"] = 8
    else:
        model.generation_config.max_length = 8
    with torch.no_grad():
        alone = [model.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, pad_token_id=0)[0, len(p):]
                 for p in prompts]
        seq = hf_generate(model, tokenizer)(ids, attention_mask=mask, **call)
    assert seq.shape == (2, 8) and torch.equal(seq[:, 4:], torch.stack(alone)), seq.tolist()


@pytest.mark.multirank
def test_rwkv_under_zero3_on_two_ranks_answers_each_prompt_as_alone(tmp_path):
    """Under ZeRO-3 on several ranks HF generate took the batch as it was (``synced_gpus``): RWKV's decode was mended
    only where a rank generated alone, so step 3's RWKV rollouts there mixed the rows (tokens 2 on of each answer),
    and padded rows generated with their padding. tests/scripts/rwkv_zero3_generate.py: each rank's answers to
    left-padded prompts equal each prompt's alone without ZeRO, the ranks holding other mixes of prompt lengths (2
    generate calls on rank 0, 3 on rank 1: rank 0 makes one more, or the ranks hang). Then rank 1 given a batch of no
    prompt: both ranks are refused together (it raised alone before, and rank 0 waited in the agreement)."""
    proc = run_deepspeed(REPO / "tests" / "scripts" / "rwkv_zero3_generate.py", "--folder", tmp_path / "rwkv",
                         timeout=300)
    for rank in (0, 1):
        assert f"rank {rank} answers as each prompt alone: OK" in proc.stdout, proc.stdout[-3000:]
    assert "rank 0 refused: hf_generate: another rank's batch of no prompt" in proc.stdout, proc.stdout[-3000:]
    assert "rank 1 refused: hf_generate: a batch of no prompt (input_ids (0, 4))" in proc.stdout, proc.stdout[-3000:]


def _tiny_xlstm_actor():
    """``tiny_xlstm``, its cache mended."""
    from dschat.compat import xlstm_cache_fits_its_layers

    model = tiny_xlstm()
    assert xlstm_cache_fits_its_layers(model)
    return model


TINY_ACTORS_READING_NO_MASK = {"recurrent_gemma": tiny_recurrent_gemma_actor, "deepseek_v4": tiny_deepseek_v4_actor,
                               "xlstm": _tiny_xlstm_actor}


def test_an_xlstm_batch_generated_as_it_is_gets_the_mended_cache_too(transformers_xlstm_cache):
    """Where HF generate takes a left-padded batch as it is (no pad id, as here; a prompt with no token or a hole), a
    64-wide xLSTM's generate failed ("matC_old has wrong shape"): only ``decodes_rows_apart`` put dschat's fix of
    transformers' xLSTMCache in, and that path never asked it. It generates now (the padding warned of), its unpadded
    row as it would alone."""
    from transformers import AutoModelForCausalLM, xLSTMConfig

    from dschat.rlhf.trainer import hf_generate

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(xLSTMConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_heads=4, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": None})()
    ids = torch.randint(3, 96, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        seq = hf_generate(model, tokenizer)(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        alone = model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=4, do_sample=False)
    assert seq.shape == (2, 10) and torch.equal(seq[0], alone[0])


@pytest.mark.parametrize("family", sorted(TINY_ACTORS_READING_NO_MASK))
def test_rows_of_one_prompt_length_generate_together_where_the_batched_decode_keeps_them_apart(monkeypatch, family):
    """RecurrentGemma's and DeepSeek-V4's batched decodes keep unpadded rows apart in transformers, and xLSTM's with
    dschat's fix of its cache (without it a 64-wide xLSTM generated nothing, one row or several), yet HF generate took
    their left-padded prompts one call per row, as RWKV's (whose decode mixed rows). Their rows of one prompt length
    now generate together: 3 calls for prompts of 12, 3, 1, 3 and 12 tokens (past the attention windows and
    DeepSeek-V4's pooling), each row's answer its prompt's alone, greedy, one row of a pair meeting EOS mid-way."""
    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    from hybrid_common import left_padded_batch

    from dschat.rlhf.trainer import from_fresh_module_states, hf_generate

    model = TINY_ACTORS_READING_NO_MASK[family]()
    tokenizer = type("Tokenizer", (), {"__len__": lambda self: 96, "eos_token_id": None, "pad_token_id": 0})()
    lengths = [12, 3, 1, 3, 12]
    ids, mask = left_padded_batch(lengths, seed=1)
    width, call = ids.shape[1], dict(max_new_tokens=8, do_sample=False, pad_token_id=0)

    def alone(row, **kwargs):  # (RecurrentGemma's states kept in its modules set up afresh, as hf_generate does)
        prompt = ids[row:row + 1, width - lengths[row]:]
        return from_fresh_module_states(model, model.generate, prompt, attention_mask=torch.ones_like(prompt),
                                        **call, **kwargs)[0, lengths[row]:]

    with torch.no_grad():
        ends, partner = alone(1).tolist(), alone(3).tolist()
        # (EOS: a token of row 1's answer after its first, not before it and not in row 3's, of its prompt length)
        stop = next(k for k, token in enumerate(ends) if k and token not in ends[:k] + partner)
        answers = [alone(row, eos_token_id=ends[stop]) for row in range(len(lengths))]
        assert len(answers[1]) == stop + 1 < 8 and len(answers[3]) == 8
        batches, generate = [], model.generate
        monkeypatch.setattr(model, "generate", lambda input_ids, **kw: batches.append(len(input_ids)) or
                            generate(input_ids, **kw))
        seq = hf_generate(model, tokenizer)(ids, attention_mask=mask, eos_token_id=ends[stop], **call)
    assert sorted(batches) == [1, 2, 2]
    assert torch.equal(seq[:, :width], ids)
    for row, answer in enumerate(answers):
        assert torch.equal(seq[row, width:width + len(answer)], answer), row
        assert (seq[row, width + len(answer):] == 0).all(), row


def test_hf_generates_and_the_hybrid_engines_rows_of_each_prompt_length_are_one_grouping():
    """HF generate's row by row path (``rows_to_generate_together``) and the hybrid engine's decode
    (``prompt_length_groups``) each grouped rows by prompt length in their own code; both now take
    ``rows_of_each_prompt_length``'s groups: the rows of each length in order, the lengths ascending whatever the
    rows' order (every rank makes its calls in one order), each group's prompts without their padding."""
    from dschat.hybrid_engine.decode import prompt_length_groups, rows_of_each_prompt_length
    from dschat.rlhf.trainer import rows_to_generate_together

    lengths = torch.tensor([3, 1, 3, 2, 1])
    ids = torch.arange(15).reshape(5, 3)
    grouped = [(rows.tolist(), length) for rows, length in rows_of_each_prompt_length(lengths)]
    assert grouped == [([1, 4], 1), ([3], 2), ([0, 2], 3)]
    assert [(rows.tolist(), length) for rows, length in rows_to_generate_together(lengths, True)] == grouped
    assert [(rows.tolist(), length) for rows, length in rows_to_generate_together(lengths, False)] == \
        [([row], length) for row, length in enumerate(lengths.tolist())]
    groups = prompt_length_groups(ids, lengths)
    assert [rows.tolist() for rows, _ in groups] == [rows for rows, _ in grouped]
    assert [prompts.tolist() for _, prompts in groups] == [[[5], [14]], [[10, 11]], [[0, 1, 2], [6, 7, 8]]]


def test_the_flags_of_logs_and_evaluation_leave_step3s_weights_bit_for_bit(trained, tmp_path):
    """``pipeline_resume.LOG_EVAL_FLAGS``: train.py --resume skips a finished step 3 given other values of them alone,
    as they cannot change its weights. Measured with the hybrid engine and the actor's and critic's dropout on (a draw
    from torch's global RNG, or from the rollouts' generator, in the greedy held-out evaluation would move the later
    dropout masks or samples): three times the held-out prompts, every answer printed, and TensorBoard."""
    flags = ["--max_steps", "3", "--enable_hybrid_engine", "--actor_dropout", "0.1", "--critic_dropout", "0.1"]
    ppo.main(ppo_args(trained, tmp_path / "few", *flags, "--eval_prompts", "4"))
    ppo.main(ppo_args(trained, tmp_path / "many", *flags, "--eval_prompts", "12", "--print_answers",
                      "--print_answers_interval", "1", "--enable_tensorboard", "--tensorboard_path",
                      str(tmp_path / "tb")))
    few, many = saved_tensors(tmp_path / "few"), saved_tensors(tmp_path / "many")
    assert few and few.keys() == many.keys()
    assert [name for name in few if not torch.equal(few[name], many[name])] == []
