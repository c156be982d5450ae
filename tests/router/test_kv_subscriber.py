"""The KV-event subscriber against a real ZMQ publisher on 127.0.0.1 (the emulated engine's, and raw sockets):
in step, gaps filled by replay, gaps without replay (stale), restarts, late joins, garbage on the socket."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from warmroute.core.exact_index import ExactIndex, pack_tokens, token_chain, token_seed
from warmroute.engine.kv_events import KvEventPublisher
from warmroute.router.kv_subscriber import KvEventMetrics, KvEventSubscriber

BS = 4


def chain(tokens):
    data = pack_tokens(tokens)
    return lambda size: token_chain(data, token_seed(), size)


class Engine:
    """A publisher storing one block per batch, each extending the last (a growing prompt)."""

    def __init__(self, replay: bool = True, start_hash: int = 500, endpoint: str = "tcp://127.0.0.1:0",
                 replay_endpoint: str = "tcp://127.0.0.1:0", token_base: int = 0) -> None:
        self.token_base = token_base
        self.pub = KvEventPublisher(endpoint, "kv", replay_endpoint if replay else None, bind=True)
        self.tokens: list[int] = []
        self.hashes: list[int] = []
        self.start_hash = start_hash

    @property
    def endpoint(self) -> str:
        return self.pub.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.pub.replay_endpoint

    def store_block(self, send: bool = True) -> None:
        block = [self.token_base + len(self.tokens) + i for i in range(BS)]
        h = self.start_hash + len(self.hashes)
        self.pub.stored([h], self.hashes[-1] if self.hashes else None, block, BS)
        self.tokens += block
        self.hashes.append(h)
        if send:
            self.pub.flush()
        else:  # lost on the way: buffered for replay, never received
            payload = msgspec.msgpack.encode([0.0, self.pub.pending, 0])
            self.pub.pending = []
            self.pub.buffer.append((self.pub.seq, payload))
            self.pub.seq += 1


def metric(metrics: KvEventMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def metrics():
    return KvEventMetrics(CollectorRegistry())


async def until(cond, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.01)


async def connected(engine: Engine, sub: KvEventSubscriber, timeout: float = 10.0) -> None:
    """Store blocks until the subscriber hears one live (a SUB socket misses what is sent before it joins)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not sub.stream.live or sub.stream.last_seq < engine.pub.seq - 1:
        assert loop.time() < end, "subscriber never received a batch"
        if not sub.stream.live:
            engine.store_block()
        await asyncio.sleep(0.02)


async def clear_and_catch_up(engine: Engine, sub: KvEventSubscriber) -> None:
    """The engine clears its cache (AllBlocksCleared): the subscriber is back in step, whatever it missed."""
    engine.pub.cleared()
    engine.pub.flush()
    await until(lambda: sub.fresh)


async def started(engine: Engine, index: ExactIndex, metrics, name: str = "a", idle_s: float = 5.0):
    await engine.pub.start()
    sub = KvEventSubscriber(name, engine.endpoint, index, metrics, engine.replay_endpoint, "kv", idle_s)
    await sub.start()
    return sub


async def test_in_step_then_gap_filled_by_replay(metrics):
    engine, index = Engine(), ExactIndex()
    sub = await started(engine, index, metrics)
    try:
        await connected(engine, sub)
        assert sub.fresh
        engine.store_block(send=False)  # lost
        engine.store_block()
        await until(lambda: sub.stream.last_seq == engine.pub.seq - 1)
        assert sub.fresh
        assert index.match_tokens("a", chain(engine.tokens), 0.0) == len(engine.tokens)
        assert metric(metrics, "warmroute_kv_events_gaps_total", backend="a", kind="gap") == 1
        assert metric(metrics, "warmroute_kv_events_replays_total", backend="a", outcome="ok") >= 1
        assert metric(metrics, "warmroute_kv_events_stale", backend="a") == 0
    finally:
        await sub.stop()
        await engine.pub.close()


async def test_gap_without_replay_marks_stale_until_cleared(metrics):
    engine, index = Engine(replay=False), ExactIndex()
    sub = await started(engine, index, metrics)
    try:
        await connected(engine, sub)
        assert not sub.fresh  # it joined after batch 0 and cannot replay: stale until the cache is cleared
        await clear_and_catch_up(engine, sub)
        engine.store_block(send=False)
        engine.store_block()
        await until(lambda: not sub.fresh)
        assert metric(metrics, "warmroute_kv_events_stale", backend="a") == 1
        await clear_and_catch_up(engine, sub)
        assert index.size("a") == 0
    finally:
        await sub.stop()
        await engine.pub.close()


