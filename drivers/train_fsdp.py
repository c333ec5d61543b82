#!/usr/bin/env python
"""An FSDP2 script whose shards spar_comm reduces between nodes (HSDP): the
GPT of ``spar_comm.workloads`` sharded with ``fully_shard`` across each
node, replicated across nodes. The lines marked ``# spar_comm`` are the
whole change from torch's own HSDP (``--algorithm native``, the same mesh).

    SPAR_COMM_RANKS_PER_NODE=2 torchrun --nproc-per-node 4 drivers/train_fsdp.py              # 2 emulated nodes of 2
    SPAR_COMM_RANKS_PER_NODE=2 torchrun --nproc-per-node 4 drivers/train_fsdp.py --algorithm native
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        drivers/train_fsdp.py --algorithm topka --density 0.01 --values int8                  # on each host

Nodes are torchrun's (``GROUP_RANK``), or emulated blocks of
``SPAR_COMM_RANKS_PER_NODE`` ranks on one host. Each rank draws its own
batches. At the end every rank compares its parameter shards with those of
the rank that holds the same shard on the first node.
"""
import argparse
import hashlib
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import spar_comm.torch as sct                                                        # spar_comm
from spar_comm.workloads.command_line import add_gpt_arguments, gpt_config
from spar_comm.workloads.gpt import gpt, random_batch, stdlib_text, validation_batches


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithm", default="topka",
                        help="between nodes: dense, topka, gtopk, auto, or native (torch's own HSDP) "
                             "(default: %(default)s)")
    parser.add_argument("--density", type=float, default=0.01, help="fraction sent (default: %(default)s)")
    parser.add_argument("--values", help="value codec between nodes (int8, fp16, bf16)")
    parser.add_argument("--steps", type=int, default=100, help="(default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="per rank (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    add_gpt_arguments(parser)
    parser.set_defaults(layers=2, width=64, heads=4, context=64)
    args = parser.parse_args()
    config = gpt_config(parser, args)
    torch.set_num_threads(1)

    sct.init_process_group("gloo")                         # from torchrun's or MPI's launch # spar_comm
    mesh = sct.node_mesh()                                 # ("rep", "shard"): a row a node # spar_comm
    native = args.algorithm == "native"
    model = gpt(config, args.seed)
    for module in [*model.blocks, model]:
        fully_shard(module, mesh=mesh if native else mesh["shard"])
    if not native:
        sct.hsdp_hook(model, args.algorithm, args.density, mesh=mesh, values=args.values)  # spar_comm
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = mesh.mesh.tolist()
    if rank == 0:
        print(f"world {world}: {len(nodes)} nodes of {len(nodes[0])} ranks {nodes}; between nodes: "
              f"{'torch HSDP (dense all-reduce)' if native else args.algorithm}"
              f"{'' if args.algorithm in ('native', 'dense') else f' at density {args.density}'}",
              flush=True)
    train, validation = stdlib_text()
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    started = time.perf_counter()
    for step in range(args.steps):
        x, y = random_batch(train, args.batch_size, args.context, generator)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1:4d}  loss {loss.item():.4f}  {time.perf_counter() - started:.1f} s", flush=True)
    with torch.no_grad():
        losses = [model(x, y).item() for x, y in validation_batches(validation, 4, args.batch_size, args.context)]
    if rank == 0:
        print(f"validation loss {sum(losses) / len(losses):.4f}", flush=True)

    differ = replicas_that_differ(model, mesh)
    if rank == 0:
        print(f"parameters identical on all {world} ranks" if not differ else
              f"parameters differ from the first node's on ranks {differ}", flush=True)
    sct.destroy_process_group()                                                      # spar_comm
    return 1 if differ else 0


def replicas_that_differ(model: torch.nn.Module, mesh) -> list:
    """The ranks whose parameter shards are not those of the rank holding the
    same shard on the first node, known to every rank."""
    model.reshard()  # the root keeps its parameters gathered after a forward
    mine = hashlib.sha256(b"".join(p.to_local().detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    replicas = mesh["rep"]
    digests = [None] * replicas.size()
    dist.all_gather_object(digests, mine, group=replicas.get_group())
    differ = [None] * dist.get_world_size()
    dist.all_gather_object(differ, mine != digests[0])
    return [r for r, bad in enumerate(differ) if bad]


if __name__ == "__main__":
    sys.exit(main())
