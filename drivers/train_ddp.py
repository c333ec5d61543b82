#!/usr/bin/env python
"""A plain DistributedDataParallel script whose gradients spar_comm reduces:
the lines marked ``# spar_comm`` are the whole change (torch.distributed
started from whichever launcher ran the script, and the communication hook,
which reduces over torch.distributed's group); two more lines, marked
``# spar_comm checkpoint``, save and resume on any number of ranks.

    torchrun --nproc-per-node 4 drivers/train_ddp.py
    mpiexec -n 4 python drivers/train_ddp.py
    mpiexec -n 2 python drivers/train_ddp.py --device cuda --algorithm hitopk --density 0.001
    torchrun --nproc-per-node 8 drivers/train_ddp.py --device cuda --backend nccl   # one rank a GPU (run at 1 so far)
    torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 2 --rdzv-backend c10d \
        --rdzv-endpoint HOST0:29400 drivers/train_ddp.py --checkpoint ckpt      # on each host

At the end every rank checks that its parameters are rank 0's, bit for bit.

``--checkpoint DIR`` saves the model, the optimizer, the hook's residuals and
the position in the data every ``--checkpoint-every`` steps
(``spar_comm.torch.save_checkpoint``: a new folder, committed last), and a
run that finds a committed save there resumes from it
(``load_checkpoint``), on this number of ranks whatever number saved it: so
an elastic torchrun that lost a host restarts on the hosts left and goes on.
The data order is the new world's from the saved epoch's position. A run
resumed from its last step (a worker that died at exit, after its work)
has nothing left to train, and ends as it would have.

``--device gpu-simulator`` runs the hook's GPU path on CPU tensors under
numba-cuda's simulator (NUMBA_ENABLE_CUDASIM=1), for tests. The last line
gives the bytes the last step copied between GPU and host (``bytes_staged``).
"""
import argparse
import hashlib
import time

import torch
import torch.distributed.checkpoint.state_dict as dcp_state
from torch.nn.parallel import DistributedDataParallel as DDP
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
    parser.add_argument("--bucket-cap-mb", type=float, default=0.05, help="DDP's bucket size (default: %(default)s)")
    parser.add_argument("--device", choices=["cpu", "cuda", "gpu-simulator"], default="cpu",
                        help="cuda: this rank's GPU (default: %(default)s)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                        help="torch.distributed's backend; nccl takes the CUDA buckets as they are, one rank a GPU "
                             "(default: %(default)s)")
    parser.add_argument("--checkpoint", metavar="DIR", help="save here, and resume from here when a save is there")
    parser.add_argument("--checkpoint-every", type=int, default=20, metavar="STEPS",
                        help="steps between saves (default: %(default)s)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda")
    torch.set_num_threads(1)
    retain_freed_memory()  # a CPU step reuses its freed tensors instead of page-faulting new ones
    sct.init_process_group(args.backend)                # from torchrun's or MPI's launch # spar_comm
    device = sct.local_device() if args.device == "cuda" else torch.device("cpu")    # spar_comm
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the first NCCL collective
    topology = Topology(device="gpu-simulator") if args.device == "gpu-simulator" else None

    train_x, train_y, test_x, test_y = digits(device)  # the same split on every rank
    train = TensorDataset(train_x, train_y)
    sampler = DistributedSampler(train)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = mlp(64, 128, layers=1).to(device)  # two hidden layers
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    hook_state, hook = sct.comm_hook(args.algorithm, args.density, topology=topology)  # spar_comm
    ddp.register_comm_hook(hook_state, hook)                                         # spar_comm
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    world = torch.distributed.get_world_size()
    if torch.distributed.get_rank() == 0:
        print(f"world size {world}", flush=True)
    progress = {"step": 0, "epoch": 0, "batch": 0, "world_size": world}
    saved = {"train": Trainer(ddp, optimizer), "hook": hook_state, "progress": progress}
    if args.checkpoint:
        resumed = sct.load_checkpoint(saved, args.checkpoint)             # spar_comm checkpoint
        if resumed is not None:
            progress = saved["progress"]
            if torch.distributed.get_rank() == 0:
                print(resumed, flush=True)
    step, first_epoch = progress["step"], progress["epoch"]
    skip = progress["batch"] * progress["world_size"] // world  # the samples the saved epoch had used
    started = time.perf_counter()
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        loss = None  # until a step of this epoch ran
        for batch, (xb, yb) in enumerate(loader):
            if epoch == first_epoch and batch < skip:
                continue
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
            loss.backward()
            optimizer.step()
            step += 1
            if args.checkpoint and step % args.checkpoint_every == 0:
                saved["progress"] = {"step": step, "epoch": epoch, "batch": batch + 1, "world_size": world}
                sct.save_checkpoint(saved, args.checkpoint, step)         # spar_comm checkpoint
        with torch.no_grad():
            accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
        if torch.distributed.get_rank() == 0 and loss is not None:
            print(f"epoch {epoch + 1:3d}  loss {loss.item():.4f}  held-out accuracy {accuracy:.4f}", flush=True)
    staged = sum(bucket.reducer.last["bytes_staged"] for bucket in hook_state.buckets.values())
    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
    digests = [None] * world
    torch.distributed.all_gather_object(digests, digest)
    if digest != digests[0]:
        raise SystemExit(f"rank {torch.distributed.get_rank()}: parameters differ from rank 0's")
    if torch.distributed.get_rank() == 0:
        print(f"done: DDP on {device}, {len(hook_state.buckets)} buckets, {time.perf_counter() - started:.1f} s, "
              f"bytes_staged {staged} in the last step; parameters identical on all {world} ranks "
              f"(sha256 {digest[:16]})", flush=True)
    sct.destroy_process_group()           # torch's, once gloo's workers let go    # spar_comm


class Trainer:
    """The model's and the optimizer's state for torch.distributed.checkpoint,
    through torch's own helpers (they strip DDP's prefix, and give a fresh SGD
    its momentum to load into)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model, optimizer = dcp_state.get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict) -> None:
        dcp_state.set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                                 optim_state_dict=state["optimizer"])


if __name__ == "__main__":
    main()
