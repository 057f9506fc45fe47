"""KDA's short causal depthwise convolution with SiLU, continued across calls by a conv state.

Per channel c and token t (kernel width W, the last tap on the current token):
  y_t[c] = silu(sum_{j<W} w[c, j] * x_{t-W+1+j}[c])
where the ``W - 1`` inputs before the first token of a call come from the state (zeros at the
start of a sequence). The state holds the last ``W - 1`` *pre-conv* rows, dim-last
(``[W - 1, C]``), as SGLang stores it. The conv runs in the weight dtype (fp32 in the checkpoint)
and the result is cast back to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv_prefill(x: Tensor, weight: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One sequence of ``T >= 1`` rows: ``x [T, C]``, ``weight [C, W]``, ``state [W-1, C]`` ->
    ``(silu(conv) [T, C] in x.dtype, new state [W-1, C] in state.dtype)``."""
    c, width = weight.shape
    if x.dim() != 2 or x.shape[1] != c or state.shape != (width - 1, c):
        raise ValueError(
            f"conv input {tuple(x.shape)} / state {tuple(state.shape)} do not fit weight "
            f"{tuple(weight.shape)}"
        )
    window = torch.cat([state.to(weight.dtype), x.to(weight.dtype)], dim=0)  # [W-1+T, C]
    y = F.conv1d(window.t().unsqueeze(0), weight.unsqueeze(1), groups=c)[0].t()  # [T, C]
    new_state = conv_state_after(x, state)
    # row-major out (conv1d leaves it channel-major): the per-head ops after it read rows
    out = torch.empty(y.shape, dtype=x.dtype, device=x.device).copy_(F.silu(y))
    return out, new_state


def conv_state_after(x: Tensor, state: Tensor) -> Tensor:
    """The conv state after the rows ``x [T, C]``: the last ``W - 1`` rows of ``[state; x]``, in
    the state's dtype."""
    keep = state.shape[0]
    if x.shape[0] >= keep:
        return x[x.shape[0] - keep :].to(state.dtype)
    return torch.cat([state[x.shape[0] :], x.to(state.dtype)], dim=0)


def causal_conv_decode(x: Tensor, weight: Tensor, states: Tensor) -> tuple[Tensor, Tensor]:
    """One new row for each of ``B`` sequences: ``x [B, C]``, ``states [B, W-1, C]`` ->
    ``(silu(conv) [B, C] in x.dtype, new states [B, W-1, C])``."""
    c, width = weight.shape
    if x.dim() != 2 or x.shape[1] != c or states.shape != (x.shape[0], width - 1, c):
        raise ValueError(
            f"conv input {tuple(x.shape)} / states {tuple(states.shape)} do not fit weight "
            f"{tuple(weight.shape)}"
        )
    window = torch.cat(
        [states.to(weight.dtype), x.to(weight.dtype).unsqueeze(1)], dim=1
    )  # [B, W, C]
    y = torch.einsum("bwc,cw->bc", window, weight)
    return F.silu(y).to(x.dtype), window[:, 1:].to(states.dtype)
