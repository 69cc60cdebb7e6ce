"""A TCP proxy on loopback for storage fault tests: clients talk to the proxy, the proxy to the real server.

    proxy = TcpProxy(("127.0.0.1", s3.port))     # proxy.endpoint: http://127.0.0.1:<its own port>
    proxy.freeze()   # connections are accepted and held, no byte is relayed: a store that hangs
    proxy.freeze_on(b"/step_100/")  # a gate: freeze at the first client bytes holding this, before relaying them
    proxy.thaw()     # relaying resumes where it stopped (held bytes are delivered)
    proxy.reset()    # every open connection is reset and its held bytes dropped (new ones are accepted)
    proxy.refuse()   # the listening socket is closed and every connection reset: connection refused
    proxy.accept()   # listening again on the same port
    proxy.close()

The server behind it keeps running (and keeps its objects) through all of these, which a stopped server
would not guarantee. `TcpProxy.hanging()` is an endpoint that accepts connections and never answers.

freeze_on() holds a job at a point of its own progress rather than at a moment of the test's clock: S3 over
plain HTTP names the object in its request line, so "freeze when step_100's first upload starts" is exact
however fast or slow the job runs. `frozen_by` says which bytes closed the gate (None until then).
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
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

    def close(self) -> None:
        self._closing.set()
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
