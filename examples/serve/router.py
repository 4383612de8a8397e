"""The router: takes prompts from clients, checks them, and sends each to a prefill instance (its
tokens) and a decode instance (what to generate, and which prefill holds the prompt); answers
with the generated tokens and where the time went. It never touches KV data: the decode
instance asks the prefill for it over ferry.

Client API: one JSON object per line over TCP,
  {"id": any, "prompt": [token ids], "max_new_tokens": n}
answered (in completion order) by
  {"id": ..., "tokens": [...], "ttft_ms": ..., "queue_ms": ..., "prefill_ms": ...,
   "kv_tail_ms": ..., "decode_ms_per_token": ..., "kv_bytes": ..., "attempts": ...}
or {"id": ..., "error": "..."}; {"op": "stats"} gives each instance's page pool and load.

A request whose KV never lands (its prefill died or hung: the decoder's transfer ends
Unavailable or DeadlineExceeded) is tried again on another live prefill; one whose decode
instance is lost is answered with an error.

Run by hand:  python3 router.py --listen 0.0.0.0:7000 --prefill host1:7001 --decode host2:7101
"""

import argparse
import asyncio
import itertools
import json
import sys
import time

from control import announce, encode, parse_address, token_list

MAX_LINE_BYTES = 1 << 20
PREFILLED_WAIT_S = 2.0  # how long a result waits for its prefill's timings (they come first)


class Unavailable(Exception):
    """Nothing can serve a request now (an outage): the client may send it again."""


class Instance:
    def __init__(self, router, role, address):
        self.router, self.role, self.address = router, role, address
        self.name = f"{role}@{address}"
        self.hello, self.alive, self.outstanding = None, False, set()
        self.stats_waiters = []

    async def connect(self, deadline):
        while True:
            try:
                self.reader, self.writer = await asyncio.open_connection(
                    *parse_address(self.address), limit=MAX_LINE_BYTES)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"{self.name}: no answer") from None
                await asyncio.sleep(0.1)
        self.hello = json.loads(await asyncio.wait_for(self.reader.readline(), 30))
        if self.hello.get("role") != self.role:
            raise ConnectionError(f"{self.name}: says it is {self.hello.get('role')}")
        self.alive = True
        asyncio.ensure_future(self._read())

    def send(self, msg):
        self.writer.write(encode(msg))

    async def _read(self):
        try:
            while line := await self.reader.readline():
                self.router.on_event(self, json.loads(line))
        except (OSError, ValueError):
            pass
        self.alive = False
        self.router.on_lost(self)

    async def stats(self):
        if not self.alive:
            return {"alive": False}
        fut = asyncio.get_running_loop().create_future()
        self.stats_waiters.append(fut)
        self.send({"op": "stats"})
        try:
            return {"alive": True, **await asyncio.wait_for(fut, 5)}
        except asyncio.TimeoutError:
            return {"alive": True, "error": "no stats within 5 s"}


class Attempt:
    def __init__(self, prefill, decode):
        self.prefill, self.decode = prefill, decode
        self.done = asyncio.get_running_loop().create_future()
        self.prefilled = asyncio.get_running_loop().create_future()
        self.refusal = None


