"""A decode instance: continuous batching over --ep ranks. Attention is data-parallel over
ep / tp groups of --tp ranks (a group holds its requests' KV cache, heads split over its ranks);
the MoE layers are expert-parallel over all ep ranks through ferry's AllToAll.

The ferry calls:
  decoder = ferry.KvDecoder(engine, side, regions, layers, layer_stride, aux=...)  group leader
  decoder.submit(id, prefill_address, prefill_side, pages, num_tokens, ...)  -> ferry.Transfer:
      the request's KV pages stream in layer by layer while other requests decode; it joins
      the batch at the step after the Transfer ends
  a2a = ferry.AllToAll(config, engine, bootstrap)                             every rank
  a2a.dispatch_send(...); <shared expert>; a2a.dispatch_recv(...); <experts>;
  a2a.combine_send(...); a2a.combine_recv(...)                                every MoE layer

With --colocated requests (the router's --colocated) the instance also prefills: a request
brings its prompt, whose chunks run mixed into the decode steps (the baseline of
tools/bench_serve.py: what the documents call prefill stalling decode).

With --device cuda the model runs on the GPU and the AllToAll on ferry's CUDA device (one node,
on the rank's stream); --cuda-graph captures the decode step once as a CUDA graph (GraphStep).

Each step, every rank shares its plan in one all-gather: the coordinator (coordinator.py; rank
0's) the requests the router sent (assigned to the least loaded group), each group leader its
batch (requests join and leave between steps) and what finished. Every rank then runs the same
layers, an empty batch included, since the AllToAll is collective.

With --elastic (attention TP 1) the coordinator is a process of its own and any rank that dies
is replaced while the others serve on (elastic.py): its requests are failed back to the router
as retryable (their KV died with it; the router sends them again), and a step that its death
touched is done again.

Run by hand:  python3 decode.py --model model.safetensors --ep 2 --control 0.0.0.0:7101
"""

import argparse
import hashlib
import sys
import threading
import time

import torch

import ferry
import elastic
import model as mdl
import ranks
from coordinator import IDLE_S, Coordinator, coordinate, lost_ranks

RETRYABLE = (ferry.Unavailable, ferry.DeadlineExceeded, ferry.Cancelled)


class Sequence:
    def __init__(self, msg):
        self.id = msg["id"]
        self.prompt_len, self.token = msg["prompt_len"], msg["last_token"]
        self.max_new = msg["max_new_tokens"]
        self.prefill_address = bytes.fromhex(msg.get("prefill_address", ""))
        self.prefill_tp = msg.get("prefill_tp", 1)
        # Colocated mode: the prompt comes along and this instance prefills it itself, in
        # chunks mixed into the decode steps; `pos` counts the prompt tokens done so far.
        self.prompt = msg.get("prompt")
        self.pages = self.slot = self.transfer = None
        self.pos = 0 if self.prompt else self.prompt_len - 1  # the last prompt token runs first
        self.out, self.times = [], []
        self.t_kv = None


