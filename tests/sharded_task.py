"""The task of the FSDP2 replica test (tests/test_sharding.py, tests/scripts/fsdp_replicas.py): one definition for
the sharded processes and the one-process reference."""

import torch
from torch import nn

from hf_sms import apply_masks, compute_masks
from hf_sms.seeding import derive_seed

REPLICAS, STEPS, BATCH = 2, 4, 8
OPTIMS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=5e-2, momentum=0.9, weight_decay=1e-3),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-2),  # not in KEEPS_ZEROS: masked after each step
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def build() -> Net:
    return Net()


def pruned_start():
    torch.manual_seed(0)
    model = build()
    masks = compute_masks(model, 0.7)
    return apply_masks(model, masks), masks


def batch(replica: int, step: int):
    g = torch.Generator().manual_seed(derive_seed(0, "fsdp", replica, step))
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)
