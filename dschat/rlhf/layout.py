"""Step 3's forwards over rows shifted to start at column 0, so that they need no attention mask.

Experience sequences are left-padded prompts followed by answers (right-padded after their end). Run as they are, every
forward needs a padding mask, and with one PyTorch's SDPA runs masked attention kernels: on an H200 cuDNN's masked
forward + backward took 2.8 ms against 1.7 ms causal per layer call at 64 x 512 (``bench/sdpa_first_call.py``,
docs/benchmarks.md), and a new mask pattern or length costs a new execution plan. Shifted left by its number of
leading pads, each row is one run of real tokens followed by padding; in a causal model no real token attends to a
later position, so the real tokens' outputs are exactly those of the masked forward, with no mask at all (plain causal
attention) and positions 0, 1, ... . Outputs are mapped back to the original columns (cheap: per-token tensors).

A row with a masked token between real ones (a pad token sampled inside an answer) cannot be shifted this way; for such
a batch :meth:`LeftAligned.of` returns None and the forwards keep the mask.
"""
import dataclasses

import torch


@dataclasses.dataclass
class LeftAligned:
    """How one batch's rows are shifted: ``aligned[:, j] = original[:, index[:, j]]``."""

    index: torch.Tensor  # (B, L)
    inverse: torch.Tensor  # (B, L): original[:, p] = aligned[:, inverse[:, p]]
    lead: torch.Tensor  # (B,) leading pads of each row
    max_lead: int
    mask: torch.Tensor  # (B, L) the shifted attention mask: ones, then zeros

    @classmethod
    def of(cls, attention_mask):
        """The shift for ``attention_mask`` (B, L), or None if some row has a gap between real tokens."""
        length = attention_mask.shape[1]
        columns = torch.arange(length, device=attention_mask.device)
        lead = (attention_mask.long().cumsum(1) == 0).sum(1)
        index = (columns + lead[:, None]) % length
        mask = attention_mask.long().gather(1, index)
        prefix = (mask[:, 1:] <= mask[:, :-1]).all()
        prefix, max_lead = torch.stack([prefix.long(), lead.max()]).tolist()  # one host sync for both
        if not prefix:
            return None
        return cls(index, (columns - lead[:, None]) % length, lead, max_lead, mask)

    def align(self, tensor):
        """(B, L) in the original columns -> shifted."""
        return tensor.gather(1, self.index)

    def restore(self, tensor):
        """(B, L) shifted -> the original columns."""
        return tensor.gather(1, self.inverse)

    def model_inputs(self, seq):
        """Keyword arguments of a forward over the shifted rows: no mask (causal attention), positions 0, 1, ..."""
        positions = torch.arange(seq.shape[1], device=seq.device).expand(seq.shape[0], -1)
        return {"input_ids": self.align(seq), "attention_mask": None, "position_ids": positions}

    def answer_columns(self, start, count):
        """(B, count) indices, into per-token results over the shifted window that starts ``max_lead`` columns before
        ``start``, of the original columns ``start``, ``start`` + 1, ... (a row shifted by ``lead`` has its column
        p at p - lead)."""
        steps = torch.arange(count, device=self.lead.device)
        return steps + (self.max_lead - self.lead)[:, None]
