"""Nested state (``state_dict()`` of a model, optimizer or strategy) as named tensors
plus a JSON skeleton, and back.

An elastic job hands its training state to joiners through the store
(``ElasticSync.publish_state`` / ``read_state``), which carries tensors and a small
JSON dict, never pickles. ``flatten`` turns a tree of dicts, lists, tuples, tensors
and JSON scalars into ``({name: tensor}, skeleton)``; ``unflatten`` rebuilds the
tree. Dict keys keep their type (an optimizer's state is keyed by int), which a
plain JSON object would lose, so dicts are stored as lists of ``[key, value]`` pairs.
"""

from __future__ import annotations

import math

import torch

__all__ = ["flatten", "unflatten"]

_SCALARS = (str, int, float, bool, type(None))


def flatten(tree, prefix: str) -> tuple[dict[str, torch.Tensor], object]:
    """``({name: tensor}, skeleton)``; names start with ``prefix`` and are unique."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node, path: str):
        if isinstance(node, torch.Tensor):
            tensors[path] = node.detach()
            return {"t": path}
        if isinstance(node, dict):
            for key in node:
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise TypeError(f"{path}: key {key!r} is neither str nor int")
            return {"d": [[k, walk(v, f"{path}.{k}")] for k, v in node.items()]}
        if isinstance(node, (list, tuple)):
            kind = "l" if isinstance(node, list) else "u"
            return {kind: [walk(v, f"{path}.{i}") for i, v in enumerate(node)]}
        if isinstance(node, _SCALARS):
            if isinstance(node, float) and not math.isfinite(node):
                return {"f": repr(node)}  # JSON has no inf/nan
            return {"v": node}
        raise TypeError(f"{path}: a {type(node).__name__} cannot be handed to a joiner "
                        "(tensors, numbers, strings, lists and dicts only)")

    return tensors, walk(tree, prefix)


def unflatten(skeleton, tensors: dict[str, torch.Tensor]):
    """The tree ``flatten`` described; ``KeyError``/``ValueError`` on a bad skeleton."""
    if not isinstance(skeleton, dict) or len(skeleton) != 1:
        raise ValueError(f"not a state skeleton node: {skeleton!r:.80}")
    (kind, value), = skeleton.items()
    if kind == "t":
        return tensors[value]
    if kind == "d":
        return {k: unflatten(v, tensors) for k, v in value}
    if kind == "l":
        return [unflatten(v, tensors) for v in value]
    if kind == "u":
        return tuple(unflatten(v, tensors) for v in value)
    if kind == "f":
        if value not in ("inf", "-inf", "nan"):
            raise ValueError(f"not a non-finite float: {value!r}")
        return float(value)
    if kind == "v" and isinstance(value, _SCALARS):
        return value
    raise ValueError(f"unknown state skeleton node {kind!r}")
