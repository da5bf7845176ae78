"""The fused operators on commfuse's CPU simulator: P ranks in one call, NumPy in and out.

Inputs are float32 arrays rounded to ``dtype`` (bf16 or f16) on the way in; outputs are the
operator's results in ``out_dtype`` (the input type or f32), returned as float32 arrays. Every
bad argument raises ``ValueError`` with a one-line reason.

``Group(name, rank, world)`` is the multi-process simulator: one rank per process (as under
``torchrun`` or ``multiprocessing``), the group's signal pads and buffers in POSIX shared memory
that rank 0 creates under ``name`` (a job id every rank knows) and that is gone once every rank
has joined and the last process ends. Its methods run this process's rank of an op on NumPy
arrays — ``collective(op, x, count=, algo=, reduce=, dtype=, root=)``, ``barrier()``,
``gemm_reduce_scatter(a, b, bias, ...)``, ``all_gather_gemm(a, b, bias, m=, ..., return_a=)``
— and every rank must make the same calls in the same order. A rank that fails raises the
group's abort flag, which stops the others' waits naming it; a wait for a rank whose process has
ended (killed, crashed, exited) stops at once naming that rank, and a wait for a rank that hangs
times out (``timeout_ms``) naming it. A failed group refuses further calls; make a new one.
"""

from ._commfuse import SimGroup as Group
from ._commfuse import sim_all_gather_gemm, sim_collective, sim_gemm_reduce_scatter

__all__ = ["Group", "gemm_reduce_scatter", "all_gather_gemm", "all_gather_matmul", "collective"]


def _per_rank(x):
    """One item per rank as a list; a string or a non-iterable is left for the binding to refuse
    by name (``list()`` would split a string into characters, or raise a TypeError)."""
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        return x
    return list(x)


def gemm_reduce_scatter(a, b, bias=None, **options):
    """GEMM + reduce-scatter (a row-parallel linear layer) of ``len(a)`` ranks.

    Rank r holds ``a[r]`` [M, K] and ``b[r]`` ([N, K] with ``b_layout="nk"``, [K, N] with
    ``"kn"``); the result's entry r is rank r's chunk of the rows of ``sum_r a[r] @ b[r]``
    (+ ``bias``, added once), chunks split as the collectives split M (the first M mod P one row
    longer). Options: ``b_layout``, ``dtype``, ``out_dtype``, ``path`` ("auto", "fused" or
    "overlapped"), ``pieces`` (with "overlapped"), ``numa_groups`` (the overlapped path's 2D
    ring over that many groups of consecutive ranks), ``timeout_ms``.
    """
    return sim_gemm_reduce_scatter(_per_rank(a), _per_rank(b), bias, **options)


def all_gather_gemm(a, b, bias=None, **options):
    """All-gather + GEMM (a column-parallel linear layer over sequence-parallel rows).

    Rank r holds ``a[r]``, its chunk of the rows of A (chunks split as the collectives split M),
    and ``b[r]``; returns ``(outputs, gathered)``: every rank's ``concat(a) @ b[r]`` (+ ``bias``)
    and, with ``return_a=True``, the gathered A (else None). Options: ``b_layout``, ``dtype``,
    ``out_dtype``, ``path`` ("auto", "overlapped" or "fused"), ``pieces``, ``return_a``,
    ``timeout_ms``.
    """
    return sim_all_gather_gemm(_per_rank(a), _per_rank(b), bias, **options)


#: The same operator as :func:`all_gather_gemm`, by the name it had first here.
all_gather_matmul = all_gather_gemm


def collective(op, inputs, **options):
    """One collective of ``len(inputs)`` ranks on rank r's 1-D ``inputs[r]``: ``op`` is
    "all-reduce", "reduce-scatter", "all-gather" (the inputs are the chunks of the gathered
    vector, split as the collectives split it), "broadcast" (only the root's input is non-empty)
    or "all-to-all". Returns ``(outputs, algo)``: every rank's output and the algorithm that ran
    (``algo=None``, the default, lets the cost model pick). Options: ``algo``, ``reduce``
    ("sum", "max", "min", "prod"), ``dtype`` ("f32", "bf16", "f16"), ``root``, ``timeout_ms``.
    """
    return sim_collective(op, _per_rank(inputs), **options)
