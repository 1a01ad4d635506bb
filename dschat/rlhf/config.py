"""Step-3 settings: the parsed namespace, a dict or any object, completed with the defaults of every flag."""
import argparse


def step3_args(args=None):
    from dschat.args import namespace_with_defaults, step3_parser

    if isinstance(args, argparse.Namespace) and getattr(args, "_dschat_complete", False):
        return args
    if args is not None and not isinstance(args, dict):
        args = {k: v for k, v in vars(args).items() if not k.startswith("__")}
    completed = namespace_with_defaults(step3_parser(), args)
    resolve_zero_stages(completed)
    completed._dschat_complete = True
    return completed


def resolve_zero_stages(args):
    """--actor_zero_stage / --critic_zero_stage left unset take --zero_stage (DeepSpeed-Chat's steps 1 and 2 name),
    else 0."""
    shared = getattr(args, "zero_stage", None)
    for name in ("actor_zero_stage", "critic_zero_stage"):
        if getattr(args, name, None) is None:
            setattr(args, name, shared if shared is not None else 0)
