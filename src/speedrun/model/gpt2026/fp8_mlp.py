"""FP8 (e4m3) MLP forward: #84's up-projection (record #84, 2026-05-21, PR #306) and #89's
down-projection with cheap delayed scaling (record #89, 2026-07-17, PR #342).

Training forwards only; the backward stays in the MLP's dtype and reads `post` = relu(pre)², as the
records' (relu(pre) = √post). Evaluation and `torch.no_grad` run the twin: the plain MLP.

- Up (#84): after each optimizer step the weight W1 (hidden, d) is stored as e4m3 with one scale,
  s_w = amax|W1| / 448. Each forward scales the normed input by 448 / amax|x| (current scaling), and
  the fp32 product is multiplied by the dequantization s_w·amax/448 before rounding to the MLP dtype.
- Down (#89): post (≥ 0) is cast as min(post / s_a, 448) with the layer's activation scale s_a from
  the previous training forward (delayed); this forward's amax(post) sets the next one,
  s_a = max(amax, 1e-12)·1.80/448. The scale is kept per micro-batch slot: `act_scale[slot]`, one
  per micro-batch of the optimizer step, all processes together (its chunk of the global batch, written
  to `micro_slot` by the training step before each forward). Slot m reads what slot m measured one step
  earlier, the same on any number of processes (the record: 8 processes, one micro-batch each, each
  reading its own previous step's). The weight W2 (d, hidden)
  is quantized at each refresh with the scale the previous refresh measured, clamp(W2 / s, ±448); the
  refresh then measures the new amax, s = max(amax|W2|, 1e-12)·1.12/448. For its first 16 steps the
  record bootstraps: s = amax/448 of the current weights just before quantizing.

The products go through `torch._scaled_mm` (model/fp8.scaled_mm: the real op on CUDA and, with
SCALED_MM_ON_CPU, on CPU; otherwise its exact fp32 evaluation of the same fp8 operands).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from speedrun.model import fp8
from speedrun.model.layers import MLP

E4M3_MAX = 448.0
ACT_HEADROOM, WEIGHT_HEADROOM, BOOTSTRAP_STEPS = 1.80, 1.12, 16


def up_weight_fp8(w1: Tensor) -> tuple[Tensor, Tensor]:
    """W1 (hidden, d) → (e4m3 copy, scale (1,) fp32): #84's per-layer scale amax/448."""
    scale = w1.detach().abs().amax().clamp(min=1e-12).reshape(1) / E4M3_MAX
    return (w1.detach() / scale).to(torch.float8_e4m3fn), scale.float()


def down_weight_fp8(w2: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """W2 (d, hidden) quantized with `scale` (the previous refresh's) → (e4m3 copy, the next scale)."""
    w = w2.detach().float()
    q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, w.abs().amax().clamp(min=1e-12).reshape(1) * (WEIGHT_HEADROOM / E4M3_MAX)


class _Fp8Forward(torch.autograd.Function):
    """relu(x W1ᵀ)² W2ᵀ with FP8 products forward, the MLP dtype's matmuls backward."""

    @staticmethod
    def forward(ctx, x, w1, w2, up_f8, up_scale, down_f8, down_scale, act_scales, slot):  # noqa: ANN001
        index = slot.reshape(1)  # a 0-d tensor: another slot is another value, not another graph
        act_scale = act_scales.index_select(0, index)
        flat = x.reshape(-1, x.size(-1))
        amax = flat.detach().abs().max().clamp(min=1e-12)
        x_f8 = (flat.detach() * (E4M3_MAX / amax)).to(torch.float8_e4m3fn)
        dequant = up_scale.clone().mul_(amax).div_(E4M3_MAX)
        one = torch.ones((), dtype=torch.float32, device=x.device)
        pre = fp8.scaled_mm(x_f8, up_f8.t(), dequant, one, x.dtype, True)
        post = F.relu(pre).square()
        post_f8 = (post.float() * (1.0 / act_scale)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        out = fp8.scaled_mm(post_f8, down_f8.t(), act_scale, down_scale, x.dtype, True)
        measured = post.float().amax().clamp(min=1e-12).reshape(1) * (ACT_HEADROOM / E4M3_MAX)
        act_scales.index_copy_(0, index, measured)
        ctx.save_for_backward(x, w1, w2, post)
        return out.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        x, w1, w2, post = ctx.saved_tensors
        g = grad.reshape(-1, grad.size(-1)).to(post.dtype)
        flat = x.reshape(-1, x.size(-1))
        grad_w2 = g.t() @ post
        grad_pre = (g @ w2.to(g.dtype)) * (2 * post.sqrt())
        grad_w1 = grad_pre.t() @ flat
        grad_x = grad_pre @ w1.to(g.dtype)
        return grad_x.view(x.shape), grad_w1, grad_w2, None, None, None, None, None, None


class Fp8MLP(MLP):
    """The gpt2026 ReLU² MLP (W1 stored (hidden, d)) with #84/#89's FP8 training forward."""

    def __init__(self, dim: int, hidden: int):
        super().__init__(dim, hidden, bias=False, relu2=True)
        self.register_buffer("up_f8", torch.zeros(hidden, dim, dtype=torch.float8_e4m3fn), persistent=False)
        self.register_buffer("down_f8", torch.zeros(dim, hidden, dtype=torch.float8_e4m3fn), persistent=False)
        for name in ("up_scale", "down_scale", "down_next_scale", "act_scale"):  # the record's init: ones
            self.register_buffer(name, torch.ones(1), persistent=name != "up_scale")
        self.register_buffer("micro_slot", torch.zeros((), dtype=torch.long), persistent=False)

    def set_micro_slots(self, slots: int) -> None:
        """One delayed activation scale per micro-batch slot of an optimizer step (all processes'
        micro-batches together), each starting at the record's 1; before a checkpoint is loaded."""
        assert slots >= 1, slots
        self.act_scale = torch.ones(slots, device=self.act_scale.device)

    @torch.no_grad()
    def refresh_fp8(self, step: int) -> None:
        """After optimizer step `step` (−1 before the first forward): the FP8 weight copies, as the
        record's quantize_mlp_fp8(bootstrap_down=step < 16)."""
        self.up_f8, up_scale = up_weight_fp8(self.c_fc.weight)
        self.up_scale.copy_(up_scale)
        if step < BOOTSTRAP_STEPS:
            # in the weight's dtype, as the record's bf16 bank (the scale is rounded to bf16 there)
            self.down_next_scale.copy_(self.c_proj.weight.abs().amax().clamp(min=1e-12) / E4M3_MAX)
        self.down_scale.copy_(self.down_next_scale)
        self.down_f8, next_scale = down_weight_fp8(self.c_proj.weight, self.down_next_scale)
        self.down_next_scale.copy_(next_scale)

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return super().forward(x)
        return _Fp8Forward.apply(
            x, self.c_fc.weight, self.c_proj.weight, self.up_f8, self.up_scale, self.down_f8,
            self.down_scale, self.act_scale, self.micro_slot,
        )  # fmt: skip
