"""Peer-mapped workspaces for the P2P path: PyTorch symmetric memory (CUDA backend, never multicast), one
workspace per (process group, device), and the check of whether the P2P path can apply to a group at all.

A workspace is allocated and rendezvoused collectively (every rank of the group, the same size: true because
every op call is collective with the same shapes), grown by powers of two and then reused, never inside a
CUDA-graph capture. Every rank's buffer is mapped into every other rank's address space: ``peer_ptr(r)`` is the
device address of rank r's data region as seen from this device, so a copy engine can pull from it. Each buffer
starts with ``FLAG_SLOTS`` int32 flags (zeroed at allocation, before a barrier) that peers may set with stream
memory operations or 4-byte copies (``flag_ptr``), then the data region. ``barrier`` is a cross-rank barrier on
the workspace's signal pad, ordered on the current stream.

Ranks that share one GPU (W processes on one device: how W = 4 and 8 run before eight GPUs), or a group whose backend
is not NCCL: PyTorch's symmetric memory refuses them, and CUDA IPC does not. There the buffers come from the caching
allocator and are exchanged as IPC handles over the group (``torch.multiprocessing``'s CUDA tensor reduction, through
``all_gather_object``: any backend, gloo included), and the barrier is the host's (a device synchronisation, then the
group's barrier), used only when a buffer is made or freed. The choice (``peer_mapping``) is made once per workspace,
collectively, at its first allocation: every rank reports its host, its GPU's UUID and the group's backend.
"""

from __future__ import annotations

import functools
import socket

import torch
import torch.distributed as dist

from flashoverlap import guards

MIN_BYTES = 1 << 20
FLAG_SLOTS = 16384  # int32 flags at the start of every buffer: up to groups * world_size of them per call
FLAG_BYTES = 4 * FLAG_SLOTS


def size_class(nbytes: int) -> int:
    """The allocation for a request of ``nbytes``: the next power of two, at least ``MIN_BYTES``."""
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    return max(MIN_BYTES, 1 << (nbytes - 1).bit_length())


@functools.cache
def _symm_mem():
    from torch.distributed import _symmetric_memory

    return _symmetric_memory


class SymmetricWorkspace:
    """A symmetric byte buffer over ``group`` on ``device``; see the module docstring."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.nbytes = 0
        self.buffer: torch.Tensor | None = None
        self.handle = None
        self._peers: list[torch.Tensor] = []
        self.mapping: str | None = None  # "symmetric" or "ipc" (``peer_mapping``), chosen at the first allocation

    def ensure(self, nbytes: int, op: str, ones: tuple[int, int] = (0, 0)) -> bool:
        """Make the data region at least ``nbytes`` (collective when it grows); a new buffer's flags start at zero,
        those in ``[ones[0], ones[1])`` at one. Returns whether the buffer was (re)allocated."""
        if nbytes <= self.nbytes:
            return False
        guards.refuse_inside_capture(
            f"{op}: the P2P path needs a {size_class(nbytes)}-byte symmetric workspace, allocated and exchanged with "
            "the peers (call the largest shape first)")
        if self.buffer is not None:
            # The old buffer may still be in use by queued work of the previous call (and, until this rank has
            # passed that call's done barrier, by peers pulling from it): let it all finish before freeing it.
            torch.cuda.synchronize(self.device)
        if self.mapping is None:
            self.mapping = peer_mapping(self.group, self.device)
        size = size_class(FLAG_BYTES + nbytes)
        if self.mapping == "ipc":
            self._ipc_buffers(size)
        else:
            symm_mem = _symm_mem()
            _use_cuda_backend(symm_mem, self.device)
            buffer = symm_mem.empty(size, dtype=torch.uint8, device=self.device)
            handle = symm_mem.rendezvous(buffer, self.group)  # torch >= 2.8 takes the group itself
            ranks = dist.get_world_size(self.group)
            self._peers = [handle.get_buffer(r, (size,), torch.uint8) for r in range(ranks)]
            self.buffer, self.handle = buffer, handle
        self.nbytes = size - FLAG_BYTES
        # Flags start at zero on every rank before any peer may set one of ours.
        self.flags.zero_()
        self.flags[ones[0] : ones[1]] = 1
        self.barrier(0)
        return True

    def _ipc_buffers(self, size: int) -> None:
        """This rank's buffer from the caching allocator, zeroed, and every peer's mapped by its CUDA IPC handle."""
        from torch.multiprocessing.reductions import reduce_tensor

        self.buffer, self._peers = None, []  # the old mappings dropped before the new exchange
        buffer = torch.zeros(size, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)  # zeroed before any peer can map it
        handles: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(handles, reduce_tensor(buffer), group=self.group)
        rank = dist.get_rank(self.group)
        self._peers = [buffer if r == rank else rebuild(*args) for r, (rebuild, args) in enumerate(handles)]
        self.buffer, self.handle = buffer, None

    def release(self) -> None:
        """Free the buffer (collective: every rank releases, after a barrier, so no peer still pulls from it)."""
        if self.buffer is None:
            return
        self.barrier(0)
        torch.cuda.synchronize(self.device)
        self.buffer, self.handle, self._peers, self.nbytes = None, None, [], 0
        if self.mapping == "ipc":
            self.barrier(0)  # every peer has dropped its mapping of this rank's buffer before the memory is reused

    @property
    def flags(self) -> torch.Tensor:
        """This rank's ``FLAG_SLOTS`` int32 flags."""
        assert self.buffer is not None
        return self.buffer[:FLAG_BYTES].view(torch.int32)

    def flag_ptr(self, rank: int, slot: int) -> int:
        """Device address, valid on this device, of flag ``slot`` of ``rank``'s buffer."""
        return self._peers[rank].data_ptr() + 4 * slot

    def local(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This rank's data region, from its start, as a ``shape`` tensor of ``dtype``."""
        assert self.buffer is not None
        count = 1
        for s in shape:
            count *= s
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return self.buffer[FLAG_BYTES : FLAG_BYTES + nbytes].view(dtype).view(shape)

    def peer(self, rank: int) -> torch.Tensor:
        """``rank``'s data region as a uint8 tensor on this device (its memory is the peer's)."""
        return self._peers[rank][FLAG_BYTES:]

    def peer_ptr(self, rank: int) -> int:
        """Device address, valid on this device, of ``rank``'s data region."""
        return self._peers[rank].data_ptr() + FLAG_BYTES

    def barrier(self, channel: int) -> None:
        """All ranks reach this point of their current streams before any goes on (a small kernel; with IPC
        mappings, the host waits for its device and then for the group)."""
        if self.mapping == "ipc":
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)
            return
        self.handle.barrier(channel=channel)