class GroupLeader:
    """The first rank of an attention group: its KvDecoder, page pool and batch."""

    def __init__(self, args, config, caches, tp):
        c = self.config = config
        self.args = args
        self.engine = ranks.engine(args.provider)
        regions = [self.engine.register(v) for v in caches.views]
        self.aux = torch.zeros(args.max_requests, c.hidden, dtype=mdl.F32)
        self.side = ranks.kv_side(c, tp)
        self.page_bytes = self.side.page_bytes * tp
        self.decoder = ferry.KvDecoder(self.engine, self.side, regions, c.layers,
                                       caches.local[0].numel() * 4,
                                       aux=self.engine.register(self.aux),
                                       max_requests=args.max_requests)
        self.pool = mdl.PagePool(args.pages - (1 if args.cuda_graph else 0))
        self.free_slots = list(range(args.max_requests))
        self.backlog, self.waiting, self.active = [], {}, {}
        self.events = []
        self.wake = None  # set when a request's KV has landed

    def load(self):
        return len(self.backlog) + len(self.waiting) + len(self.active)

    def _free(self, s):
        self.pool.give(s.pages)
        self.free_slots.append(s.slot)

    def admit(self, msgs):
        """New requests from the router, then those that waited for pages."""
        c = self.config
        self.backlog.extend(Sequence(m) for m in msgs)
        keep = []
        for s in self.backlog:
            if s.prompt and self.args.cuda_graph:
                self.events.append({"op": "failed", "id": s.id, "retryable": False, "error":
                                    "colocated prefill does not run in a captured graph"})
                continue
            pages = self.pool.take(mdl.pages_for(c, s.prompt_len + s.max_new - 1))
            if pages is None or not self.free_slots:
                if pages is not None:
                    self.pool.give(pages)
                keep.append(s)
                continue
            s.pages, s.slot = pages, self.free_slots.pop()
            if s.prompt_len == 1 or s.prompt:  # nothing to fetch
                self.active[s.id] = s
                continue
            try:
                s.transfer = self.decoder.submit(
                    s.id, s.prefill_address, ranks.kv_side(c, s.prefill_tp),
                    s.pages[:mdl.pages_for(c, s.prompt_len - 1)], num_tokens=s.prompt_len,
                    aux_offset=s.slot * c.hidden * 4, aux_bytes=c.hidden * 4, speculative=True,
                    timeout=self.args.kv_timeout)
            except ferry.Error as e:
                self._fail(s, e)
                continue
            s.transfer.add_done_callback(lambda _t, s=s: self._landed(s))
            self.waiting[s.id] = s
        self.backlog = keep

    def _landed(self, s):  # on ferry's callback thread
        s.t_kv = s.transfer.ended_at
        self.wake.set()

    def _fail(self, s, error):
        self._free(s)
        self.events.append({"op": "failed", "id": s.id, "error": str(error),
                            "retryable": isinstance(error, RETRYABLE)})

    def check_waiting(self):
        """Requests whose KV has landed join the batch; those whose transfer failed are
        reported (their pages are free to reuse once the Transfer has ended)."""
        for rid in [rid for rid, s in self.waiting.items() if s.transfer.done]:
            s = self.waiting.pop(rid)
            if s.transfer.error is not None:
                self._fail(s, s.transfer.error)
            else:
                self.active[rid] = s

    def batch(self):
        """This step's rows: one token of each decoding sequence (up to --max-batch), then in
        colocated mode chunks of prompts still to prefill, up to --chunk tokens in all."""
        rows, budget = [], self.args.chunk
        for rid in sorted(self.active):
            s = self.active[rid]
            if s.prompt and s.pos < s.prompt_len - 1:
                n = min(budget, s.prompt_len - 1 - s.pos)
                if n > 0:
                    rows.append({"id": rid, "start": s.pos, "tokens": s.prompt[s.pos:s.pos + n],
                                 "pages": s.pages, "sample": False})
                    budget -= n
            elif sum(r["sample"] for r in rows) < self.args.max_batch:
                rows.append({"id": rid, "start": s.pos, "tokens": [s.token], "pages": s.pages,
                             "sample": True})
        return rows

    def step_done(self, batch, hidden, next_tokens, now):
        c, row = self.config, 0
        for entry in batch:
            row += len(entry["tokens"])
            s = self.active[entry["id"]]
            if not entry["sample"]:  # a prefill chunk
                s.pos += len(entry["tokens"])
                if s.pos == s.prompt_len - 1:
                    self.aux[s.slot] = hidden[row - 1].to(mdl.F32)
                    s.t_kv = now
                continue
            rid, token = entry["id"], next_tokens[row - 1]
            s.out.append(token)
            s.times.append(now)
            s.pos, s.token = s.pos + 1, token
            if len(s.out) < s.max_new:
                continue
            del self.active[rid]
            kv_pages = mdl.pages_for(c, s.prompt_len - 1)
            aux = self.aux[s.slot].numpy().tobytes() if s.prompt_len > 1 else b""
            self.events.append({
                "op": "result", "id": rid, "tokens": s.out, "t_kv_done": s.t_kv,
                "token_times": s.times,
                "kv_bytes": (kv_pages * c.layers * self.page_bytes + len(aux))
                if aux and not s.prompt else 0,
                "aux_sha256": hashlib.sha256(aux).hexdigest() if aux else None})
            self._free(s)

    def take_events(self):
        out, self.events = self.events, []
        return out

    def close(self):
        self.decoder.close()
        self.engine.close()


