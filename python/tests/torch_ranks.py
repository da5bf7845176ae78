"""Helpers of the PyTorch tests: P ranks as P processes on a gloo group (CPU tensors, served by
commfuse's simulator), and the checks every rank runs against float64 references that it
computes itself from seeds every rank shares."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist

UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def _rank_main(fn, rank, world, store, errors, args):
    os.environ.setdefault("COMMFUSE_TIMEOUT_MS", "20000")
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world)
        fn(rank, world, *args)
        dist.barrier()
        import commfuse.torch as cf

        # commfuse's operators and its references to the groups go before the groups do
        cf.clear_cache()
        dist.destroy_process_group()
        errors.put((rank, None))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        errors.put((rank, traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout: float = 600.0) -> None:
    """Runs ``fn(rank, world, *args)`` in ``world`` spawned processes joined in one gloo group;
    raises with every failing rank's traceback, or when a rank neither finished nor failed in
    ``timeout`` seconds."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world, store, errors, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in range(world):
                rank, err = errors.get(timeout=timeout)
                results[rank] = err
        except queue.Empty:
            pass
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    missing = sorted(set(range(world)) - set(results))
    failed = {r: e for r, e in results.items() if e is not None}
    if failed or missing:
        text = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(failed.items()))
        raise AssertionError(f"ranks {sorted(failed)} failed, {missing} did not finish{text}")


def operands(seed: int, shapes, dtype=torch.float64):
    """Random tensors of ``shapes`` (integers / 8 in [-2, 2]: exact in bf16, f16 and f32, and
    so are their products), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(-16, 17, s, generator=g) / 8).to(dtype) for s in shapes]


def rows_of(m: int, world: int):
    """Every rank's rows, as torch.tensor_split splits m."""
    return [t.tolist() for t in torch.tensor_split(torch.arange(m), world)]


def check(name: str, got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, dtype,
          roundings: float = 3.0) -> None:
    """Every element of ``got`` within ``roundings`` roundings of ``dtype`` of the float64
    ``want``, relative to ``scale`` (the sum of the magnitudes of what was added), plus f32
    accumulation."""
    got = got.detach().double().cpu()
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
    limit = roundings * UNIT[dtype] * scale + 2.0**-20 * scale + 1e-9
    bad = ((got - want).abs() > limit) | ~torch.isfinite(got)
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {got.numel()} elements out of bound, first at {i}:"
            f" got {got[i].item()}, want {want[i].item()} ± {limit[i].item()}")
