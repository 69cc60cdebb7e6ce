"""A TCP proxy on loopback for storage fault tests: clients talk to the proxy, the proxy to the real server.

    proxy = TcpProxy(("127.0.0.1", s3.port))     # proxy.endpoint: http://127.0.0.1:<its own port>
    proxy.freeze()   # connections are accepted and held, no byte is relayed: a store that hangs
    proxy.freeze_on(b"/step_100/")  # a gate: freeze at the first client bytes holding this, before relaying them
    proxy.thaw()     # relaying resumes where it stopped (held bytes are delivered)
    proxy.reset()    # every open connection is reset and its held bytes dropped (new ones are accepted)
    proxy.refuse()   # the listening socket is closed and every connection reset: connection refused
    proxy.accept()   # listening again on the same port
    proxy.refuse_matching(rb"/step_6/")  # only requests naming this are refused (reset, nothing relayed), until
    proxy.allow()                        # ... this; every other connection is relayed meanwhile
    proxy.hold_matching(rb"PUT /b/step_4/manifest.json")  # only these requests' bodies are held back until
    proxy.release()                      # ... this delivers them to the server, even those their client gave up on
    proxy.close()

The server behind it keeps running (and keeps its objects) through all of these, which a stopped server
would not guarantee. `TcpProxy.hanging()` is an endpoint that accepts connections and never answers.

freeze_on() holds a job at a point of its own progress rather than at a moment of the test's clock: S3 over
plain HTTP names the object in its request line, so "freeze when step_100's first upload starts" is exact
however fast or slow the job runs. `frozen_by` says which bytes closed the gate (None until then).

refuse_matching() and hold_matching() act on single requests and leave every other connection alone: a store that
fails one object's uploads (the client retries them) while the rest of the job goes on, and a request the network
delivers late, after its client has given up on it. `refused` / `held` are set at the first such request (the
job is then at that point of its progress); `release()` returns once the server has answered every held request
whose client had gone.
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import struct
import threading
import time


class TcpProxy:
    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.port = 0
        self._frozen = threading.Event()
        self._gate: bytes | re.Pattern[bytes] | None = None
        self.frozen_by: bytes | None = None
        self.gate_closed = threading.Event()
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._refuse: re.Pattern[bytes] | None = None
        self.refused = threading.Event()
        self.refused_count = 0
        self._hold: re.Pattern[bytes] | None = None
        self.held = threading.Event()
        self._released = threading.Event()
        self._holding = 0  # held requests not yet answered by the server
        self._answered = threading.Condition(self._lock)
        self.accept()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def accept(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._serve, args=(listener,), daemon=True).start()

    def refuse(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        self.reset()

    def freeze(self) -> None:
        self._frozen.set()

    @property
    def frozen(self) -> bool:
        return self._frozen.is_set()

    def freeze_on(self, pattern: bytes | re.Pattern[bytes]) -> None:
        """Freeze as soon as a client sends bytes containing `pattern` (bytes, or a compiled bytes regex); those
        bytes are held, not relayed."""
        self._gate = pattern

    def thaw(self) -> None:
        self._gate = None
        self._frozen.clear()

    def refuse_matching(self, pattern: bytes) -> None:
        """Reset every connection as soon as its client sends bytes matching `pattern` (a bytes regex), before
        relaying them: that request fails, and so does each retry of it, until allow()."""
        self._refuse = re.compile(pattern)

    def allow(self) -> None:
        self._refuse = None

    def hold_matching(self, pattern: bytes) -> None:
        """Hold back every request whose bytes match `pattern` (a bytes regex) until release(): nothing of it
        reaches the server meanwhile, while every other connection is relayed."""
        self._released.clear()
        self._hold = re.compile(pattern)

    def release(self, timeout: float = 60.0) -> None:
        """Deliver the held requests and stop holding; returns once the server has answered each of them whose
        client had already given up (the request then counts as applied, whoever hears the answer)."""
        self._hold = None
        self._released.set()
        with self._answered:
            if not self._answered.wait_for(lambda: self._holding == 0, timeout):
                raise TimeoutError(f"{self._holding} held requests not answered by the server within {timeout} s")

    def close(self) -> None:
        self._closing.set()
        self._released.set()
        self.refuse()

    def reset(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                c.close()

    def _serve(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # refused or closed
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            threading.Thread(target=self._relay, args=(client, server), daemon=True).start()

    def _gate_closes(self, tail: bytes, data: bytes) -> bool:
        """Whether client bytes `data` (after `tail`, the end of what came before) close the gate; if so, freeze."""
        with self._lock:
            gate, seen = self._gate, tail + data
            found = gate is not None and (gate.search(seen) if isinstance(gate, re.Pattern) else gate in seen)
            if not found:
                return False
            self._gate = None
            self.frozen_by = found.group(0) if isinstance(gate, re.Pattern) else gate
            self._frozen.set()
        self.gate_closed.set()
        return True

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        peers = {client: server, server: client}
        held: list[tuple[socket.socket, bytes]] = []  # bytes that closed the gate: relayed on thaw
        tail = b""  # the end of the client's last chunk: a pattern may straddle two reads
        try:
            while not self._closing.is_set():
                if self._frozen.is_set():
                    time.sleep(0.05)  # hold everything: neither side hears from the other
                    continue
                for dest, data in held:
                    dest.sendall(data)
                held.clear()
                ready, _, _ = select.select(list(peers), [], [], 0.1)
                for s in ready:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    if s is client:
                        seen = tail + data
                        if self._refuse is not None and self._refuse.search(seen):
                            self.refused_count += 1
                            self.refused.set()
                            for c in (client, server):
                                with contextlib.suppress(OSError):
                                    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                            return  # closed (reset) below
                        hold = self._hold
                        if hold is not None and hold.search(seen):
                            if not self._hold_back(client, server, data):
                                return
                            tail = b""
                            break
                        closes, tail = self._gate_closes(tail, data), (tail + data)[-256:]
                        if closes:
                            held.append((server, data))
                            break
                    peers[s].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            for s in (client, server):
                with contextlib.suppress(OSError):
                    s.close()

    def _hold_back(self, client: socket.socket, server: socket.socket, first: bytes) -> bool:
        """Keep a request's body from the server until release(); whether its client is still there to hear the
        answer. Its headers go on at once and the server's answers to them come back (an S3 client's PUT asks
        for "100 Continue" before it sends the body, and waits for it without a timeout): the client then sends
        the body, hears nothing more, and gives up on the request after its read timeout, as it would with a
        network that delays the request."""
        with self._lock:
            self._holding += 1
        self.held.set()
        end = first.find(b"\r\n\r\n")
        head, body = (first[: end + 4], first[end + 4 :]) if end >= 0 else (b"", first)
        held, client_open = [body], True
        try:
            server.sendall(head)
            while not self._released.wait(0.05):
                watched = [server, client] if client_open else [server]
                for s in select.select(watched, [], [], 0)[0]:
                    data = s.recv(1 << 16)
                    if s is server:
                        if data and client_open:
                            client.sendall(data)  # "100 Continue" (the answer itself needs the body)
                        continue
                    client_open = bool(data)  # the rest of the request, or the client giving up (b"")
                    held.append(data)
            if self._closing.is_set():
                return False
            for data in held:
                server.sendall(data)
            if not client_open:
                # Nobody waits for this answer: read it here, so that release() knows the request was applied.
                server.settimeout(30)
                server.recv(1 << 16)
            return client_open
        except OSError:
            return False
        finally:
            with self._answered:
                self._holding -= 1
                self._answered.notify_all()

    @staticmethod
    @contextlib.contextmanager
    def hanging():
        """An endpoint URL whose connections are accepted (by the kernel's backlog) and never answered."""
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        try:
            yield f"http://127.0.0.1:{listener.getsockname()[1]}"
        finally:
            listener.close()
