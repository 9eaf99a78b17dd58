"""The model's own rotary position embedding, applied by us at positions we choose.

EM-LLM keeps keys un-rotated: window keys are rotated at their position inside the window, sinks and retrieved
events at one fixed position. The table comes from the model's rotary module itself (its ``inv_freq`` and
``attention_scaling``), so ``rope_scaling`` variants (linear, dynamic, yarn, llama3, longrope) stay exactly the
model's own instead of being rebuilt from ``rope_theta``.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class RotaryTable:
    """cos/sin for positions [0, max_positions) on one device, in the model's dtype."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, rotary: torch.nn.Module | None = None):
        self.cos = cos  # [max_positions, head_dim]
        self.sin = sin  # [max_positions, head_dim]
        self._rotary = rotary

    @classmethod
    def from_rotary_module(cls, rotary: torch.nn.Module, max_positions: int, dtype: torch.dtype,
                           device: torch.device) -> RotaryTable:
        """Ask the model's rotary module for every position once (it computes in fp32, then casts).

        ``forward`` is called directly so the identity hook that attention.install adds does not apply.
        """
        anchor = next(rotary.buffers())
        probe = torch.zeros(1, max_positions, 1, dtype=dtype, device=anchor.device)
        positions = torch.arange(max_positions, device=anchor.device)[None]
        with torch.no_grad():
            cos, sin = rotary.forward(probe, position_ids=positions)
        return cls(cos[0].to(device, dtype), sin[0].to(device, dtype), rotary)

    def ensure(self, positions: int) -> None:
        """Grow the table (doubling) when plain full attention goes past it; episodic windows never do."""
        if positions <= self.cos.shape[0] or self._rotary is None:
            return
        grown = RotaryTable.from_rotary_module(self._rotary, max(positions, 2 * self.cos.shape[0]),
                                               self.cos.dtype, self.cos.device)
        self.cos, self.sin = grown.cos, grown.sin

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., n, head_dim] rotated at positions [n] (same arithmetic as the models' apply_rotary_pos_emb)."""
        cos, sin = self.cos[positions], self.sin[positions]
        return x * cos + rotate_half(x) * sin

    def rotate_rows(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each x [rows, ..., head_dim] with row r rotated at positions[r] (positions [rows]): one decoding step of
        several conversations, each at its own window position, in one set of ops (cos and sin gathered once)."""
        cos, sin = self.cos[positions], self.sin[positions]                                  # [rows, head_dim]
        out = []
        for x in xs:
            shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
            out.append(x * cos.view(shape) + rotate_half(x) * sin.view(shape))
        return tuple(out)

    def rotate_at(self, x: torch.Tensor, position: int) -> torch.Tensor:
        """x [..., n, head_dim], every row rotated at the same position."""
        return x * self.cos[position] + rotate_half(x) * self.sin[position]
