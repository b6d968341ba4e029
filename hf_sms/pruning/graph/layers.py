"""How layers act on spaces: a matmul or convolution joins its input's channels with a weight's input dimension and
makes its output the weight's rows; norms, embeddings and attention kernels (:mod:`hf_sms.pruning.graph`)."""

from __future__ import annotations

import math

import torch

from .labels import CHANNELWISE, CONSUMER, PRODUCER, Labels, _arg, _flat

VALUE = "the size of an attention's values (each head's)"


class LayerOps(Labels):
    """The recorder's layer ops."""

    def contract(self, a: int, b: int, weights: tuple[bool, bool], kind: str) -> int:
        """Join the contracted dimensions ``a`` and ``b`` of two operands (``weights``: which are weights)."""
        for space, weight in zip((a, b), weights):
            if weight:
                self.role(space, CONSUMER, kind)
        space = self.s.union(a, b)
        if not any(weights):
            self.s.pin(space, "contracted between two activations")
        return space

    def produce(self, spaces, weights: tuple[bool, ...], kind: str) -> None:
        for space, weight in zip(spaces, weights):
            if weight:
                self.role(space, PRODUCER, kind)

    def op_mm(self, func, args, kwargs, out) -> None:
        a, b = self.lab(args[0]), self.lab(args[1])
        weights = (self.is_weight(args[0]), self.is_weight(args[1]))
        self.contract(a[1], b[0], weights, "linear")
        self.produce((a[0], b[1]), weights, "linear")
        if not any(weights):  # attention's probabilities times its values: the values keep their head size
            self.s.pin(b[1], VALUE)
        self.set(out, [a[0], b[1]])

    def op_addmm(self, func, args, kwargs, out) -> None:
        self.op_mm(func, args[1:3], {}, out)
        self.pointwise([args[0], out], {}, out)

    def op_bmm(self, func, args, kwargs, out) -> None:
        a, b = self.lab(args[0]), self.lab(args[1])
        weights = (self.is_weight(args[0]), self.is_weight(args[1]))
        batch = self.s.union(a[0], b[0])
        self.contract(a[2], b[1], weights, "linear")
        self.produce((a[1], b[2]), weights, "linear")
        if not any(weights):
            self.s.pin(b[2], VALUE)
        self.set(out, [batch, a[1], b[2]])

    def op_baddbmm(self, func, args, kwargs, out) -> None:
        self.op_bmm(func, args[1:3], {}, out)
        self.pointwise([args[0], out], {}, out)

    def op_linear(self, func, args, kwargs, out) -> None:
        x, w = self.lab(args[0]), self.lab(args[1])
        self.contract(x[-1], w[1], (False, True), "linear")
        self.role(w[0], PRODUCER, "linear")
        self.set(out, [*x[:-1], w[0]])
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if torch.is_tensor(bias):
            self.pointwise([bias, out], {}, out)

    def op_convolution(self, func, args, kwargs, out) -> None:
        x, w, bias = args[0], args[1], args[2]
        transposed, groups = bool(args[6]), int(args[8])
        xl, wl = self.lab(x), self.lab(w)
        kind = "conv1x1" if math.prod(w.shape[2:]) == 1 and groups == 1 else "conv"
        c_in = x.shape[1]
        labels = [xl[0], None, *(self.s.new(n) for n in out.shape[2:])]
        if groups == 1:
            w_in, w_out = (wl[0], wl[1]) if transposed else (wl[1], wl[0])
            self.contract(xl[1], w_in, (False, True), kind)
            self.role(w_out, PRODUCER, kind)
            labels[1] = w_out
        elif groups == c_in == out.shape[1] and not transposed and w.shape[1] == 1:  # depthwise: channel by channel
            self.role(wl[0], CHANNELWISE, "conv")
            labels[1] = self.s.union(xl[1], wl[0])
        else:
            reason = f"read by a grouped convolution ({groups} groups)"
            self.s.pin(xl[1], reason)
            for space in wl[:2]:
                self.s.pin(space, reason)
            labels[1] = self.s.new(out.shape[1])
            self.s.pin(labels[1], reason)
        if torch.is_tensor(bias):
            labels[1] = self.s.union(labels[1], self.lab(bias)[0])
        self.set(out, labels)

    op__convolution = op_convolution

    def op_embedding(self, func, args, kwargs, out) -> None:
        w, idx = self.lab(args[0]), self.lab(args[1])
        self.s.pin(w[0], "embedding rows (a vocabulary)")
        self.role(w[1], PRODUCER, "embedding")
        self.set(out, [*idx, w[1]])

    def sdpa(self, func, args, kwargs, out) -> None:
        q, k, v = args[:3]
        ql, kl, vl = self.lab(q), self.lab(k), self.lab(v)
        batch = [self.s.union(a, b) for a, b in zip(ql[:-3], kl[:-3])]
        batch = [self.s.union(a, b) for a, b in zip(batch, vl[:-3])]
        heads = ql[-3]
        kv = self.s.union(kl[-3], vl[-3])
        if q.shape[-3] == k.shape[-3]:
            heads = self.s.union(heads, kv)
        elif q.shape[-3] % k.shape[-3] == 0:  # grouped-query attention: query heads = kv heads x group size
            parts = self.s.refine(heads, [k.shape[-3], q.shape[-3] // k.shape[-3]], "prod")
            if len(parts) == 2:  # one key/value head: every query head is in its group, no unit to join
                self.s.union(parts[0], kv)
        self.contract(ql[-1], kl[-1], (False, False), "attention")
        keys = self.s.union(kl[-2], vl[-2])
        self.s.pin(keys, "attended over (a softmax)")
        self.s.pin(vl[-1], VALUE)
        mask = _arg(func, args, kwargs, "attn_mask", None)
        if mask is None:
            mask = _arg(func, args, kwargs, "attn_bias", None)
        if torch.is_tensor(mask):
            target = [*batch, heads, ql[-2], keys]
            shape = [*q.shape[:-1], k.shape[-2]]
            ml = self.lab(mask)
            for j in range(1, mask.dim() + 1):
                if j <= len(shape) and mask.shape[-j] == shape[-j] and shape[-j] > 1 and not self.s.is_free(ml[-j]):
                    self.s.union(ml[-j], target[-j])
        outs = _flat(out)
        self.set(outs[0], [*batch, heads, ql[-2], vl[-1]])
        for o in outs[1:]:
            if torch.is_tensor(o) and o.dim() == q.dim() - 1 and o.shape == q.shape[:-1]:
                self.set(o, [*batch, heads, ql[-2]])
            else:
                self.fresh(o)

    def batch_norm(self, args, out) -> None:
        x = args[0]
        labels = self.lab(x)
        for p in args[1:5]:
            if torch.is_tensor(p) and p.dim() == 1 and x.dim() > 1 and p.shape[0] == x.shape[1]:
                self.role(self.lab(p)[0], CHANNELWISE, "norm")
                self.s.union(labels[1], self.lab(p)[0])
        outs = _flat(out)
        self.set(outs[0], labels)
        for o in outs[1:]:
            if torch.is_tensor(o) and o.dim() == 1 and x.dim() > 1 and o.shape[0] == x.shape[1]:
                self.set(o, [labels[1]])
            else:
                self.fresh(o)

    def op_native_layer_norm(self, func, args, kwargs, out) -> None:
        x, shape = args[0], list(args[1])
        labels = self.lab(x)
        k = len(shape)
        for d in range(x.dim() - k, x.dim()):
            self.s.pin(labels[d], "normalised over (a layer norm)")
        for p in args[2:4]:
            if torch.is_tensor(p):
                for j, space in enumerate(self.lab(p)):
                    self.s.union(labels[x.dim() - k + j], space)
        outs = _flat(out)
        self.set(outs[0], labels)
        for o in outs[1:]:
            self.fresh(o)

    def op_native_group_norm(self, func, args, kwargs, out) -> None:
        x, groups = args[0], args[6]
        labels = self.lab(x)
        if groups != x.shape[1]:
            self.s.pin(labels[1], f"normalised over in groups (a group norm of {groups} groups)")
        for p in args[1:3]:
            if torch.is_tensor(p):
                self.s.union(labels[1], self.lab(p)[0])
        outs = _flat(out)
        self.set(outs[0], labels)
        for o in outs[1:]:
            self.fresh(o)
