"""gloo and NCCL through torch.distributed, and the two-level sync."""