def moe_layer(bootstrap, a2a, model, bufs, members, tp_rank, timeout, after_send=None):
    """moe(l, xn, ids, weights, shared) for Model.forward: this rank's share of the group's
    tokens through the AllToAll, the shared expert between its send and receive halves; each
    receive waits up to `timeout` seconds. after_send(): run after each dispatch's send."""
    cfg = a2a.config
    first_expert = cfg.rank * cfg.local_experts

    def moe(l, xn, ids, weights, shared):
        lo, hi = split(xn.shape[0], len(members), tp_rank)
        n = hi - lo
        bufs["x"][:n] = xn[lo:hi].to(mdl.BF16)
        bufs["ids"][:n] = ids[lo:hi].to(torch.int32)
        bufs["w"][:n] = weights[lo:hi]
        a2a.dispatch_send(bufs["x"], bufs["ids"], bufs["w"], num_tokens=n)
        if after_send is not None:
            after_send()
        shared()
        a2a.dispatch_recv(bufs["recv"], bufs["counts"], timeout=timeout)
        for e, count in enumerate(bufs["counts"].tolist()):  # (waits for the receive)
            if count:
                bufs["out"][e, :count] = model.expert(l, first_expert + e, bufs["recv"][e, :count])
        a2a.combine_send(bufs["out"])
        a2a.combine_recv(bufs["y"], timeout=timeout)
        return ranks.group_cat(bootstrap, bufs["y"][:n].clone(), members)

    return moe


class GraphStep:
    """A decode step captured once as a CUDA graph (--cuda-graph; attention TP 1): up to
    `rows` sequences of one new token each, their count, positions, tokens and page tables in
    device tensors the graph reads when it replays, the AllToAll told the count on the device
    (device_num_tokens), so that one graph serves every batch. Rows past the count attend over
    the page kept for them and are not dispatched. Every rank captures and replays together:
    the AllToAll inside is collective."""

    def __init__(self, model, a2a, bufs, cache, rows, width, spare_page):
        device = model.device
        self.rows, self.width, self.spare = rows, width, spare_page
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.table = torch.full((rows, width), spare_page, dtype=torch.long, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)
        first = a2a.config.rank * a2a.config.local_experts

        def moe(l, xn, ids, weights, shared):
            bufs["x"][:rows] = xn.to(mdl.BF16)
            bufs["ids"][:rows] = ids.to(torch.int32)
            bufs["w"][:rows] = weights
            a2a.dispatch_send(bufs["x"], bufs["ids"], bufs["w"], num_tokens=rows,
                              device_num_tokens=self.count)
            shared()
            a2a.dispatch_recv(bufs["recv"], bufs["counts"])
            for e in range(a2a.config.local_experts):  # every slot: the counts stay on the GPU
                bufs["out"][e] = model.expert(l, first + e, bufs["recv"][e])
            a2a.combine_send(bufs["out"])
            a2a.combine_recv(bufs["y"])
            return bufs["y"][:rows]

        def step():
            hidden = model.forward(self.tokens, None, cache, moe=moe, attend=lambda l, h:
                                   model.attention_static(l, h, self.positions, self.table,
                                                          cache))
            return model.logits(hidden).argmax(-1)

        step()  # once eagerly (every rank: a dispatch of no tokens), then captured
        a2a.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=torch.cuda.current_stream()):
            self.next_tokens = step()
        a2a.synchronize()

    def run(self, batch):
        """The batch's next tokens (rows as GroupLeader.batch gives them; [] replays too)."""
        n = len(batch)
        tokens, positions = [0] * self.rows, [0] * self.rows
        table = [[self.spare] * self.width for _ in range(self.rows)]
        for i, r in enumerate(batch):
            tokens[i], positions[i] = r["tokens"][0], r["start"]
            table[i][:len(r["pages"])] = r["pages"]
        self.tokens.copy_(torch.tensor(tokens), non_blocking=False)
        self.positions.copy_(torch.tensor(positions))
        self.table.copy_(torch.tensor(table))
        self.count.fill_(n)
        self.graph.replay()
        return self.next_tokens[:n].tolist()


def split(n, parts, i):
    """Rows [lo, hi) of part i when n rows split over `parts` as evenly as can be."""
    base, extra = divmod(n, parts)
    lo = i * base + min(i, extra)
    return lo, lo + base + (i < extra)


