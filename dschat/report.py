"""The end-of-run report: report.json, a PNG plot of step-3 curves, and a short text summary."""
import json
import os

from dschat.run_layout import (DPO_DIR, FINISHED_MARK, PPO_ACTOR_DIR, PPO_DIR, RECIPE_STEP_FOLDERS, REPORT_FILE, RM_DIR,
                               RUN_ARGS_FILE, SFT_DIR)
from dschat.utils.files import atomic_file, read_json_object, write_json_atomic


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# The model a recipe produces, which the tools (chat.py, eval) take from the output folder.
RECIPE_POLICY = {"ppo": PPO_ACTOR_DIR, "grpo": PPO_ACTOR_DIR, "dpo": DPO_DIR}
# The DPO step's held-out metrics the report keeps.
DPO_REPORT_KEYS = ("reference_logp_accuracy", "logp_accuracy", "reward_accuracy", "chosen_reward", "rejected_reward",
                   "reward_margin", "eval_loss", "eval_pairs", "seconds", "reference_logp_ties", "logp_ties",
                   "reward_ties")


def stale_folders(recipe, steps_run, rm_from_sft=True):
    """Folders of steps (of any recipe) that come after an earlier step this run ran again, and that this run did not
    write: they were made from that step's old output, so they are not this run's results (``train.py --step 1`` after
    a full run leaves an older PPO actor; ``--recipe dpo`` after a PPO run leaves its reward model and actor).
    ``rm_from_sft``: step 2's reward model starts from the SFT model (the tiny default, ``pipeline.step_argv``);
    otherwise it starts from ``--reward-model`` and a new step 1 leaves it this run's."""
    if not steps_run:
        return set()
    written = {RECIPE_STEP_FOLDERS[recipe][step] for step in steps_run}
    own_start = set() if rm_from_sft else {RM_DIR}  # folders that start from no earlier step
    stale = {folder for step, folder in RECIPE_STEP_FOLDERS[recipe].items() if step > min(steps_run)}
    if 1 in steps_run:  # every other recipe's folders start from the SFT model too
        stale |= {folder for folders in RECIPE_STEP_FOLDERS.values() for folder in folders.values()}
    return stale - written - own_start - {SFT_DIR}


def build_report(output_dir, timings, recipe="ppo", steps_run=None, rm_from_sft=True, skipped=(), resumed=(),
                 reward_model=None, rule_scores=None, outdated=()):
    """Collect the metrics of ``recipe``'s steps from their folders under ``output_dir`` (an output folder may also
    hold another recipe's results, e.g. a PPO run's step2_rm beside a GRPO run's: those are not this run's);
    ``steps_run``: the steps of this run (None: all), so that folders left by an earlier run on older inputs are not
    reported; ``skipped``: the names of those ``train.py --resume`` found finished; ``resumed``: those it resumed
    (their seconds count the earlier run's too); ``reward_model``: the trained reward model step 3 scored with
    instead of step 2's; ``rule_scores``: the DPO recipe's held-out rule scores (``pipeline.held_out_rule_scores``);
    ``outdated``: folders of steps this run left out that were made from older outputs
    (``pipeline_resume.outdated_outputs``)."""
    stale = {folder for folder in stale_folders(recipe, steps_run, rm_from_sft)
             if os.path.isdir(os.path.join(output_dir, folder))} | set(outdated)
    own_rm = os.path.join(output_dir, RM_DIR)
    if reward_model and os.path.isdir(own_rm) and os.path.realpath(reward_model) != os.path.realpath(own_rm):
        stale.add(RM_DIR)  # an earlier run's reward model, which this run's step 3 did not score with

    def metrics(folder):
        if folder not in RECIPE_STEP_FOLDERS[recipe].values() or folder in stale:
            return {}
        return read_json_object(os.path.join(output_dir, folder, FINISHED_MARK)) or {}

    step1, step2, step3 = metrics(SFT_DIR), metrics(RM_DIR), metrics(PPO_DIR)
    report = {"timings_s": timings, "skipped": list(skipped), "resumed": list(resumed),
              "sft_eval_loss": step1.get("eval_loss"),
              "sft_perplexity": step1.get("perplexity"), "sft_eval_records": step1.get("eval_records"),
              "sft_eval_tokens": step1.get("eval_tokens"), "rm_accuracy": step2.get("accuracy"),
              "rm_chosen_mean_score": step2.get("chosen_mean_score"),
              "rm_rejected_mean_score": step2.get("rejected_mean_score"),
              "rm_ties": step2.get("ties"), "rm_eval_pairs": step2.get("eval_pairs"),
              "rm_train_margin_pairs": step2.get("train_margin_pairs"),
              "policy": next((sub for sub in (RECIPE_POLICY[recipe], SFT_DIR)
                              if sub.split("/")[0] not in stale
                              and os.path.isfile(os.path.join(output_dir, sub, "config.json"))), None),
              "not_reported": sorted(stale)}
    report.update(reported_reward_model(reward_model))
    dpo = metrics(DPO_DIR)
    if dpo:
        report["dpo"] = {key: dpo.get(key) for key in DPO_REPORT_KEYS}
        if rule_scores:
            report["dpo"]["held_out_rule_score"] = rule_scores
    if step3:
        before, after = step3.get("eval_before") or {}, step3.get("eval_after") or {}
        report["held_out"] = {
            **{name: {key: result.get(key) for key in ("reward_mean", "rule_score_mean", "reward_fn_mean",
                                                       "empty_answers")}
               for name, result in (("sft_policy", before), ("ppo_policy", after))},
            "prompts": after.get("prompts"),
        }
        report["held_out_examples"] = {"sft_policy": before.get("examples", []),
                                       "ppo_policy": after.get("examples", [])}
        report["step3_iterations"] = step3.get("iterations")
        report["step3_algorithm"] = step3.get("algorithm") or step3_algorithm_of_flags(output_dir)
        # read only for a reported step 3: another run's log, e.g. an interrupted one's with its last line cut off,
        # is none of this report's
        curve = read_jsonl(os.path.join(output_dir, PPO_DIR, "step3_log.jsonl"))
        # a critic-free run (GRPO) logs no critic loss: no curve of nulls, and no plot panel; one with no KL loss term
        # (PPO's KL in the reward) no kl_loss
        report["step3_curve"] = {k: [r.get(k) for r in curve] for k in STEP3_CURVES if any(k in r for r in curve)}
        if "kl_loss" in report["step3_curve"]:
            report["step3_kl_loss_estimator"] = kl_loss_estimator_of_flags(output_dir)
    return report


