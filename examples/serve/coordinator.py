"""A decode instance's coordinator: the router's control connection and each step's plan --
which attention group takes each new request -- with what it keeps from step to step (the
requests checked but not yet handed out, the group serving each one handed out, the groups'
loads). Rank 0 runs it within its step loop; an --elastic instance runs it as a process of its
own beside the ranks (coordinate), so that any rank can be lost and replaced.

Each step every rank and the coordinator share their states in one all-gather: the
coordinator's plan ({"assign": per group, "stop"}), and each group leader's batch, load and
events (results, failures) -- see decode.py.
"""

import sys

import ferry
import ranks
from control import ControlServer, announce, check_fields, parse_address, token_list

IDLE_S = 0.01  # with nothing to decode, an idle participant looks again this often


def lost_ranks(everyone):
    """The ranks some participant's last step masked (--elastic: presumed lost), sorted."""
    return sorted({r for s in everyone for r in s.get("masked", ())})


def check_generate(msg, config, args):
    """None for a well-formed generate message, else what is wrong with it."""
    problem = check_fields(msg, {"id": int, "prompt_len": int, "last_token": int,
                                 "max_new_tokens": int})
    if problem is not None:
        return problem
    if msg["prompt_len"] < 1 or msg["max_new_tokens"] < 1:
        return "prompt_len and max_new_tokens must be positive"
    if not token_list([msg["last_token"]], config.vocab):
        return "last_token is not a token id"
    if msg["prompt_len"] + msg["max_new_tokens"] - 1 > args.pages * config.page_tokens:
        return "the sequence does not fit this instance's pages"
    if "prompt" in msg:
        if not token_list(msg["prompt"], config.vocab) or len(msg["prompt"]) != msg["prompt_len"]:
            return "prompt must hold prompt_len token ids"
    elif msg["prompt_len"] > 1:
        problem = check_fields(msg, {"prefill_address": str, "prefill_tp": int})
        if problem is not None:
            return problem
        try:
            bytes.fromhex(msg["prefill_address"])
        except ValueError:
            return "prefill_address is not hex"
        if msg["prefill_tp"] < 1:
            return "prefill_tp must be positive"
    return None


class Coordinator:
    """Listens at args.control for the router (printing the instance's ready line) and plans
    the steps of `groups` attention groups of `tp` ranks."""

    def __init__(self, args, config, groups, tp):
        self.args, self.config, self.tp = args, config, tp
        c = config
        self.hello = {"op": "hello", "role": "decode", "ep": groups * tp, "tp": tp,
                      "max_tokens": min(args.graph_tokens, (args.pages - 1) * c.page_tokens)
                      if args.cuda_graph else args.pages * c.page_tokens,
                      "max_batch": args.max_batch, "vocab": c.vocab}
        host, port = parse_address(args.control)
        self.control = ControlServer(host, port,
                                     on_connect=lambda cid: self.control.send(cid, self.hello))
        self.wake = self.control.wake
        self.unsent, self.owner = [], {}  # requests not yet handed out; request -> group
        self.loads, self.stop = [0] * groups, False
        self.streaming = [0] * groups  # requests whose KV still streams in, per group
        announce({"ready": "decode", "control": self.control.address})

    def plan(self):
        """This step's plan: the router's new requests (checked; those malformed answered)
        handed to the least loaded groups, and whether to stop."""
        for cid, msg in self.control.drain():
            op = msg and msg.get("op")
            if op == "generate":
                problem = check_generate(msg, self.config, self.args)
                if problem is not None:
                    self.control.send(cid, {"op": "failed", "id": msg.get("id"),
                                            "retryable": False, "error": problem})
                    continue
                self.unsent.append(msg)
            elif op == "stats":
                self.control.send(cid, {"op": "stats", "loads": self.loads,
                                        "streaming": self.streaming})
            elif op == "stop":
                self.stop = True
        per_group, planned = [[] for _ in self.loads], list(self.loads)
        for msg in self.unsent:
            g = min(range(len(planned)), key=lambda i: planned[i])
            per_group[g].append(msg)
            planned[g] += 1
        return {"assign": per_group, "stop": self.stop}

    def planned(self, plan, everyone):
        """`plan` reached every rank (the all-gather of `everyone`'s states, by rank): its
        requests are handed out; the leaders' loads and events (sent to the router) taken."""
        self.unsent = []
        for g, msgs in enumerate(plan["assign"]):
            self.owner.update((m["id"], g) for m in msgs)
        self.loads = [everyone[g * self.tp]["load"] for g in range(len(self.loads))]
        self.streaming = [everyone[g * self.tp].get("streaming", 0)
                          for g in range(len(self.loads))]
        for s in everyone:
            for event in s.get("events", ()):
                self.owner.pop(event.get("id"), None)
                self.control.broadcast(event)

    def lost(self, replaced):
        """Ranks `replaced` were lost: their groups' requests are failed back to the router as
        retryable (their KV cache died with them; rank_lost: the prefill may serve them
        again), and their loads start again from nothing."""
        groups = {r // self.tp for r in replaced}
        for rid, g in [(rid, g) for rid, g in self.owner.items() if g in groups]:
            del self.owner[rid]
            self.control.broadcast({"op": "failed", "id": rid, "retryable": True,
                                    "rank_lost": True,
                                    "error": f"unavailable: decode rank {g * self.tp} lost"})
        for g in groups:
            self.loads[g] = 0

    def close(self):
        self.control.close()


def coordinate(member, args, config):
    """The coordinator of an --elastic instance as a process of its own (elastic.supervise):
    the last participant of every step's all-gather, over each generation's plan bootstrap;
    when a step fails or a rank was taken for lost, it waits for the generation that
    replaces the lost ranks and fails their requests back to the router."""
    groups = member.world // args.tp
    coordinator = Coordinator(args, config, groups, args.tp)
    plans = member.plans(args.recovery_timeout)
    while True:
        plan = coordinator.plan()
        try:
            everyone = ranks.gather(plans, {"load": 0, **plan}, args.recovery_timeout)
        except ferry.Error:
            everyone = None  # recovered outside the handler, whose traceback holds plans
        lost = lost_ranks(everyone or ())
        if everyone is not None:
            coordinator.planned(plan, everyone)
            if plan["stop"]:
                break
        if everyone is None or lost:
            plans = None  # closed: ranks waiting in a collective on it fail at once
            plans, replaced = member.next_plans(args.recovery_timeout)
            print(f"decode coordinator: generation {member.generation}, ranks {replaced} "
                  "replaced", file=sys.stderr, flush=True)
            coordinator.lost(replaced)
            continue
        if not any(s.get("batch") for s in everyone):
            coordinator.wake.wait(IDLE_S)
            coordinator.wake.clear()
    coordinator.close()
