"""Fault injection on the multi-process simulator: a rank of a ``commfuse.sim.Group`` is killed
(SIGKILL) or frozen (SIGSTOP) at a random moment of a loop of calls of a random operator, or
killed while the group forms, and every surviving rank must raise, within the group's timeout
and a margin, an error of one line that names the rank; nothing may hang (the parent gives every
answer a deadline); no shared memory may be left under the group's name; and each survivor must
then join a new group (among the survivors, or alone; after a fault while the group formed,
under the same name) and make correct calls.

Workers are long-lived processes (``sim_fault_worker.serve``) forked from a forkserver that has
imported NumPy and commfuse, so that a run costs one new process (the victim's replacement),
and survivors go on to later runs: a process that saw a peer die stays usable for good. Runs
are drawn from one seed, printed at the start and in every failure; set
``COMMFUSE_FAULT_SEED`` to replay them.
"""

import collections
import concurrent.futures
import multiprocessing as mp
import os
import random
import re
import signal
import threading
import time
import uuid

import pytest

from sim_fault_worker import ALGOS, OPS, serve

SEED = int(os.environ.get("COMMFUSE_FAULT_SEED") or random.SystemRandom().randrange(1 << 32))
#: Every wait of every call is bounded by this.
TIMEOUT_MS = 1500
#: How late past the timeout a survivor's error may come on a loaded machine.
MARGIN_S = 2.0
#: Kill runs of each (operator, P).
KILLS_EACH = 4
#: Runs at each P whose victim is killed while the group forms.
JOINS_EACH = 5
#: Runs at a time.
PARALLEL = 3
SHM = "/dev/shm"
# a group's name and nonce; names are unique per run, so a name left behind is one leak
PREFIX = f"faults-{os.getpid()}"


class Worker:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        if self.recv(time.monotonic() + 60) != ("up",):
            raise RuntimeError(f"worker {self.pid} did not start")

    @property
    def pid(self):
        return self.proc.pid

    def send(self, order):
        self.conn.send(order)

    def recv(self, deadline):
        """The worker's next answer, or None if it has not come by `deadline` (monotonic) or the
        worker died."""
        try:
            if self.conn.poll(max(0.0, deadline - time.monotonic())):
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        return None

    def end(self, how=signal.SIGKILL):
        try:
            os.kill(self.pid, how)
        except ProcessLookupError:
            pass
        self.proc.join(10)
        self.conn.close()


class Pool:
    """Idle workers, and new ones where there are too few."""

    def __init__(self):
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["numpy", "commfuse.sim", "sim_fault_worker"])
        self.idle = []
        self.lock = threading.Lock()
        self.started = 0

    def take(self, n):
        with self.lock:
            while len(self.idle) < n:
                self.idle.append(Worker(self.ctx))
                self.started += 1
            taken, self.idle = self.idle[:n], self.idle[n:]
        return taken

    def give(self, workers):
        with self.lock:
            self.idle.extend(workers)

    def close(self):
        for w in self.idle:
            try:
                w.send(None)
            except OSError:
                pass
            w.proc.join(5)
            if w.proc.is_alive():
                w.end()


def jobs(name, world, op, rng):
    """Every rank's job in a new group `name` of `world` ranks running `op`: the same nonce,
    algorithm, root and input seed for all."""
    shared = {
        "name": name,
        "nonce": rng.randrange(1, 1 << 62),
        "world": world,
        "timeout_ms": TIMEOUT_MS,
        "op": op,
        "algo": rng.choice(ALGOS.get(op, [None])),
        "root": rng.randrange(world),
        "seed": rng.randrange(1 << 30),
    }
    return [dict(shared, rank=r) for r in range(world)]


def names_rank(message, rank):
    return re.search(rf"\brank {rank}\b", message) is not None