async def test_late_subscriber_catches_up_by_replay(metrics):
    engine, index = Engine(), ExactIndex()
    await engine.pub.start()
    for _ in range(5):
        engine.store_block()  # nobody listening yet
    sub = KvEventSubscriber("a", engine.endpoint, index, metrics, engine.replay_endpoint, "kv")
    await sub.start()
    try:
        await connected(engine, sub)  # the first batch it sees is past 0: it replays from 0
        engine.store_block()
        await until(lambda: sub.stream.last_seq == engine.pub.seq - 1)
        assert sub.fresh
        assert index.match_tokens("a", chain(engine.tokens), 0.0) == len(engine.tokens)
    finally:
        await sub.stop()
        await engine.pub.close()


async def test_engine_restart_clears_its_blocks(metrics):
    engine, index = Engine(), ExactIndex()
    sub = await started(engine, index, metrics)
    try:
        await connected(engine, sub)
        for _ in range(3):
            engine.store_block()
        await until(lambda: sub.stream.last_seq == engine.pub.seq - 1)
        old_tokens = list(engine.tokens)
        endpoint, replay = engine.pub.endpoint, engine.pub.replay_endpoint
        await engine.pub.close()
        restarted = Engine(start_hash=9000, endpoint=endpoint, replay_endpoint=replay, token_base=4)  # same ports
        await restarted.pub.start()
        loop = asyncio.get_running_loop()
        end = loop.time() + 20
        while not metric(metrics, "warmroute_kv_events_gaps_total", backend="a", kind="restart"):
            assert loop.time() < end, "restart never seen"
            restarted.store_block()  # until the subscriber has reconnected and hears one
            await asyncio.sleep(0.05)
        await until(lambda: sub.fresh and sub.stream.last_seq == restarted.pub.seq - 1)
        assert index.match_tokens("a", chain(old_tokens), 0.0) == 0
        assert index.match_tokens("a", chain(restarted.tokens), 0.0) == len(restarted.tokens)
        assert metric(metrics, "warmroute_kv_events_gaps_total", backend="a", kind="restart") == 1
        await restarted.pub.close()
    finally:
        await sub.stop()


async def test_garbage_on_the_socket_is_counted_and_skipped(metrics):
    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = ExactIndex()
    sub = KvEventSubscriber("a", f"tcp://127.0.0.1:{port}", index, metrics)
    await sub.start()
    good = msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                         "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None,
                                         "medium": "GPU", "lora_name": None}], 0])
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + 5
        while sub.stream.last_seq is None:  # until it is subscribed
            assert loop.time() < end
            await pub.send_multipart([b"", (0).to_bytes(8, "big"), good])
            await asyncio.sleep(0.02)
        await pub.send_multipart([b"kv", b"\x01"])  # two frames
        await pub.send_multipart([b"kv", b"\x00\x01", good])  # a short sequence frame
        await pub.send_multipart([b"kv", (1).to_bytes(8, "big"), b"\xc1\xc1 not msgpack"])
        await pub.send_multipart([b"kv", (1).to_bytes(8, "big"), msgspec.msgpack.encode([0, [{"type": "X"}]])])
        await until(lambda: metric(metrics, "warmroute_kv_events_bad_total", backend="a") >= 4)
        assert sub.fresh and index.match_tokens("a", chain([1, 2, 3, 4]), 0.0) == 4
    finally:
        await sub.stop()
        pub.close(linger=0)


async def test_a_restart_heard_only_past_the_old_sequence_is_found_by_replay(metrics):
    engine, index = Engine(), ExactIndex()
    sub = await started(engine, index, metrics)
    try:
        await connected(engine, sub)
        old_tokens, old_last = list(engine.tokens), sub.stream.last_seq
        endpoint, replay = engine.pub.endpoint, engine.pub.replay_endpoint
        await engine.pub.close()
        restarted = Engine(start_hash=9000, endpoint=endpoint, replay_endpoint=replay, token_base=4)
        await restarted.pub.start()
        for _ in range(old_last + 5):  # published while the subscriber was reconnecting: never heard
            restarted.store_block(send=False)
        loop = asyncio.get_running_loop()
        end = loop.time() + 20
        while not sub.stream.last_seq or sub.stream.last_seq < restarted.pub.seq - 1:
            assert loop.time() < end, "never caught up"
            restarted.store_block()
            await asyncio.sleep(0.05)
        assert metric(metrics, "warmroute_kv_events_gaps_total", backend="a", kind="restart") == 1
        assert sub.fresh
        assert index.match_tokens("a", chain(old_tokens), 0.0) == 0
        assert index.match_tokens("a", chain(restarted.tokens), 0.0) == len(restarted.tokens)
        await restarted.pub.close()
    finally:
        await sub.stop()


