"""A tiny Lightning run for tests/integrations/test_lightning.py (not a test itself).

``python lightning_script.py BACKEND OUT.pt``: ``Trainer(accelerator="cpu", devices=2,
strategy=DDPStrategy(process_group_backend=BACKEND))`` trains a linear model for a few
steps, logging with ``sync_dist=True``, then tests it (``trainer.test``: Lightning's
test loop runs under ``torch.inference_mode()``); every rank saves its final
parameters and the values it logged to ``OUT.pt.rank<R>``. Lightning's subprocess
launcher starts rank 1 by rerunning this script. For ``BACKEND="ferrosync"`` the data goes to
``$FERROSYNC_URL`` (Lightning initialises with ``env://`` and its own TCP store).
"""

from __future__ import annotations

import gc
import sys
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

import ferrosync  # noqa: F401  registers the "ferrosync" backend (also in Lightning's child)

warnings.filterwarnings("ignore")  # Lightning's advice on num_workers, logging, ...

import lightning as L  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

STEPS = 4
BATCH = 4


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))
        self.logged: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        # sync_dist=True: a float AVG all_reduce of the loss, and at epoch end Lightning's
        # int64 batch-size counter goes through an all_reduce too
        self.log("loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        return loss

    def test_step(self, batch, batch_idx):
        # trainer.test() runs under torch.inference_mode(): the all_reduce of sync_dist
        # gets inference tensors (on the ferrosync backend, on its overlapped path)
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.logged.append(float(self.trainer.callback_metrics["loss_step"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


#: (dtype, op) of every torch.distributed.all_reduce (Lightning's _sync_ddp calls it by
#: attribute), to show which reductions Lightning sent
CALLS: list[tuple[str, str]] = []
_all_reduce = torch.distributed.all_reduce


def _recording_all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, *args, **kwargs):
    CALLS.append((str(tensor.dtype), str(op).rsplit(".", 1)[-1]))
    return _all_reduce(tensor, op, *args, **kwargs)


def main() -> None:
    backend, out = sys.argv[1], sys.argv[2]
    torch.distributed.all_reduce = _recording_all_reduce
    g = torch.Generator().manual_seed(1)
    n = 2 * BATCH * STEPS
    x = torch.randn(n, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    data = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    model = Tiny()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend=backend),
        max_epochs=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        deterministic=True)
    trainer.fit(model, data)
    fit_calls = len(CALLS)
    epoch_loss = float(trainer.callback_metrics["loss_epoch"])  # test() resets the metrics
    # then test, as users do: Lightning's test loop runs in inference mode
    tested = trainer.test(model, data, verbose=False)
    rank = trainer.global_rank
    assert trainer.world_size == 2, trainer.world_size
    pg = torch.distributed.group.WORLD
    torch.save({
        "backend": torch.distributed.get_backend(pg),
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "logged": model.logged,
        "epoch_loss": epoch_loss,
        "steps": trainer.global_step,
        "all_reduce": CALLS[:fit_calls],
        "test_all_reduce": CALLS[fit_calls:],
        "test_loss": tested[0]["test_loss"],
        "lightning": L.__version__,
    }, f"{out}.rank{rank}")
    # Lightning leaves the group alive; a gloo group still referenced at interpreter
    # exit can abort the process (SIGABRT, "terminate called without an active
    # exception"; pytorch/pytorch#179291), which Lightning's launcher does not report
    del trainer, model
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
