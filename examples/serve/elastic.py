"""An elastic decode instance (decode.py --elastic): its EP ranks are processes a supervisor
forks and watches, beside a coordinator process (coordinator.py) that holds the router's
connection and plans the steps. A rank that dies -- any of them -- is replaced by a new process
that takes its rank id and experts, and the survivors readmit it into their AllToAll (ferry's
AllToAll.readmit on the survivors, AllToAll.join on the new process) over a new bootstrap of
the whole world, while the instance keeps serving.

Membership generations. Generation 0 is the world as it starts. Each replacement is a new
generation: the supervisor publishes {"generation", "address", "plans", "replaced"} in a file
of the instance (written whole, then renamed over the last); the new processes meet the
survivors at the rendezvous `address` (the EP ranks: the AllToAll's group) and, with the
coordinator, at `plans` (the step plans' all-gather); the survivors mask the replaced ranks
before they readmit them (a rank that died between steps was masked by nobody). A rank that
dies while a recovery runs makes that generation's meeting fail; the supervisor's next
generation replaces it too, and the lost ranks of both count.

What a survivor does with a step that a death touched (decode.py): its AllToAll, made with
mask_lost_peers, masks a rank that sends nothing by the step's deadline and finishes the step
with what the others sent; outputs computed without every expert are wrong, so a step in which
this rank masked anyone is not committed (its tokens are not taken, its KV writes are made
again by the step redone after the recovery). A rank that a peer masked while it lived is
presumed lost by the others: it leaves (exit code 3), and is replaced as a dead one would be.
"""

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback

import ferry
from control import announce

POLL_S = 0.05  # how often a survivor looks for the next generation
SETTLE_S = 0.2  # after a death, how long the supervisor waits for others before it replaces
EVICTED = 3  # the exit code of a rank that leaves because a peer masked it


def free_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1:%d" % s.getsockname()[1]


class Membership:
    """The instance's latest generation, in a file every rank of this host reads."""

    def __init__(self, tag):
        self.path = f"/dev/shm/ferry-serve-{tag}-membership"

    def publish(self, generation, address, plans, replaced):
        tmp = f"{self.path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"generation": generation, "address": address, "plans": plans,
                       "replaced": sorted(replaced)}, f)
        os.replace(tmp, self.path)

    def read(self):
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def after(self, generation, timeout):
        """The first generation past `generation`, waiting up to timeout seconds for it."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.read()
            if m is not None and m["generation"] > generation:
                return m
            if time.monotonic() > deadline:
                raise TimeoutError(f"no membership generation after {generation} within "
                                   f"{timeout} s")
            time.sleep(POLL_S)

    def remove(self):
        try:
            os.unlink(self.path)
        except OSError:
            pass


class Member:
    """What a participant's body learns of its place: its rank of `world` (the coordinator:
    `world`, the last of the plans' all-gather), the generation it starts in, where that
    generation meets, and whether it joins a running world (a replacement)."""

    def __init__(self, rank, world, start, joining, membership):
        self.rank, self.world, self.joining, self.membership = rank, world, joining, membership
        self.take(start)

    def take(self, m):
        """Generation m's meeting places."""
        self.generation, self.address, self.plans_address = (m["generation"], m["address"],
                                                             m["plans"])

    def bootstrap(self, timeout):
        """The EP ranks' bootstrap of this generation (the AllToAll's group)."""
        return ferry.join_rendezvous(self.address, world_size=self.world, rank=self.rank,
                                     timeout=timeout)

    def plans(self, timeout):
        """The plans' bootstrap of this generation: the EP ranks, then the coordinator."""
        return ferry.join_rendezvous(self.plans_address, world_size=self.world + 1,
                                     rank=self.rank, timeout=timeout)

    def _next(self, timeout, meet):
        """meet() in the generations after this one until one succeeds; (its result, every
        rank replaced since)."""
        replaced = set()
        while True:
            m = self.membership.after(self.generation, timeout)
            self.take(m)
            replaced.update(m["replaced"])
            try:
                return meet(replaced), sorted(replaced)
            except ferry.Error as e:
                print(f"decode {self.rank}: generation {self.generation} failed ({e}); waiting "
                      "for the next", file=sys.stderr, flush=True)

    def recover(self, a2a, timeout):
        """An EP rank after a step that failed or that a peer's death touched: waits for the
        generation that replaces the lost ranks, masks them, meets their new processes and
        readmits them, then meets the coordinator. Returns (the EP bootstrap, the plans'
        bootstrap, the ranks replaced)."""
        def meet(replaced):
            masked = a2a.masked()
            for r in replaced:
                if not masked[r]:
                    a2a.set_masked(r)
            group = self.bootstrap(timeout)
            a2a.readmit(group, timeout)
            return group, self.plans(timeout)
        (group, plans), replaced = self._next(timeout, meet)
        return group, plans, replaced

    def next_plans(self, timeout):
        """The coordinator's recover: (the plans' bootstrap of the next generation that meets,
        the ranks replaced)."""
        return self._next(timeout, lambda _replaced: self.plans(timeout))


