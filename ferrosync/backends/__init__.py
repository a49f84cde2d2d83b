"""Transports behind ``GradSync``: ``files`` (directories, object stores) and
``torchdist`` (NCCL / gloo). Chosen by URL scheme in ``ferrosync.registry``."""
