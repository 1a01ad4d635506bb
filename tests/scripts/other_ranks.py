"""A step checkpointed on one number of ranks and resumed on another: ``run`` trains a step (stopping right after
its checkpoint of a given step, or resuming) and writes what each rank saw to ``<out>/<name>_rank<N>.json``: the
records of every micro-batch it trained on (their tokens), the step it resumed from, how far the weights right after
the load are from the checkpoint's (DeepSpeed's own zero_to_fp32 consolidation of it), the optimizer's parameter
groups then, the step's metrics, and a resumed run's Adam step count of each optimizer state at its end. Step 3
("ppo", ``run_ppo``): the prompts of every generation batch (with their iteration) and the unsupervised blocks it
trained on, the iteration it resumed from, and how far the actor's, the critic's and the EMA copy's weights right
after the load are from the checkpoint's.

Run by tests/test_step_resume.py through the deepspeed launcher, ``other_ranks.py <step> <out> <runs> <flags>``:
``<runs>`` is ``name:folder:stop,...``, each a run of ``<flags>`` with ``--output_dir <out>/<folder>`` (stop 0: to the
end); and imported by it for the one-rank side.
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dschat.steps import ppo, resume, reward, sft  # noqa: E402
from dschat.utils.dist import barrier, ensure_distributed, get_rank  # noqa: E402

STEPS = {"sft": (sft.main, sft.SFT), "reward": (reward.main, reward.REWARD)}


def checkpoint_weights(folder, tag):
    """The full fp32 weights of a DeepSpeed checkpoint, consolidated by DeepSpeed's zero_to_fp32 (ZeRO 1-3), or its
    module states (no ZeRO)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if not any(p.name.endswith("optim_states.pt") for p in (Path(folder) / tag).iterdir()):
        return torch.load(Path(folder) / tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag)


def loaded_weights_difference(engine, folder, tag, saved=None):
    """The largest difference between the engine's weights and the checkpoint's (``saved``: those weights, else
    DeepSpeed's of ``folder``/``tag``; None: some parameter is missing)."""
    from dschat.models.zero3 import gathered

    saved, worst = checkpoint_weights(folder, tag) if saved is None else saved, 0.0
    for name, param in engine.module.named_parameters():
        if name not in saved:
            return None
        with gathered([param]):
            worst = max(worst, (param.data.float() - saved[name].float()).abs().max().item())
    return worst


def run(step, out, name, stop, flags):
    """Train ``step`` with ``flags`` (stopping right after its checkpoint of step ``stop``, if given), recording what
    this rank trains on and loads; returns the step's metrics (None when stopped)."""
    if step == "ppo":
        return run_ppo(out, name, stop, flags)
    main, recipe = STEPS[step]
    seen, loaded = {"samples": [], "resumed_at": None}, []
    real_loss, real_save, real_load = recipe.loss_fn, resume.save_step_checkpoint, resume.load_step_checkpoint

    def recording_loss(engine, batch):
        for ids, mask in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist()):
            seen["samples"].append([token for token, keep in zip(ids, mask) if keep])
        return real_loss(engine, batch)

    def save_then_stop(engine, args, position, *rest):
        tag = real_save(engine, args, position, *rest)
        if position["step"] == stop:
            raise KeyboardInterrupt(tag)
        return tag

    def load_recording(engine, args, *rest):
        position = real_load(engine, args, *rest)
        if position is not None:
            seen["resumed_at"] = position["step"]
            folder = Path(args.output_dir) / "checkpoints" / "model"
            seen["loaded_weights_difference"] = loaded_weights_difference(engine, folder,
                                                                          f"step_{position['step']:07d}")
            optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
            seen["param_groups"] = [{"lr": g["lr"], "weight_decay": g["weight_decay"]}
                                    for g in optimizer.param_groups]
            loaded.append(optimizer)
        return position

    recipe.loss_fn, resume.save_step_checkpoint, resume.load_step_checkpoint = \
        recording_loss, save_then_stop, load_recording
    metrics = None
    try:
        metrics = main(flags)
    except KeyboardInterrupt:
        if not stop:
            raise
    finally:
        recipe.loss_fn, resume.save_step_checkpoint, resume.load_step_checkpoint = real_loss, real_save, real_load
    seen["metrics"] = metrics
    if loaded:  # Adam's step count of each optimizer state at the end of a resumed run
        seen["adam_steps"] = [float(state["step"]) for state in loaded[0].state.values() if "step" in state]
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{name}_rank{get_rank()}.json").write_text(json.dumps(seen))
    return metrics


