"""examples/ddp_train.py: the same script on gloo, the ferrosync backend and the hook.

The example's ``train(rank, world_size, args)`` runs on real processes (one per
rank) exactly as ``mp.spawn`` would call it; the three transports must end with
the same weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

import torch

from ranks import run_ranks

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "ddp_train.py")


def load_example():
    spec = importlib.util.spec_from_file_location("ddp_train_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_trains_identically_three_ways(tmp_path):
    example = load_example()
    states = {}
    for transport in ("gloo", "ferrosync", "hook"):
        location = tmp_path / transport
        location.mkdir()
        save = str(tmp_path / f"final.{transport}")
        args = argparse.Namespace(transport=transport, location=str(location), epochs=1,
                                  batch_size=32, lr=0.05, seed=0, save=save)
        run_ranks(example.train, 2, args)
        states[transport] = [torch.load(f"{save}.rank{r}.pt", weights_only=True)
                             for r in range(2)]
    for transport in ("ferrosync", "hook"):
        for rank in range(2):
            for key, ref in states["gloo"][rank].items():
                torch.testing.assert_close(states[transport][rank][key], ref, rtol=1e-5,
                                           atol=1e-6,
                                           msg=lambda m, k=key, t=transport: f"{t} {k}: {m}")
    torch.manual_seed(0)  # the example's initial weights: training must have moved them
    initial = example.make_model()[0].weight
    assert not torch.allclose(states["gloo"][0]["0.weight"], initial, atol=1e-3)
