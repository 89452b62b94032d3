"""Streaming extraction: producers run the target, consumers (trainer ranks) receive samples.

Transport: ZeroMQ over TCP (127.0.0.1 by default; any host in production). Each consumer
binds a ROUTER socket; each producer connects a DEALER to one or more consumers. Nothing
touches the disk (the vllm backend's hand-off file lives on tmpfs and is deleted on read).

Protocol (multipart frames; tensors travel as raw bytes after a small JSON header):

    producer -> consumer   HELLO  {pid, host, backend, layer_ids, hidden_size, ...}
    consumer -> producer   CREDIT n           n more samples may be sent
    producer -> consumer   SAMPLE {id, T, n, H} input_ids loss_mask aux last
    producer -> consumer   END    {sent, blocked_s}   or   ERROR {error}
    consumer -> producer   STOP               (consumer closed: stop producing)

Backpressure is credit-based: a consumer grants `window` credits per producer and one more
each time it hands a sample to the caller, so at most `window` samples per producer are
queued or in flight, whatever the speeds; a producer without credit blocks (and extracts
nothing more). Liveness: ZMTP heartbeats (1 s, 5 s timeout) drop dead peers, the consumer
monitors disconnects, and a producer that disconnects before END, sends ERROR, never
connects (`connect_timeout`) or goes silent (`idle_timeout`) makes the consumer raise
`StreamError` — never a hang.

Run a producer with `python -m eyas.extract.stream --target T --data CONV.jsonl --connect
tcp://127.0.0.1:PORT` (the flags of `eyas extract`, mode streaming; `--shard i/n` splits the
data among producers, several `--connect` feed several consumers by credit); consume with
`for sample in StreamConsumer("tcp://127.0.0.1:PORT", num_producers=1): ...`, or
`open_consumer("tcp://HOST:PORT?producers=N", rank)` from a trainer rank (binds PORT + rank).
"""

from __future__ import annotations

import collections
import json
import os
import socket
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import zmq

from eyas.config import ExtractConfig, check_choices
from eyas.models import resolve_target
from eyas.target import facts as target_facts
from eyas.target import resolve_layer_ids

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
WIRE_DTYPE = torch.bfloat16


class StreamError(RuntimeError):
    """A producer failed, crashed, never connected or went silent."""