class Router:
    def __init__(self, args):
        self.args = args
        self.prefills = [Instance(self, "prefill", a) for a in args.prefill]
        self.decodes = [Instance(self, "decode", a) for a in args.decode]
        self.attempts = {}
        self.ids = itertools.count(1)

    # -- instance events --

    def on_event(self, inst, msg):
        op, a = msg.get("op"), self.attempts.get(msg.get("id"))
        if op == "stats":
            if inst.stats_waiters:
                inst.stats_waiters.pop(0).set_result(msg)
        elif a is None:
            return
        elif op in ("result", "failed") and not a.done.done():
            a.done.set_result(msg)
        elif op == "prefilled" and not a.prefilled.done():
            a.prefilled.set_result(msg)
        elif op == "refused":
            a.refusal = msg["error"]

    def on_lost(self, inst):
        print(f"router: {inst.name} lost", file=sys.stderr, flush=True)
        for kv_id in list(inst.outstanding):
            a = self.attempts.get(kv_id)
            if inst.role == "decode" and a is not None and not a.done.done():
                a.done.set_result({"op": "failed", "retryable": False, "outage": True,
                                   "error": f"decode instance {inst.name} lost"})

    # -- requests --

    def check(self, msg):
        """The request's (prompt, max_new_tokens); a ValueError saying what is wrong with it, or
        Unavailable where nothing could serve it now."""
        if not isinstance(msg, dict):
            raise ValueError("a request is a JSON object")
        prompt, new = msg.get("prompt"), msg.get("max_new_tokens", 16)
        hello = next((d.hello for d in self.decodes if d.alive), None)
        if hello is None:
            raise Unavailable("no decode instance is up")
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt must be a non-empty list of token ids")
        if len(prompt) > self.args.max_prompt:
            raise ValueError(f"prompt of {len(prompt)} tokens; at most {self.args.max_prompt}")
        if not token_list(prompt, hello["vocab"]):
            bad = next(t for t in prompt if not token_list([t], hello["vocab"]))
            raise ValueError(f"token {bad!r} is not an id in [0, {hello['vocab']})")
        if type(new) is not int or not 1 <= new <= self.args.max_new:
            raise ValueError(f"max_new_tokens must be an integer in [1, {self.args.max_new}]")
        if len(prompt) + new - 1 > hello["max_tokens"]:
            raise ValueError(f"prompt + max_new_tokens exceed a decode sequence's "
                             f"{hello['max_tokens']} tokens")
        return prompt, new

    @staticmethod
    def _least_busy(instances, skip=()):
        live = [i for i in instances if i.alive and i not in skip]
        return min(live, key=lambda i: len(i.outstanding)) if live else None

    async def generate(self, prompt, new):
        t_received, rid, tried, last_error = time.time(), next(self.ids), [], None
        outage = False
        for attempt in range(self.args.attempts):
            decode = self._least_busy(self.decodes)
            remote = len(prompt) > 1 and not self.args.colocated
            prefill = self._least_busy(self.prefills, tried) if remote else None
            if decode is None or (prefill is None and remote):
                break
            kv_id = rid * 16 + attempt
            a = self.attempts[kv_id] = Attempt(prefill, decode)
            msg = {"op": "generate", "id": kv_id, "prompt_len": len(prompt),
                   "last_token": prompt[-1], "max_new_tokens": new}
            if self.args.colocated:
                msg["prompt"] = prompt
            if prefill is not None:
                tried.append(prefill)
                prefill.outstanding.add(kv_id)
                prefill.send({"op": "prompt", "id": kv_id, "tokens": prompt[:-1]})
                msg.update(prefill_address=prefill.hello["address"], prefill_tp=prefill.hello["tp"])
            decode.outstanding.add(kv_id)
            decode.send(msg)
            try:
                result = await a.done
                if result["op"] == "result":
                    return await self._answer(a, result, t_received, attempt + 1)
                last_error = result["error"] + (f" ({a.refusal})" if a.refusal else "")
                outage = bool(result.get("retryable") or result.get("outage"))
                if not result.get("retryable"):
                    break
                if result.get("rank_lost") and prefill is not None:
                    tried.remove(prefill)  # the decode rank was lost, not the prefill
            finally:
                del self.attempts[kv_id]
                decode.outstanding.discard(kv_id)
                if prefill is not None:
                    prefill.outstanding.discard(kv_id)
        # An outage (no instance to try, an instance lost, every prefill tried) is the service's,
        # not the request's: the client may send it again. What an instance refused is final.
        if last_error is not None and not outage:
            return {"error": last_error, "retryable": False}
        return {"error": f"unavailable: {last_error or 'no live prefill and decode instances'}",
                "retryable": True}

    async def _answer(self, a, result, t_received, attempts):
        times = result["token_times"]
        out = {"tokens": result["tokens"], "ttft_ms": (times[0] - t_received) * 1e3,
               "t_first_token": times[0],
               "kv_bytes": result["kv_bytes"], "aux_sha256": result["aux_sha256"],
               "itl_ms": [(t1 - t0) * 1e3 for t0, t1 in zip(times, times[1:])],
               "decode_ms_per_token": ((times[-1] - times[0]) / (len(times) - 1) * 1e3
                                       if len(times) > 1 else None),
               "decode": a.decode.name, "attempts": attempts}
        if a.prefill is not None:
            out["prefill"] = a.prefill.name
            try:
                p = await asyncio.wait_for(asyncio.shield(a.prefilled), PREFILLED_WAIT_S)
                out.update(queue_ms=(p["t_start"] - t_received) * 1e3,
                           prefill_ms=(p["t_last_layer"] - p["t_start"]) * 1e3,
                           kv_tail_ms=(result["t_kv_done"] - p["t_last_layer"]) * 1e3)
            except asyncio.TimeoutError:
                pass
        return out

    # -- clients --

    async def client(self, reader, writer):
        async def reply(msg):
            writer.write(encode(msg))
            await writer.drain()

        async def serve_one(cid, msg):
            try:
                prompt, new = self.check(msg)
            except Unavailable as e:
                await reply({"id": cid, "error": f"unavailable: {e}", "retryable": True})
                return
            except ValueError as e:
                await reply({"id": cid, "error": f"bad request: {e}", "retryable": False})
                return
            await reply({"id": cid, **await self.generate(prompt, new)})

        tasks = set()
        try:
            async for line in lines(reader, MAX_LINE_BYTES):
                if line is None:
                    await reply({"error": f"bad request: a line over {MAX_LINE_BYTES} bytes", "retryable": False})
                    continue
                try:
                    msg = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    await reply({"error": f"bad request: not JSON ({e})", "retryable": False})
                    continue
                cid = msg.get("id") if isinstance(msg, dict) else None
                if isinstance(msg, dict) and msg.get("op") == "stats":
                    await reply({"id": cid, "stats": {i.name: await i.stats()
                                                      for i in self.prefills + self.decodes}})
                    continue
                task = asyncio.ensure_future(serve_one(cid, msg))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def run(self):
        deadline = time.monotonic() + self.args.connect_timeout
        for inst in self.prefills + self.decodes:
            await inst.connect(deadline)
        server = await asyncio.start_server(self.client, *parse_address(self.args.listen),
                                            limit=MAX_LINE_BYTES)
        host, port = server.sockets[0].getsockname()[:2]
        announce({"ready": "router", "listen": f"{host}:{port}"})
        async with server:
            await server.serve_forever()