# step 3's logged numbers the report keeps over the iterations and plots, a panel each: kl is the rollout's k1,
# kl_loss the KL loss term's own estimator (k3 unless --kl_estimator), what GRPO's loss penalises
STEP3_CURVES = ("reward", "kl", "kl_loss", "actor_loss", "critic_loss")

# What the report calls each step-3 --advantage_estimator's training (GRPO's run is no PPO run).
ALGORITHM_NAMES = {"gae": "PPO", "grpo": "GRPO", "rloo": "RLOO", "reinforce_pp": "REINFORCE++"}


def step3_algorithm_of_flags(output_dir):
    """The algorithm of a step 3 whose metrics.json names none (written before it recorded one): its
    training_args.json's --advantage_estimator; PPO where that says nothing."""
    run_args = read_json_object(os.path.join(output_dir, PPO_DIR, RUN_ARGS_FILE)) or {}
    return ALGORITHM_NAMES.get((run_args.get("flags") or {}).get("advantage_estimator"), "PPO")


def kl_loss_estimator_of_flags(output_dir):
    """The estimator of step 3's KL loss term: its training_args.json's --kl_estimator, else k3 (the term's default);
    None where the run's flags are not there to say."""
    run_args = read_json_object(os.path.join(output_dir, PPO_DIR, RUN_ARGS_FILE))
    if not run_args:
        return None
    return (run_args.get("flags") or {}).get("kl_estimator") or "k3"


def plot_curves(curve, path, algorithm="PPO"):
    """Reward, KL and losses over the iterations of step 3's ``algorithm`` (``ALGORITHM_NAMES``), one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in STEP3_CURVES if curve.get(k)]
    if not keys:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    axes = axes if len(keys) > 1 else [axes]
    for ax, key in zip(axes, keys):
        ys = curve[key]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", markersize=2)
        ax.set_title(key)
        ax.set_xlabel(f"{algorithm} iteration")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        with atomic_file(path, "wb") as f:  # an earlier run's plot stays whole until this one is
            fig.savefig(f, format="png", dpi=100)
    finally:
        plt.close(fig)
    return path


def reported_reward_model(reward_model):
    """The report's "reward_model" entry: the trained reward model given to train.py that step 3 scored with (a
    folder's absolute path, or a hub name), which the tools then score with; none for step 2's own."""
    if not reward_model:
        return {}
    return {"reward_model": os.path.abspath(reward_model) if os.path.isdir(reward_model) else reward_model}


def write_unfinished_report(output_dir, recipe, steps_run, reward_model=None):
    """report.json while a train.py run's steps run: none of the earlier run's results (an interrupted run must not
    leave them reported over its unfinished folders), marked "unfinished", and naming the policy and reward model
    this run's report will, so the tools take this run's models (and warn) rather than an earlier run's."""
    policy = RECIPE_POLICY[recipe] if max(RECIPE_STEP_FOLDERS[recipe]) in steps_run else SFT_DIR
    write_json_atomic(os.path.join(output_dir, REPORT_FILE),
                      {"unfinished": True, "policy": policy, **reported_reward_model(reward_model)})