def fault_run(pool, index, op, p, how):
    """One run: P workers loop `op`; one of them is killed (`how` "kill") or frozen ("stop")
    after a random delay, or killed while the group forms ("join"); the survivors must raise
    naming it, then recover. Returns (problems, each a kind and a line, and the seconds from the
    fault to each survivor's error)."""
    rng = random.Random(f"{SEED}-{index}")
    victim, delay = rng.randrange(p), rng.uniform(0, 0.03)
    if how == "join":
        delay /= 6
    name = f"{PREFIX}-{index}-{uuid.uuid4().hex[:8]}"
    mine = jobs(name, p, op, rng)
    what = (f"seed {SEED} run {index}: {how} rank {victim} of P={p} in {op} "
            f"(algo {mine[0]['algo']}, root {mine[0]['root']}) after {delay * 1000:.1f} ms")
    problems, lags = [], []
    workers = pool.take(p)
    if how == "join":
        # rank 0 and the victim start to form the group and the victim dies within 5 ms:
        # before it joined, while rank 0 waits for it, or just after; the others come after
        first = sorted({0, victim})
        for r in first:
            workers[r].send(("loop", mine[r]))
        time.sleep(delay)
        faulted = time.monotonic()
        os.kill(workers[victim].pid, signal.SIGKILL)
        for r in range(p):
            if r not in first:
                workers[r].send(("loop", mine[r]))
    else:
        for w, j in zip(workers, mine):
            w.send(("loop", j))
        for r, w in enumerate(workers):
            answer = w.recv(time.monotonic() + 60)
            if answer != ("ready",):
                problems.append(("join", f"{what}: rank {r} did not join: {answer}"))
        if problems:
            for w in workers:
                w.end()
            return problems, lags
        time.sleep(delay)
        faulted = time.monotonic()
        os.kill(workers[victim].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    deadline = faulted + TIMEOUT_MS / 1000 + MARGIN_S
    survivors, messages = [], {}
    for r, w in enumerate(workers):
        if r == victim:
            continue
        answer = w.recv(deadline)
        if how == "join" and answer == ("ready",):
            answer = w.recv(deadline)  # joined; now its calls must end
        if answer is None:
            problems.append(("hang", f"{what}: rank {r} hung (no error {TIMEOUT_MS} ms + {MARGIN_S} s after the fault)"))
            w.end()
            continue
        if answer[0] != "raised":
            problems.append(("crash", f"{what}: rank {r} answered {answer}"))
            w.end()
            continue
        _, message, when, calls = answer
        lags.append(when - faulted)
        messages[r] = message
        survivors.append((r, w))
        if "\n" in message:
            problems.append(("lines", f"{what}: rank {r}'s error is not one line: {message!r}"))
        if when - faulted > TIMEOUT_MS / 1000 + MARGIN_S:
            problems.append(("late", f"{what}: rank {r} raised {when - faulted:.2f} s after the fault"))
        if how == "kill" and not names_rank(message, victim):
            problems.append(("unnamed", f"{what}: rank {r}'s error does not name rank {victim}: {message}"))
        # a rank that never joins looks slow until rank 0 gives up on it, so a rank that joined
        # may time out first waiting for rank 0 (still waiting for the victim) and name it
        if how == "join" and not (names_rank(message, victim) or (r != 0 and calls >= 0 and names_rank(message, 0))):
            problems.append(("unnamed", f"{what}: rank {r}'s error names neither rank {victim} nor rank 0: {message}"))
        if how == "kill" and f"the process of rank {victim}" not in message:
            problems.append(("not ended", f"{what}: rank {r}'s error does not say rank {victim}'s process ended: {message}"))
        if how == "stop" and not re.search(r"\brank \d+\b", message.replace(f"rank {r} ", "", 1)):
            problems.append(("no peer", f"{what}: rank {r}'s error names no peer: {message}"))
    if how == "stop" and messages and not any(
        re.search(rf"\b(for|from|on|of) rank {victim}\b", m) for m in messages.values()
    ):
        problems.append(("frozen unnamed", f"{what}: no survivor names the frozen rank {victim}: {messages}"))
    workers[victim].end()
    if os.path.exists(os.path.join(SHM, f"commfuse-{name}")):
        problems.append(("leak", f"{what}: the group's shared memory /dev/shm/commfuse-{name} was left"))

    # the survivors recover: a new group of all of them, or each alone; after a fault while
    # the group formed, under the same name (nothing left under it may block it)
    together = len(survivors) > 1 and (how == "join" or rng.random() < 0.6)
    groups = [survivors] if together else [[s] for s in survivors]
    pending = []
    for k, members in enumerate(groups):
        op2 = rng.choice(OPS)
        theirs = jobs(name if how == "join" else f"{name}-again{k}", len(members), op2, rng)
        for (old, w), j in zip(members, theirs):
            w.send(("once", j))
            pending.append((old, w, f"a new group of {len(members)} running {op2} ({j['algo']})"))
    healthy = []
    for old, w, doing in pending:
        answer = w.recv(time.monotonic() + 60)
        if answer == ("ok", 2):
            healthy.append(w)
        else:
            problems.append(("recovery", f"{what}: survivor rank {old} in {doing}: {answer}"))
            w.end()
    pool.give(healthy)
    return problems, lags


def test_ranks_killed_or_frozen_at_random_leave_survivors_an_error_naming_them():
    print(f"fault-injection seed {SEED} (COMMFUSE_FAULT_SEED={SEED} replays it)")
    plan = [(op, p, "kill") for op in OPS for p in (2, 3, 4) for _ in range(KILLS_EACH)]
    rng = random.Random(SEED)
    plan += [(op, rng.choice((2, 3, 4)), "stop") for op in OPS]
    plan += [(rng.choice(OPS), p, "join") for p in (2, 3, 4) for _ in range(JOINS_EACH)]
    rng.shuffle(plan)
    started = time.monotonic()
    pool = Pool()
    problems, lags = [], {"kill": [], "stop": [], "join": []}
    try:
        with concurrent.futures.ThreadPoolExecutor(PARALLEL) as runs:
            futures = [runs.submit(fault_run, pool, i, *spec) for i, spec in enumerate(plan)]
            for (op, p, how), f in zip(plan, futures):
                found, seconds = f.result()
                problems += found
                lags[how] += seconds
    finally:
        pool.close()
    kills = sum(1 for *_, how in plan if how != "stop")
    left = [f for f in os.listdir(SHM) if f.startswith(f"commfuse-{PREFIX}")]
    print(
        f"{kills} kill runs ({JOINS_EACH * 3} while the group formed) and {len(plan) - kills} "
        f"freeze runs in {time.monotonic() - started:.1f} s, "
        f"{pool.started} processes; a killed rank was named after at most "
        f"{max(lags['kill'], default=0) * 1000:.0f} ms (median "
        f"{sorted(lags['kill'])[len(lags['kill']) // 2] * 1000 if lags['kill'] else 0:.0f} ms), "
        f"a frozen one after at most {max(lags['stop'], default=0):.2f} s"
    )
    kinds = collections.Counter(kind for kind, _ in problems)
    firsts = {}
    for kind, text in problems:
        firsts.setdefault(kind, text)
    assert not problems, f"{len(problems)} problems {dict(kinds)}; the first of each: " + "\n".join(
        firsts.values()
    )
    assert kills >= 100
    assert not left, f"shared memory left behind: {left}"


def test_a_frozen_rank_is_named_by_the_timeout_of_the_rank_waiting_for_it():
    # rank 1 stops; rank 0 waits for its notify in the all-reduce and times out naming it
    pool = Pool()
    try:
        workers = pool.take(2)
        mine = jobs(f"{PREFIX}-frozen-{uuid.uuid4().hex[:8]}", 2, "all-reduce", random.Random(0))
        for w, j in zip(workers, mine):
            w.send(("loop", dict(j, algo="ring")))
        assert [w.recv(time.monotonic() + 60) for w in workers] == [("ready",)] * 2
        os.kill(workers[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        answer = workers[0].recv(stopped + TIMEOUT_MS / 1000 + MARGIN_S)
        workers[1].end()
        assert answer is not None and answer[0] == "raised", answer
        _, message, when, _ = answer
        assert re.fullmatch(
            rf"timeout after {TIMEOUT_MS} ms: rank 0 waits on slot \(row \d+, col \d+\) for >= \d+ from rank 1 but sees \d+",
            message,
        ), message
        assert TIMEOUT_MS / 1000 - 0.1 < when - stopped < TIMEOUT_MS / 1000 + MARGIN_S, when - stopped
        pool.give(workers[:1])
    finally:
        pool.close()
