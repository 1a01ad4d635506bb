"""Scoring a policy on held-out prompts with the reward model and, where the data has one, a rule scorer."""
import contextlib

import torch

from dschat.data.samplers import eval_weights
from dschat.errors import UsageError
from dschat.models.positions import position_limit
from dschat.rlhf.layout import forward_layout, reward_scores
from dschat.rlhf.reward_fn import batch_extras, call_reward_fn
# (hf_generate: imported from here by step 3, the tools and the pipeline)
from dschat.rlhf.trainer import answer_mask, answer_texts, hf_generate, pad_answers  # noqa: F401
from dschat.utils.dist import all_reduce, get_world_size


def rule_scorer_for(data_path):
    """The bundled rule scorer when the prompts come from the embedded data, else None."""
    from dschat.data.raw_datasets import is_tiny_data

    if is_tiny_data(data_path):  # (the name tiny, or the shipped files' paths)
        from dschat.tiny.scorer import rule_score

        return rule_score
    return None


@torch.no_grad()
def generate_answers(generate, prompts, mask, max_new_tokens, eos_token_id, pad_token_id, synced_gpus=None):
    """Greedy answers (ids and masks) from a ``generate`` callable with HF's keyword arguments.

    ``synced_gpus`` keeps ZeRO-3 ranks stepping together until all have finished (HF generate needs it); None: as
    the model needs (``hf_generate``: ZeRO-3, seen by the model's partitioned parameters, or FSDP, on several ranks,
    ``trainer.syncs_ranks``), not False, which hangs a ZeRO-3 model on several ranks whose answers end at different
    steps.
    """
    seq = generate(prompts, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                   eos_token_id=eos_token_id, pad_token_id=pad_token_id, synced_gpus=synced_gpus)
    answers = seq[:, prompts.shape[1]:]
    return seq, answer_mask(answers, eos_token_id)


@torch.no_grad()
def evaluate_policy(generate, reward_model, tokenizer, loader, device, max_new_tokens, rule_scorer=None,
                    max_prompts=None, keep_examples=4, synced_gpus=None, pad_to_multiple_of=1, reward_fn=None,
                    eos_token_id=None, padded_forwards=False):
    """Mean reward-model score, rule score and ``--reward_fn`` score of greedy answers to the prompts of ``loader``
    (all ranks), and how many of the answers are empty (``empty_answers``: ended before any text; the means score
    them as such, e.g. a rule score of 0, and do not say why).

    ``generate`` is the actor's generate (hybrid engine or HF), ``reward_model`` the frozen reward engine (or None),
    ``reward_fn`` step 3's reward function (or None): each reported unweighted, as ``reward_mean`` and
    ``reward_fn_mean``.
    Rows whose ``eval_weight`` is 0 (a rank's padding, see EvalWeighted) are generated for but not counted;
    rows without one count once. ``max_prompts`` counts rows, padding included, so ranks stop together.
    The reward model scores the rows as step 3's experience does: answers right-padded to a multiple of
    ``pad_to_multiple_of``, each row shifted to start at its first token (``forward_layout``; left-padded as they are
    with ``padded_forwards``, step 3's ``--padded_forwards``). A backbone that reads no attention mask
    (``LEFT_PADDING_MOVES_SCORES``) scored left-padded rows otherwise than step 3's rollouts do.
    ``eos_token_id``: the id(s) answers stop at (step 3's ``answer_stop_ids``); default the tokenizer's EOS.
    """
    eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    totals = torch.zeros(5, dtype=torch.float64, device=device)  # reward, rule, count, reward_fn sums, empty answers
    examples, seen = [], 0
    limit = position_limit(reward_model.module) if reward_model is not None else None  # (how far rows may round up)
    for batch in loader:
        if max_prompts and seen >= max_prompts:
            break
        prompts, mask = batch["prompt"].to(device), batch["prompt_att_mask"].to(device)
        seq, amask = generate_answers(generate, prompts, mask, max_new_tokens, eos_token_id,
                                      tokenizer.pad_token_id, synced_gpus)
        seq, amask, _ = pad_answers(seq, amask, tokenizer.pad_token_id, pad_to_multiple_of)
        full_mask = torch.cat([mask.long(), amask], dim=1)
        if reward_model is not None:
            layout = forward_layout(full_mask, prompts.shape[1] - 1, pad_to_multiple_of, limit, padded_forwards)
            scores = reward_scores(reward_model.module, seq, full_mask, layout).double()
        else:  # reward function only: no reward-model score to report
            scores = torch.zeros(seq.shape[0], dtype=torch.float64, device=device)
        texts = answer_texts(tokenizer, seq[:, prompts.shape[1]:], amask)
        rules = [rule_scorer(p, t) for p, t in zip(batch["prompt_text"], texts)] if rule_scorer else [0.0] * len(texts)
        w = eval_weights(batch, len(texts), device)
        weights = w.tolist()
        fn_scores = _agreed_scored_rows(reward_fn, batch, texts, weights, device) if reward_fn else [0.0] * len(texts)
        reward_sum = torch.where(w > 0, scores * w, 0.0).sum().item()  # a padding row's nan/inf stays out too
        rule_sum = sum(r * x for r, x in zip(rules, weights) if x > 0)
        fn_sum = sum(f * x for f, x in zip(fn_scores, weights) if x > 0)
        empty = sum(x for t, x in zip(texts, weights) if x > 0 and not t.strip())
        totals += torch.tensor([reward_sum, rule_sum, sum(weights), fn_sum, empty], dtype=torch.float64,
                               device=device)
        examples += [{"prompt": p, "answer": t, "reward": s if reward_model is not None else None,
                      **({"rule_score": r} if rule_scorer else {}), **({"reward_fn": f} if reward_fn else {})}
                     for p, t, s, r, f, x in zip(batch["prompt_text"], texts, scores.tolist(), rules, fn_scores,
                                                 weights)
                     if x > 0][: keep_examples - len(examples)]
        seen += len(texts)
    all_reduce(totals)
    count = totals[2].item()

    def mean(index, scored):  # no held-out prompt: no score, rather than a mean of 0 (as step 2's accuracy)
        return totals[index].item() / count if scored and count else None

    result = {"reward_mean": mean(0, reward_model is not None), "prompts": int(count), "examples": examples}
    if rule_scorer:
        result["rule_score_mean"] = mean(1, True)
    if reward_fn:
        result["reward_fn_mean"] = mean(3, True)
    result["empty_answers"] = round(totals[4].item())  # (last: the held-out line says the scores first)
    return result