CURVES_FILE = "step3_curves.png"  # (in train.py's --output_dir, beside report.json)


def write_report(output_dir, timings, recipe="ppo", steps_run=None, rm_from_sft=True, skipped=(), resumed=(),
                 reward_model=None, rule_scores=None, outdated=()):
    report = build_report(output_dir, timings, recipe, steps_run, rm_from_sft, skipped, resumed, reward_model,
                          rule_scores, outdated)
    plot = os.path.join(output_dir, CURVES_FILE)
    if report.get("step3_curve"):
        report["plot"] = plot_curves(report["step3_curve"], plot, report["step3_algorithm"])
    if not report.get("plot") and os.path.isfile(plot):
        os.remove(plot)  # an earlier run's curves (this run reports no step 3): not left beside this run's report
    write_json_atomic(os.path.join(output_dir, REPORT_FILE), report)
    return report


FINAL_KL_ITERATIONS = 10


def counted(number, noun, plural=None):
    """``number`` ``noun``, in the plural (``plural``, else noun + "s") but for one: "1 iteration", "74 iterations"."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def ties_said(ties, pairs):
    """The tied pairs of a preference accuracy, which count half in it (``preference_accuracy``), where there are any:
    an accuracy of 0.5 made of ties (a model that scores every pair alike) is no coin flip's. Nothing where none tied
    (or a run from before the ties were counted)."""
    if not ties:
        return ""
    if pairs:
        return f" ({ties} of {counted(pairs, 'pair')} tied, each counted half)"
    return f" ({counted(ties, 'tied pair')}, each counted half)"


def sft_eval_counts_said(report):
    """What step 1's eval loss was taken over, as step 2's and DPO's say their pairs; nothing for a run from before
    step 1 counted them."""
    records, tokens = report.get("sft_eval_records"), report.get("sft_eval_tokens")
    if records is None:
        return ""
    return f" over {counted(records, 'held-out record')}" + (f" ({counted(tokens, 'scored token')})"
                                                            if tokens is not None else "")


def final_kl_said(kl, name="KL"):
    """The KL at the end of the run, as the mean over its last iterations: each iteration's is an estimate over one
    rollout's samples, noisy, and the k1 one ("KL": the answer tokens' mean log-ratio to the reference) of a few
    prompts' answers can fall below 0. ``name``: what the line calls it."""
    last = [value for value in kl[-FINAL_KL_ITERATIONS:] if value is not None]
    if not last:
        return f"no {name} logged"
    if len(last) == 1:
        return f"final {name} {last[0]:.4f}"
    return f"final {name} {sum(last) / len(last):.4f} (mean of the last {len(last)} iterations)"


def final_kl_loss_said(report):
    """Where step 3's loss had a KL term (GRPO's, RLOO's, --kl_in_reward 0's), its final kl_loss after the final KL:
    the KL the loss penalised, in the term's own estimator (named where the run's flags say it), where the KL is the
    rollout's k1; nothing for a run without one."""
    kl_loss = report.get("step3_curve", {}).get("kl_loss") or []
    if all(value is None for value in kl_loss):
        return ""
    estimator = report.get("step3_kl_loss_estimator")
    return ", " + final_kl_said(kl_loss, f"kl_loss ({estimator})" if estimator else "kl_loss")


def empty_answers_said(empty, prompts):
    """The held-out answers that are empty, said where there are any: a policy that ends its answers at once gets a
    rule score of 0 and the reward model's score of an empty answer, which the means alone leave unexplained."""
    if not empty:
        return ""
    return f"{empty} of {counted(prompts, 'answer')} empty" if prompts else f"{counted(empty, 'empty answer')}"