def supervise(world, body, coordinate, tag):
    """Forks the coordinator, running coordinate(member), and `world` ranks, running
    body(member); replaces each rank that dies with a new process for its rank, until every
    process has ended well (0) or the coordinator is lost (1: the ranks are stopped). Prints
    {"ranks": {rank: pid}} as they start and are replaced."""
    membership = Membership(tag)
    children = {}

    def spawn(rank, run, joining):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                run(Member(rank, world, membership.read(), joining, membership))
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 -- a process's end, printed for its log
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
        return pid

    membership.publish(0, free_address(), free_address(), [])
    spawn(world, coordinate, False)
    pids = {r: spawn(r, body, False) for r in range(world)}
    announce({"ranks": pids})
    generation, lost = 0, False

    def reap(flags):
        """The next (rank, exit code) of a child that ended, or None."""
        try:
            pid, status = os.waitpid(-1, flags)
        except ChildProcessError:
            return None
        if pid == 0:
            return None
        return children.pop(pid), os.waitstatus_to_exitcode(status)

    while children:
        rank, code = reap(0)
        if code == 0:
            continue  # the instance stopping
        dead = {rank}
        time.sleep(SETTLE_S)  # others that went with it are replaced in the same generation
        while (ended := reap(os.WNOHANG)) is not None:
            if ended[1] != 0:
                dead.add(ended[0])
        print(f"decode: {sorted(dead)} ended ({code})", file=sys.stderr, flush=True)
        if world in dead or lost:  # the router's connection is gone: so is the instance
            lost = True
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            continue
        generation += 1
        membership.publish(generation, free_address(), free_address(), dead)
        for r in sorted(dead):
            pids[r] = spawn(r, body, True)
        announce({"ranks": pids, "generation": generation})
    membership.remove()
    return 1 if lost else 0


def crash_hook(a2a, moe_engine, leader):
    """--elastic: SIGUSR1 makes this rank die in the middle of its next MoE layer, after the
    dispatch's send (its peers then wait for its combine rows in vain), as the tests kill a
    rank: its engines closed first, then os._exit. Over libfabric's shm provider a process
    killed inside the provider can leave a lock in shared memory that its peers spin on, which
    no NIC has; to the peers' protocol the rank is gone all the same. Returns the check
    moe_layer runs after each send."""
    asked = threading.Event()
    signal.signal(signal.SIGUSR1, lambda _sig, _frame: asked.set())

    def check():
        if not asked.is_set():
            return
        print("decode: crashing as asked (SIGUSR1)", file=sys.stderr, flush=True)
        if leader() is not None:
            leader().close()
        a2a.close()
        if moe_engine is not None:
            moe_engine.close()
        os._exit(1)

    return check