def _agreed_scored_rows(reward_fn, batch, texts, weights, device):
    """``_scored_rows``, with every rank told when the function failed on one (each runs as many batches, padding
    included; a rank of padding rows alone does not call the function, but agrees all the same)."""
    from dschat.hybrid_engine.tensor_parallel import together

    return together(lambda: _scored_rows(reward_fn, batch, texts, weights), device,
                    "held-out evaluation: the reward function failed on another rank", UsageError)


def _scored_rows(reward_fn, batch, texts, weights):
    """``reward_fn``'s scores of the counted rows (0 for a rank's padding rows, which it is not called on: a function
    may be costly, e.g. a judge model)."""
    rows = [i for i, x in enumerate(weights) if x > 0]
    extras = {k: [v[i] for i in rows] for k, v in batch_extras(batch).items()}
    scores = call_reward_fn(reward_fn, [batch["prompt_text"][i] for i in rows], [texts[i] for i in rows], extras) \
        if rows else []
    out = [0.0] * len(texts)
    for i, score in zip(rows, scores):
        out[i] = score
    return out


def held_out_eval(trainer, loader, args, device, scorer):
    """Step 3's held-out evaluation of ``trainer``'s policy (``DeepSpeedPPOTrainer.evaluate``, a notebook's): greedy
    answers to ``args.eval_prompts`` of ``loader``'s prompts (over all ranks; 0: all) of at most
    ``args.eval_max_new_tokens`` (else ``max_answer_seq_len``) tokens, scored by ``evaluate_policy`` as the rollouts
    are (the trainer's reward model, reward function, stops and padding) and by ``scorer`` (a rule scorer, or None)."""
    # HF's: the one place that builds its arguments (the rows no token has are never chosen, as in the rollouts)
    generate = trainer.actor_model.generate if trainer.hybrid else hf_generate(trainer.actor_model.module,
                                                                               trainer.tokenizer)
    # the hybrid engine's latency line counts PPO iterations: the evaluation's generations stay out of them
    outside_iterations = trainer.actor_model.evaluation() if trainer.hybrid else contextlib.nullcontext()
    with outside_iterations:
        trainer.eval()
        return evaluate_policy(generate, trainer.reward_model, trainer.tokenizer, loader, device,
                               args.eval_max_new_tokens or args.max_answer_seq_len, scorer,
                               -(-args.eval_prompts // get_world_size()),  # a count over all ranks: each its share
                               synced_gpus=trainer.z3_enabled and get_world_size() > 1,
                               pad_to_multiple_of=trainer.pad_to_multiple_of, reward_fn=trainer.reward_fn,
                               eos_token_id=trainer.eos_token_id,  # (the stops of its rollouts)
                               padded_forwards=args.padded_forwards)  # (how its rollouts score rows)
