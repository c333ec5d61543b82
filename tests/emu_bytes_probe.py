"""Run under the emulated cluster by tests/test_emucluster.py: a few allreduces,
then rank 0 prints what the package says crossed nodes, as JSON."""
import json
import sys

import numpy as np

from spar_comm import Topology, make_allreducer

algorithm, size, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
topology = Topology()  # no emulation: the hosts must be found by shared memory
reducer = make_allreducer(algorithm, topology, size, "float32", density=0.01, selector="exact")
grad = np.ones(size, np.float32)
inter = 0
for _ in range(calls):
    reducer.allreduce(grad)
    inter += reducer.last["bytes_inter"]
total = topology.world.allreduce(inter)
hosts = sorted(set(topology.hosts))
if topology.world.rank == 0:
    print(json.dumps({"bytes_inter": total, "num_nodes": topology.num_nodes, "hosts": hosts}))
