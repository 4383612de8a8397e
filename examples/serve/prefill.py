"""A prefill instance: the model's prompt pass, tensor-parallel over --tp ranks, streaming each
layer's KV pages to the decoders as the pass goes.

The ferry calls, all on the leader rank (rank 0):
  engine  = ferry.TransferEngine(...)                  one engine for every rank's cache
  prefill = ferry.KvPrefill(engine, side, regions, layers, layer_stride, aux, counter)
  prefill.poll_requests()                              what decoders asked for
  prefill.schedule_chunk(id, first_page, pages, pass_base=counter.value, aux_offset=...)
  counter.increment()                                  after each layer's output projection
  prefill.poll_releases()                              a request's source pages are free again

A request needs two halves: its prompt from the router (control socket) and its KV request
from the decoder (ferry). Once both are here it is prefilled in chunks of --chunk tokens, several
requests' chunks to a pass up to --batch-tokens. The prompt's last token is left out: the decoder
runs it as its first step, and the final hidden state of the token before it goes as aux data.

Run by hand:  python3 prefill.py --model model.safetensors --tp 2 --control 0.0.0.0:7001
              (FERRY_PROVIDER picks the fabric; its engine address goes to the router)
"""

import argparse
import collections
import sys
import time

import torch

import ferry
import model as mdl
import ranks
from control import ControlServer, announce, check_fields, parse_address, token_list

UNMATCHED_S = 30.0  # a prompt or KV request whose other half has not come by then is dropped
IDLE_S = 0.05       # an idle leader looks again this often (unmatched halves age out)


class Request:
    def __init__(self, rid, tokens):
        self.id, self.tokens = rid, tokens
        self.pages, self.slot = None, None
        self.done = 0           # tokens scheduled so far
        self.t_start = None     # first pass


