"""Inference layers that compute with a sparse weight: one per pruned layer type, each a drop-in for the dense one.

Every layer keeps what model code reads from the layer it replaces (``weight.dtype/.device/.shape``,
``in_features``/``out_features``, ``bias``, a conv's ``in_channels``/``kernel_size``...), and its ``state_dict``
holds the dense weight, so a runtime model's state dict equals the masked dense model's. They are for
inference only: ``.train()`` and any forward that would need a gradient raise.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from .csr import to_csr

_TRAIN_ERROR = (
    "a sparse runtime model is for inference only: train the masked dense model (SparseSoupTrainer), then "
    "convert it again with hf_sms.to_sparse_runtime"
)
# The dtypes torch's CSR x dense product takes (CPU: MKL; CUDA: cuSPARSE); others raise at conversion.
CSR_DTYPES = {
    "cpu": (torch.float32, torch.float64),
    "cuda": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
}


def has_csr_kernel(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch has a CSR matrix product for ``dtype`` on ``device``."""
    return dtype in CSR_DTYPES.get(device.type, ())


def check_csr_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """Raise if torch has no CSR matrix product for ``dtype`` on ``device``."""
    supported = CSR_DTYPES.get(device.type, ())
    if not has_csr_kernel(dtype, device):
        names = ", ".join(str(d).removeprefix("torch.") for d in supported) or "nothing"
        raise ValueError(
            f"the csr layout has no {device.type} kernel for {dtype} (it takes {names}): convert the model with "
            "model.float() first, or keep it dense (layout='dense')"
        )


def _copy_tensor(t: torch.Tensor | None, memo: dict) -> torch.Tensor | None:
    if t is None or t.layout == torch.strided:
        return t  # deep-copied with the rest
    if id(t) not in memo:
        clone = memo[id(t)] = t.clone()
        memo[id(clone)] = clone  # the copied dict of buffers keeps it as it is
    return memo[id(t)]


def guarded_apply(model: nn.Module, fn, recurse: bool = True):
    """A runtime model's ``_apply`` (installed on the instance): every sparse layer checks the cast before any module
    of the model changes, so a refused ``.to(torch.bfloat16)`` leaves the whole model as it was."""
    for module in model.modules():
        if isinstance(module, _InferenceOnly):
            module.check_cast(fn)
    return type(model)._apply(model, fn, recurse)


def _autocast_off(x: torch.Tensor):
    return torch.autocast(x.device.type, enabled=False) if torch.is_autocast_enabled(x.device.type) else nullcontext()