def _heartbeats(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


# ---------------------------------------------------------------- wire format

def encode_sample(s: dict[str, Any]) -> list[Any]:
    """Sample dict -> [header, input_ids, loss_mask, aux, last] frames (zero-copy buffers)."""
    aux, last = s["aux_hidden_states"].to(WIRE_DTYPE).contiguous(), s["last_hidden_states"].to(WIRE_DTYPE).contiguous()
    T, n, H = aux.shape
    header = json.dumps({"id": str(s["id"]), "T": T, "n": n, "H": H}).encode()
    ids = torch.as_tensor(s["input_ids"], dtype=torch.int64).contiguous()
    mask = torch.as_tensor(s["loss_mask"]).to(torch.bool).contiguous()
    return [header] + [t.view(torch.uint8).numpy() for t in (ids, mask, aux, last)]


def decode_sample(frames: list[Any]) -> dict[str, Any]:
    h = json.loads(bytes(frames[0]))
    T, n, H = h["T"], h["n"], h["H"]

    def tensor(frame, dtype, shape):
        return torch.frombuffer(bytearray(frame.buffer if hasattr(frame, "buffer") else frame),
                                dtype=torch.uint8).view(dtype).reshape(shape)

    return {
        "id": h["id"],
        "input_ids": tensor(frames[1], torch.int64, (T,)),
        "loss_mask": tensor(frames[2], torch.bool, (T,)),
        "aux_hidden_states": tensor(frames[3], WIRE_DTYPE, (T, n, H)),
        "last_hidden_states": tensor(frames[4], WIRE_DTYPE, (T, H)),
    }


def sample_nbytes(s: dict[str, Any]) -> int:
    return sum(int(s[k].numel() * s[k].element_size())
               for k in ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_states"))


# ---------------------------------------------------------------- consumer

class StreamConsumer:
    """Iterable over samples pushed by `num_producers` producers; yields offline-reader dicts.

    `address` "tcp://127.0.0.1:0" binds a free port (see `.address`). `window`: samples per
    producer that may be queued or in flight. After the stream: `.stats` has the counts,
    the largest queue depth / bytes seen, and each producer's END report.
    """

    def __init__(self, address: str = "tcp://127.0.0.1:0", num_producers: int = 1, window: int = 4,
                 connect_timeout: float = 300.0, idle_timeout: float = 600.0, disconnect_grace: float = 2.0):
        if window < 1 or num_producers < 1:
            raise ValueError("window and num_producers must be >= 1")
        self.num_producers, self.window = num_producers, window
        self.connect_timeout, self.idle_timeout, self.disconnect_grace = connect_timeout, idle_timeout, disconnect_grace
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 4 * window * num_producers + 16)  # credits bound it well below
        _heartbeats(self.sock)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        try:
            if address.endswith(":0"):
                port = self.sock.bind_to_random_port(address.rsplit(":", 1)[0])
                self.address = f"{address.rsplit(':', 1)[0]}:{port}"
            else:
                self.sock.bind(address)
                self.address = address
        except zmq.ZMQError as e:
            self.monitor.close(linger=0)
            self.sock.close(linger=0)
            raise ValueError(f"streaming consumer: cannot bind {address} ({e}): another process holds the port, or "
                             "the host is not this machine's; choose another port (train.features=tcp://HOST:PORT)") from None
        self.producers: dict[bytes, dict[str, Any]] = {}
        self.ended: dict[bytes, dict[str, Any]] = {}
        self.queue: collections.deque[tuple[bytes, dict[str, Any]]] = collections.deque()
        self.connections = 0
        self._lost_since: float | None = None
        self._last_message = self._started = time.monotonic()
        self.stats: dict[str, Any] = {"received": 0, "yielded": 0, "max_queued": 0, "max_queued_bytes": 0,
                                      "producers": {}}
        self._closed = False
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)

    def wait_ready(self) -> dict[str, Any]:
        """Block until a producer said HELLO; its info: layer_ids, hidden_size, target, backend, ..."""
        while not self.producers:
            self._poll(100)
            self._check()
        return next(iter(self.producers.values()))

    # -- protocol
    def _send(self, ident: bytes, *frames: bytes) -> None:
        try:
            self.sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            pass  # the producer is gone: the disconnect check reports it

    def _handle(self, frames: list[Any]) -> None:
        ident, kind, rest = bytes(frames[0]), bytes(frames[1]), frames[2:]
        self._last_message = time.monotonic()
        if kind == b"HELLO":
            info = json.loads(bytes(rest[0]))
            first = next(iter(self.producers.values()), None)
            if first and (first["layer_ids"], first["hidden_size"]) != (info["layer_ids"], info["hidden_size"]):
                raise StreamError(f"producer {info} disagrees with {first} on layer ids / hidden size")
            if ident not in self.producers:
                self._send(ident, b"CREDIT", str(self.window).encode())
            self.producers[ident] = info
        elif kind == b"SAMPLE":
            s = decode_sample(rest)
            self.queue.append((ident, s))
            self.stats["received"] += 1
            self.stats["max_queued"] = max(self.stats["max_queued"], len(self.queue))
            qb = sum(sample_nbytes(x) for _, x in self.queue)
            self.stats["max_queued_bytes"] = max(self.stats["max_queued_bytes"], qb)
        elif kind == b"END":
            self.ended[ident] = json.loads(bytes(rest[0]))
            self.stats["producers"][ident.decode(errors="replace")] = self.ended[ident]
        elif kind == b"ERROR":
            err = json.loads(bytes(rest[0]))
            raise StreamError(f"producer {ident.decode(errors='replace')} failed: {err.get('error')}")
        else:
            raise StreamError(f"unknown message {kind!r} from {ident!r}")

    def _poll(self, timeout_ms: int) -> None:
        events = dict(self._poller.poll(timeout_ms))
        if self.monitor in events:
            from zmq.utils.monitor import recv_monitor_message

            while self.monitor.poll(0):
                ev = recv_monitor_message(self.monitor)["event"]
                self.connections += 1 if ev == zmq.EVENT_ACCEPTED else -1
        while self.sock.poll(0):
            self._handle(self.sock.recv_multipart(copy=False))

    def _check(self) -> None:
        now = time.monotonic()
        if not self.producers and now - self._started > self.connect_timeout:
            raise StreamError(f"no producer connected to {self.address} within {self.connect_timeout:.0f}s")
        live_expected = len(self.producers) - len(self.ended)  # said HELLO, no END yet
        if self.producers and self.connections < live_expected:
            self._lost_since = self._lost_since or now
            if now - self._lost_since > self.disconnect_grace:
                raise StreamError(
                    f"{live_expected - self.connections} producer(s) disconnected from {self.address} without "
                    f"end of stream (crashed or killed?); {self.stats['received']} samples received"
                )
        else:
            self._lost_since = None
        if now - self._last_message > self.idle_timeout:
            raise StreamError(f"no message from any producer for {self.idle_timeout:.0f}s (hung producer?)")

    @property
    def finished(self) -> bool:
        return len(self.ended) >= self.num_producers and not self.queue

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            while True:
                if self.queue:
                    ident, s = self.queue.popleft()
                    self._send(ident, b"CREDIT", b"1")
                    self.stats["yielded"] += 1
                    yield s
                    self._last_message = time.monotonic()  # the caller's own time is not producer silence
                    self._poll(0)
                    continue
                if self.finished:
                    return
                self._poll(100)
                if not self.queue:
                    self._check()
        except (GeneratorExit, StreamError):
            self.close()
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ident in self.producers:
            if ident not in self.ended:
                self._send(ident, b"STOP")
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.sock.close(linger=1000)  # let STOP reach live producers (bounded)
        self.ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_consumer(address: str, rank: int = 0, **kwargs: Any) -> StreamConsumer:
    """The consumer of trainer rank `rank`: binds `address`'s port + rank.

    `address` is `tcp://HOST:PORT[?producers=N&window=W&timeout=S]` (the query sets
    `num_producers`, `window`, `idle_timeout`); producers for rank r connect to PORT + r.
    """
    from urllib.parse import parse_qs

    base, _, query = address.partition("?")
    if not base.startswith("tcp://") or base.count(":") != 2:
        raise ValueError(f"stream address {address!r} must look like tcp://HOST:PORT[?producers=N&window=W]")
    host, port = base.rsplit(":", 1)
    opts = {k: v[-1] for k, v in parse_qs(query).items()}
    unknown = set(opts) - {"producers", "window", "timeout"}
    if unknown:
        raise ValueError(f"stream address {address!r}: unknown options {sorted(unknown)} (producers, window, timeout)")
    kw: dict[str, Any] = {"num_producers": int(opts.get("producers", 1)), "window": int(opts.get("window", 4))}
    if "timeout" in opts:
        kw["idle_timeout"] = float(opts["timeout"])
    return StreamConsumer(f"{host}:{int(port) + rank if int(port) else 0}", **{**kw, **kwargs})