async def test_an_engine_that_published_nothing_yet_is_in_step(metrics):
    engine, index = Engine(), ExactIndex()
    sub = await started(engine, index, metrics)
    try:
        await until(lambda: sub.fresh)
        assert metric(metrics, "warmroute_kv_events_replays_total", backend="a", outcome="ok") == 1
    finally:
        await sub.stop()
        await engine.pub.close()


async def test_an_engine_restarted_without_a_word_is_found_when_quiet(metrics):
    engine, index = Engine(), ExactIndex()
    sub = await started(engine, index, metrics, idle_s=0.3)
    try:
        await connected(engine, sub)
        assert index.size("a") > 0
        endpoint, replay = engine.pub.endpoint, engine.pub.replay_endpoint
        await engine.pub.close()
        restarted = Engine(endpoint=endpoint, replay_endpoint=replay)  # publishes nothing: an empty cache
        await restarted.pub.start()
        await until(lambda: metric(metrics, "warmroute_kv_events_gaps_total", backend="a", kind="restart") == 1)
        await until(lambda: sub.fresh)  # the restart is counted before the replay that puts it back in step
        assert index.size("a") == 0
        await restarted.pub.close()
    finally:
        await sub.stop()


async def test_an_unreadable_batch_even_replayed_leaves_it_stale_until_cleared(metrics):
    engine, index = Engine(), ExactIndex()
    sub = await started(engine, index, metrics, idle_s=0.3)
    try:
        await connected(engine, sub)
        engine.pub.publish_raw(b"\xc1 garbage")  # takes a sequence number, also in the replay buffer
        engine.store_block()
        await until(lambda: not sub.fresh)
        assert metric(metrics, "warmroute_kv_events_bad_total", backend="a") >= 2  # live, and replayed
        await asyncio.sleep(1.0)  # its retries from batch 0 find the same unreadable batch
        assert not sub.fresh
        await clear_and_catch_up(engine, sub)
        assert index.size("a") == 0
    finally:
        await sub.stop()
        await engine.pub.close()


async def test_stop_ends_the_subscriber_while_messages_are_queued(metrics):
    """Stopping while a backlog waits on the socket: every receive then completes at once, so the stop request
    lands on a receive that has already finished; it must still end the subscriber (the router's shutdown
    waits for it)."""
    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    empty = msgspec.msgpack.encode([0.0, [], 0])
    seq = 0
    try:
        for _ in range(5):  # each round a new subscriber, stopped mid-backlog
            sub = KvEventSubscriber("a", f"tcp://127.0.0.1:{port}", ExactIndex(), metrics)
            await sub.start()
            loop = asyncio.get_running_loop()
            end = loop.time() + 5
            while sub.stream.live == 0:  # until it is subscribed
                assert loop.time() < end
                pub.send_multipart([b"", seq.to_bytes(8, "big"), empty])
                seq += 1
                await asyncio.sleep(0.02)
            for _ in range(500):  # a backlog: the subscriber is now busy taking it, one message per loop turn
                pub.send_multipart([b"", seq.to_bytes(8, "big"), empty])
                seq += 1
            while sub.stream.live < 3:
                await asyncio.sleep(0)
            task = sub._task
            await asyncio.wait([asyncio.ensure_future(sub.stop())], timeout=5)
            assert task is not None and task.done(), "the subscriber kept running after stop()"
    finally:
        pub.close(linger=0)


async def test_a_late_subscriber_catches_up_on_10000_buffered_batches_without_starving_the_loop(metrics):
    """vLLM buffers up to 10,000 batches for replay: a router started after a busy engine reads them all, batch by
    batch as they arrive (no limit on the whole replay), while the event loop keeps serving, and the live batches
    published meanwhile are neither lost nor applied twice."""
    engine, index = Engine(), ExactIndex()
    await engine.pub.start()
    for _ in range(10_000):
        engine.store_block(send=False)  # published before any router listened: only the replay buffer has them
    loop = asyncio.get_running_loop()
    stalls: list[float] = []

    async def ticking() -> None:  # other requests' work, and the engine's live traffic meanwhile
        last = loop.time()
        while True:
            await asyncio.sleep(0.002)
            stalls.append(loop.time() - last)
            last = loop.time()
            if len(stalls) % 10 == 0:
                engine.store_block()

    ticker = asyncio.create_task(ticking())
    sub = KvEventSubscriber("a", engine.endpoint, index, metrics, engine.replay_endpoint, "kv")
    began = loop.time()
    await sub.start()
    try:
        await until(lambda: sub.fresh and index.size("a") >= 10_000, timeout=20)
        caught_up = loop.time() - began
        await asyncio.sleep(0.2)
        ticker.cancel()
        engine.store_block()
        await until(lambda: sub.stream.last_seq == engine.pub.seq - 1)
        assert sub.fresh and index.match_tokens("a", chain(engine.tokens), 0.0) == len(engine.tokens)
        assert metric(metrics, "warmroute_kv_events_gaps_total", backend="a", kind="restart") == 0
        assert metric(metrics, "warmroute_kv_events_replays_total", backend="a", outcome="failed") == 0
        assert caught_up < 10, caught_up
        assert max(stalls) < 0.25, max(stalls)  # the loop ran all along (whole replay applied at once: ~1 s)
    finally:
        ticker.cancel()
        await sub.stop()
        await engine.pub.close()


