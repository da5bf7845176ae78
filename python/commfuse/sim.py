"""The fused operators on commfuse's CPU simulator: P ranks in one call, NumPy in and out.

Inputs are float32 arrays rounded to ``dtype`` (bf16 or f16) on the way in; outputs are the
operator's results in ``out_dtype`` (the input type or f32), returned as float32 arrays. Every
bad argument raises ``ValueError`` with a one-line reason.
"""

from ._commfuse import sim_all_gather_matmul, sim_collective, sim_gemm_reduce_scatter


def gemm_reduce_scatter(a, b, bias=None, **options):
    """GEMM + reduce-scatter (a row-parallel linear layer) of ``len(a)`` ranks.

    Rank r holds ``a[r]`` [M, K] and ``b[r]`` ([N, K] with ``b_layout="nk"``, [K, N] with
    ``"kn"``); the result's entry r is rank r's chunk of the rows of ``sum_r a[r] @ b[r]``
    (+ ``bias``, added once), chunks split as the collectives split M (the first M mod P one row
    longer). Options: ``b_layout``, ``dtype``, ``out_dtype``, ``path`` ("auto", "fused" or
    "overlapped"), ``pieces`` (with "overlapped"), ``timeout_ms``.
    """
    return sim_gemm_reduce_scatter(list(a), list(b), bias, **options)


def all_gather_matmul(a, b, bias=None, **options):
    """All-gather + GEMM (a column-parallel linear layer over sequence-parallel rows).

    Rank r holds ``a[r]``, its chunk of the rows of A (chunks split as the collectives split M),
    and ``b[r]``; returns ``(outputs, gathered)``: every rank's ``concat(a) @ b[r]`` (+ ``bias``)
    and, with ``return_a=True``, the gathered A (else None). Options: ``b_layout``, ``dtype``,
    ``out_dtype``, ``pieces``, ``return_a``, ``timeout_ms``.
    """
    return sim_all_gather_matmul(list(a), list(b), bias, **options)


def collective(op, inputs, **options):
    """One collective of ``len(inputs)`` ranks on rank r's 1-D ``inputs[r]``: ``op`` is
    "all-reduce", "reduce-scatter", "all-gather" (the inputs are the chunks of the gathered
    vector, split as the collectives split it), "broadcast" (only the root's input is non-empty)
    or "all-to-all". Returns ``(outputs, algo)``: every rank's output and the algorithm that ran
    (``algo=None``, the default, lets the cost model pick). Options: ``algo``, ``reduce``
    ("sum", "max", "min", "prod"), ``dtype`` ("f32", "bf16", "f16"), ``root``, ``timeout_ms``.
    """
    return sim_collective(op, list(inputs), **options)
