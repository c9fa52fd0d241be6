"""KV-cache events in vLLM's wire format, so prefix-aware routers (llm-d's KV-cache indexer, Dynamo, the Gateway API
Inference Extension's precise prefix scorer) can track which blocks each replica holds.

The block manager appends BlockStored / BlockRemoved / AllBlocksCleared to a list as its prefix cache changes; the
engine core drains it once per step into one KVEventBatch and hands it to KVEventPublisher, whose thread encodes it as
vLLM (0.28) does: msgpack, the batch an array [ts, events, data_parallel_rank], each event a map tagged by "type" (the
class name; older vLLM sent events as arrays, which current routers refuse), and sends [topic, seq as 8 bytes
big-endian, payload] on a ZMQ PUB socket. A ROUTER socket answers [empty, start seq] with every kept batch from that seq
on, each as [empty, seq, payload], then [empty, -1 as 8 signed bytes, b""]. The step never blocks: the queue is bounded
and a full queue drops the batch (a gap in seq the subscriber can replay).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Union

import msgspec
import zmq

from novainfer.config.kv_events import KVEventsConfig

logger = logging.getLogger(__name__)
MEDIUM = "GPU"  # vLLM's name for the device KV cache; NovaInfer's CPU cache is the same tier
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to the prefix cache; encoded as a map {"type": class name, field: value, ...}."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: int | None = None


def wire_hash(block_hash: int) -> int:
    """A block hash as sent: the block manager's signed 64-bit value as unsigned (consumers refuse negatives)."""
    return block_hash & 0xFFFF_FFFF_FFFF_FFFF


def stored(block_hash: int, parent: int | None, token_ids: list[int], block_size: int) -> BlockStored:
    """The event for one full block entering the prefix cache."""
    return BlockStored(
        [wire_hash(block_hash)],
        None if parent is None else wire_hash(parent),
        token_ids,
        block_size,
        None,
        MEDIUM,
        None,
    )


def removed(block_hash: int) -> BlockRemoved:
    """The event for one cached block evicted."""
    return BlockRemoved([wire_hash(block_hash)], MEDIUM)


def _binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard and local endpoints are bound here; a concrete tcp address is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Sends each step's batch from a thread of its own; keeps the last buffer_steps batches for replay."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        self.config, self.data_parallel_rank = config, data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self.num_dropped = 0
        self._ctx = zmq.Context()
        self._started = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="novainfer-kv-events", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:  # a taken port: refuse at start-up, naming the field
            raise ValueError(
                f"kv_events_config: cannot open {config.endpoint} / {config.replay_endpoint}: {self._error}"
            ) from self._error

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events; never blocks (a full queue drops them and counts the drop)."""
        try:
            self._queue.put_nowait(KVEventBatch(time.time(), events, self.data_parallel_rank))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV event queue full: %d batches dropped", self.num_dropped)

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to timeout), then close the sockets; a second call does nothing."""
        if self._ctx.closed:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._ctx.term()

    def _open(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        cfg = self.config
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(cfg.hwm)
        (pub.bind if _binds(cfg.endpoint) else pub.connect)(cfg.endpoint)
        replay = None
        if cfg.replay_endpoint:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.bind(cfg.replay_endpoint)
        return pub, replay

    def _run(self) -> None:
        try:
            pub, replay = self._open()
        except zmq.ZMQError as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        kept: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        seq = 0
        try:
            while True:
                if replay is not None:
                    while replay.poll(0):
                        self._answer_replay(replay, kept)
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                payload = encoder.encode(batch)
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                kept.append((seq, payload))
                seq += 1
        finally:
            pub.close(linger=500)
            if replay is not None:
                replay.close(linger=0)

    @staticmethod
    def _answer_replay(replay: zmq.Socket, kept: deque[tuple[int, bytes]]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV event replay: ignored a request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in kept:
            if seq >= first:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))


def publisher_for(config: Any) -> KVEventPublisher | None:
    """The engine's publisher, or None when its kv_events_config leaves events off."""
    cfg = getattr(config, "kv_events_config", None)
    return KVEventPublisher(cfg) if cfg is not None else None
