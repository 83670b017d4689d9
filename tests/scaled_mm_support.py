"""What torch's own ``_scaled_mm`` takes on a device, for tests that run it as a candidate or a
reference: its CPU kernel scales per row from torch 2.13, not in 2.11 (per tensor only)."""

import torch


def scales_rows_on(device: str) -> bool:
    """Whether torch's _scaled_mm takes row-wise scales on ``device``."""
    a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1, device=device), torch.ones(1, 16, device=device),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True
