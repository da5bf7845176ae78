"""The operator cache that ``commfuse.torch`` and ``commfuse.cuda`` share.

An operator is built the first time a (group, shape, types) combination is called: every rank
builds its half, exports its buffers' CUDA IPC handles as bytes, the group's all-gather of bytes
carries them to every rank, and each connects to the others'. Building is collective, so every
rank of a group must make the same calls in the same order.
"""

from __future__ import annotations

from typing import Callable, List

# (kind, id(group)) + key -> [operator, max_m, group]; the group is kept so that its id is not
# reused while the entry lives
_CACHE: dict = {}
#: Advances whenever an operator is built or the cache cleared: what was prepared against the
#: cache before (``commfuse.torch``'s prepared calls) is stale once it moves.
generation = 0
#: Called (without arguments) whenever ``generation`` advances: caches outside Python that hold
#: operators (``commfuse.torch``'s C++ prepared calls) drop them then
listeners: List[Callable[[], None]] = []


def _advance() -> None:
    global generation
    generation += 1
    for listener in listeners:
        listener()


def cached(kind: str, group, m: int, key: tuple, build: Callable[[int], object],
           all_gather: Callable[[bytes], List[bytes]], capturing: Callable[[], bool]):
    """The cached operator of ``key`` for calls of ``m`` rows, built (collectively) when absent
    or too small: ``build(max_m)`` for the larger of m and twice the old limit, connected
    through ``all_gather`` (this rank's bytes in, every rank's in rank order out). Building
    runs on the host, so it is refused when ``capturing()`` says the stream is being captured
    into a CUDA graph (asked only then)."""
    full = (kind, id(group)) + key
    entry = _CACHE.get(full)
    if entry is not None and entry[1] >= m:
        return entry[0]
    if capturing():
        raise RuntimeError(
            f"commfuse: the {kind} operator for this shape (M = {m}) is built by its first call,"
            " collectively and on the host, which a CUDA graph cannot capture: call it once"
            " before capturing"
        )
    max_m = max(m, 2 * entry[1]) if entry is not None else m
    op = build(max_m)
    op.connect([bytes(b) for b in all_gather(bytes(op.export()))])
    _CACHE[full] = [op, max_m, group]
    _advance()
    return op


def lookup(kind: str, group, key: tuple):
    """The cached operator of ``key``, or None."""
    entry = _CACHE.get((kind, id(group)) + key)
    return None if entry is None else entry[0]


def ag_path_key(pieces, path: str) -> tuple:
    """What an all-gather + GEMM's ``pieces`` and ``path`` build (the binding's rule: "auto"
    is the overlapped path, no pieces one piece), for operator keys: every spelling of one
    operator finds it; an unknown path stays as given, for the binding to refuse."""
    return (1 if pieces is None else pieces, "overlapped" if path == "auto" else path)


def clear() -> None:
    """Drops every cached operator (each waits for its last calls before freeing its memory)."""
    _CACHE.clear()
    _advance()
