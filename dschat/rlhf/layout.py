"""Step 3's forwards over rows shifted to start at column 0, so that they need no attention mask.

Experience sequences are left-padded prompts followed by answers (right-padded after their end). Run as they are, every
forward needs a padding mask, and with one PyTorch's SDPA runs masked attention kernels: on an H200 cuDNN's masked
forward + backward took 2.8 ms against 1.7 ms causal per layer call at 64 x 512 (``bench/sdpa_first_call.py``,
docs/benchmarks.md), and a new mask pattern or length costs a new execution plan. Shifted left by its number of
leading pads, each row is one run of real tokens followed by padding; in a causal model no real token attends to a
later position, so the real tokens' outputs are exactly those of the masked forward, with no padding mask (plain
causal attention; a model with a sliding window still builds its window's mask) and positions 0, 1, ... . Rows are
cut to the longest one, so no position is larger than in the masked forward. Per-token outputs are mapped back to the
original columns (cheap), and the LM head runs on each row's answer positions only (:func:`head_reads`).

A row with a masked token between real ones (a pad token sampled inside an answer) cannot be shifted this way; for such
a batch :meth:`LeftAligned.of` returns None and the forwards keep the mask.
"""
import contextlib
import dataclasses

import torch


@dataclasses.dataclass
class LeftAligned:
    """How one batch's rows are shifted: ``aligned[:, j] = original[:, index[:, j]]``, cut to the longest row (``width``
    columns), so positions stay those of the masked forward and of generation (learned position tables, RoPE scalings
    that depend on the longest position)."""

    index: torch.Tensor  # (B, width)
    inverse: torch.Tensor  # (B, L): original[:, p] = aligned[:, inverse[:, p]]; width and over: padding
    lead: torch.Tensor  # (B,) leading pads of each row
    max_lead: int
    width: int  # the longest row's real tokens
    mask: torch.Tensor  # (B, width) the shifted attention mask: ones, then zeros

    @classmethod
    def of(cls, attention_mask):
        """The shift for ``attention_mask`` (B, L), or None if some row has a gap between real tokens."""
        length = attention_mask.shape[1]
        columns = torch.arange(length, device=attention_mask.device)
        lead = (attention_mask.long().cumsum(1) == 0).sum(1)
        index = (columns + lead[:, None]) % length
        mask = attention_mask.long().gather(1, index)
        prefix = (mask[:, 1:] <= mask[:, :-1]).all()
        prefix, max_lead, width = torch.stack([prefix.long(), lead.max(), mask.sum(1).max()]).tolist()  # one sync
        if not prefix or width == 0:
            return None
        inverse = (columns - lead[:, None]) % length
        return cls(index[:, :width], inverse, lead, max_lead, width, mask[:, :width])

    def align(self, tensor):
        """(B, L) in the original columns -> shifted, (B, width)."""
        return tensor.gather(1, self.index)

    def restore(self, tensor):
        """(B, width) shifted -> the original columns, (B, L); padding columns hold zeros or values of other padding."""
        padded = torch.nn.functional.pad(tensor, (0, self.inverse.shape[1] - tensor.shape[1]))
        return padded.gather(1, self.inverse)

    def model_inputs(self, seq):
        """Keyword arguments of a forward over the shifted rows: no mask (causal attention) and the models' default
        positions 0, 1, ... (passing them would make transformers look for packed sequences, a host sync)."""
        return {"input_ids": self.align(seq), "attention_mask": None}

    def answer_window(self, start):
        """How many of the shifted rows' last columns hold every row's answer predictions: the logits at a row's
        original column ``start`` (which predict its first answer token) are at ``start - lead`` after the shift."""
        return self.width - (start - self.max_lead)

    def answer_columns(self, start, count):
        """(B, count) indices into the window of :meth:`answer_window` of the positions predicting the original
        columns ``start + 1``, ``start + 2``, ...; a row's columns past its own end (padding) are clamped into the
        window."""
        steps = torch.arange(count, device=self.lead.device)
        window = self.answer_window(start)
        return (steps + (self.max_lead - self.lead)[:, None]).clamp(max=window - 1)


@contextlib.contextmanager
def head_reads(model, columns, window):
    """Inside: the LM head of ``model`` (an HF model) runs only on the hidden states at ``columns`` (B, count) of the
    rows' last ``window`` positions (what ``logits_to_keep`` gives it, or all positions where the model has no such
    argument), so each row's answer logits come out in the answer's own columns and no others are computed."""
    def gather_rows(module, args):
        hidden = args[0]
        index = columns + (hidden.shape[1] - window)
        return (hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1])), *args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(gather_rows)
    try:
        yield
    finally:
        handle.remove()
