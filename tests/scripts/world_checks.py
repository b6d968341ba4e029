"""Checks of ReplicaWorld's collectives, run under ``torchrun --nproc_per_node 2``; prints OK on success."""

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn

from hf_sms import SparseSoupConfig, SparseSoupTrainer, compute_masks
from hf_sms.data import TensorDictDataset
from hf_sms.loop.distributed import ReplicaWorld
from hf_sms.soup.soup import average_state_dicts

torch.set_num_threads(1)
mode = sys.argv[1]
world = ReplicaWorld(num_replicas=2 if mode == "replicas" else 1, cpu=True)
rank = world.rank


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 4, 3), nn.Linear(4 * 6 * 6, 10)

    def forward(self, x):  # batch keys are forward's argument names, as with timm models
        return self.fc(self.conv(x).flatten(1))


def net(seed):
    torch.manual_seed(seed)
    return Net()


if mode == "replicas":  # 2 processes, m = 2: one replica each
    assert (world.size, world.group_size, world.owned(2), world.owned(5)) == (2, 1, [rank], list(range(rank, 5, 2)))
    # Masks from differently seeded models differ; after the broadcast every rank holds rank 0's.
    mine = compute_masks(net(seed=rank), 0.7)
    synced = world.broadcast_masks(mine)
    everyone = [None, None]
    dist.all_gather_object(everyone, synced)
    assert all(torch.equal(everyone[0][k], everyone[1][k]) for k in mine)
    assert all(torch.equal(everyone[0][k], compute_masks(net(seed=0), 0.7)[k]) for k in mine)
    # The all-reduced mean equals the sequential mean of both replicas.
    models = [net(seed=10), net(seed=11)]
    soup = world.average({rank: models[rank].state_dict()}, [0.5, 0.5], models[0].state_dict())
    expected = average_state_dicts([m.state_dict() for m in models])
    assert all(torch.allclose(soup[k], expected[k], atol=1e-7, rtol=0) for k in soup)
    assert world.gather({rank: f"score{rank}"}) == {0: "score0", 1: "score1"}
    d = world.pairwise_l2({rank: models[rank]}, 2, models[0])
    flat = [torch.cat([p.detach().reshape(-1).double() for p in m.parameters()]) for m in models]
    assert abs(d[0] - float((flat[0] - flat[1]).norm())) < 1e-9
    # Every replica starts from rank 0's model, even where the processes built different ones; the user's
    # object is left alone.
    built = net(seed=rank)
    before = copy.deepcopy(built.state_dict())
    start = world.broadcast_model(built)
    assert all(torch.equal(start.state_dict()[k], net(seed=0).state_dict()[k]) for k in before)
    assert all(torch.equal(built.state_dict()[k], before[k]) for k in before)
    assert (start is built) == (rank == 0)
    assert world.broadcast_model(start) is start  # agreeing models are not copied
elif mode == "group":  # 2 processes, m = 1: the replica is data-parallel over a group of two
    assert (world.group_size, world.n_groups, world.owned(1)) == (2, 1, [0]) and world.subgroup is not None
    x, y = torch.randn(64, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(64) % 10
    model = net(seed=0)
    start = copy.deepcopy(model)
    args = SparseSoupConfig(
        output_dir=sys.argv[2],
        max_steps=5,
        per_device_train_batch_size=8,
        learning_rate=0.1,
        optim="sgd",
        use_cpu=True,
        disable_tqdm=True,
        target_sparsity=0.5,
    )
    trainer = SparseSoupTrainer(model, args, train_dataset=TensorDictDataset(x, y), process_group=world.subgroup)
    trainer.train()
    params = [None, None]
    dist.all_gather_object(params, [p.detach() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params)), "group members diverged"
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), start.parameters())), "nothing trained"
    assert len(trainer.get_train_dataloader()) == 64 // (8 * 2)  # each rank sees half the data
    # The group shares its replica's ensemble predictions: each predicts its batches, both get all, in order.
    from hf_sms.evaluation import ClassificationAccuracy, SubgroupRecall
    from hf_sms.evaluation.sharded import predict_shared

    items = [{"x": x[i], "labels": y[i]} for i in range(37)]
    grouped = [{**item, "group": i % 3} for i, item in enumerate(items)]
    for metric, data in ((ClassificationAccuracy(batch_size=8), items), (SubgroupRecall(batch_size=8), grouped)):
        probs, targets = predict_shared(metric, model, data, world.group)
        alone = metric.predict_targets(model, data)
        assert torch.equal(probs, alone[0]) and str(targets) == str(alone[1]), type(metric).__name__
        assert metric.score_targets(probs, targets) == metric.score_targets(*alone)
print("OK", rank, flush=True)
