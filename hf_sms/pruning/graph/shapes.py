"""How shape ops move spaces: reshapes split and join them, slices and concatenations lay them end to end,
permutes reorder them (:mod:`hf_sms.pruning.graph`)."""

from __future__ import annotations

from .labels import Labels


class ShapeOps(Labels):
    """The recorder's shape ops (``op_<aten name>``)."""

    def reshape(self, x, out) -> None:
        leaves = [leaf for lab, n in zip(self.lab(x), x.shape) if n != 1 for leaf in self.s.factors(lab)]
        labels, i = [], 0
        for n in out.shape:
            if n == 1:
                labels.append(self.s.new(1))
                continue
            take, acc = [], 1
            while acc < n:
                if i >= len(leaves):
                    raise ValueError("reshape")
                z = self.s.size(leaves[i])
                if acc * z <= n:
                    take.append(leaves[i])
                    acc, i = acc * z, i + 1
                else:
                    need = n // acc
                    if n % acc or z % need:
                        raise ValueError("reshape")
                    a, b = self.s.refine(leaves[i], [need, z // need], "prod")
                    take.append(a)
                    leaves[i] = b
                    acc *= need
            labels.append(self.s.compose(take, "prod"))
        self.set(out, labels)

    def op_view(self, func, args, kwargs, out) -> None:
        try:
            self.reshape(args[0], out)
        except ValueError:
            self.pin_all([args[0]], "reshaped in a way hf-sms does not follow")
            self.fresh(out, "reshaped in a way hf-sms does not follow")

    op__unsafe_view = op_reshape = op_view

    def op_permute(self, func, args, kwargs, out) -> None:
        labels = self.lab(args[0])
        self.set(out, [labels[d % len(labels)] for d in args[1]])

    def op_transpose(self, func, args, kwargs, out) -> None:
        labels = list(self.lab(args[0]))
        a, b = args[1] % len(labels), args[2] % len(labels)
        labels[a], labels[b] = labels[b], labels[a]
        self.set(out, labels)

    op_swapaxes = op_transpose

    def op_t(self, func, args, kwargs, out) -> None:
        self.set(out, self.lab(args[0])[::-1])

    def op_expand(self, func, args, kwargs, out) -> None:
        x = args[0]
        labels = self.lab(x)
        extra = out.dim() - x.dim()
        new = [self.s.new(n, free=True) for n in out.shape[:extra]]
        for d in range(x.dim()):
            same = x.shape[d] == out.shape[extra + d]
            new.append(labels[d] if same else self.s.new(out.shape[extra + d], free=True))
        self.set(out, new)

    def op_unsqueeze(self, func, args, kwargs, out) -> None:
        labels = list(self.lab(args[0]))
        labels.insert(args[1] % (len(labels) + 1), self.s.new(1))
        self.set(out, labels)

    def op_squeeze(self, func, args, kwargs, out) -> None:
        x = args[0]
        labels = self.lab(x)
        dims = args[1] if len(args) > 1 else [d for d in range(x.dim()) if x.shape[d] == 1]
        dims = {d % max(x.dim(), 1) for d in ([dims] if isinstance(dims, int) else dims) if x.shape[d] == 1}
        self.set(out, [lab for d, lab in enumerate(labels) if d not in dims])

    def op_slice(self, func, args, kwargs, out) -> None:
        x = args[0]
        dim = (args[1] if len(args) > 1 else 0) % x.dim()
        n = x.shape[dim]
        start, end = (args[2] if len(args) > 2 else 0), (args[3] if len(args) > 3 else n)
        step = args[4] if len(args) > 4 else 1
        start = 0 if start is None else min(max(start + n if start < 0 else start, 0), n)
        end = n if end is None else min(max(end + n if end < 0 else end, start), n)
        labels = list(self.lab(x))
        if step != 1:
            self.s.pin(labels[dim], "sliced with a stride")
            labels[dim] = self.s.new(out.shape[dim])
        elif end == start:
            labels[dim] = self.s.new(0)
        elif end - start != n:
            parts = self.s.refine(labels[dim], [start, end - start, n - end], "sum")
            labels[dim] = parts[1 if start else 0]
        self.set(out, labels)

    def op_select(self, func, args, kwargs, out) -> None:
        x, dim = args[0], args[1] % args[0].dim()
        labels = self.lab(x)
        self.s.pin(labels[dim], "indexed at one position")
        self.set(out, [lab for d, lab in enumerate(labels) if d != dim])

    def op_unbind(self, func, args, kwargs, out) -> None:
        x = args[0]
        dim = (args[1] if len(args) > 1 else 0) % x.dim()
        labels = self.lab(x)
        self.s.pin(labels[dim], "unbound into separate tensors")
        for o in out:
            self.set(o, [lab for d, lab in enumerate(labels) if d != dim])

    def _split(self, x, dim, sizes, out) -> None:
        labels = list(self.lab(x))
        parts = self.s.refine(labels[dim], list(sizes), "sum")
        parts = iter(parts if len(parts) == len([s for s in sizes if s]) else [])
        for o, size in zip(out, sizes):
            part = next(parts, None) if size else self.s.new(0)
            if part is None:
                part = labels[dim] if size == x.shape[dim] else self.s.new(size)
            self.set(o, [*labels[:dim], part, *labels[dim + 1 :]])

    def op_split(self, func, args, kwargs, out) -> None:
        x, size = args[0], args[1]
        dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.dim()
        sizes = list(size) if isinstance(size, (list, tuple)) else [o.shape[dim] for o in out]
        self._split(x, dim, sizes, out)

    def op_split_with_sizes(self, func, args, kwargs, out) -> None:
        x = args[0]
        dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % x.dim()
        self._split(x, dim, list(args[1]), out)

    def op_cat(self, func, args, kwargs, out) -> None:
        inputs = [t for t in args[0] if t.numel() > 0 or t.dim() == out.dim()]
        inputs = [t for t in inputs if t.dim() == out.dim() and t.numel() > 0] or inputs
        dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % out.dim()
        labels = list(self.lab(inputs[0]))
        for t in inputs[1:]:
            for d, space in enumerate(self.lab(t)):
                if d != dim and t.shape[d] == out.shape[d] and out.shape[d] > 1:
                    labels[d] = self.s.union(labels[d], space)
        labels[dim] = self.s.compose([self.lab(t)[dim] for t in inputs if t.shape[dim]], "sum")
        self.set(out, labels)

    def op_stack(self, func, args, kwargs, out) -> None:
        inputs = list(args[0])
        dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % out.dim()
        labels = list(self.lab(inputs[0]))
        for t in inputs[1:]:
            labels = [self.s.union(a, b) if t.shape[d] > 1 else a for d, (a, b) in enumerate(zip(labels, self.lab(t)))]
        labels.insert(dim, self.s.new(out.shape[dim]))
        self.set(out, labels)

    def op_index_select(self, func, args, kwargs, out) -> None:
        x, dim = args[0], args[1] % args[0].dim()
        labels = list(self.lab(x))
        self.s.pin(labels[dim], "indexed (index_select)")
        labels[dim] = self.s.new(out.shape[dim])
        self.set(out, labels)

    def op_repeat(self, func, args, kwargs, out) -> None:
        x, reps = args[0], list(args[1])
        labels = list(self.lab(x))
        extra = len(reps) - x.dim()
        new = [self.s.new(n) for n in out.shape[:extra]]
        for d, r in enumerate(reps[extra:]):
            new.append(labels[d] if r == 1 else self.s.compose([self.s.new(r), labels[d]], "prod"))
        self.set(out, new)

    def op_flip(self, func, args, kwargs, out) -> None:
        labels = self.lab(args[0])
        for d in args[1]:
            self.s.pin(labels[d % len(labels)], "flipped")
        self.set(out, labels)

    def op_roll(self, func, args, kwargs, out) -> None:
        labels = self.lab(args[0])
        dims = args[2] if len(args) > 2 else []
        for d in dims or range(len(labels)):
            self.s.pin(labels[d % len(labels)], "rolled")
        self.set(out, labels)

    def op_copy(self, func, args, kwargs, out) -> None:  # copy_(dst, src): src broadcast into dst
        self.pointwise(args[:2], {}, out)
