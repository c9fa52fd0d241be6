"""KV-cache events read by a subscriber written from vLLM's published schema (not our structs): the blocks
stored minus removed equal the prefix cache's blocks, and the replay socket resends what a subscriber missed."""

import time
from typing import Union

import msgspec
import pytest
import zmq

from novainfer import LLM, SamplingParams
from tests.server_utils import free_port


# vLLM's schema (vllm/distributed/kv_events.py, 0.28: events are maps tagged by "type"), as a subscriber defines it
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None]
    extra_keys: Union[list, None] = None
    group_idx: Union[int, None] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[int, bytes]]
    medium: Union[str, None]
    group_idx: Union[int, None] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Union[int, None] = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def apply(cached: set, batch: KVEventBatch) -> None:
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            cached.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            cached.difference_update(ev.block_hashes)
        else:
            cached.clear()


def drain(sub: zmq.Socket, quiet_s: float = 0.5) -> list[tuple[bytes, int, bytes]]:
    got = []
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        got.append((topic, int.from_bytes(seq, "big"), payload))
    return got


def replay(ctx: zmq.Context, port: int, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while dealer.poll(5000):
        _, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            break
        out.append((int.from_bytes(seq, "big"), payload))
    dealer.close(linger=0)
    return out


def test_events_track_the_prefix_cache_and_replay(tiny_qwen2):
    pub_port, replay_port = free_port(), free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    # 8 blocks of 16 tokens: the later prompts evict the earlier ones' blocks
    llm = LLM(
        tiny_qwen2,
        device="cpu",
        num_gpu_blocks=8,
        max_num_seqs=2,
        kv_events_config={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pub_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
            "topic": "kv",
        },
    )
    bm = llm.llm_engine.engine_core.block_manager
    time.sleep(0.5)  # the subscription reaches the publisher (ZMQ's slow joiner)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    shared = list(range(5, 45))
    prompts = [shared + [100 + i] * 9 for i in range(3)] + [[200 + i] * 50 for i in range(3)]
    for p in prompts:
        llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)
    llm.generate([{"prompt_token_ids": shared + [300 + i] * 5} for i in range(2)], params, use_tqdm=False)
    bm.reset_prefix_cache()
    llm.generate({"prompt_token_ids": shared + [7] * 20}, params, use_tqdm=False)

    msgs = drain(sub)
    assert msgs and all(topic == b"kv" for topic, _, _ in msgs)
    assert [seq for _, seq, _ in msgs] == list(range(len(msgs)))  # every batch, in order
    batches = [DECODER.decode(payload) for _, _, payload in msgs]
    raw = msgspec.msgpack.decode(msgs[0][2])  # the layout itself: [ts, [{"type": ..., ...}, ...], rank]
    assert isinstance(raw, list) and raw[1][0]["type"] == "BlockStored" and "block_hashes" in raw[1][0]
    kinds = {type(ev) for b in batches for ev in b.events}
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}
    cached: set = set()
    for b in batches:
        apply(cached, b)
    assert cached == {h & (2**64 - 1) for h in bm.hash_to_block_id} and cached  # hashes go out unsigned
    first = next(ev for ev in batches[0].events if isinstance(ev, BlockStored))
    assert first.token_ids == prompts[0][:16] and first.block_size == 16 and first.parent_block_hash is None
    stored = [ev for b in batches for ev in b.events if isinstance(ev, BlockStored)]
    known = {h for ev in stored for h in ev.block_hashes}
    assert all(ev.parent_block_hash is None or ev.parent_block_hash in known for ev in stored)

    # a subscriber that missed everything after batch 2 gets exactly those batches back
    missed = replay(ctx, replay_port, 2)
    assert missed == [(seq, payload) for _, seq, payload in msgs[2:]]
    llm.llm_engine.engine_core.shutdown()
    sub.close(linger=0)
    ctx.term()


def test_unknown_field_is_refused(tiny_qwen2):
    with pytest.raises(ValueError, match="bogus"):
        LLM(tiny_qwen2, device="cpu", kv_events_config={"enable_kv_cache_events": True, "bogus": 1})