# ---------------------------------------------------------------- producer

class StreamProducer:
    """Sends samples to consumers as their credits allow; blocks (bounded) when none has any."""

    def __init__(self, addresses: list[str], shard: str = "0/1", idle_timeout: float = 600.0):
        if not addresses:
            raise ValueError("no consumer address: pass --connect tcp://HOST:PORT (one or more)")
        self.ctx = zmq.Context()
        self.idle_timeout = idle_timeout
        self.shard = shard
        ident = f"{socket.gethostname()}:{os.getpid()}:{shard}".encode()
        self.socks: list[zmq.Socket] = []
        self.credits: list[int] = []
        self.poller = zmq.Poller()
        for addr in addresses:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, ident)
            s.setsockopt(zmq.LINGER, 30_000)  # deliver END / ERROR before exiting (bounded)
            _heartbeats(s)
            s.connect(addr)
            self.socks.append(s)
            self.credits.append(0)
            self.poller.register(s, zmq.POLLIN)
        self.sent = 0
        self.blocked_s = 0.0
        self.stopped = False

    def hello(self, info: dict[str, Any]) -> None:
        """Announce this producer (layer ids, hidden size, ...); consumers answer with credit."""
        body = json.dumps({**info, "shard": self.shard, "pid": os.getpid(), "host": socket.gethostname()}).encode()
        for s in self.socks:
            s.send_multipart([b"HELLO", body])

    def _drain(self, timeout_ms: int) -> None:
        for s, _ in self.poller.poll(timeout_ms):
            while s.poll(0):
                msg = s.recv_multipart()
                i = self.socks.index(s)
                if msg[0] == b"CREDIT":
                    self.credits[i] += int(msg[1])
                elif msg[0] == b"STOP":
                    self.credits[i] = -1  # this consumer wants no more
        self.stopped = all(c < 0 for c in self.credits)

    def send(self, sample: dict[str, Any]) -> bool:
        """Send one sample; False when every consumer said STOP."""
        self._drain(0)
        t0 = time.monotonic()
        while max(self.credits) <= 0:
            if self.stopped:
                return False
            self._drain(100)
            if time.monotonic() - t0 > self.idle_timeout:
                raise TimeoutError(f"no consumer credit for {self.idle_timeout:.0f}s (consumers gone?)")
        self.blocked_s += time.monotonic() - t0
        i = max(range(len(self.socks)), key=lambda j: self.credits[j])
        self.credits[i] -= 1
        self.socks[i].send_multipart([b"SAMPLE", *encode_sample(sample)], copy=False)
        self.sent += 1
        return True

    def end(self, **stats: Any) -> None:
        body = json.dumps({"sent": self.sent, "blocked_s": round(self.blocked_s, 3), **stats}).encode()
        for s in self.socks:
            s.send_multipart([b"END", body])

    def error(self, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        for s in self.socks:
            s.send_multipart([b"ERROR", body])

    def close(self) -> None:
        for s in self.socks:
            s.close()  # lingers until END / ERROR is delivered (bounded)
        self.ctx.term()


def _parse_shard(shard: str) -> tuple[int, int]:
    if not shard:
        return 0, 1
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise ValueError(f"--shard {shard!r} must look like i/n (e.g. 0/2)") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {shard!r}: need 0 <= i < n")
    return i, n


def run_producer(cfg: ExtractConfig) -> int:
    """`eyas extract --mode streaming --connect ADDR...`: extract and push until done or stopped."""
    from eyas.extract.backends import extractor_from_config
    from eyas.extract.base import Renderer, read_conversations, resolve_lengths

    if not cfg.connect:
        raise ValueError("streaming mode needs --connect tcp://HOST:PORT (a StreamConsumer's address)")
    i, n = _parse_shard(cfg.shard)
    producer = StreamProducer(cfg.connect, shard=f"{i}/{n}")
    extractor = None
    t0, ntok, epoch = time.time(), 0, 0
    try:  # from here on every failure reaches the consumers as ERROR
        check_choices(cfg, "extract")
        cfg = resolve_lengths(cfg)
        target = resolve_target(cfg.target)
        facts = target_facts(target)
        producer.hello({"backend": cfg.backend, "target": str(target), "hidden_size": facts["hidden_size"],
                        "layer_ids": resolve_layer_ids(cfg.layer_ids or None, facts["num_layers"]),
                        "num_target_layers": facts["num_layers"]})
        convs = read_conversations(cfg.data, cfg.limit)[i::n]
        renderer = Renderer(target, cfg.chat_template, cfg.max_len)
        extractor = extractor_from_config(cfg, target)

        def push(batch: list[dict]) -> bool:  # False once every consumer said STOP
            nonlocal ntok
            for s in extractor.extract(batch):
                if not producer.send(s):
                    return False
                ntok += s["input_ids"].shape[0]
            return True

        running = True
        while running and (cfg.epochs == 0 or epoch < cfg.epochs):
            batch, tokens = [], 0
            for c in convs:
                r = renderer.render(c, where=f"{cfg.data}: id {c['id']}")
                if not bool(r["loss_mask"].any()):
                    continue  # no assistant token within max_len
                batch.append(r)
                tokens += r["input_ids"].shape[0]
                if tokens >= cfg.batch_tokens:
                    running = push(batch)
                    batch, tokens = [], 0
                    if not running:
                        break
            if running and batch:
                running = push(batch)
            epoch += 1
        producer.end(epochs=epoch, tokens=ntok, tok_per_s=round(ntok / max(time.time() - t0, 1e-9), 1))
        return 0
    except BaseException as e:
        producer.error(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")
        raise
    finally:
        if extractor is not None:
            extractor.close()
        producer.close()
