"""Communicators: issue the communication for each group of a plan once the group is ready.

``reference`` runs a plan group by group with ``torch.matmul`` and blocking collectives, on any device (it is the
executable specification and the CPU test oracle); ``nccl`` waits on the GEMM's counters with zero-SM stream waits
and issues ``torch.distributed`` collectives per group on a high-priority stream.
"""
