#!/usr/bin/env python
"""A plain PyTorch script (an nn.Module, a DataLoader over the digits data,
torch.optim.SGD) made data-parallel by spar_comm: the lines marked
``# spar_comm`` are the whole change.

    mpiexec -n 4 python drivers/train_torch.py
    mpiexec -n 4 python drivers/train_torch.py --algorithm dense
    mpiexec -n 2 python drivers/train_torch.py --device cuda --hidden 4096   # 17M parameters on the GPUs

``--device gpu-simulator`` runs the optimizer's GPU path on CPU tensors under
numba-cuda's simulator (NUMBA_ENABLE_CUDASIM=1), for tests. The last line
gives the bytes the last step copied between GPU and host (``bytes_staged``:
0 on the CPU, or with a CUDA-aware MPI).
"""
import argparse
import time

import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import spar_comm.torch as sct                                                        # spar_comm
from spar_comm import Topology, retain_freed_memory
from spar_comm.workloads.digits import digits
from spar_comm.workloads.mlp import mlp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithm", default="hitopk", help="gradient allreduce (default: %(default)s)")
    parser.add_argument("--density", type=float, default=0.01, help="fraction of gradients sent (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=20, help="(default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.05, help="(default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=128, help="width of the two hidden layers (default: %(default)s)")
    parser.add_argument("--device", choices=["cpu", "cuda", "gpu-simulator"], default="cpu",
                        help="cuda: this rank's GPU (default: %(default)s)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    torch.set_num_threads(1)
    retain_freed_memory()  # a CPU step reuses its freed tensors instead of page-faulting new ones
    device = sct.local_device() if args.device == "cuda" else torch.device("cpu")  # spar_comm
    topology = Topology(device="gpu-simulator") if args.device == "gpu-simulator" else None

    train_x, train_y, test_x, test_y = digits(device)  # the same split on every rank
    train = TensorDataset(train_x, train_y)
    sampler = DistributedSampler(train, num_replicas=sct.size(), rank=sct.rank())    # spar_comm
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = mlp(64, args.hidden, layers=1).to(device)  # two hidden layers
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sct.broadcast_parameters(model)                                                  # spar_comm
    optimizer = sct.DistributedOptimizer(optimizer, model.named_parameters(),        # spar_comm
                                         algorithm=args.algorithm, density=args.density, topology=topology)

    started = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)                                                     # spar_comm
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
        if sct.rank() == 0:                                                          # spar_comm
            print(f"epoch {epoch + 1:3d}  loss {loss.item():.4f}  held-out accuracy {accuracy:.4f}", flush=True)
    staged = sum(bucket.reducer.last["bytes_staged"] for bucket in optimizer.buckets)
    if sct.rank() == 0:
        parameters = sum(p.numel() for p in model.parameters())
        print(f"done: {parameters} parameters on {device}, {len(optimizer.buckets)} buckets, "
              f"{time.perf_counter() - started:.1f} s, bytes_staged {staged} in the last step "
              f"(the gradient is {4 * parameters} bytes)", flush=True)


if __name__ == "__main__":
    main()
