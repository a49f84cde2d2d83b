"""Transports behind ``GradSync``: ``files`` (directories, object stores) and
``torchdist`` (NCCL / gloo). Each is registered (class, options, URL schemes) in
``ferrosync.registry``."""