async def lines(reader, limit):
    """The lines of a stream (without their newline); None for one over `limit` bytes, which
    is skipped to its end rather than ending the connection."""
    buf, skipping = b"", False
    while chunk := await reader.read(65536):
        buf += chunk
        while True:
            end = buf.find(b"\n")
            if end < 0:
                if len(buf) > limit:
                    if not skipping:
                        yield None
                    buf, skipping = b"", True
                break
            line, buf = buf[:end], buf[end + 1:]
            if skipping or len(line) > limit:
                if not skipping:
                    yield None
                skipping = False
                continue
            if line.strip():
                yield line


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT for clients")
    p.add_argument("--prefill", action="append", default=[], help="a prefill's control address")
    p.add_argument("--decode", action="append", default=[], help="a decode's control address")
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--attempts", type=int, default=3, help="prefills a request may try")
    p.add_argument("--connect-timeout", type=float, default=60.0)
    p.add_argument("--colocated", action="store_true",
                   help="no prefill instances: each decode instance prefills its own prompts")
    args = p.parse_args(argv)
    if not args.decode or not (args.prefill or args.colocated):
        p.error("at least one --decode, and one --prefill unless --colocated")
    return args


def main(argv=None):
    asyncio.run(Router(parse_args(argv)).run())


if __name__ == "__main__":
    main()
