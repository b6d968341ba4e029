"""The recorder: one eval forward under a dispatch mode that reads every aten op and joins, refines or pins the
spaces of its inputs and outputs (:mod:`hf_sms.pruning.graph`), by the kind :data:`~hf_sms.pruning.graph.ops.OPS`
registers for each op. Ops it does not know pin what they read."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .labels import Labels, _arg, _flat, _tensors
from .layers import LayerOps
from .ops import OPS
from .shapes import ShapeOps


def _spatial(name: str) -> int | None:
    """How many trailing (spatial) dims a pooling, resizing or padding op changes, from its name."""
    for k in (1, 2, 3):
        if name.endswith(f"{k}d") or f"{k}d_" in name or name.endswith(f"{k}d_aa"):
            return k
    return None


class Recorder(ShapeOps, LayerOps, Labels, TorchDispatchMode):
    """Labels every tensor of one forward with a space per dimension, joining and pinning them op by op."""

    def __init__(self, names: dict[int, str]):
        TorchDispatchMode.__init__(self)
        Labels.__init__(self, names)

    # -- the ops ----------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__.rstrip("_")
        if OPS.has(name, "view") and args and torch.is_tensor(args[0]) and self.is_weight(args[0]):
            self.weights.update(id(o) for o in _flat(out) if torch.is_tensor(o))
        try:
            self.record(func, name, args, kwargs, out)
        except Exception as e:  # noqa: BLE001 - an op this analysis reads wrong must not stop the forward
            self.unknown(func, args, kwargs, out, f"{name} ({type(e).__name__})")
        return out

    def unknown(self, func, args, kwargs, out, name=None) -> None:
        reason = (
            f"read by aten.{name or func.overloadpacket.__name__}, which hf-sms does not follow (if it acts "
            "position by position: hf_sms.pruning.graph.OPS.add(name, 'pointwise'))"
        )
        self.pin_all(_tensors(args, kwargs), reason)
        for o in _flat(out):
            self.fresh(o, reason)

    def record(self, func, name, args, kwargs, out) -> None:  # noqa: C901 - one branch per family of ops
        tensors = _tensors(args, kwargs)
        if OPS.has(name, "factory") or (not tensors and not name.startswith("_scaled")):
            for o in _flat(out):
                self.fresh(o, free=True)
            return
        if OPS.has(name, "test"):
            for o in _flat(out):
                self.fresh(o)
            return
        handler = getattr(self, f"op_{name}", None)
        if handler is not None:
            handler(func, args, kwargs, out)
        elif OPS.has(name, "batch_norm"):
            self.batch_norm(args, out)
        elif OPS.has(name, "sdpa"):
            self.sdpa(func, args, kwargs, out)
        elif OPS.has(name, "reduction"):
            self.reduction(func, name, args, kwargs, out)
        elif OPS.has(name, "along"):
            dim = _arg(func, args, kwargs, "dim", -1)
            x = args[0]
            labels = self.lab(x)
            self.s.pin(labels[dim % max(x.dim(), 1)], f"mixed along it (aten.{name})") if x.dim() else None
            for o in _flat(out):
                if torch.is_tensor(o) and o.shape == x.shape:
                    self.set(o, labels)
                else:
                    self.fresh(o)
        elif OPS.has(name, "pointwise") or torch.Tag.pointwise in func.tags:
            self.pointwise(args, kwargs, out)
        elif (k := _spatial(name)) is not None and ("pool" in name or "upsample" in name or "pad" in name):
            self.spatial(name, k, args, out)
        else:
            self.unknown(func, args, kwargs, out)

    def pointwise(self, args, kwargs, out) -> None:
        """Join each output dimension's space with the inputs' that match it (broadcast dims of size 1 do not). A
        dimension only constants have (a zeros tensor's) joins nothing: a constant reused by several layers (T5's
        cross-attention position bias) must not tie their units together."""
        outs = [o for o in _flat(out) if torch.is_tensor(o)]
        if not outs:
            return
        shape = outs[0].shape
        inputs = [(t, self.lab(t)) for t in _tensors(args, kwargs) if t.dim() > 0]
        labels = []
        for k in range(len(shape), 0, -1):
            found = [tl[-k] for t, tl in inputs if k <= t.dim() and t.shape[-k] == shape[-k] and shape[-k] > 1]
            real = [space for space in found if not self.s.is_free(space)] or found
            space = real[0] if real else self.s.new(shape[-k], free=True)
            for other in real[1:]:
                space = self.s.union(space, other)
            labels.append(space)
        for o in outs:
            if o.shape == shape:
                self.set(o, labels)
            else:
                self.fresh(o)

    def reduction(self, func, name, args, kwargs, out) -> None:
        x = args[0]
        labels = self.lab(x)
        dims = _arg(func, args, kwargs, "dim", None)
        if dims is None or dims == []:
            dims = list(range(x.dim()))
        dims = {d % max(x.dim(), 1) for d in ([dims] if isinstance(dims, int) else dims)}
        for d in dims:
            self.s.pin(labels[d], f"reduced over (aten.{name})")
        keep = [labels[d] for d in range(x.dim()) if d not in dims]
        for o in _flat(out):
            if not torch.is_tensor(o):
                continue
            if o.dim() == len(keep):
                self.set(o, keep)
            elif o.dim() == x.dim():  # keepdim
                self.set(o, [self.s.new(1) if d in dims else labels[d] for d in range(x.dim())])
            else:
                self.fresh(o)

    def spatial(self, name, k, args, out) -> None:
        x = args[0]
        labels = self.lab(x)
        if "pad" in name and "constant" not in name:
            pass
        for o in _flat(out):
            if torch.is_tensor(o) and o.dim() == x.dim():
                self.set(o, [*labels[: x.dim() - k], *(self.s.new(n) for n in o.shape[x.dim() - k :])])
            else:
                self.fresh(o)

    def op_constant_pad_nd(self, func, args, kwargs, out) -> None:
        x, pad = args[0], list(args[1])
        labels = list(self.lab(x))
        for j in range(len(pad) // 2):
            d = x.dim() - 1 - j
            if pad[2 * j] or pad[2 * j + 1]:
                self.s.pin(labels[d], "padded")
                labels[d] = self.s.new(out.shape[d])
        self.set(out, labels)