def run_ppo(out, name, stop, flags):
    """``run`` of step 3: records the prompts of each generation batch ("prompts": [iteration, tokens]), the
    unsupervised blocks taken ("blocks"), the KL coefficient of each checkpoint saved, and, on a resume, its
    iteration, the loaded weights' differences and KL coefficient."""
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    seen = {"prompts": [], "blocks": [], "resumed_at": None}
    real_generate, real_cycle = DeepSpeedPPOTrainer.generate_experience, ppo.cycle
    real_save, real_load = ppo.save_checkpoint, ppo.load_checkpoint

    def recording_generate(self, prompts, mask=None, step=None, **kwargs):
        for ids, keep in zip(prompts["prompt"].tolist(), prompts["prompt_att_mask"].tolist()):
            seen["prompts"].append([step, [token for token, kept in zip(ids, keep) if kept]])  # (step 3's iteration)
        return real_generate(self, prompts, mask, step=step, **kwargs)

    def recording_cycle(*args, **kwargs):
        for batch in real_cycle(*args, **kwargs):
            for ids, keep in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist()):
                seen["blocks"].append([token for token, kept in zip(ids, keep) if kept])
            yield batch

    def save_then_stop(trainer, root, position, *rest):
        tag = real_save(trainer, root, position, *rest)
        seen.setdefault("saved_kl_coef", {})[position["iteration"]] = trainer.kl_ctl.value
        if position["iteration"] == stop:
            raise KeyboardInterrupt(tag)
        return tag

    def load_recording(trainer, root, *rest):
        position = real_load(trainer, root, *rest)
        if position is not None:
            seen["resumed_at"] = tag = position["iteration"]
            seen["kl_coef"] = trainer.kl_ctl.value
            for part, engine in (("actor", trainer.actor_model), ("critic", trainer.critic_model)):
                seen[f"loaded_{part}_difference"] = loaded_weights_difference(engine, Path(root) / part,
                                                                              f"iter_{tag:07d}")
                optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
                seen[f"{part}_weight_decays"] = [group["weight_decay"] for group in optimizer.param_groups]
            if trainer.actor_ema is not None:  # (saved whole, by rank 0)
                seen["loaded_ema_difference"] = loaded_weights_difference(
                    trainer.actor_ema, None, None, torch.load(Path(root) / "trainer" / f"iter_{tag:07d}" / "ema.pt"))
        return position

    DeepSpeedPPOTrainer.generate_experience, ppo.cycle = recording_generate, recording_cycle
    ppo.save_checkpoint, ppo.load_checkpoint = save_then_stop, load_recording
    metrics = None
    try:
        metrics = ppo.main(flags)
    except KeyboardInterrupt:
        if not stop:
            raise
    finally:
        DeepSpeedPPOTrainer.generate_experience, ppo.cycle = real_generate, real_cycle
        ppo.save_checkpoint, ppo.load_checkpoint = real_save, real_load
    seen["metrics"] = metrics
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{name}_rank{get_rank()}.json").write_text(json.dumps(seen))
    return metrics


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    step, out, runs, flags = args[0], args[1], args[2], args[3:]
    ensure_distributed()
    for spec in runs.split(","):
        name, folder, stop = spec.split(":")
        run(step, out, name, int(stop) or None, [*flags, "--output_dir", str(Path(out) / folder)])
        barrier()


if __name__ == "__main__":
    from dschat.utils.cli import end_script

    main()
    end_script()  # (a gloo rank aborted in the interpreter's teardown now and then: exit 250)