class Leader:
    """Rank 0's side: the control socket, the KvPrefill, the page pool and the schedule."""

    def __init__(self, args, config, caches, tp, kv_local):
        self.args, self.config, self.tp = args, config, tp
        c = config
        self.engine = ranks.engine(args.provider)
        self.regions = [self.engine.register(v) for v in caches.views]
        self.aux = torch.zeros(args.max_requests, c.hidden, dtype=mdl.F32)
        self.aux_bytes = c.hidden * 4
        # The layer counter: bumped by the host, or on a CUDA device enqueued on the model's
        # stream behind the kernels that wrote the layer's KV. `counted` is how many bumps
        # have been issued: the counter's value once they ran, which the next pass starts from.
        self.cuda = args.device == "cuda"
        self.counter = ferry.GpuLayerCounter() if self.cuda else ferry.LayerCounter()
        self.counted = 0
        layer_stride = caches.local[0].numel() * 4
        self.prefill = ferry.KvPrefill(self.engine, ranks.kv_side(c, tp), self.regions, c.layers,
                                       layer_stride, self.engine.register(self.aux),
                                       self.counter)
        self.pool = mdl.PagePool(args.pages)
        self.free_slots = list(range(args.max_requests))
        self.prompts, self.asked = {}, {}          # id -> (tokens, t) / (incoming dict, t)
        self.queue = collections.deque()           # ids with both halves, not yet started
        self.running = {}                          # id -> Request, until released
        self.stopping = False
        self.armed = [None, None]  # the request and release readiness _wait listens to
        host, port = parse_address(args.control)
        self.control = ControlServer(host, port, on_connect=self._hello)
        announce({"ready": "prefill", "control": self.control.address})

    def _hello(self, cid):
        self.control.send(cid, {"op": "hello", "role": "prefill", "tp": self.tp,
                                "address": self.engine.address.hex(),
                                "pages": self.args.pages, "chunk": self.args.chunk})

    # -- events --

    def _take_events(self):
        now = time.time()
        for cid, msg in self.control.drain():
            op = msg and msg.get("op")
            if op == "prompt":
                problem = check_fields(msg, {"id": int, "tokens": list})
                if problem is None and not token_list(msg["tokens"], self.config.vocab):
                    problem = "tokens must be ids in [0, vocab)"
                if problem is not None:  # its KV request, if one comes, ages out refused
                    print(f"prefill: a prompt message refused: {problem}", file=sys.stderr)
                    continue
                self.prompts[msg["id"]] = (msg["tokens"], now)
            elif op == "stats":
                self.control.send(cid, {"op": "stats", "free_pages": self.pool.free,
                                        "pages": self.pool.num_pages,
                                        "running": len(self.running)})
            elif op == "stop":
                self.stopping = True
        for incoming in self.prefill.poll_requests():
            self.asked[incoming["request_id"]] = (incoming, now)
        for rid, error in self.prefill.poll_releases():
            r = self.running.pop(rid, None)
            if r is not None and r.pages is not None:
                self.pool.give(r.pages)
                self.free_slots.append(r.slot)
            self.control.broadcast({"op": "released", "id": rid,
                                    "error": None if error is None else str(error)})
        for rid in [rid for rid in self.asked if rid in self.prompts]:
            (incoming, _), (tokens, _) = self.asked.pop(rid), self.prompts.pop(rid)
            if incoming["num_tokens"] != len(tokens) or \
                    incoming["num_pages"] != mdl.pages_for(self.config, len(tokens)):
                self._refuse(rid, f"the decoder asked for {incoming['num_tokens']} tokens in "
                             f"{incoming['num_pages']} pages; the prompt has {len(tokens)}")
                continue
            self.running[rid] = Request(rid, tokens)
            self.queue.append(rid)
        for table in (self.prompts, self.asked):
            for rid in [rid for rid, (_, t) in table.items() if now - t > UNMATCHED_S]:
                del table[rid]
                if table is self.asked:
                    self._refuse(rid, "no prompt came from the router")

    def _refuse(self, rid, why):
        self.control.broadcast({"op": "refused", "id": rid, "error": why})
        try:
            self.prefill.cancel(rid)
        except ferry.NotFound:  # its decoder went away and the messenger forgot it: no release
            return
        self.running[rid] = Request(rid, [])  # its release comes back through poll_releases

    # -- the schedule --

    def next_pass(self):
        """The next pass's chunks (waiting for work), or None to stop."""
        while True:
            self._take_events()
            if self.stopping:
                return None
            chunks = self._plan()
            if chunks:
                return chunks
            self._wait()

    def _wait(self):
        """Until a message, a request or a release may be there (at most IDLE_S). A queue's
        readiness is armed once and again only after it fired: while nothing comes,
        request_ready() hands back the same pending Transfer, and arming it every pass would
        pile up callbacks for as long as the leader idles."""
        wake = self.control.wake
        for i, make in enumerate((self.prefill.request_ready, self.prefill.release_ready)):
            if self.armed[i] is None or self.armed[i].done:
                self.armed[i] = make()
                self.armed[i].add_done_callback(lambda _t: wake.set())
        wake.wait(IDLE_S)
        wake.clear()

    def _plan(self):
        c, budget, chunks = self.config, self.args.batch_tokens, []
        started = [r for r in self.running.values() if r.pages is not None and
                   r.done < len(r.tokens)]
        while budget > 0:
            if started:
                r = started.pop(0)
            elif self.queue:
                r = self.running.get(self.queue[0])
                if r is None or r.pages is not None:
                    self.queue.popleft()
                    continue
                pages = self.pool.take(mdl.pages_for(c, len(r.tokens)))
                if pages is None or not self.free_slots:
                    if pages is not None:
                        self.pool.give(pages)
                    break  # the oldest waits for pages; later ones wait behind it
                self.queue.popleft()
                r.pages, r.slot = pages, self.free_slots.pop()
            else:
                break
            left = len(r.tokens) - r.done
            step = min(self.args.chunk, budget)
            n = left if left <= step else step // c.page_tokens * c.page_tokens
            if n == 0:
                break
            first = r.done // c.page_tokens
            last = r.done + n == len(r.tokens)
            pages = r.pages[first:mdl.pages_for(c, r.done + n)]
            self.prefill.schedule_chunk(r.id, first, pages, pass_base=self.counted,
                                        aux_offset=r.slot * self.aux_bytes if last else 0)
            chunks.append({"id": r.id, "tokens": r.tokens[r.done:r.done + n], "pages": r.pages,
                           "start": r.done, "last": last})
            r.done += n
            budget -= n
        return chunks

    def _count_layer(self):
        if self.cuda:
            self.counter.increment(torch.cuda.current_stream().cuda_stream)
        else:
            self.counter.increment()
        self.counted += 1

    def after_layer(self, l):
        if l < self.config.layers - 1:
            self._count_layer()

    def after_pass(self, chunks, hidden, t_start):
        """The last layer counts once the final hidden states are known, so that the aux bytes
        (read right after it) hold the hidden state before each finished prompt's last token."""
        row = 0
        for ch in chunks:
            row += len(ch["tokens"])
            r = self.running.get(ch["id"])
            if r is not None and r.t_start is None:
                r.t_start = t_start
            if ch["last"] and r is not None:
                self.aux[r.slot] = hidden[row - 1].to(mdl.F32)
        self._count_layer()
        t_end = time.time()
        for ch in chunks:
            r = self.running.get(ch["id"])
            if ch["last"] and r is not None:
                self.control.broadcast({"op": "prefilled", "id": r.id, "t_start": r.t_start,
                                        "t_last_layer": t_end})

    def close(self):
        self.prefill.close()
        self.engine.close()
        self.control.close()