def rank_main(bootstrap, args, member=None):
    """One rank's life: its model share, caches and AllToAll, then the step loop. `member`
    (elastic.Member, --elastic): its place in a world whose ranks may be replaced; a
    replacement joins the survivors' AllToAll instead of making one."""
    torch.set_num_threads(1)
    config, weights = mdl.load(args.model)
    c = config
    ep, me, tp = bootstrap.world_size, bootstrap.rank, args.tp
    group, tp_rank = divmod(me, tp)
    members = list(range(group * tp, group * tp + tp))
    cuda = args.device == "cuda"
    device = f"cuda:{ranks.cuda_device(me)}" if cuda else "cpu"
    model = mdl.Model(config, weights, tp_rank=tp_rank, tp_size=tp, device=device)
    caches = ranks.SharedCaches(bootstrap, args.tag,
                                mdl.cache_shape(c, args.pages, model.kv_local), members,
                                leader=members[0], device=args.device)
    per_rank = -(-(args.max_batch + args.chunk) // tp)
    moe_config = ferry.AllToAllConfig(
        world_size=ep, rank=me, num_experts=c.experts, experts_per_token=c.top_k,
        max_tokens_per_rank=per_rank, hidden=c.hidden, dtype=ferry.DispatchDtype.BF16,
        mask_lost_peers=member is not None)
    if cuda:  # one node: the NVLink kernels, no engine; the steps go on torch's stream
        moe_config.device, moe_config.ranks_per_node = ferry.MoeDevice.CUDA, ep
        moe_config.cuda_device = torch.cuda.current_device()
        moe_engine = None
    else:
        moe_engine = ranks.engine(args.provider)
    if member is not None and member.joining:
        a2a = ferry.AllToAll.join(moe_config, moe_engine, bootstrap, args.recovery_timeout)
    else:
        a2a = ferry.AllToAll(moe_config, moe_engine, bootstrap)
    if cuda:
        a2a.set_stream(torch.cuda.current_stream())
    cfg = a2a.config

    def zeros(*shape, dtype):
        return torch.zeros(*shape, dtype=dtype, device=device)

    bufs = {"x": zeros(per_rank, c.hidden, dtype=mdl.BF16),
            "ids": zeros(per_rank, c.top_k, dtype=torch.int32),
            "w": zeros(per_rank, c.top_k, dtype=mdl.F32),
            "recv": zeros(cfg.local_experts, cfg.expert_capacity, c.hidden, dtype=mdl.BF16),
            "counts": zeros(cfg.local_experts, dtype=torch.int32),
            "out": zeros(cfg.local_experts, cfg.expert_capacity, c.hidden, dtype=mdl.BF16),
            "y": zeros(per_rank, c.hidden, dtype=mdl.BF16)}
    crash = elastic.crash_hook(a2a, moe_engine, lambda: leader) if member is not None else None
    moe = moe_layer(bootstrap, a2a, model, bufs, members, tp_rank, args.step_timeout, crash)
    graph = None
    if args.cuda_graph:  # the last page of each rank's pool is kept for the graph's idle rows
        graph = GraphStep(model, a2a, bufs, caches.compute, args.max_batch,
                          mdl.pages_for(c, args.graph_tokens), args.pages - 1)
    leader = GroupLeader(args, config, caches, tp) if tp_rank == 0 else None
    groups = ep // tp
    # Whose plan each step takes: rank 0's coordinator, or (--elastic) the coordinator process,
    # the last of the plans' all-gather, which then runs over a bootstrap of its own.
    coordinator, planner, plans = None, 0, bootstrap
    if member is None and me == 0:
        coordinator = Coordinator(args, config, groups, tp)
    if member is not None:
        planner, plans = ep, member.plans(args.recovery_timeout)
    wake = coordinator.wake if coordinator is not None else None
    if leader is not None:
        wake = leader.wake = wake or threading.Event()
    assigned = []
    gather_timeout = args.recovery_timeout if member is not None else ranks.COLLECTIVE_TIMEOUT

    def recover():
        """The lost ranks replaced (elastic.Member.recover), over new bootstraps."""
        nonlocal bootstrap, plans
        bootstrap = plans = None  # closed: peers waiting in a collective on them fail at once
        bootstrap, plans, replaced = member.recover(a2a, args.recovery_timeout)
        print(f"decode rank {me}: generation {member.generation}, ranks {replaced} replaced",
              file=sys.stderr, flush=True)

    while True:
        state = {"load": leader.load() if leader else 0}
        if coordinator is not None:
            state.update(coordinator.plan())
        if leader is not None:
            leader.admit(assigned)
            assigned = []
            leader.check_waiting()
            state.update(batch=leader.batch(), events=leader.take_events(),
                         load=leader.load(), streaming=len(leader.waiting))
        if member is not None:  # the ranks this one's last step masked (presumed lost)
            state["masked"] = [r for r, m in enumerate(a2a.masked()) if m]
        try:
            everyone = ranks.gather(plans, state, gather_timeout)
        except ferry.Error:
            if member is None:
                raise
            everyone = None  # recovered outside the handler, whose traceback holds plans
        if everyone is None:
            if leader is not None:  # what finished is reported after the recovery
                leader.events[:0] = state["events"]
            recover()
            continue
        if coordinator is not None:
            coordinator.planned(state, everyone)
        plan = everyone[planner]
        if plan["stop"]:
            break
        assigned = plan["assign"][group] if leader is not None else []
        lost = lost_ranks(everyone)
        if lost:
            if me in lost:  # a peer took this rank for lost: it leaves, a new process takes over
                print(f"decode rank {me}: masked by a peer; leaving", file=sys.stderr,
                      flush=True)
                raise SystemExit(elastic.EVICTED)
            recover()
            continue
        batch = everyone[members[0]]["batch"]
        if not any(everyone[g * tp]["batch"] for g in range(groups)):
            if wake is not None:  # until a message or a landed KV may change the plan
                wake.wait(IDLE_S)
                wake.clear()
            continue
        if graph is not None:
            next_tokens = graph.run(batch)
            if leader is not None:
                leader.step_done(batch, None, next_tokens, time.time())
            a2a.synchronize()
            continue
        seqs = [mdl.Seq(r["pages"], r["start"], len(r["tokens"])) for r in batch]
        hidden = model.forward([t for r in batch for t in r["tokens"]], seqs, caches.compute,
                               all_reduce=lambda t: ranks.group_sum(bootstrap, t, members),
                               moe=moe)
        if cuda:
            a2a.synchronize()  # what its kernels found; the step's arrays let go
        # A step in which this rank masked anyone ran without that rank's experts: its tokens
        # are not taken, and it runs again after the recovery (its KV writes made again).
        if leader is not None and not (member is not None and any(a2a.masked())):
            next_tokens = model.logits(hidden).argmax(-1).tolist() if batch else []
            leader.step_done(batch, hidden, next_tokens, time.time())
    a2a.close()
    if moe_engine is not None:
        moe_engine.close()
    if leader is not None:
        leader.close()
    if coordinator is not None:
        coordinator.close()


def elastic_rank(member, args):
    """rank_main of an --elastic rank: over its generation's bootstrap (elastic.supervise). A
    new process whose generation does not meet (another rank lost meanwhile) meets the next:
    the survivors there readmit every rank replaced since their last meeting."""
    while True:
        try:
            group = member.bootstrap(args.recovery_timeout)
            break
        except ferry.Error:
            if not member.joining:
                raise
            member.take(member.membership.after(member.generation, args.recovery_timeout))
    rank_main(group, args, member)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ranks.instance_args(p, "decode")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (forked here)")
    p.add_argument("--tp", type=int, default=1, help="attention tensor-parallel ranks per group")
    p.add_argument("--max-batch", type=int, default=32, help="sequences per group and step")
    p.add_argument("--max-requests", type=int, default=64, help="requests a group holds at once")
    p.add_argument("--chunk", type=int, default=64,
                   help="colocated mode: prompt tokens prefilled here per step")
    p.add_argument("--cuda-graph", action="store_true",
                   help="--device cuda, --tp 1: the decode step captured once as a CUDA graph")
    p.add_argument("--graph-tokens", type=int, default=1024,
                   help="with --cuda-graph: the longest sequence a graph's page table holds")
    p.add_argument("--kv-timeout", type=float, default=20.0,
                   help="seconds a request's KV may take to land")
    p.add_argument("--elastic", action="store_true",
                   help="--tp 1: a rank that dies (but rank 0) is replaced while the others "
                        "serve (elastic.py)")
    p.add_argument("--step-timeout", type=float, default=30.0,
                   help="seconds an MoE receive waits for its peers (--elastic: then masks "
                        "those silent)")
    p.add_argument("--recovery-timeout", type=float, default=60.0,
                   help="--elastic: seconds a rank waits for its peers' next plan, and for a "
                        "lost rank's replacement to meet it")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    config, _ = mdl.load(args.model)
    if args.tp < 1 or args.ep % args.tp or config.kv_heads % args.tp:
        sys.exit(f"--tp {args.tp} must divide --ep {args.ep} and {config.kv_heads} KV heads")
    if config.experts % args.ep:
        sys.exit(f"--ep {args.ep} must divide {config.experts} experts")
    if args.cuda_graph and (args.device != "cuda" or args.tp != 1):
        sys.exit("--cuda-graph wants --device cuda and --tp 1 (TP sums leave the GPU)")
    if args.elastic and (args.tp != 1 or args.cuda_graph):
        # A lost rank's TP group would lose a share of every sum mid-step; a graph holds the
        # AllToAll's memory, which a readmission makes anew.
        sys.exit("--elastic wants --tp 1 and no --cuda-graph")
    if args.elastic:
        torch.set_num_threads(1)  # before the ranks fork (ranks.run_instance says why)
        raise SystemExit(elastic.supervise(args.ep, lambda m: elastic_rank(m, args),
                                           lambda m: coordinate(m, args, config), args.tag))
    ranks.run_instance(args.ep, lambda b: rank_main(b, args))


if __name__ == "__main__":
    main()
