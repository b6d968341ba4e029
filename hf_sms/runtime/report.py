"""What the sparse runtime did with each layer, and the whole model's measured timing (``model.hf_sms_runtime``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class LayerChoice:
    """What the runtime did with one prunable layer, and why."""

    name: str
    kind: str  # "linear" | "conv1x1" | "conv" | "embedding"
    shape: tuple[int, ...]
    sparsity: float
    layout: str = "dense"  # what runs now: "csr" | "semi_structured" | "dense"
    reason: str = ""
    dense_ms: float | None = None
    sparse_ms: float | None = None


@dataclass
class RuntimeReport:
    """The per-layer decisions of :func:`to_sparse_runtime` and the whole model's timing on the sample."""

    layout: str
    device: str
    threads: int
    layers: list[LayerChoice] = field(default_factory=list)
    dense_ms: float | None = None  # the whole model on the sample input, dense
    runtime_ms: float | None = None  # and with the runtime's layers
    speedup_range: list[float] | None = None  # lowest and highest dense / runtime of one interleaved round
    repeats: int | None = None  # interleaved rounds behind the medians

    @property
    def speedup(self) -> float | None:
        """Measured dense / runtime latency on the sample input, or ``None`` if not measured."""
        return self.dense_ms / self.runtime_ms if self.dense_ms and self.runtime_ms else None

    @property
    def sparse_layers(self) -> list[LayerChoice]:
        return [c for c in self.layers if c.layout != "dense"]

    def to_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}

    def table(self) -> str:
        """A markdown table of every layer's decision, then the whole model's measured speedup."""
        lines = ["| layer | kind | shape | sparsity | runs as | dense ms | sparse ms | why |", "|---" * 8 + "|"]
        for c in self.layers:
            ms = [f"{v:.3f}" if v is not None else "-" for v in (c.dense_ms, c.sparse_ms)]
            lines.append(
                f"| {c.name} | {c.kind} | {'x'.join(map(str, c.shape))} | {c.sparsity:.1%} | {c.layout} | "
                f"{ms[0]} | {ms[1]} | {c.reason} |"
            )
        speed = f"{self.speedup:.2f}x" if self.speedup else "not measured"
        lines.append(
            f"\n{len(self.sparse_layers)} of {len(self.layers)} prunable layers sparse; whole model on the sample: "
            f"{speed} ({self.device}, {self.threads} threads)"
        )
        return "\n".join(lines)
