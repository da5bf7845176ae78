"""Process groups as commfuse.torch's ops see them: by name (``group.group_name``, as PyTorch's
functional collectives pass them, so that compiled graphs carry a string), and what serves
each group on each kind of device — commfuse's kernels (CUDA tensors, ranks that can open each
other's memory), commfuse's simulator (CPU tensors), or ``torch.distributed`` (everything else:
ranks on several hosts or sharing a GPU, or ``COMMFUSE_PEER_ACCESS=0``)."""

from __future__ import annotations

import os
import socket
import warnings
from typing import Optional

import torch
import torch.distributed as dist

# what serves a group's calls
KERNELS, SIMULATOR, TORCH = "commfuse", "commfuse-sim", "torch.distributed"


class Group:
    """One process group: its name, this process's rank, its size, and what serves it on each
    device type (settled collectively at the first call on that device type)."""

    def __init__(self, process_group, name: str):
        self.process_group = process_group
        self.name = name
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        self._served: dict = {}
        # (what, request) -> every rank's request, exchanged at this rank's first such call
        self._requests: dict = {}

    def requests(self, what: str, request: tuple) -> tuple:
        """``(every, first)``: every rank's ``request`` for its call of ``what``, in rank order,
        and whether this call exchanged it. Exchanged by ``dist.all_gather_object``
        (collective) at this rank's first call of each (what, request), a dictionary lookup at
        later ones. Every rank makes the same calls in the same order, so a first call meets the
        other ranks' first calls: a rank whose request differs from the others' makes a first
        call of its own too. (A rank repeating an earlier request while another makes a new one
        is not met: that one waits alone.)"""
        every = self._requests.get((what, request))
        if every is not None:
            return every, False
        every = [request]
        if self.world > 1:
            every = [None] * self.world
            dist.all_gather_object(every, request, group=self.process_group)
        self._requests[(what, request)] = every
        return every, True

    def forget(self, what: str, request: tuple) -> None:
        """Drops the exchange of ``request`` (a call every rank refused), so that every rank
        exchanges it again at its next such call."""
        self._requests.pop((what, request), None)

    def served_by(self, device: torch.device) -> str:
        """KERNELS, SIMULATOR or TORCH for tensors on ``device`` (collective at the first call
        of each device type: every rank must make it)."""
        kind = device.type
        served = self._served.get(kind)
        if served is None:
            served = self._served[kind] = self._settle(device)
        return served

    def served_by_gemm(self, device: torch.device, k: int) -> str:
        """What serves a GEMM op (GEMM + reduce-scatter, all-gather + GEMM) of inner dimension
        ``k`` on ``device``: what serves the group, except that a K the kernels and the
        simulator cannot take (they load rows of A and B 16 bytes at a time: K a multiple of 8)
        goes to torch.matmul and torch.distributed, with the same semantics, instead of failing
        (a layer whose features split over the ranks into such shards, say)."""
        served = self.served_by(device)
        return TORCH if k % 8 else served

    def serve_by_torch(self) -> None:
        """torch.distributed and torch.matmul serve every later call, on every device."""
        self._served = {kind: TORCH for kind in ("cpu", "cuda")}

    def _settle(self, device: torch.device) -> str:
        forbidden = os.environ.get("COMMFUSE_PEER_ACCESS", "1") == "0"
        if device.type == "cpu":
            if forbidden:
                self._warn("COMMFUSE_PEER_ACCESS=0 forbids shared memory between its ranks")
                return TORCH
            return SIMULATOR
        if device.type != "cuda":
            raise ValueError(f"commfuse.torch runs on CUDA and CPU tensors, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        mine = (socket.gethostname(), str(torch.cuda.get_device_properties(index).uuid),
                forbidden)
        every = [None] * self.world
        dist.all_gather_object(every, mine, group=self.process_group)
        visible = {str(torch.cuda.get_device_properties(i).uuid): i
                   for i in range(torch.cuda.device_count())}
        why = cuda_verdict(every, self.rank, visible, torch.cuda.can_device_access_peer)
        # (peer access is each rank's to see: every rank learns every rank's verdict, so that
        # all of them choose alike)
        whys = [why]
        if self.world > 1:
            whys = [None] * self.world
            dist.all_gather_object(whys, why, group=self.process_group)
        why = next((w for w in whys if w is not None), None)
        if why is not None:
            self._warn(why)
            return TORCH
        return KERNELS

    def _warn(self, why: str) -> None:
        warnings.warn(
            f"commfuse.torch: group {self.name!r} is served by torch.distributed (NCCL or gloo)"
            f" and torch.matmul, with the same semantics, because {why}",
            RuntimeWarning, stacklevel=4,
        )


def cuda_verdict(every, rank: int, visible: dict, can_access) -> Optional[str]:
    """Why commfuse's kernels cannot serve a group of CUDA tensors whose ranks sent ``every``
    ((host name, GPU UUID, peer access forbidden) each, in rank order), as rank ``rank`` sees
    it — its process sees the GPUs ``visible`` (UUID -> device index) and asks
    ``can_access(device, peer device)`` — or None where they can: every rank's GPU its own, on
    one host, and able to open every other's memory."""
    if any(e[2] for e in every):
        return "COMMFUSE_PEER_ACCESS=0 forbids peer access between its GPUs"
    hosts = {e[0] for e in every}
    if len(hosts) > 1:
        return (f"its ranks are on {len(hosts)} hosts, and commfuse's kernels need every GPU of"
                " a group to open every other's memory")
    gpus = [e[1] for e in every]
    if len(set(gpus)) < len(gpus):
        return "some of its ranks share a GPU, and commfuse's kernels need one rank per GPU"
    mine = visible.get(gpus[rank])
    for r, gpu in enumerate(gpus):
        if r == rank:
            continue
        peer = visible.get(gpu)
        if peer is None:
            return (f"rank {r}'s GPU is not visible to rank {rank}'s process"
                    " (CUDA_VISIBLE_DEVICES), which must open its memory")
        if not can_access(mine, peer):
            return (f"GPU {mine} of rank {rank} has no peer access to GPU {peer} of rank {r},"
                    " and commfuse's kernels need every GPU to open every other's memory")
    return None


# group name -> Group
_BY_NAME: dict = {}
# the default group last named, and its name: most calls name no group, and asking a group's
# name costs more than the rest of the lookup (the default group is replaced, never renamed,
# when torch.distributed is initialised again)
_world: tuple = (None, None)


def name_of(group) -> str:
    """The name of ``group`` (the default group's when None) as the ops take it."""
    global _world
    if group is None:
        group = dist.group.WORLD  # None until torch.distributed is initialised
        if group is None:
            raise ValueError(
                "commfuse.torch needs torch.distributed initialised (init_process_group)")
        if group is _world[0]:
            return _world[1]
        name = name_of(group)
        _world = (group, name)
        return name
    if isinstance(group, str):
        return group
    name = group.group_name
    if name not in _BY_NAME:
        _BY_NAME[name] = Group(group, name)
    return name


def by_name(name: str) -> Group:
    """The group an op names (looked up once per name; rank and size need no communication,
    so fake kernels ask them too)."""
    g = _BY_NAME.get(name)
    if g is None:
        from torch.distributed.distributed_c10d import _resolve_process_group

        g = _BY_NAME[name] = Group(_resolve_process_group(name), name)
    return g


def lookup(group) -> Optional[Group]:
    return _BY_NAME.get(name_of(group))


def clear() -> None:
    global _world
    _BY_NAME.clear()
    _world = (None, None)