def peer_mapping(group: dist.ProcessGroup, device: torch.device) -> str:
    """How a workspace over ``group`` maps its peers' buffers (collective, the same answer on every rank):
    ``"symmetric"`` (PyTorch's symmetric memory) where the group's backend is NCCL and every rank has a GPU of its
    own, else ``"ipc"`` (CUDA IPC handles: ranks that share a GPU, or a group of another backend)."""
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", device.index))
    mine = (socket.gethostname(), uuid, dist.get_backend(group))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return mapping_of(everyone)


def mapping_of(everyone: list[tuple[str, str, str]]) -> str:
    """``peer_mapping``'s decision from every rank's ``(host, GPU UUID, backend)`` (pure: testable without GPUs)."""
    shared = len({(host, uuid) for host, uuid, _ in everyone}) < len(everyone)
    return "ipc" if shared or any(backend != "nccl" for _, _, backend in everyone) else "symmetric"


def _use_cuda_backend(symm_mem, device: torch.device) -> None:
    """Ask for PyTorch's CUDA backend (driver-mapped peer memory, no NVSHMEM, no multicast) unless this process
    already chose one: the backend is global and fixed by the first symmetric allocation."""
    get_backend = getattr(symm_mem, "get_backend", None)
    if get_backend is not None and get_backend(device) is None:
        symm_mem.set_backend("CUDA")


def p2p_unavailable_reason(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Why the P2P path cannot serve ``group`` (None if it can). Collective: every rank reports its host and GPU,
    and the answer is the same on every rank (the runtime asks once per group)."""
    why = _local_reason(device)
    no_access = [] if why else [d for d in range(torch.cuda.device_count())
                                if d != device.index and not torch.cuda.can_device_access_peer(device.index, d)]
    mine = {"host": socket.gethostname(), "device": device.index, "why": why, "no_access": no_access}
    everyone: list[dict] = [{}] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return group_reason(everyone)


def _local_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"the tensors are on {device}, not a CUDA GPU"
    try:
        _symm_mem()
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory is not available in this torch ({exc})"
    return None


def group_reason(everyone: list[dict]) -> str | None:
    """The decision from every rank's report ``{"host", "device", "why", "no_access"}`` (pure: the same on every
    rank, and testable without GPUs)."""
    for rank, info in enumerate(everyone):
        if info["why"]:
            return f"rank {rank}: {info['why']}"
    hosts = {info["host"] for info in everyone}
    if len(hosts) > 1:
        return f"the group spans {len(hosts)} hosts ({', '.join(sorted(hosts))}); P2P needs every rank on one node"
    for rank, info in enumerate(everyone):
        for peer, other in enumerate(everyone):
            if peer != rank and other["device"] in info["no_access"]:
                return (f"rank {rank}'s GPU {info['device']} cannot access the memory of rank {peer}'s GPU "
                        f"{other['device']} directly (no NVLink or PCIe peer access)")
    return None