async def test_the_older_replay_framing_is_read_too(metrics):
    """A replay socket written as other vLLM versions write theirs: [seq, payload] per batch after the
    delimiter, [END_SEQ, b""] at the end (vllm/distributed/kv_events.py, ZmqEventPublisher._service_replay)."""
    ctx = zmq.asyncio.Context.instance()
    pub, replay = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.setsockopt(zmq.LINGER, 0)
    replay.setsockopt(zmq.LINGER, 0)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    replay_port = replay.bind_to_random_port("tcp://127.0.0.1")
    tokens = list(range(40 * BS))
    buffer = []
    for i in range(40):
        event = {"type": "BlockStored", "block_hashes": [100 + i], "parent_block_hash": 99 + i if i else None,
                 "token_ids": tokens[i * BS:(i + 1) * BS], "block_size": BS, "lora_id": None, "medium": "GPU"}
        buffer.append((i, msgspec.msgpack.encode([1.0 + i, [event], 0])))

    async def serve() -> None:
        while True:
            client, _, start = await replay.recv_multipart()
            for seq, payload in buffer:
                if seq >= int.from_bytes(start, "big"):
                    await replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await replay.send_multipart((client, b"", (-1).to_bytes(8, "big", signed=True), b""))

    server = asyncio.create_task(serve())
    index = ExactIndex()
    sub = KvEventSubscriber("a", f"tcp://127.0.0.1:{pub_port}", index, metrics, f"tcp://127.0.0.1:{replay_port}")
    await sub.start()
    try:
        await until(lambda: sub.fresh)
        assert index.match_tokens("a", chain(tokens), 0.0) == len(tokens)
        assert metric(metrics, "warmroute_kv_events_bad_total", backend="a") == 0
    finally:
        await sub.stop()
        server.cancel()
        pub.close(linger=0)
        replay.close(linger=0)


async def test_a_bad_discovery_answer_is_logged_once_counted_and_asked_again(metrics, monkeypatch, caplog):
    import logging

    from warmroute.router import kv_subscriber

    monkeypatch.setattr(kv_subscriber, "RETRY_S", 0.02)
    engine = Engine()
    await engine.pub.start()
    answers = [{"\u00b2": {"endpoint": engine.endpoint}}] * 3 + [{"0": {"endpoint": engine.endpoint,
                                                                         "replay_endpoint": engine.replay_endpoint}}]
    asked = []

    async def discover():
        asked.append(1)
        return 200, answers[min(len(asked), len(answers)) - 1]

    caplog.set_level(logging.WARNING, logger="warmroute.router")
    sub = KvEventSubscriber("a", None, ExactIndex(), metrics, discover=discover, host="127.0.0.1")
    await sub.start()
    try:
        await until(lambda: sub.fresh)
        assert len(asked) == 4
        assert metric(metrics, "warmroute_kv_events_failures_total", backend="a", kind="discovery") == 3
        said = [r.getMessage() for r in caplog.records if "cannot be used" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("kv events a: discovery:") and "'²'" in said[0]
    finally:
        await sub.stop()
        await engine.pub.close()


async def test_an_endpoint_zmq_refuses_is_logged_once_and_retried_with_backoff(metrics, monkeypatch, caplog):
    import logging

    from warmroute.router import kv_subscriber

    monkeypatch.setattr(kv_subscriber, "RETRY_S", 0.01)
    caplog.set_level(logging.WARNING, logger="warmroute.router")
    sub = KvEventSubscriber("a", "tcp://no such host:5557", ExactIndex(), metrics)
    await sub.start()
    try:
        await until(lambda: metric(metrics, "warmroute_kv_events_failures_total", backend="a", kind="connect") >= 4)
        assert sub._task is not None and not sub._task.done() and not sub.fresh  # alive, trying again
        said = [r.getMessage() for r in caplog.records if "no such host" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("kv events a: connect: cannot connect")
        await asyncio.sleep(0.3)  # 0.01, 0.02, 0.04, 0.08, 0.16 ...: a handful more, not hundreds
        assert metric(metrics, "warmroute_kv_events_failures_total", backend="a", kind="connect") < 10
    finally:
        await sub.stop()
