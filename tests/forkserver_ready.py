"""The suite's forkserver imports this last of its preloads (``tests/ranks.py``). It
readies the server for the processes it forks (ranks, and the CLIs, scripts and
launchers of ``tests/train_cli.py``) in two ways.

**Gloo groups live until the process exits.** The preloads include ``torch._dynamo``,
which the first optimizer step of a process imports: about 0.85 CPU-seconds per
training rank otherwise, over hundreds of them in the suite. With ``torch._dynamo``
imported before a gloo group is created, torch 2.13 can deadlock when the group is
destroyed:

- the last reference goes from Python (a DDP module's reducer, freed as a rank's
  function returns);
- the group's destructor joins its worker threads, holding the GIL;
- a worker may still be freeing a finished allreduce whose saved thread-local state
  holds a Python object, so it waits for the GIL.

Forking 2-rank DDP-on-gloo runs from a process that had imported ``torch._dynamo``
reproduces it outside the suite: 12 of 80 ranks hung. With every gloo backend
referenced here, 0 of 300 hung. A forked process ends with ``os._exit`` (a rank or a
forked CLI always does), which runs no destructor; new interpreters, which preload
nothing, run torch unchanged. ``destroy_process_group`` still unregisters a group
from torch; only its C++ object outlives that.

**The heap is frozen.** Everything the server built moves to the garbage collector's
permanent generation. A collection in a forked process then never visits these
objects. Visiting one writes to its header, which copies the page shared with the
server: about 0.2 CPU-seconds for one full collection in a rank without this."""

import gc

import torch.distributed as dist

_GLOO_BACKENDS: list = []

if dist.is_available() and dist.is_gloo_available():
    import torch.distributed.distributed_c10d as c10d

    class _KeptProcessGroupGloo(dist.ProcessGroupGloo):
        """A gloo backend referenced until the process exits (see the docstring)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _GLOO_BACKENDS.append(self)

    # every constructor call looks the name up at call time: torch's own group
    # creation (distributed_c10d) and ferrosync's hierarchical sync (torch.distributed)
    dist.ProcessGroupGloo = c10d.ProcessGroupGloo = _KeptProcessGroupGloo

gc.collect()
gc.freeze()
