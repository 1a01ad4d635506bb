"""Step 2: reward-model training with the pairwise loss on chosen/rejected answers."""
import time

import torch

from dschat.args import step2_parser
from dschat.models.checkpoint import save_reward_model
from dschat.models.loading import load_tokenizer
from dschat.models.lora import apply_lora
from dschat.models.reward_model import create_critic_model
from dschat.steps.common import (Throughput, build_dataloaders, count_params, format_metrics, initialize_engine,
                                 num_update_steps, run_training, setup_run, tensorboard_writer, to_device,
                                 write_metrics)
from dschat.steps.sft import load_step_data
from dschat.utils.dist import all_reduce, get_world_size, print_rank_0
from dschat.utils.ds_config import get_train_ds_config


def pairwise_step_loss(engine, batch):
    out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return out["loss"], int(batch["attention_mask"].sum())


@torch.no_grad()
def evaluate_reward(engine, eval_loader, device, max_batches):
    """Pairwise accuracy (chosen scored above rejected) and mean scores over all ranks."""
    engine.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # correct, pairs, sum chosen, sum rejected
    for i, batch in enumerate(eval_loader):
        if max_batches and i >= max_batches:
            break
        batch = to_device(batch, device)
        out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        chosen, rejected = out["chosen_mean_scores"].double(), out["rejected_mean_scores"].double()
        totals += torch.stack([(chosen > rejected).sum().double(), torch.tensor(float(len(chosen)), device=device,
                                                                                dtype=torch.float64),
                               chosen.sum(), rejected.sum()])
    all_reduce(totals)
    pairs = totals[1].clamp(min=1)
    return {"accuracy": (totals[0] / pairs).item(), "chosen_mean_score": (totals[2] / pairs).item(),
            "rejected_mean_score": (totals[3] / pairs).item(), "eval_pairs": int(totals[1].item())}


def main(args=None):
    """Train a reward model; returns the final metrics (accuracy and mean chosen/rejected scores)."""
    if args is None or isinstance(args, (list, tuple)):
        args = step2_parser().parse_args(args)
    started = time.time()
    device = setup_run(args)
    tokenizer = load_tokenizer(args.model_name_or_path, add_eot_token=args.add_eot_token)
    ds_config = get_train_ds_config(
        offload=args.offload, dtype=args.dtype, stage=args.zero_stage,
        micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, world_size=get_world_size(),
        enable_tensorboard=args.enable_tensorboard, tb_path=args.tensorboard_path, tb_name="step2_model")
    model = create_critic_model(args.model_name_or_path, tokenizer, ds_config, args.num_padding_at_beginning,
                                dropout=args.dropout, zero_stage=args.zero_stage,
                                compute_fp32_loss=args.compute_fp32_loss)
    model.rwtransformer = apply_lora(model.rwtransformer, args.lora_dim, args.lora_module_name, args.lora_alpha,
                                     only_optimize_lora=args.only_optimize_lora)
    if args.lora_dim and args.only_optimize_lora:
        model.v_head.requires_grad_(True)  # the head is new: it must train even when the base is frozen
    train_data, eval_data = load_step_data(args, tokenizer, phase=2)
    from dschat.data import DataCollatorReward

    collator = DataCollatorReward(tokenizer.pad_token_id)
    train_loader, eval_loader = build_dataloaders(train_data, eval_data, collator, args.per_device_train_batch_size,
                                                  args.per_device_eval_batch_size, args.seed)
    total_steps = num_update_steps(len(train_loader), args.gradient_accumulation_steps, args.num_train_epochs,
                                   args.max_steps)
    engine = initialize_engine(model, ds_config, args.learning_rate, args.weight_decay,
                               args.lora_learning_rate if args.lora_dim else None, args.offload,
                               args.lr_scheduler_type, args.num_warmup_steps, total_steps,
                               args.gradient_checkpointing)
    print_rank_0(f"[step2] {len(train_data)} train / {len(eval_data)} eval pairs, {total_steps} steps, "
                 f"{count_params(model) / 1e6:.2f}M parameters, ZeRO-{args.zero_stage}, {args.dtype}")
    evaluate = lambda: evaluate_reward(engine, eval_loader, device, args.eval_iters)  # noqa: E731
    print_rank_0(f"[step2] before training: {format_metrics(evaluate())}")
    throughput = Throughput(count_params(model), args.gradient_checkpointing)
    writer = tensorboard_writer(args, "step2")
    train_loss = run_training(engine, train_loader, pairwise_step_loss, evaluate, args, device, "step2",
                              total_steps, writer, throughput)
    metrics = {**evaluate(), "train_loss": train_loss, **throughput.summary(), "steps": total_steps,
               "seconds": time.time() - started}
    print_rank_0(f"[step2] after training: {format_metrics(metrics)}")
    save_reward_model(engine.module, tokenizer, args.output_dir)
    write_metrics(args.output_dir, metrics)
    return metrics
