"""The harness of the token-mean scripts (``sft_token_mean.py``, ``dpo_rpo_token_mean.py``): one optimizer step of
``common.run_training`` over this rank's micro-batches on a fresh DeepSpeed engine, recording the gradient the step
applied (whole, averaged over the ranks) and the loss the loop logged for it."""
from types import SimpleNamespace

import torch


def one_training_step(model, micro_batches, loss_fn, recipe, mode, name, stage=0):
    """(the gradient the optimizer step applied, its logged loss): ``micro_batches`` (this rank's, one optimizer step)
    through ``run_training`` with ``loss_fn`` and --loss_agg ``mode``, the token counts of ``recipe``
    (``common.step_loss_tokens``), at ZeRO ``stage``."""
    from deepspeed.utils import safe_get_full_grad

    from dschat.models.training_engine import initialize_engine, release_engine
    from dschat.steps import common
    from dschat.utils.dist import get_world_size, local_device
    from dschat.utils.ds_config import get_train_ds_config

    accum = len(micro_batches)
    config = get_train_ds_config(dtype="fp32", stage=stage, gradient_accumulation_steps=accum,
                                 world_size=get_world_size(), gradient_clipping=0.0)
    engine = initialize_engine(model, config, 1e-3, 0.0, None, "constant", 0, 1)
    applied, logged = [], []
    real_step = engine.step

    def recorded_step(*args, **kwargs):
        if engine.is_gradient_accumulation_boundary():
            # (on the CPU, as the scripts' torch references)
            applied.append(torch.cat([safe_get_full_grad(p).detach().flatten().cpu()
                                      for p in engine.module.parameters()]))
        return real_step(*args, **kwargs)

    engine.step = recorded_step
    args = SimpleNamespace(gradient_accumulation_steps=accum, num_train_epochs=1, seed=0, save_interval=0,
                           eval_interval=0, print_loss=True, loss_agg=mode)
    real_log = common._log_step
    common._log_step = lambda *a: logged.append(a[3]) or real_log(*a)
    try:
        loader = torch.utils.data.DataLoader(micro_batches, batch_size=None)
        common.run_training(engine, loader, loss_fn, None, args, local_device(), name, 1,
                            loss_tokens=common.step_loss_tokens(args, recipe))
    finally:
        common._log_step = real_log
        release_engine(engine)
    (gradient,), (loss,) = applied, logged
    return gradient, loss
