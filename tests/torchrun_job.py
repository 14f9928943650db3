"""Run by tests/test_api.py under torchrun: gpunet.init() bootstraps from torchrun's environment
(no process group made by hand), puts to the next rank and checks what arrived."""
import torch

import gpunet

with gpunet.init(heap_bytes=2 << 20, timeout_s=20.0) as ctx:
    x = ctx.alloc((256,), torch.int32)
    y = ctx.alloc((256,), torch.int32)
    x[:] = ctx.rank * 1000 + torch.arange(256, dtype=torch.int32)
    gpunet.barrier()
    gpunet.put(ctx.remote((ctx.rank + 1) % ctx.world_size, y), x)
    gpunet.quiet()
    gpunet.barrier()
    prev = (ctx.rank - 1) % ctx.world_size
    assert torch.equal(y, prev * 1000 + torch.arange(256, dtype=torch.int32)), y
    print("torchrun rank %d of %d OK" % (ctx.rank, ctx.world_size), flush=True)
