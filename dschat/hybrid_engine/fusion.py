"""Projections that read the same input, run as one GEMM while generating (``HybridEngine(fuse_projections=...)``).

At decode batch sizes a GEMM moves the weights from memory and little else, and a small one cannot keep the GPU's
memory system busy: on an H200 at 64 rows, OPT-1.3B's three 2048x2048 q/k/v projections take 16.4 us as three cuBLAS
calls and 7.1 us as one 2048x6144 call (1.5 against 3.5 TB/s; Qwen2.5-7B's q/k/v: 23.7 against 9.3 us), while
projections of 32 MB or more already run near the copy bandwidth (``bench/decode_gemm.py``, docs/benchmarks.md).

Which projections share an input is found, not declared: during the first forward of the first generation (run
eagerly: the prefill, or with CUDA graphs the capture's warm-up step) every candidate ``nn.Linear`` records the input
tensor it was called with; linears called one after another with the very same tensor object form a group (q/k/v in
Llama, Qwen2, Mistral, OPT, ...; gate/up in gated MLPs).
A group is fused when its weights together are at most ``max_bytes``, so only the small projections that gain are
copied (the fused copy costs their memory once more; Qwen2.5-7B's gate/up, 272 MB, run as fast separately). The fused
weight is a copy, rewritten in place from the model's weights at the start of every generation: a fraction of a
millisecond, and nothing that changes the weights (an optimizer step, ``load_state_dict``, another engine over the same
model) can leave it stale; captured CUDA graphs stay valid. Training forwards never see any of it: the linears'
forwards are only replaced inside :meth:`ProjectionFusion.active`.

Whichever member of a group is called first with a new input computes the whole group's output; the others return
their slice of it when called with that same tensor; a call with another tensor starts over (the group's GEMM for
that tensor), so the result is right whatever the order of the calls. The slices are views of
the fused output (last dimension split), which the attention code reshapes per head as it would its own output.
"""
import contextlib
import dataclasses
import logging
import weakref

import torch
from torch import nn

logger = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
DEFAULT_MAX_BYTES = 64 * 2**20


def resolve_mode(mode, device):
    """"auto" fuses on CUDA (where the measured gain is); "on"/"off" (or True/False) force it."""
    if mode in (True, False):
        return bool(mode)
    if mode not in MODES:
        raise ValueError(f"fuse_projections must be one of {MODES}, got {mode!r}")
    return mode == "on" or (mode == "auto" and torch.device(device).type == "cuda")


def _candidate(module):
    """A plain linear layer with nothing attached: its forward may be replaced by a slice of a fused one."""
    return (type(module) is nn.Linear and module.weight.device.type != "meta" and not module._forward_hooks
            and not module._forward_pre_hooks and "forward" not in module.__dict__)  # not patched by anyone else


@dataclasses.dataclass
class FusedGroup:
    """Linears that read the same input, their fused weight (and bias), and the last fused output not yet taken."""

    members: list
    weight: torch.Tensor
    bias: torch.Tensor = None
    pending_input: object = None
    pending: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, members):
        group = cls(members, torch.cat([m.weight.detach() for m in members]))
        if members[0].bias is not None:
            group.bias = torch.cat([m.bias.detach() for m in members])
        return group

    @property
    def nbytes(self):
        return self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    def refresh(self):
        torch.cat([m.weight.detach() for m in self.members], out=self.weight)
        if self.bias is not None:
            torch.cat([m.bias.detach() for m in self.members], out=self.bias)

    def forward_of(self, member):
        index = self.members.index(member)
        sizes = [m.out_features for m in self.members]

        def forward(input):  # nn.Linear.forward's signature
            if self.pending_input is input and member in self.pending:
                out = self.pending.pop(member)
                if not self.pending:
                    self.pending_input = None
                return out
            outputs = torch.nn.functional.linear(input, self.weight, self.bias).split(sizes, dim=-1)
            self.pending = {m: o for m, o in zip(self.members, outputs) if m is not member}
            self.pending_input = input
            return outputs[index]
        return forward


def _fusable(run):
    """A run of linears called with one input: same input size, dtype and device, all with a bias or none."""
    first = run[0]
    return len(run) > 1 and all(
        m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None) for m in run)


class ProjectionFusion:
    """The fused groups of one model: found during its first generation, used from then on."""

    def __init__(self, model, max_bytes=DEFAULT_MAX_BYTES):
        self.model = model
        self.max_bytes = max_bytes
        self.groups = None  # None: not discovered yet
        self._patched = []

    @property
    def nbytes(self):
        return sum(g.nbytes for g in self.groups or ())

    @contextlib.contextmanager
    def active(self):
        """Inside: the model's grouped linears run fused, from fused weights equal to the model's current ones."""
        try:
            if self.groups is None:
                with self._discovering():
                    yield
                return
            with torch.no_grad():
                for group in self.groups:
                    group.refresh()
            self._patch()
            yield
        finally:
            self._unpatch()

    def _patch(self):
        for group in self.groups:
            for member in group.members:
                member.forward = group.forward_of(member)  # an instance attribute shadows the class's forward
                self._patched.append(member)

    def _unpatch(self):
        for member in self._patched:
            del member.forward
        self._patched = []
        for group in self.groups or ():
            group.pending, group.pending_input = {}, None

    @contextlib.contextmanager
    def _discovering(self):
        """Group the candidate linears called one after another with the same tensor during the model's first
        forward, then fuse them for the rest of this generation."""
        runs, last = [], [None]  # last: a weak reference to the previous call's input

        def record(module, args):
            x = args[0] if args and torch.is_tensor(args[0]) else None
            if x is not None and last[0] is not None and last[0]() is x and module not in runs[-1]:
                runs[-1].append(module)
            else:
                runs.append([module])
            last[0] = weakref.ref(x) if x is not None else None

        def finish(*_):
            for handle in handles:
                handle.remove()
            self._group(runs)
            self._patch()

        handles = [m.register_forward_pre_hook(record) for m in self.model.modules() if _candidate(m)]
        handles.append(self.model.register_forward_hook(finish))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _group(self, runs):
        groups, seen = [], set()
        for run in runs:
            if not _fusable(run) or any(m in seen for m in run):
                continue
            if sum(m.weight.nbytes for m in run) <= self.max_bytes:
                seen.update(run)
                groups.append(FusedGroup.of(run))  # built from the current weights
        self.groups = groups
        logger.info("hybrid engine: %d groups of projections fused for generation (%.1f MB of fused weights)",
                    len(groups), self.nbytes / 2**20)
