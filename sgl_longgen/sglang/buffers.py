"""Page-locked host buffers a step reuses, so its small inputs travel in one copy each.

Reuse is safe because the host never refills a buffer before the device has read it: each step
waits for the read-back of its draws, queued after the verify forward and every copy before it;
a draft queued ahead on its own stream is waited for (its event) before its buffers are refilled.
"""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    """One reused page-locked host buffer per purpose (``name``)."""

    def __init__(self, device: torch.device):
        self.pin = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 64), dtype=dtype, pin_memory=self.pin)
            self._buffers[name] = buf
        return buf[:n]


class VerifyBuffers:
    """One batch size's verify inputs: a page-locked host buffer, its device copy, their views.

    Tokens, positions, parents and walk tokens (int64 ``[4, bs, N]``), then the ancestor masks
    (bool ``[bs, N, N]``): one host-to-device copy per step, and no tensor views to make between
    the draft's candidates and the verify forward.
    """

    def __init__(self, bs: int, n: int, device: torch.device):
        mask_at = 4 * bs * n * 8
        self.host = torch.empty(mask_at + bs * n * n, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.device = torch.empty_like(self.host, device=device)
        self.ints = self.host[:mask_at].numpy().view(np.int64).reshape(4, bs, n)
        self.masks = self.host[mask_at:].numpy().view(np.bool_).reshape(bs, n, n)
        ints = self.device[:mask_at].view(torch.int64).view(4, bs, n)
        self.draft_token, self.positions = ints[0].flatten(), ints[1].flatten()
        # What the walk reads besides the ancestor masks: each node's parent, and its token
        # where a walk may enter it (else -1).
        self.parents, self.walk_tokens = ints[2], ints[3]
        self.tree_mask = self.device[mask_at:].view(torch.bool).view(bs, n, n)