def summary_lines(report):
    lines = ["==== dschat report ===="]
    said = {step: f"{step}: {seconds:.1f} s" + (" (resumed: the earlier run's time up to its checkpoint included)"
                                                if step in report.get("resumed", ()) else "")
            for step, seconds in report["timings_s"].items()}
    said.update({step: f"{step}: finished earlier, skipped (--resume)" for step in report.get("skipped", [])})
    lines += [said[step] for step in sorted(said)]  # in step order ("step1", "step2", "step3"), run or skipped
    if report.get("sft_eval_loss") is not None:
        lines.append(f"SFT eval loss: {report['sft_eval_loss']:.4f} (perplexity {report['sft_perplexity']:.2f})"
                     f"{sft_eval_counts_said(report)}")
    elif report.get("sft_eval_records") == 0:  # (step 1 ran, on no held-out records: said, not left out unsaid)
        lines.append("SFT: no held-out records, so no eval loss")
    if report.get("rm_accuracy") is not None:
        lines.append(f"RM held-out accuracy: {report['rm_accuracy']:.4f}"
                     f"{ties_said(report.get('rm_ties'), report.get('rm_eval_pairs'))} (chosen "
                     f"{report['rm_chosen_mean_score']:.3f} vs rejected {report['rm_rejected_mean_score']:.3f})")
    if report.get("rm_train_margin_pairs"):
        lines.append(f"RM trained on {counted(report['rm_train_margin_pairs'], 'pair')} with a margin, subtracted in "
                     "its loss: -logsigmoid(chosen - rejected - margin)")
    if report.get("reward_model"):
        lines.append(f"reward model: {report['reward_model']} (given by --reward-model; no step 2 in this run)")
    held = report.get("held_out")
    if held:
        algorithm = report.get("step3_algorithm", "PPO")
        # (report.json keys them "sft_policy" and "ppo_policy" whatever step 3's algorithm)
        for name, said_as in (("sft_policy", "SFT policy"), ("ppo_policy", f"{algorithm} policy")):
            r = held[name]
            scores = (("reward", "reward_mean"), ("rule score", "rule_score_mean"), ("reward_fn", "reward_fn_mean"))
            parts = [f"{label} {r[key]:.4f}" for label, key in scores if r.get(key) is not None]
            parts += [empty_answers_said(r.get("empty_answers"), held.get("prompts"))]
            lines.append(f"held-out {said_as}: {', '.join(filter(None, parts)) or 'no held-out prompts, so no score'}")
        curve = report.get("step3_curve", {})
        if curve.get("kl"):
            lines.append(f"{algorithm}: {counted(report['step3_iterations'], 'iteration')}, "
                         f"{final_kl_said(curve['kl'])}{final_kl_loss_said(report)}")
    if report.get("dpo"):
        lines += dpo_summary_lines(report["dpo"])
    if report.get("plot"):
        lines.append(f"plot: {report['plot']}")
    for folder in report.get("not_reported", []):
        why = ("not the reward model step 3 scored with" if report.get("reward_model") and folder == RM_DIR
               else "made from an older output of a step before it")
        lines.append(f"not reported: {folder} (an earlier run's, {why})")
    return lines


def dpo_summary_lines(m):
    if not m["eval_pairs"]:
        return ["DPO: no held-out pairs, so no held-out scores"]
    pairs = m["eval_pairs"]
    lines = [f"DPO held-out preference accuracy (chosen answer more likely, {counted(pairs, 'pair')}): "
             f"SFT {m['reference_logp_accuracy']:.4f}{ties_said(m.get('reference_logp_ties'), pairs)} -> "
             f"DPO {m['logp_accuracy']:.4f}{ties_said(m.get('logp_ties'), pairs)}",
             f"DPO implicit rewards: chosen {m['chosen_reward']:.3f}, rejected {m['rejected_reward']:.3f}, "
             f"margin {m['reward_margin']:.3f}, accuracy {m['reward_accuracy']:.4f}"
             f"{ties_said(m.get('reward_ties'), pairs)}; eval loss {m['eval_loss']:.4f}"]
    rule_scores = m.get("held_out_rule_score")
    if rule_scores and rule_scores["dpo"]["prompts"]:  # no held-out prompts: no score (None)
        said = {name: f"{rule_scores[name]['rule_score']:.3f}" for name in ("sft", "dpo")}
        for name in said:  # (a run from before the count: nothing)
            empty = empty_answers_said(rule_scores[name].get("empty_answers"), rule_scores[name]["prompts"])
            said[name] += f" ({empty})" if empty else ""
        lines.append(f"held-out rule score of greedy answers ({counted(rule_scores['dpo']['prompts'], 'prompt')}): "
                     f"SFT {said['sft']} -> DPO {said['dpo']}")
    return lines
