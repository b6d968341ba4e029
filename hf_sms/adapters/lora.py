"""LoRA that keeps a pruned layer's zeros, on peft's own layer (``peft.tuners.lora.Linear``, a ``LoraVariant``).

Two variants of PERP (Zimmer et al., 2023), registered with peft as custom layers for ``nn.Linear``:

- **MaskLoRA**: ``W + M * (s B A)``, ``M = (W != 0)`` the layer's mask: pruned entries never move, and training sees
  exactly what the merge writes.
- **ScaleLoRA**: ``W * (1 + s B A)``, a low-rank multiplicative scaling that starts at all ones (peft's usual init,
  ``B = 0``): zero stays zero. PERP writes ``W * (B A)`` with ``B A`` starting at ones; with ``1 + B A`` the usual
  LoRA init gives the ones and its random ``A`` breaks the symmetry an all-ones start leaves between B's columns.

Both are ``W + G * (s B A)`` with a gate ``G`` (the mask or the weight itself), computed by one autograd function
that never keeps the dense ``G * B A`` for backward (it is rebuilt there): training memory is the frozen base, the
adapters and the activations, as with plain LoRA. peft's ``merge``/``merge_and_unload``/``unmerge`` go through the
variant, so they keep the zeros too.
"""

from __future__ import annotations

import threading

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.layer import LoraVariant
from torch import nn
from transformers.pytorch_utils import Conv1D


def oriented(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as ``(out, in)``: GPT-2's ``Conv1D`` stores it transposed (peft's ``fan_in_fan_out``); a view."""
    return weight.T if getattr(module, "fan_in_fan_out", False) else weight


def gate_of(weight: torch.Tensor, gating: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``G``: ``M = (W != 0)`` for ``"mask"``, in ``weight``'s dtype (exactly 0 or 1: a comparison written straight
    into a float tensor is one vectorised pass, where a bool mask and its conversion are several times slower on the
    CPU), ``W`` itself for ``"scale"``."""
    if gating != "mask":
        return weight
    return torch.ne(weight, 0, out=torch.empty_like(weight) if out is None else out)


BLOCK = 1 << 22
"""Elements of a dense gated product (or a soup's update) made at a time on the CPU (8 MiB in bf16, 16 MiB in fp32):
see :class:`_GatedLinear`."""


