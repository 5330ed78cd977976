import json
import threading
import time

import pytest

from tests.helpers import waiting
from wildtrain.events import TrackingOutage
from wildtrain.tracking.controller.buffer import Backoff, Outage, TrackingBuffer

FAST = Backoff(first_s=0.01, max_s=0.05)


class Server:
    """A fake tracking server: takes records while up, raises while down, and can hang
    inside a send (a stopped process) until released."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.attempts = 0
        self.up = threading.Event()
        self.up.set()
        self.released = threading.Event()
        self.released.set()
        self.sending = threading.Event()

    def send(self, record: dict) -> None:
        self.sending.set()
        self.released.wait()
        self.attempts += 1
        if not self.up.is_set():
            raise ConnectionError("connection refused")
        self.received.append(record["i"])


def wait_for(condition, timeout_s: float = 10.0) -> None:
    waiting.wait_for(condition, timeout_s=timeout_s, every_s=0.005)


def test_records_arrive_in_order_after_the_server_comes_back(tmp_path):
    server = Server()
    outages: list[Outage] = []
    buffer = TrackingBuffer(server.send, tmp_path, backoff=FAST, on_outage=outages.append)
    buffer.put({"i": 0})
    wait_for(lambda: server.received == [0])
    server.up.clear()
    for i in range(1, 50):
        buffer.put({"i": i})
    wait_for(lambda: server.attempts > 5)  # retried, not given up on
    down_at = time.time()
    server.up.set()
    assert buffer.close(timeout_s=10) is None
    assert server.received == list(range(50))
    assert len(outages) == 1 and outages[0].resolved
    assert outages[0].start < down_at < outages[0].end
    assert isinstance(outages[0].event(), TrackingOutage)
    assert "connection refused" in outages[0].error


def test_put_never_waits_on_a_hung_server(tmp_path):
    server = Server()
    server.released.clear()  # the first send hangs, as on a stopped process
    buffer = TrackingBuffer(server.send, tmp_path, capacity=100, backoff=FAST)

    def put_all():
        for i in range(1000):  # ten times the capacity: most spill to disk
            buffer.put({"i": i, "payload": "x" * 100})

    # The server stays hung until the puts are done: a put that waited on it would never end.
    putter = threading.Thread(target=put_all, daemon=True)
    putter.start()
    putter.join(timeout=60)
    assert not putter.is_alive(), "put waited on the hung server"
    server.released.set()
    assert buffer.close(timeout_s=10) is None
    assert server.received == list(range(1000))
    assert not list(tmp_path.glob("*.jsonl")), "spill files are removed once sent"


def test_records_beyond_the_capacity_spill_to_disk_and_come_back_in_order(tmp_path):
    server = Server()
    server.up.clear()
    buffer = TrackingBuffer(server.send, tmp_path, capacity=5, backoff=FAST)
    for i in range(20):
        buffer.put({"i": i})
    spilled = [json.loads(line)["i"] for f in tmp_path.glob("*-spill.jsonl") for line in f.read_text().splitlines()]
    assert spilled == list(range(5, 20))
    server.up.set()
    wait_for(lambda: len(server.received) == 20)
    for i in range(20, 25):  # memory again once the spill file has drained
        buffer.put({"i": i})
    assert buffer.close(timeout_s=10) is None
    assert server.received == list(range(25))
    assert not list(tmp_path.glob("*.jsonl"))


def test_close_flushes_what_is_left(tmp_path):
    server = Server()
    buffer = TrackingBuffer(server.send, tmp_path, backoff=FAST)
    for i in range(200):
        buffer.put({"i": i})
    assert buffer.close(timeout_s=10) is None
    assert server.received == list(range(200))
    with pytest.raises(RuntimeError, match="closed"):
        buffer.put({"i": 200})


def test_what_close_cannot_send_waits_in_a_file_that_the_next_buffer_sends_first(tmp_path):
    server = Server()
    server.up.clear()
    outages: list[Outage] = []

    def record_outage(outage: Outage) -> None:
        outages.append(outage)
        first.put({"i": "outage", **outage.event().to_dict()})

    first = TrackingBuffer(server.send, tmp_path, capacity=3, backoff=FAST, on_outage=record_outage)
    for i in range(10):
        first.put({"i": i})
    started = time.monotonic()
    unsent = first.close(timeout_s=0.3)
    assert time.monotonic() - started < 10, "close waits a bounded time, not for the server"
    lines = [json.loads(line) for line in unsent.read_text().splitlines()]
    assert [line["i"] for line in lines] == [*range(10), "outage"]
    assert lines[-1]["event"] == "tracking_outage" and lines[-1]["resolved"] is False
    assert [p.name for p in tmp_path.glob("*.jsonl")] == [unsent.name], "the spill file was folded into it"

    server.up.set()
    second = TrackingBuffer(server.send, tmp_path, backoff=FAST)
    second.put({"i": 10})
    assert second.close(timeout_s=10) is None
    assert server.received == [*range(10), "outage", 10]
    assert not unsent.exists()


def test_a_close_during_a_hung_send_returns_and_keeps_that_record(tmp_path):
    server = Server()
    server.released.clear()
    buffer = TrackingBuffer(server.send, tmp_path, backoff=FAST)
    buffer.put({"i": 0})
    buffer.put({"i": 1})
    server.sending.wait(10)
    unsent = buffer.close(timeout_s=0.2)
    assert [json.loads(line)["i"] for line in unsent.read_text().splitlines()] == [0, 1]
    # The hung send ends after the close gave up on it (0 may so arrive twice, which the
    # server takes as a no-op); nothing after it is sent.
    server.released.set()
    time.sleep(0.2)
    assert server.received == [0]


def test_a_record_refused_for_good_is_set_aside_and_the_rest_go_on(tmp_path):
    received = []

    def send(record: dict) -> None:
        if record["i"] == 1:
            raise ValueError("metric value must be a number")
        received.append(record["i"])

    buffer = TrackingBuffer(send, tmp_path, backoff=FAST, is_transient=lambda e: not isinstance(e, ValueError))
    for i in range(3):
        buffer.put({"i": i})
    assert buffer.close(timeout_s=10) is None
    assert received == [0, 2]
    rejected = [json.loads(line) for line in (tmp_path / "rejected.jsonl").read_text().splitlines()]
    assert rejected == [{"record": {"i": 1}, "error": "ValueError: metric value must be a number"}]


def test_the_backoff_doubles_up_to_its_cap():
    assert [Backoff(0.5, 4.0).delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