def rank_main(bootstrap, args):
    torch.set_num_threads(1)
    config, weights = mdl.load(args.model)
    tp, me = bootstrap.world_size, bootstrap.rank
    device = f"cuda:{ranks.cuda_device(me)}" if args.device == "cuda" else "cpu"
    model = mdl.Model(config, weights, tp_rank=me, tp_size=tp, device=device)
    members = list(range(tp))
    caches = ranks.SharedCaches(bootstrap, args.tag, mdl.cache_shape(config, args.pages,
                                                                      model.kv_local),
                                members, leader=0, device=args.device)
    leader = Leader(args, config, caches, tp, model.kv_local) if me == 0 else None
    delay = args.layer_delay_ms / 1000.0

    def after_attention(l):
        if delay:
            time.sleep(delay)
        if leader is not None:
            leader.after_layer(l)

    while True:
        chunks = leader.next_pass() if leader is not None else None
        if tp > 1:
            chunks = ranks.gather(bootstrap, chunks)[0]
        if chunks is None:
            break
        t_start = time.time()
        seqs = [mdl.Seq(ch["pages"], ch["start"], len(ch["tokens"])) for ch in chunks]
        tokens = [t for ch in chunks for t in ch["tokens"]]
        hidden = model.forward(tokens, seqs, caches.compute,
                               all_reduce=lambda t: ranks.group_sum(bootstrap, t, members),
                               after_attention=after_attention)
        if leader is not None:
            leader.after_pass(chunks, hidden, t_start)
            print(f"prefill: pass of {len(tokens)} tokens ({len(chunks)} chunks) in "
                  f"{(time.time() - t_start) * 1e3:.1f} ms", file=sys.stderr, flush=True)
    if leader is not None:
        leader.close()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ranks.instance_args(p, "prefill")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (forked here)")
    p.add_argument("--chunk", type=int, default=64, help="chunk tokens (a multiple of a page)")
    p.add_argument("--batch-tokens", type=int, default=128, help="prompt tokens per pass")
    p.add_argument("--max-requests", type=int, default=64, help="aux slots: requests at once")
    p.add_argument("--layer-delay-ms", type=float, default=0.0,
                   help="extra time per layer (stands for a larger model's compute)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    config, _ = mdl.load(args.model)
    if args.chunk <= 0 or args.chunk % config.page_tokens:
        sys.exit(f"--chunk {args.chunk} is not a positive multiple of {config.page_tokens}")
    if args.batch_tokens < args.chunk:
        sys.exit("--batch-tokens must hold at least one chunk")
    ranks.run_instance(args.tp, lambda b: rank_main(b, args))


if __name__ == "__main__":
    main()