def sparse_matmul(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for a 2-D ``x`` of shape (rows, in) and a CSR ``weight`` of shape (out, in)."""
    return torch.sparse.mm(weight, x.t()).t()


class _InferenceOnly(nn.Module):
    """Refuses training and gradients; stores the weight as a non-persistent CSR buffer, saves it dense."""

    weight: torch.Tensor

    def train(self, mode: bool = True):
        if mode:
            raise RuntimeError(_TRAIN_ERROR)
        return super().train(False)

    csr_product = False  # computes with torch's CSR matrix product (whose dtypes depend on the device)

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the layer computes with it: under autocast, in the weight's dtype (the sparse product runs with
        autocast off: torch has no lower-precision CSR product on the CPU)."""
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(_TRAIN_ERROR)
        if torch.is_autocast_enabled(x.device.type):
            return x.to(self.weight.dtype)
        if x.dtype != self.weight.dtype:
            raise ValueError(f"input of dtype {x.dtype} for a {self.weight.dtype} sparse layer: cast one to the other")
        return x

    def check_cast(self, fn) -> None:
        """Raise if ``fn`` (what ``.to()``, ``.half()``... apply) would give the weight a dtype or device with no CSR
        product: it would fail at the layer's first call."""
        probe = fn(torch.empty(0, dtype=self.weight.dtype, device=self.weight.device))
        if self.csr_product and not has_csr_kernel(probe.dtype, probe.device):
            names = ", ".join(str(d).removeprefix("torch.") for d in CSR_DTYPES.get(probe.device.type, ()))
            raise ValueError(
                f"a sparse runtime model cannot become {probe.dtype} on {probe.device.type}: torch's CSR product "
                f"there takes {names or 'nothing'}. Keep it in float32 (autocast works: the sparse layers compute "
                "in float32), or cast the masked dense model instead (load_sparse(dir) without runtime)"
            )

    def _apply(self, fn, recurse=True):
        self.check_cast(fn)  # before this layer changes (the model's own _apply checks every layer first)
        return super()._apply(fn, recurse)

    def __deepcopy__(self, memo):
        """A copy with its own sparse weight (``copy.deepcopy`` cannot reach a CSR tensor's storage); tied layers
        stay tied within one copy."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key == "_buffers":
                value = {k: _copy_tensor(b, memo) for k, b in value.items()}
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    def dense_weight(self) -> torch.Tensor:
        """The weight as the dense layer held it (pruned entries zero)."""
        return self.weight.to_dense()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.dense_weight()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        key = prefix + "weight"
        if key in state_dict and tuple(state_dict[key].shape) != tuple(self.weight.shape):
            errors.append(
                f"size mismatch for {key}: copying a param with shape {tuple(state_dict[key].shape)} from "
                f"checkpoint, the shape in current model is {tuple(self.weight.shape)}."
            )
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        elif key in state_dict:
            dense = state_dict[key].to(self.weight.device, self.weight.dtype)
            self.weight = self._compress(dense)
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        elif strict:
            missing.append(key)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)

    def _compress(self, dense: torch.Tensor) -> torch.Tensor:
        return to_csr(dense)


class SparseLinear(_InferenceOnly):
    """``y = x W^T + b`` with ``W`` in CSR (torch.sparse.mm). Also stands in for transformers' ``Conv1D``.

    Args:
        weight: the (out, in) weight as a CSR tensor.
        bias: the bias, or ``None``.
        transposed: the layer it replaces stores the weight as (in, out), as ``Conv1D`` does; its state dict
            keeps that layout (``weight`` here is always (out, in)).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.transposed = transposed
        self.register_buffer("weight", weight, persistent=False)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    def dense_weight(self) -> torch.Tensor:
        dense = self.weight.to_dense()
        return dense.t().contiguous() if self.transposed else dense

    def _compress(self, dense: torch.Tensor) -> torch.Tensor:
        return to_csr(dense.t() if self.transposed else dense)

    csr_product = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._check_input(x)
        with _autocast_off(x):
            y = sparse_matmul(self.weight, x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        nnz = self.weight.values().numel()
        return f"in_features={self.in_features}, out_features={self.out_features}, nnz={nnz}, layout=csr"


def has_sparse_product(conv: nn.Conv2d) -> bool:
    """Whether a convolution is one unfolded matrix product: ``groups=1`` and numeric zero padding."""
    return conv.groups == 1 and conv.padding_mode == "zeros" and not isinstance(conv.padding, str)


class SparseConv2d(_InferenceOnly):
    """A 2-D convolution as a CSR product: 1x1 kernels directly, kxk kernels on unfolded patches (im2col).

    Args:
        conv: the dense ``nn.Conv2d`` (zero padding, ``groups=1``) it replaces; it gives the geometry.
        weight, bias: the CSR (out, in * kh * kw) weight and the bias, when ``conv`` holds none (a model built on
            the meta device and loaded sparse-first); by default ``conv``'s own.
    """

    def __init__(self, conv: nn.Conv2d, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        super().__init__()
        if not has_sparse_product(conv):
            raise ValueError("only groups=1 convolutions with numeric zero padding have a sparse product")
        for attr in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups"):
            setattr(self, attr, getattr(conv, attr))
        self.padding_mode = "zeros"
        if weight is None:
            weight, bias = to_csr(conv.weight.detach().reshape(conv.out_channels, -1)), conv.bias
        self.register_buffer("weight", weight, persistent=False)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    @property
    def pointwise(self) -> bool:
        return self.kernel_size == (1, 1) and self.padding == (0, 0)

    def dense_weight(self) -> torch.Tensor:
        return self.weight.to_dense().reshape(self.out_channels, self.in_channels, *self.kernel_size)

    def _compress(self, dense: torch.Tensor) -> torch.Tensor:
        return to_csr(dense.reshape(self.out_channels, -1))

    csr_product = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._check_input(x)
        n = x.shape[0]
        if self.pointwise:
            x = x[:, :, :: self.stride[0], :: self.stride[1]]
            h, w = x.shape[2:]
            cols = x.permute(1, 0, 2, 3).reshape(self.in_channels, -1)  # (C, N*H*W)
        else:
            h, w = (
                (size + 2 * p - d * (k - 1) - 1) // s + 1
                for size, p, d, k, s in zip(x.shape[2:], self.padding, self.dilation, self.kernel_size, self.stride)
            )
            patches = F.unfold(x, self.kernel_size, self.dilation, self.padding, self.stride)  # (N, C*k*k, L)
            cols = patches.permute(1, 0, 2).reshape(patches.shape[1], -1)
        with _autocast_off(x):
            y = torch.sparse.mm(self.weight, cols)  # (out, N*L)
        if self.bias is not None:
            y = y + self.bias[:, None]
        return y.reshape(self.out_channels, n, h, w).permute(1, 0, 2, 3)

    def extra_repr(self) -> str:
        nnz = self.weight.values().numel()
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"nnz={nnz}, layout=csr"
        )


class SparseEmbedding(_InferenceOnly):
    """A lookup table in CSR: each looked-up row is gathered from its stored nonzeros.

    It saves the table's memory (a tied embedding and lm_head share one CSR); at the sizes of a forward pass the
    gather costs a small fraction of one matrix product.

    Args:
        weight: the (num_embeddings, embedding_dim) table as a CSR tensor.
        padding_idx: as in ``nn.Embedding`` (only recorded: inference needs nothing from it).
    """

    def __init__(self, weight: torch.Tensor, padding_idx: int | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).long()
        # only the looked-up rows' indices are widened to int64: the whole table's per call would dominate decoding
        crow, col, values = self.weight.crow_indices(), self.weight.col_indices(), self.weight.values()
        start = crow[flat].long()
        counts = crow[flat + 1].long() - start
        rows = torch.repeat_interleave(torch.arange(flat.numel(), device=flat.device), counts)
        first = torch.repeat_interleave(start - (counts.cumsum(0) - counts), counts)
        taken = first + torch.arange(rows.numel(), device=flat.device)
        out = torch.zeros(flat.numel(), self.embedding_dim, dtype=values.dtype, device=values.device)
        out[rows, col[taken].long()] = values[taken]
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, nnz={self.weight.values().numel()}, layout=csr"


def is_two_four(weight: torch.Tensor) -> bool:
    """Whether every group of 4 consecutive inputs of a 2-D weight holds at most 2 nonzeros."""
    return weight.shape[-1] % 4 == 0 and bool(((weight != 0).reshape(-1, 4).sum(-1) <= 2).all())


class SemiStructuredLinear(_InferenceOnly):
    """``y = x W^T + b`` with ``W`` as torch's 2:4 semi-structured tensor (CUDA compute capability >= 8.0).

    Args:
        weight: the dense (out, in) weight, 2:4 sparse along its inputs, fp16 or bf16, on a supported GPU.
        bias: the bias, or ``None``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        check_semi_structured(weight)
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", self._compress(weight), persistent=False)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    def _compress(self, dense: torch.Tensor) -> torch.Tensor:
        return torch.sparse.to_sparse_semi_structured(dense.detach().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._check_input(x), self.weight, self.bias)


def check_semi_structured(weight: torch.Tensor) -> None:
    """Raise, saying how to fix it, unless ``weight`` can become a 2:4 semi-structured tensor here."""
    if weight.device.type != "cuda" or torch.cuda.get_device_capability(weight.device) < (8, 0):
        raise ValueError(
            "layout='semi_structured' needs the model on a CUDA GPU of compute capability >= 8.0 (Ampere or "
            "newer); move it there with model.cuda(), or use layout='csr' (CPU and GPU)"
        )
    if weight.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"layout='semi_structured' takes float16 or bfloat16 weights, not {weight.dtype}: call "
            "model.to(torch.bfloat16) first"
        )
    if not is_two_four(weight):
        raise ValueError(
            "layout='semi_structured' needs 2:4 sparse weights (at most 2 nonzeros in every 4 consecutive "
            "inputs): prune with allocation='2:4'"
        )
    out, inp = weight.shape
    if out % 32 or inp % 64:
        raise ValueError(f"a {tuple(weight.shape)} weight is not a multiple of (32, 64), which 2:4 kernels need")


def dense_module(sparse: nn.Module) -> nn.Module:
    """The dense layer a runtime layer stands for (weights equal), e.g. to time it or to fall back to it."""
    weight = sparse.dense_weight()
    bias = getattr(sparse, "bias", None)
    if isinstance(sparse, SparseEmbedding):
        out = nn.Embedding(sparse.num_embeddings, sparse.embedding_dim, sparse.padding_idx, device="meta")
    elif isinstance(sparse, SparseConv2d):
        out = nn.Conv2d(
            sparse.in_channels,
            sparse.out_channels,
            sparse.kernel_size,
            sparse.stride,
            sparse.padding,
            sparse.dilation,
            bias=bias is not None,
            device="meta",
        )
    elif getattr(sparse, "transposed", False):
        out = Conv1D(sparse.out_features, sparse.in_features).to("meta")
    else:
        out = nn.Linear(sparse.in_features, sparse.out_features, bias=bias is not None, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None and not isinstance(sparse, SparseEmbedding):
        out.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return out.eval()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model``, each storage once; a CSR weight counts its values and
    both index arrays, a semi-structured one its packed values and metadata."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.layout == torch.sparse_csr:
            parts = [t.values(), t.crow_indices(), t.col_indices()]
        elif hasattr(t, "packed"):  # torch's SparseSemiStructuredTensor
            parts = [p for p in (t.packed, t.meta) if p is not None]
        else:
            parts = [t]
        for p in parts:
            key = (p.untyped_storage().data_ptr(), p.storage_offset(), p.numel())
            if key not in seen:
                seen.add(key)
                total += p.numel() * p.element_size()
    return total
