"""A tiny HF Accelerate run for tests/integrations/test_accelerate.py (not a test itself).

Run on every rank by ``python -m ferrosync.train --nproc 2 --sync DIR accelerate_script.py
BACKEND OUT.pt [MODE]``; the launcher gives each rank torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) and ``FERROSYNC_URL``.

MODE ``preinit`` (the recipe in docs/ddp.md): ``dist.init_process_group(BACKEND)`` first,
then ``Accelerator(cpu=True)``, which adopts the existing group. MODE ``kwargs``:
``Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend=BACKEND)])``,
which Accelerate refuses on CPU for any backend but gloo/mpi (the error is saved). MODE
``preinit-nocpu``: as ``preinit`` but ``Accelerator()``, which on a host without a GPU
ignores the group (``DistributedType.NO``; each rank trains alone).

Every rank saves its final parameters, losses and what Accelerate reports to
``OUT.pt.rank<R>``.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import ferrosync  # noqa: F401  registers the "ferrosync" backend

warnings.filterwarnings("ignore")

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import InitProcessGroupKwargs, set_seed  # noqa: E402

STEPS = 4
BATCH = 4


def main() -> None:
    backend, out = sys.argv[1], sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else "preinit"
    rank = int(os.environ["RANK"])
    if mode == "preinit":
        dist.init_process_group(backend)  # env:// from the launcher; data to $FERROSYNC_URL
        accelerator = Accelerator(cpu=True)
    elif mode == "preinit-nocpu":
        dist.init_process_group(backend)
        accelerator = Accelerator()
    else:
        try:
            accelerator = Accelerator(
                cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend=backend)])
        except Exception as e:  # noqa: BLE001  the refusal is the result
            torch.save({"error": f"{type(e).__name__}: {e}"}, f"{out}.rank{rank}")
            return
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * BATCH * STEPS, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    data = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt, data = accelerator.prepare(model, opt, data)
    losses = []
    for xb, yb in data:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), reduction="mean")))
    gathered = accelerator.gather(torch.tensor([float(rank)]))
    state = accelerator.state
    torch.save({
        "pg_backend": dist.get_backend(),
        "accelerate_backend": state.backend,
        "distributed_type": str(state.distributed_type),
        "num_processes": state.num_processes,
        "process_index": state.process_index,
        "ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel),
        "batches": len(losses),
        "losses": losses,
        "gathered": gathered.tolist(),
        "params": {k: v.detach().clone()
                   for k, v in accelerator.unwrap_model(model).state_dict().items()},
    }, f"{out}.rank{rank}")
    # drop DDP (it holds the group) before destroying the group: a gloo group still
    # referenced at interpreter exit can abort the process (SIGABRT, "terminate called
    # without an active exception"; pytorch/pytorch#179291)
    del model, opt, data
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
