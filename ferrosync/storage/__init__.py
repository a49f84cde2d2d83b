"""The storage backend: collectives through a shared directory or object store."""
