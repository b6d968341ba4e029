"""Which aten ops the unit tracer follows, and how: one public registry, so an op it does not know (a new kernel,
a library's custom op) is one registration, not an edit of the tracer.

    from hf_sms.pruning.graph import OPS
    OPS.add("my_gelu", "pointwise")   # acts position by position: joins its inputs' channel spaces

Kinds (an op may have several):

- ``pointwise``: acts position by position on its inputs' broadcast shape (beside ops torch tags pointwise);
- ``factory``: makes a tensor from nothing the model computed (arange, zeros, randn);
- ``view``: gives a weight another shape, layout or dtype; what it returns is still that weight;
- ``test``: reads values only for control flow, never feeding an activation;
- ``reduction``: reduces over dims (pins them); ``along``: mixes positions along one dim (softmax, sort);
- ``batch_norm``, ``sdpa``: the BatchNorm and scaled-dot-product-attention kernels.

An op none of these names, without its own ``op_<name>`` method in the recorder, pins every space it reads.
"""

from __future__ import annotations

KINDS = ("pointwise", "factory", "view", "test", "reduction", "along", "batch_norm", "sdpa")


class OpTable:
    """aten op names (the overload packet's, trailing ``_`` of in-place ops dropped) by kind."""

    def __init__(self):
        self._kinds: dict[str, set[str]] = {}
        self.version = 0  # traces remembered under an older version are traced again

    def add(self, name: str, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown op kind {kind!r}: choose one of {KINDS}")
        self._kinds.setdefault(name.rstrip("_"), set()).add(kind)
        self.version += 1

    def update(self, kind: str, names) -> None:
        for name in names:
            self.add(name, kind)

    def has(self, name: str, kind: str) -> bool:
        return kind in self._kinds.get(name, ())

    def names(self, kind: str) -> set[str]:
        return {name for name, kinds in self._kinds.items() if kind in kinds}


OPS = OpTable()
OPS.update(
    "pointwise",
    """
    clone _to_copy alias detach lift_fresh lift_fresh_copy contiguous _to_dim_order_copy to dropout native_dropout
    masked_fill where copy fill zero clamp clamp_min clamp_max hardtanh hardswish hardsigmoid leaky_relu elu gelu silu
    mish relu sigmoid tanh softplus threshold prelu _prelu_kernel erf round abs neg sign
""".split(),
)
OPS.update(
    "factory",
    """
    arange zeros ones full empty empty_like zeros_like ones_like full_like rand_like randn_like new_zeros new_ones
    new_full new_empty scalar_tensor rand randn randint empty_strided new_empty_strided tensor bernoulli randperm
    linspace tril_indices triu_indices eye
""".split(),
)
OPS.update(
    "view",
    """
    t transpose permute view _unsafe_view reshape expand unsqueeze squeeze _to_copy clone alias detach contiguous slice
    split split_with_sizes unbind select to _to_dim_order_copy lift_fresh
""".split(),
)
OPS.update("test", "_local_scalar_dense equal is_nonzero any all isnan isinf isfinite sym_size".split())
OPS.update(
    "reduction",
    """
    sum mean amax amin max min var std var_mean std_mean logsumexp prod norm linalg_vector_norm argmax argmin nansum
    nanmean count_nonzero median mode
""".split(),
)
OPS.update(
    "along",
    """
    _softmax _log_softmax _safe_softmax softmax log_softmax cumsum cumprod sort topk argsort logcumsumexp cummax cummin
    kthvalue
""".split(),
)
OPS.update(
    "batch_norm",
    """
    native_batch_norm _native_batch_norm_legit_no_training _native_batch_norm_legit _native_batch_norm_legit_functional
    cudnn_batch_norm miopen_batch_norm batch_norm
""".split(),
)
OPS.update(
    "sdpa",
    """
    _scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_efficient_attention
    _scaled_dot_product_flash_attention _scaled_dot_product_cudnn_attention scaled_dot_product_attention
    _scaled_dot_product_attention_math _scaled_dot_product_fused_attention_overrideable
""".split(),
)
