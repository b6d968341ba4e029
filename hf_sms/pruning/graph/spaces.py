"""Spaces: the positions a tensor dimension indexes, joined, refined and pinned as a trace reads ops
(:mod:`hf_sms.pruning.graph`)."""

from __future__ import annotations

import math

import torch


class Spaces:
    """Union-find over spaces, each a range of positions of one size; a space may be *refined* into a product
    (``"prod"``: factors outer to inner, position = row-major index) or a sum (``"sum"``: parts end to end) of
    others. ``pins`` map spaces to why their positions must stay."""

    def __init__(self):
        self.parent: list[int] = []
        self.sizes: list[int] = []
        self.refined: dict[int, tuple[str, list[int]]] = {}
        self.pins: dict[int, str] = {}
        self.free: set[int] = set()  # roots of spaces only constants (zeros, ranges, broadcasts) have

    def new(self, size: int, free: bool = False) -> int:
        self.parent.append(len(self.parent))
        self.sizes.append(int(size))
        if free:
            self.free.add(len(self.parent) - 1)
        return len(self.parent) - 1

    def is_free(self, i: int) -> bool:
        return self.find(i) in self.free

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = i = self.parent[self.parent[i]]
        return i

    def size(self, i: int) -> int:
        return self.sizes[self.find(i)]

    def pin(self, i: int, reason: str) -> None:
        self.pins.setdefault(i, reason)

    def union(self, a: int, b: int) -> int:
        """One space from ``a`` and ``b`` (same size); refinements of both are aligned to a common one."""
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        if self.sizes[ra] != self.sizes[rb]:
            self.pin(ra, "joined with a dimension of another size")
            self.pin(rb, "joined with a dimension of another size")
            return ra
        fa, fb = self.refined.get(ra), self.refined.pop(rb, None)
        self.parent[rb] = ra
        if rb not in self.free:
            self.free.discard(ra)
        self.free.discard(rb)
        if fb is not None:
            if fa is None:
                self.refined[ra] = fb
            else:
                self._align(ra, fa, fb)
        return ra

    def _leaves(self, i: int, kind: str) -> list[int]:
        r = self.find(i)
        f = self.refined.get(r)
        if f is None or f[0] != kind:
            return [r]
        return [leaf for c in f[1] for leaf in self._leaves(c, kind)]

    def _split(self, leaves: list[int], bounds: list[int], kind: str) -> list[int] | None:
        """``leaves`` (of one product or sum) cut further at ``bounds`` (prefix products or sums); None if a cut
        falls in a leaf refined the other way."""
        out, acc = [], 1 if kind == "prod" else 0
        cuts = sorted(set(bounds))
        for leaf in leaves:
            z = self.size(leaf)
            end = acc * z if kind == "prod" else acc + z
            inside = [c for c in cuts if acc < c < end and (kind != "prod" or c % acc == 0)]
            if kind == "prod":
                inside = [c for c in inside if end % c == 0]
            if inside:
                if self.refined.get(self.find(leaf)) is not None:
                    return None
                sizes, prev = [], acc
                for c in [*inside, end]:
                    sizes.append(c // prev if kind == "prod" else c - prev)
                    prev = c
                children = [self.new(s) for s in sizes]
                self.refined[self.find(leaf)] = (kind, children)
                out += children
            else:
                out.append(leaf)
            acc = end
        return out

    def _align(self, root: int, fa, fb) -> None:
        kind = fa[0]
        if fb[0] != kind:
            self.refined[root] = fa
            self.pin(root, "reshaped and sliced in ways that do not fit together")
            return
        self.refined[root] = fa
        a = [leaf for c in fa[1] for leaf in self._leaves(c, kind)]
        b = [leaf for c in fb[1] for leaf in self._leaves(c, kind)]

        def bounds(leaves):
            out, acc = [], 1 if kind == "prod" else 0
            for leaf in leaves:
                acc = acc * self.size(leaf) if kind == "prod" else acc + self.size(leaf)
                out.append(acc)
            return out

        both = bounds(a) + bounds(b)
        a, b = self._split(a, both, kind), self._split(b, both, kind)
        if a is None or b is None or [self.size(x) for x in a] != [self.size(x) for x in b]:
            self.pin(root, "reshaped in ways that do not fit together")
            return
        for x, y in zip(a, b):
            self.union(x, y)

    def refine(self, i: int, sizes: list[int], kind: str) -> list[int]:
        """Factors (``"prod"``) or parts (``"sum"``) of ``i`` with these sizes (size-1 factors and empty parts
        dropped), aligned with any refinement ``i`` has."""
        sizes = [s for s in sizes if (s != 1 if kind == "prod" else s != 0)]
        if len(sizes) <= 1:
            return [self.find(i)]
        children = [self.new(s) for s in sizes]
        temp = self.new(self.size(i))
        self.refined[temp] = (kind, children)
        self.union(i, temp)
        return [self.find(c) for c in children]

    def compose(self, parts: list[int], kind: str) -> int:
        """A new space made of ``parts``: their product (a merged reshape) or their sum (a concatenation)."""
        if len(parts) == 1:
            return parts[0]
        sizes = [self.size(p) for p in parts]
        out = self.new(math.prod(sizes) if kind == "prod" else sum(sizes))
        self.refined[out] = (kind, list(parts))
        return out

    def expand(self, i: int, _depth: int = 0) -> dict[int, torch.Tensor]:
        """``{leaf: positions}``: for every leaf space under ``i``, a ``(leaf size, k)`` tensor of the positions of
        ``i`` each of its units covers."""
        r = self.find(i)
        f = self.refined.get(r)
        if f is None or _depth > 64:
            return {r: torch.arange(self.sizes[r]).view(-1, 1)}
        kind, children = f
        out: dict[int, torch.Tensor] = {}

        def add(leaf, pos):
            out[leaf] = torch.cat([out[leaf], pos], 1) if leaf in out else pos

        if kind == "sum":
            offset = 0
            for c in children:
                for leaf, pos in self.expand(c, _depth + 1).items():
                    add(leaf, pos + offset)
                offset += self.size(c)
            return out
        sizes = [self.size(c) for c in children]
        strides = [math.prod(sizes[j + 1 :]) for j in range(len(sizes))]
        for j, c in enumerate(children):
            others = torch.zeros(1, dtype=torch.long)
            for k, (z, s) in enumerate(zip(sizes, strides)):
                if k != j:
                    others = (others.view(-1, 1) + torch.arange(z).view(1, -1) * s).flatten()
            for leaf, pos in self.expand(c, _depth + 1).items():
                add(leaf, (pos.unsqueeze(-1) * strides[j] + others).flatten(1))
        return out

    def factors(self, i: int) -> list[int]:
        """The product factors of ``i``, outer to inner (``[i]`` if not a product); nested products flattened."""
        return self._leaves(i, "prod")
