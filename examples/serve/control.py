"""The serving example's control plane: JSON objects, one per line, over TCP. The router talks to
each instance's leader rank this way (prompts, generate requests, results, timings); clients talk
to the router the same way. None of it is ferry: ferry carries the KV cache and the MoE traffic,
this carries the few hundred bytes that say what to compute.

ControlServer is the instance side: a thread accepts connections and a thread per connection
parses lines into one queue the instance's step loop drains without waiting.
"""

import json
import os
import queue
import socket
import sys
import threading

MAX_LINE_BYTES = 4 << 20


def announce(message):
    """Prints `message` (a dict) on stdout as one JSON line in one write. An instance's processes
    share their stdout (an elastic decode's supervisor and its coordinator), which deploy.py
    reads line by line; unbuffered (PYTHONUNBUFFERED), print writes a line's text and its end
    apart, and another process's line could land between them: two objects on one line, which
    the reader cannot parse (a missed "ready" stalls the deployment's start)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (json.dumps(message) + "\n").encode())


def encode(msg):
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def token_list(value, vocab):
    """True when value is a list of token ids in [0, vocab) (bools are not ids)."""
    return isinstance(value, list) and all(type(t) is int and 0 <= t < vocab for t in value)


def check_fields(msg, fields):
    """None when msg has every field of `fields` ({name: type or (types)}) with a value of that
    type (bools are not ints), else what is wrong: a message from the wire is checked before
    anything is computed from it."""
    for name, kind in fields.items():
        value = msg.get(name)
        if value is None or (type(value) is bool and kind is not bool) or \
                not isinstance(value, kind):
            return f"field {name!r} missing or not {getattr(kind, '__name__', kind)}"
    return None


def parse_address(text):
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {text!r} is not HOST:PORT")
    return host, int(port)


class ControlServer:
    """Listens on host:port (port 0: any free one, see .address). inbox holds (connection id,
    message) pairs, and (connection id, None) once a connection has closed. on_connect(cid) runs
    on the accept thread for each new connection (an instance sends its hello there)."""

    def __init__(self, host="127.0.0.1", port=0, on_connect=None):
        self.inbox = queue.Queue()
        self.wake = threading.Event()  # set whenever a message (or a close) is queued
        self._conns, self._lock, self._next = {}, threading.Lock(), 0
        self._on_connect = on_connect
        self._sock = socket.create_server((host, port))
        self.address = "%s:%d" % self._sock.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True, name="control-accept").start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                cid, self._next = self._next, self._next + 1
                self._conns[cid] = conn
            if self._on_connect is not None:
                self._on_connect(cid)
            threading.Thread(target=self._read, args=(cid, conn), daemon=True,
                             name=f"control-{cid}").start()

    def _read(self, cid, conn):
        f = conn.makefile("rb")
        try:
            while True:
                line = f.readline(MAX_LINE_BYTES + 1)
                if not line or len(line) > MAX_LINE_BYTES:
                    break
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the router sends JSON; anything else is dropped, not fatal
                if isinstance(msg, dict):
                    self.inbox.put((cid, msg))
                    self.wake.set()
        except OSError:
            pass
        with self._lock:
            self._conns.pop(cid, None)
        conn.close()
        self.inbox.put((cid, None))
        self.wake.set()

    def send(self, cid, msg):
        """False when that connection is gone."""
        with self._lock:
            conn = self._conns.get(cid)
            if conn is None:
                return False
            try:
                conn.sendall(encode(msg))
                return True
            except OSError:
                return False

    def broadcast(self, msg):
        with self._lock:
            cids = list(self._conns)
        for cid in cids:
            self.send(cid, msg)

    def drain(self):
        """Every (cid, message) queued now."""
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def close(self):
        self._sock.close()
        with self._lock:
            for conn in self._conns.values():
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Client:
    """A blocking JSON-lines connection (to the router): send() and recv()."""

    def __init__(self, address, timeout=30.0):
        self._sock = socket.create_connection(parse_address(address), timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._file = self._sock.makefile("rb")

    def send(self, msg):
        self._sock.sendall(encode(msg) if isinstance(msg, dict) else msg)

    def recv(self, timeout=None):
        if timeout is not None:
            self._sock.settimeout(timeout)
        line = self._file.readline(MAX_LINE_BYTES + 1)
        if not line:
            raise ConnectionError("the router closed the connection")
        return json.loads(line)

    def close(self):
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
