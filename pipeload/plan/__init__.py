"""Planning, pure: the state dict's boxes, the local plan, what ranks exchange, the global plan,
the greedy both save and load use, and plan reuse. No I/O, no torch.distributed.
"""
