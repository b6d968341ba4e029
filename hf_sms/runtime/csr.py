"""CSR matrices for the runtime: from a dense weight, or from the flat positions of its nonzeros, never dense."""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import torch


@contextlib.contextmanager
def quiet_beta():
    # torch marks CSR tensors "beta" on construction; the runtime uses only the long-stable CSR x dense product.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
        yield


def index_dtype(numel: int) -> torch.dtype:
    """32-bit CSR indices where they fit (half the index memory of int64; the CPU kernels take both)."""
    return torch.int32 if numel < 2**31 else torch.int64


BLOCK = 1 << 20
"""Elements of a dense weight turned into CSR at a time on the CPU."""


def to_csr(weight: torch.Tensor) -> torch.Tensor:
    """A 2-D weight as a CSR tensor with 32-bit indices where they fit; on the CPU a block of rows at a time
    (torch's own conversion holds int64 indices of every nonzero: 16 bytes each, four times the values of fp32)."""
    w = weight.detach()
    if w.device.type == "cpu" and w.dim() == 2:
        return _csr_by_rows(w)
    with quiet_beta():
        csr = w.to_sparse_csr()
        index = index_dtype(weight.numel())
        return torch.sparse_csr_tensor(
            csr.crow_indices().to(index),
            csr.col_indices().to(index),
            csr.values(),
            size=csr.shape,
            check_invariants=False,  # built by torch from a dense tensor: valid by construction
        )


def _csr_by_rows(w: torch.Tensor) -> torch.Tensor:
    rows, cols = w.shape
    index = index_dtype(w.numel())
    nnz = int(torch.count_nonzero(w))
    crow, col = torch.zeros(rows + 1, dtype=index), torch.empty(nnz, dtype=index)
    values, done = torch.empty(nnz, dtype=w.dtype), 0
    step = max(1, BLOCK // max(cols, 1))
    for start in range(0, rows, step):
        block = w[start : start + step]
        keep = block != 0
        crow[start + 1 : start + 1 + block.shape[0]] = keep.sum(1).cumsum(0).to(index) + done
        where = keep.nonzero()  # row-major, as to_sparse_csr orders them
        col[done : done + len(where)] = where[:, 1].to(index)
        values[done : done + len(where)] = block[keep]
        done += len(where)
    with quiet_beta():
        return torch.sparse_csr_tensor(crow, col, values, size=(rows, cols), check_invariants=False)


class CSRBuilder:
    """A CSR matrix from the flat row-major positions of its nonzeros, given in increasing chunks (e.g. as a
    checkpoint's index decodes, :func:`hf_sms.checkpoint.codec.position_chunks`). Each chunk is checked to be
    increasing and inside the matrix: indices from a file that broke CSR's invariants would be a memory error
    in the kernel, not an exception."""

    def __init__(self, shape: tuple[int, int], nnz: int):
        self.shape = shape
        index = index_dtype(shape[0] * shape[1])
        # torch.empty, not numpy: numpy asks for huge pages on large arrays, whose first touch can stall on
        # memory compaction (measured here: decoding T5-small's indices took 0.11 s instead of 0.07 s)
        self._crow, self._col = torch.empty(shape[0] + 1, dtype=index), torch.empty(nnz, dtype=index)
        self._done, self._next_row, self._last = 0, 0, -1

    def add(self, positions: np.ndarray) -> None:
        """Append the entries at ``positions`` (int64, increasing, after every position added before)."""
        n, (rows, cols) = len(positions), self.shape
        if not n:
            return
        if (
            positions[0] <= self._last
            or positions[-1] >= rows * cols
            or self._done + n > len(self._col)
            or (n > 1 and not (positions[1:] > positions[:-1]).all())
        ):
            raise ValueError(f"CSR positions must increase, lie inside {self.shape} and number {len(self._col)}")
        first, last = min(int(positions[0]) // cols, self._next_row), int(positions[-1]) // cols
        starts = np.arange(first, last + 1, dtype=np.int64) * cols
        before = np.searchsorted(positions, starts)  # the chunk's entries before each row's start
        self._crow.numpy()[self._next_row : last + 1] = before[self._next_row - first :] + self._done
        col = self._col.numpy()[self._done : self._done + n]
        if cols & (cols - 1) == 0:  # a power-of-two width (most hidden sizes): the column is the low bits
            np.bitwise_and(positions, cols - 1, out=col, casting="unsafe")
        else:
            np.subtract(positions, np.repeat(starts, np.diff(before, append=n)), out=col, casting="unsafe")
        self._done, self._next_row, self._last = self._done + n, last + 1, int(positions[-1])

    def tensor(self, values: torch.Tensor) -> torch.Tensor:
        """The CSR matrix with ``values`` (one per position, in order)."""
        if values.numel() != self._done or self._done != len(self._col):
            raise ValueError(f"{self._done} positions of {len(self._col)} for {values.numel()} values")
        self._crow.numpy()[self._next_row :] = self._done
        with quiet_beta():  # invariants checked chunk by chunk in add()
            return torch.sparse_csr_tensor(self._crow, self._col, values, size=self.shape, check_invariants=False)


def csr_from_positions(positions: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A CSR matrix from the flat row-major positions (increasing) of its nonzeros and their values."""
    builder = CSRBuilder(shape, positions.numel())
    builder.add(positions.to(torch.int64).numpy())
    return builder.tensor(values)
