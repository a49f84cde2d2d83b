"""Collectives on inference tensors (Lightning's test loop runs under
``torch.inference_mode()``): the collective runs outside inference mode on normal
stand-ins and the results are copied back inside it, so every collective works on
inference tensors, on the overlapped path's library thread too, as with gloo."""

from __future__ import annotations

import torch

from ferrosync.ddp.work import Done

__all__ = ["StandIns", "inference_safe", "needs_stand_ins"]


def needs_stand_ins(args) -> bool:
    """Whether a collective's arguments need ``StandIns``: the caller is in inference
    mode, or passes an inference tensor."""
    if torch.is_inference_mode_enabled():
        return True
    return any(t.is_inference() for t in _tensors_in(args))


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


class StandIns:
    """Normal tensors standing in for a collective's inference tensors.

    Inference mode is per thread, and an inference tensor may be changed in place only
    inside it: the overlapped allreduce runs on a library thread (never in inference
    mode), and the GradSync's pooled buffers must not be created as inference tensors
    (a later collective outside inference mode could not reuse them). So the
    collective always runs outside inference mode on stand-ins: each inference tensor
    is cloned (a normal tensor), and ``restore`` copies the results back inside
    inference mode, on whichever thread finishes the collective. Tensors that are not
    inference tensors are used as they are, as with gloo.
    """

    def __init__(self, args) -> None:
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.inference_mode(False):
            self.args = self._swap(args)

    def _swap(self, value):
        if isinstance(value, torch.Tensor):
            if not value.is_inference():
                return value
            stand = value.clone()
            self._pairs.append((value, stand))
            return stand
        if isinstance(value, list):
            return [self._swap(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self._swap(v) for v in value)
        return value

    def restore(self) -> None:
        if self._pairs:
            with torch.inference_mode(), torch.no_grad():
                for original, stand in self._pairs:
                    original.copy_(stand)

    def original(self, value):
        """``value`` (a result built from the stand-ins) with the originals back."""
        back = {id(stand): original for original, stand in self._pairs}
        if isinstance(value, torch.Tensor):
            return back.get(id(value), value)
        if isinstance(value, (list, tuple)):
            return type(value)(self.original(v) for v in value)
        return value


def inference_safe(method):
    """Run a synchronous collective method outside inference mode on ``StandIns``
    when the caller is in inference mode or passes inference tensors (see there)."""
    def wrapper(self, *args, **kwargs):
        if not needs_stand_ins(args):
            return method(self, *args, **kwargs)
        stand_ins = StandIns(args)
        with torch.inference_mode(False):
            work = method(self, *stand_ins.args, **kwargs)
        stand_ins.restore()
        return Done(stand_ins.original(work.result()))

    wrapper.__name__, wrapper.__doc__ = method.__name__, method.__doc__
    wrapper.__qualname__ = method.__qualname__
    return wrapper