def row_blocks(weight: torch.Tensor) -> list[slice]:
    """The output rows of ``weight`` in blocks of at most :data:`BLOCK` elements on the CPU, one block elsewhere."""
    out, inp = weight.shape
    rows = out if weight.device.type != "cpu" else max(1, BLOCK // max(inp, 1))
    return [slice(s, min(s + rows, out)) for s in range(0, out, rows)]


def column_blocks(weight: torch.Tensor) -> list[slice]:
    """The input columns of ``weight`` in blocks of at most :data:`BLOCK` elements on the CPU, one block elsewhere."""
    out, inp = weight.shape
    cols = inp if weight.device.type != "cpu" else max(1, BLOCK // max(out, 1))
    return [slice(s, min(s + cols, inp)) for s in range(0, inp, cols)]


_workspace = threading.local()


def _scratch(slot: int, shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    """A ``shape`` tensor for a block temporary, reused across blocks and steps on the CPU (at most :data:`BLOCK`
    elements a slot, a few per thread): glibc serves fresh block-sized temporaries from its heap, where the small
    tensors freed around them fragment it and the process grows by about a model's bytes over a run; elsewhere a
    fresh tensor (the caching allocator reuses it)."""
    if like.device.type != "cpu":
        return like.new_empty(shape)
    slots = _workspace.__dict__.setdefault("slots", {})
    n, key = shape[0] * shape[1], (slot, like.dtype)
    buf = slots.get(key)
    if buf is None or buf.numel() < n:
        buf = slots[key] = like.new_empty(n)
    return buf[:n].view(shape)


def _block(weight: torch.Tensor, index) -> torch.Tensor:
    """``weight[index]``, contiguous in a reused buffer on the CPU: read from memory once for the gate and the
    effective weight, where a strided block (the backward's columns, a ``Conv1D``'s transposed rows) makes each
    elementwise pass several times slower (the gate 7x on a column block); elsewhere the view itself."""
    w = weight[index]
    return _scratch(3, w.shape, w).copy_(w) if w.device.type == "cpu" else w


def _effective(weight, gate, a, b_s, gating: str, with_base: bool) -> torch.Tensor:
    """A block of the layer's effective weight, ``W + G * (s B A)`` (``with_base``) or the update ``G * (s B A)``
    alone, from the block's ``weight`` and ``gate`` (``b_s = s B`` and ``a`` in the weight's dtype): one rank-r
    product and one elementwise pass, in reused block buffers (MaskLoRA's ``W +`` rides in the product: one pass
    and one rounding fewer, 3% of a large layer's step)."""
    if with_base and gating == "mask":  # M * (W + s B A) = W + M * (s B A), as W = M * W
        return torch.addmm(weight, b_s, a, out=_scratch(1, weight.shape, weight)).mul_(gate)
    update = torch.mm(b_s, a, out=_scratch(1, weight.shape, weight))
    eff = _scratch(2, weight.shape, weight)
    if with_base:  # scale: W * (1 + s B A)
        return torch.addcmul(weight, update, gate, out=eff)
    return torch.mul(update, gate, out=eff)


class _GatedLinear(torch.autograd.Function):
    """``x @ (W + G * (s B A)).T + bias`` (``with_base``; else the update ``x @ (G * (s B A)).T``), with ``G`` built
    from the frozen weight: full fine-tuning's three dense products (forward, the input's gradient, the update's
    gradient ``s G * (grad^T x)``) in the layer's dtype, B A's small products beside them, and no optimizer step
    over the weight. Saves x, A, B and W (already held), never the dense effective weight (rebuilt in backward).

    On the CPU the dense blocks are made a block of output rows (forward) or input columns (backward) at a time, in
    buffers reused from block to block (:func:`_scratch`), so every dense product is whole within its block (no
    bf16 sums across blocks) and no layer-sized temporary exists. The gate is made once per block and serves both
    of the backward's uses. The CPU's time beyond the products goes to reading each weight from memory
    (docs/benchmarks.md).

    With ``with_base`` the forward sees the effective weight in the layer's dtype, as the merge writes it (a bf16
    update below half a step of its weight rounds away there as in the merged model); its gradient is exact."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling: float, gating: str, with_base: bool):
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else weight.dtype
        ctx.save_for_backward(x, a, b, weight)
        ctx.scaling, ctx.gating, ctx.with_base, ctx.dtype = scaling, gating, with_base, dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        blocks = row_blocks(weight)
        out = x2.new_empty(x2.shape[0], weight.shape[0])
        a_, b_s = a.to(weight.dtype), (b * scaling).to(weight.dtype)  # r-sized: the dense work in the layer's dtype
        for rows in blocks:
            w = _block(weight, rows)
            gate = gate_of(w, gating, _scratch(0, w.shape, w))
            eff = _effective(w, gate, a_, b_s[rows], gating, with_base).to(dtype)
            torch.mm(x2, eff.T, out=out if len(blocks) == 1 else out[:, rows])
        if bias is not None and with_base:
            out += bias.to(dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, a, b, weight = ctx.saved_tensors
        dtype, scaling, gating = ctx.dtype, ctx.scaling, ctx.gating
        grad2, x2 = grad.reshape(-1, grad.shape[-1]).to(dtype), x.reshape(-1, x.shape[-1]).to(dtype)
        need_x = ctx.needs_input_grad[0]
        grad_x = x2.new_empty(x2.shape) if need_x else None
        grad_a, grad_b = torch.empty_like(a), torch.zeros_like(b)
        a_, b_s = a.to(weight.dtype), (b * scaling).to(weight.dtype)
        grad_t = grad2.T.contiguous()  # once: every block's update gradient reads it
        for cols in column_blocks(weight):
            w = _block(weight, (slice(None), cols))
            gate = gate_of(w, gating, _scratch(0, w.shape, w))  # once for both uses
            if need_x:
                eff = _effective(w, gate, a_[:, cols], b_s, gating, ctx.with_base).to(dtype)
                torch.mm(grad2, eff, out=grad_x[:, cols])
            # dL/d(BA) = s * G * (grad^T x), summed over every leading dimension: whole within the block
            g = torch.mm(grad_t, x2[:, cols], out=_scratch(1, w.shape, x2)).mul_(gate.to(dtype))
            grad_b.add_((g @ a_[:, cols].T.to(dtype)).to(b.dtype), alpha=scaling)  # s applied to the small products
            grad_a[:, cols] = (b_s.T.to(dtype) @ g).to(a.dtype)
        grad_bias = grad2.sum(0).to(ctx.bias_dtype) if ctx.with_base and ctx.needs_input_grad[2] else None
        grad_x = grad_x.reshape(x.shape).to(x.dtype) if need_x else None
        return grad_x, None, grad_bias, grad_a, grad_b, None, None, None


class _GatedVariant(LoraVariant):
    """peft's ``LoraVariant`` hooks for a gated update ``G * (s B A)``: the merge, the unmerge and the forward of a
    layer with dropout or several adapters (the common case runs :meth:`MaskLoraLinear.forward`)."""

    gating = "mask"  # what gates the update: the mask M, or the weight W

    @staticmethod
    def init(module: LoraLinear, adapter_name: str, **kwargs) -> None:
        """Nothing beyond peft's own init of A and B."""
        pass  # peft's init of A and B (B = 0): the update starts at zero, the scaling at ones

    @classmethod
    def delta(cls, module: LoraLinear, adapter: str, weight: torch.Tensor) -> torch.Tensor:
        """The update ``G * (s B A)`` the merge adds to ``weight`` (as stored), computed in float32, in ``weight``'s
        dtype."""
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        compute = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype
        product = b.to(compute) @ a.to(compute)
        gate = gate_of(oriented(module, weight), cls.gating).to(compute)
        return oriented(module, product * gate * module.scaling[adapter]).to(weight.dtype)

    @classmethod
    def merge_safe(cls, module: LoraLinear, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        """The merged weight, as a new tensor."""
        return orig_weight + cls.delta(module, active_adapter, orig_weight)

    @classmethod
    def merge_unsafe(cls, module: LoraLinear, active_adapter: str, orig_weight: torch.Tensor) -> None:
        """The update merged into ``orig_weight`` in place."""
        orig_weight.data += cls.delta(module, active_adapter, orig_weight.data)

    @classmethod
    def unmerge(cls, module: LoraLinear, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        """The weight before the merge."""
        # ScaleLoRA: W' = W (1 + D) gives W = W' / (1 + D) where 1 + D is nonzero; MaskLoRA: W' - M D (M unchanged)
        if cls.gating == "scale":
            a, b = module.lora_A[active_adapter].weight, module.lora_B[active_adapter].weight
            factor = oriented(module, 1 + (b.float() @ a.float()) * module.scaling[active_adapter])
            return (orig_weight.float() / factor).to(orig_weight.dtype)
        return orig_weight - cls.delta(module, active_adapter, orig_weight)

    @classmethod
    def forward(
        cls, module: LoraLinear, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs
    ) -> torch.Tensor:
        """``result`` (the base layer's output) plus the gated update of ``x`` (after the adapter's dropout)."""
        a, b = module.lora_A[active_adapter].weight, module.lora_B[active_adapter].weight
        weight = oriented(module, module.get_base_layer().weight)
        x = module.lora_dropout[active_adapter](x)
        update = _GatedLinear.apply(x, weight, None, a, b, module.scaling[active_adapter], cls.gating, False)
        return result + update.to(result.dtype)

    def supports_lora_conversion(self) -> bool:
        return False  # its update is not a plain low-rank product


class MaskLoraVariant(_GatedVariant):
    gating = "mask"


class ScaleLoraVariant(_GatedVariant):
    gating = "scale"


class MaskLoraLinear(LoraLinear):
    """peft's LoRA ``Linear`` whose update is ``M * (s B A)`` (MaskLoRA)."""

    variant = MaskLoraVariant

    def __init__(self, base_layer: nn.Module, adapter_name: str, **kwargs) -> None:
        super().__init__(base_layer, adapter_name, **kwargs)
        self.fan_in_fan_out = isinstance(base_layer, Conv1D)  # per layer: GPT-2's Conv1D stores W transposed

    def resolve_lora_variant(self, *, config, **kwargs):
        return self.variant()

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """One adapter, no dropout, not merged: the base and the update as one product with the effective weight
        (:class:`_GatedLinear`), not the base layer's product plus the update's; peft's path otherwise."""
        adapters = [n for n in self.active_adapters if n in self.lora_A]
        base = self.get_base_layer()
        if (
            args or kwargs or self.disable_adapters or self.merged or len(adapters) != 1
            or not isinstance(self.lora_dropout[adapters[0]], nn.Identity) or type(base) not in (nn.Linear, Conv1D)
            or base.weight.requires_grad
        ):  # fmt: skip
            return super().forward(x, *args, **kwargs)
        (name,) = adapters
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        weight = oriented(self, base.weight)
        return _GatedLinear.apply(x, weight, base.bias, a, b, self.scaling[name], self.variant.gating, True)

    def get_delta_weight(self, adapter) -> torch.Tensor:
        return self.variant.delta(self, adapter, self.get_base_layer().weight)

    def __repr__(self) -> str:
        return "mask_" + super().__repr__()


class ScaleLoraLinear(MaskLoraLinear):
    """peft's LoRA ``Linear`` whose weight is ``W * (1 + s B A)`` (ScaleLoRA)."""

    variant = ScaleLoraVariant

    def __repr__(self) -> str:
        return "scale_" + LoraLinear.__repr__(self)


LAYERS = {"mask_lora": MaskLoraLinear, "scale_lora": ScaleLoraLinear}


def lora_config(kind: str, rank: int, alpha: float, targets: list[str], dropout: float = 0.0):
    """A peft ``LoraConfig`` whose ``nn.Linear`` targets become :class:`MaskLoraLinear` or :class:`ScaleLoraLinear`
    (``kind``: ``"mask_lora"`` or ``"scale_lora"``)."""
    from peft import LoraConfig

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=dropout, bias="none")
    config._register_custom_module({nn.Linear: LAYERS[kind], Conv1D: LAYERS[kind]})  # peft's custom layer hook
    return config
