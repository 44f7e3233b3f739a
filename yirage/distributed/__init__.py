"""Multi-rank (tensor-parallel) decode on torch.distributed: the foundations of issue 14.

yirage brings no transport of its own: ranks talk through torch.distributed
(gloo on CPU, NCCL on CUDA, the vendors' HCCL/CNCL/MCCL where installed),
launched by ``torchrun`` or ``mpirun``. The modules are small and import
torch only inside their functions, so ``import yirage`` stays light:

- ``world``: who am I (rank, world size) from arguments or the launcher's
  environment, and ``init_world`` (the process group, with a timeout).
- ``sharding``: the tensor-parallel split of a Llama model and loaders that read
  only a rank's slices of safetensors / GGUF files.
- ``collectives``: the all-reduce, all-gather and distributed argmax the decode
  step calls between layers, with errors that name the rank and the layer.
- ``reference_tp``: a torch decode step over one rank's shards: the oracle for the
  fused PersistentKernel runtime. See docs/distributed.md.
"""

from __future__ import annotations

from yirage.distributed.world import DistributedError, World, init_world, resolve_world, shutdown_world

__all__ = ["DistributedError", "World", "init_world", "resolve_world", "shutdown_world"]
