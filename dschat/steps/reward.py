"""Step 2: reward-model training with the pairwise loss on chosen/rejected answers."""
import torch

from dschat.args import step2_parser, step_settings
from dschat.data.samplers import eval_weights
from dschat.models.checkpoint import save_reward_model
from dschat.models.reward_model import create_critic_model
from dschat.rlhf.dpo import preference_accuracy, preference_ties
from dschat.steps.common import StepRecipe, run_supervised_step, to_device
from dschat.utils.dist import all_reduce


def build_reward_model(args, tokenizer, ds_config):
    model = create_critic_model(args.model_name_or_path, tokenizer, ds_config, args.num_padding_at_beginning,
                                dropout=args.dropout, zero_stage=args.zero_stage,
                                compute_fp32_loss=args.compute_fp32_loss)
    return model.apply_lora(args.lora_dim, args.lora_module_name, args.lora_alpha, args.only_optimize_lora)


def reward_collator(tokenizer, pad_to_multiple_of=1, max_length=None):
    from dschat.data import DataCollatorReward

    return DataCollatorReward(tokenizer.pad_token_id, pad_to_multiple_of=pad_to_multiple_of,
                              max_length=max_length)


def pairwise_step_loss(engine, batch):
    out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], margin=batch.get("margin"))
    return out["loss"], int(batch["attention_mask"].sum())


@torch.no_grad()
def evaluate_reward(engine, eval_loader, device):
    """Pairwise accuracy (chosen scored above rejected; a tie counts half, ``preference_accuracy``), the tied pairs
    ("ties") and mean scores over all ranks."""
    engine.eval()
    totals = torch.zeros(5, dtype=torch.float64, device=device)  # correct, pairs, sum chosen, sum rejected, ties
    for batch in eval_loader:
        batch = to_device(batch, device)
        out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        chosen, rejected = out["chosen_mean_scores"].double(), out["rejected_mean_scores"].double()
        w = eval_weights(batch, chosen.shape[0], device)  # 0 for a rank's padding repeats
        totals += torch.stack([(preference_accuracy(chosen, rejected).double() * w).sum(), w.sum(),
                               (chosen * w).sum(), (rejected * w).sum(),
                               (preference_ties(chosen, rejected).double() * w).sum()])
    all_reduce(totals)
    pairs = totals[1]
    if pairs == 0:  # no eval pairs: no score, rather than an accuracy of 0
        return {"accuracy": None, "chosen_mean_score": None, "rejected_mean_score": None, "eval_pairs": 0, "ties": 0}
    return {"accuracy": (totals[0] / pairs).item(), "chosen_mean_score": (totals[2] / pairs).item(),
            "rejected_mean_score": (totals[3] / pairs).item(), "eval_pairs": int(pairs.item()),
            "ties": int(totals[4].item())}


REWARD = StepRecipe(name="step2", phase=2, build_model=build_reward_model, collator=reward_collator,
                    loss_fn=pairwise_step_loss, evaluate_fn=evaluate_reward, save_fn=save_reward_model,
                    rows_per_record=2, reads_margins=True, trains_policy=False)


def main(args=None):
    """Train a reward model; returns the final metrics (accuracy and mean chosen/rejected scores)."""
    args = step_settings(step2_parser(), args)  # (a notebook's dict too)
    return run_supervised_step(args, REWARD)
