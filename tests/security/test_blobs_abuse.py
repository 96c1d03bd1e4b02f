"""A blob server that survives abuse: out of file descriptors, trickling and idle peers, too
many connections, malformed and oversized requests, a peer that never reads, a TLS peer that
never finishes its handshake. Each test decides from what the server did (its counts, what
it sent) with small, configured timeouts."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from digen.dataplane.auth import keyring, request_mac
from digen.dataplane.blobs import BlobLost, connection, fetch, tls_contexts
from digen.dataplane.wire import MAGIC, encode_header, recv_header, send_frame
from tests.reliability.certs import make_certs
from tests.security.blob_helpers import (
    JOB,
    client_hello,
    job_key,
    raw_connection,
    read_hello,
    server_threads,
    serving,
    until_closed,
    wait_until,
    weights,
)

NAME = f"{JOB}:weights:1"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_accept_loop_survives_running_out_of_file_descriptors():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "tests.security.emfile_child"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["failed_while_out"] >= 3  # accept() kept failing with EMFILE, and kept being retried
    assert seen["hello"] == "digen-blob/2"  # the waiting peer was served once descriptors were back
    assert seen["fetched"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert seen["accept_warnings"] == 1  # logged once, not once per retry


def test_a_peer_that_trickles_its_header_is_cut_by_the_header_deadline():
    with job_key(), serving(header_s=0.3, idle_s=30) as (store, server):
        store.put(NAME, weights())
        with raw_connection(server.address) as s:
            read_hello(s)
            sent = 0
            try:
                for b in MAGIC + b"\x00" * 8:  # one byte every 50 ms: each arrives well within idle_s
                    s.sendall(bytes([b]))
                    sent += 1
                    time.sleep(0.05)
                    if server.counts["timed_out"]:
                        break
            except OSError:
                pass
            wait_until(lambda: server.counts["timed_out"] == 1, "the header deadline")
            assert until_closed(s) == b""  # closed, nothing answered
        assert sent < 12 and server.active == 0


def test_an_idle_connection_is_closed_after_idle_s():
    with job_key(), serving(idle_s=0.2) as (store, server):
        with raw_connection(server.address) as s:
            read_hello(s)
            assert until_closed(s) == b""
        wait_until(lambda: server.counts["timed_out"] == 1 and server.active == 0, "the idle timeout")


def _signed_describe(s: socket.socket, key: bytes, who: str) -> dict:
    """Authenticate a raw connection as requester ``who``: its first request, signed."""
    nonce = read_hello(s)["nonce"]
    req = {"op": "describe", "blob": NAME, "seq": 0, "nonce": "c" * 32, "from": who}
    req["mac"] = request_mac(key, nonce, req)
    send_frame(s, req)
    return recv_header(s)


def test_connections_are_capped_by_authenticated_identity_not_by_address():
    """Every peer on loopback is 127.0.0.1: the caps count who signed, and connections that
    never authenticate count for none of them."""
    with job_key() as key, serving(max_conns=3, max_per_peer=2, auth_s=60) as (store, server):
        store.put(NAME, weights())
        idle = [raw_connection(server.address, "127.0.0.1") for _ in range(5)]  # over both caps
        a = [raw_connection(server.address, "127.0.0.1") for _ in range(2)]
        assert all(_signed_describe(s, key, "rollout-0")["ok"] for s in a)
        with raw_connection(server.address, "127.0.0.2") as third:  # A again, from another address
            assert _signed_describe(third, key, "rollout-0") == {
                "ok": False,
                "error": "busy",
                "message": "too many connections",
                "tensors": [],
            }
        b = raw_connection(server.address, "127.0.0.1")  # another identity, the same address
        assert _signed_describe(b, key, "trainer-0")["ok"]
        with raw_connection(server.address, "127.0.0.3") as fourth:  # the server is full
            assert _signed_describe(fourth, key, "trainer-1")["error"] == "busy"
        assert server.counts["busy"] == 2 and server.pending == len(idle)
        with pytest.raises(BlobLost, match="too many connections"):
            fetch(server.address, NAME)
        for s in [*a, b]:
            s.close()
        wait_until(lambda: server.active == len(idle), "the authenticated connections to end")
        assert torch.equal(fetch(server.address, NAME)[0]["layer0.w"], weights()["layer0.w"])
        for s in idle:
            s.close()


def test_an_idle_flood_past_the_cap_does_not_keep_a_peer_of_the_job_out():
    """Three times ``max_pending`` connections that never authenticate, from the address a
    worker's peers share: each new one drops the oldest waiting, and a real fetch still gets
    its answer (before, one peer address over 16 connections was refused as busy)."""
    with job_key(), serving(max_pending=8, max_per_peer=16, auth_s=60) as (store, server):
        store.put(NAME, weights())
        flood = [raw_connection(server.address, "127.0.0.1") for _ in range(3 * server.max_pending)]
        wait_until(lambda: server.counts["evicted"] == 2 * server.max_pending, "the flood to be admitted")
        assert server.pending == server.max_pending
        got, _ = fetch(server.address, NAME)
        assert torch.equal(got["layer3.w"], weights()["layer3.w"])
        assert server.counts["served"] == 1 and server.counts["busy"] == 0
        assert server.counts["evicted"] == 2 * server.max_pending + 1  # the fetch's own room
        for s in flood:
            s.close()
        wait_until(lambda: server.active == 0, "the flood's connections to end")


def test_a_connection_that_does_not_authenticate_within_auth_s_is_dropped_one_that_did_stays():
    with job_key(), serving(auth_s=0.3, idle_s=60) as (store, server):
        store.put(NAME, weights())
        with connection(server.address) as ch:
            fetch(server.address, NAME, sock=ch)  # authenticated: idle_s (60 s) applies now
            with raw_connection(server.address) as s:  # opened later, never authenticates
                read_hello(s)
                assert until_closed(s) == b""
            wait_until(lambda: server.counts["auth_timeout"] == 1, "the authentication deadline")
            assert server.active == 1  # the deadline of the older, authenticated one passed too
            assert torch.equal(fetch(server.address, NAME, sock=ch)[0]["layer1.w"], weights()["layer1.w"])
        assert server.counts["served"] == 2 and server.counts["timed_out"] == 1


def test_a_tls_servers_busy_answer_is_read_by_the_tls_peer(tmp_path):
    certs = make_certs(tmp_path / "certs")
    server_ctx, client_ctx = tls_contexts(str(certs.ca), str(certs.cert), str(certs.key))
    with job_key(), serving(ssl_context=server_ctx, max_conns=1) as (store, server):
        store.put(NAME, weights())
        with connection(server.address, client_ctx) as ch:
            fetch(server.address, NAME, sock=ch)
            with (
                connection(server.address, client_ctx) as second,
                pytest.raises(BlobLost, match="too many connections"),
            ):
                fetch(server.address, NAME, sock=second)
        assert server.counts["busy"] == 1


def test_malformed_requests_get_an_error_frame_and_a_debug_line_never_a_traceback(caplog):
    caplog.set_level(logging.DEBUG, "digen.dataplane.blobs")
    long = f"{JOB}:" + "n" * 500_000  # under the request limit: read whole, then refused
    with job_key(), serving(max_request=2**20) as (store, server):
        store.put(NAME, weights())
        cases = [
            b"GET / HTTP/1.1\r\n\r\n",
            MAGIC + (5).to_bytes(8, "little") + b"{nope",
            MAGIC + (2**40).to_bytes(8, "little"),
            MAGIC + (3 * 2**20).to_bytes(8, "little"),  # over the 1 MiB request limit: not read
        ]
        for raw in cases:
            with raw_connection(server.address) as s:
                read_hello(s)
                s.sendall(raw)
                assert b'"error": "bad"' in until_closed(s)
        frames = [
            {"op": "get", "blob": NAME, "names": "layer0.w", "seq": 0, "nonce": "c"},
            {"op": "get", "blob": NAME, "dtype": "complex128", "seq": 0, "nonce": "c"},
            {"op": "get", "blob": 7},
            {"op": "get", "blob": long, "names": 5, "seq": 0, "nonce": "c"},  # not echoed back
        ]
        for frame in frames:
            with raw_connection(server.address) as s:
                read_hello(s)
                send_frame(s, frame)
                answer = until_closed(s)
                assert b'"error": "bad"' in answer and len(answer) < 600  # the name is not echoed
        assert server.counts["bad"] == len(cases) + len(frames) and server.bytes_sent == 0
        assert torch.equal(fetch(server.address, NAME)[0]["layer0.w"], weights()["layer0.w"])  # still serving
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == [] and any("bad frame" in r.getMessage() for r in caplog.records)


def test_a_missing_blobs_long_name_is_cut_in_the_answer():
    with job_key(), serving() as (_store, server):
        name = f"{JOB}:" + "x" * 100_000
        with pytest.raises(BlobLost) as err:
            fetch(server.address, name)
        assert "no blob" in str(err.value) and len(str(err.value)) < 600


def test_a_peer_that_asks_for_a_float64_copy_and_never_reads_is_cut_by_the_request_deadline():
    """The cast is made one tensor at a time as it goes out; a reader that stalls is cut at
    ``request_s`` and the copy is freed with its connection."""
    big = {f"t{i}": torch.zeros(2**20) for i in range(16)}  # 64 MiB float32, 128 MiB as float64
    with job_key() as key, serving(request_s=0.5) as (store, server):
        store.put(NAME, big)
        with raw_connection(server.address) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            nonce = read_hello(s)["nonce"]
            req = {"op": "get", "blob": NAME, "names": None, "exclude": [], "dtype": "float64"}
            req |= {"seq": 0, "nonce": "c" * 32, "from": "test"}
            req["mac"] = request_mac(key, nonce, req)
            send_frame(s, req)
            wait_until(lambda: server.counts["timed_out"] == 1, "the request deadline")
        wait_until(lambda: server.active == 0, "the connection to end")


def test_a_tls_peer_that_never_finishes_its_handshake_is_cut(tmp_path):
    certs = make_certs(tmp_path / "certs")
    server_ctx, client_ctx = tls_contexts(str(certs.ca), str(certs.cert), str(certs.key))
    with job_key(), serving(ssl_context=server_ctx, handshake_s=0.3) as (store, server):
        store.put(NAME, weights())
        with raw_connection(server.address) as s:  # TCP only: no ClientHello ever comes
            assert until_closed(s) == b""
        wait_until(lambda: server.counts["timed_out"] == 1 and server.active == 0, "the handshake timeout")
        with connection(server.address, client_ctx) as ch:  # a real peer is served as before
            assert torch.equal(fetch(server.address, NAME, sock=ch)[0]["layer2.w"], weights()["layer2.w"])


def test_the_process_keyring_is_left_as_found():
    assert keyring().get(JOB) is None


def test_a_peer_that_trickles_within_every_other_deadline_is_cut_by_the_authentication_deadline():
    """Slowloris before authenticating: a byte every 50 ms keeps ``idle_s`` and ``header_s``
    (both 30 s) from ever passing; ``auth_s`` counts from the connection's start."""
    with job_key(), serving(auth_s=0.3, header_s=30, idle_s=30) as (store, server):
        store.put(NAME, weights())
        with raw_connection(server.address) as s:
            read_hello(s)
            with contextlib.suppress(OSError):
                for b in (
                    MAGIC + (1000).to_bytes(8, "little") + b" " * 1000
                ):  # a header that never ends in time
                    s.sendall(bytes([b]))
                    if server.counts["auth_timeout"]:
                        break
                    time.sleep(0.05)
            wait_until(lambda: server.counts["auth_timeout"] == 1, "the authentication deadline")
        wait_until(lambda: server.active == 0, "the connection to end")
        assert server.counts["timed_out"] == 1 and server.counts["bad"] == 0


def test_connections_waiting_to_authenticate_cost_no_thread_and_a_stalled_handshake_delays_no_one(tmp_path):
    """Three times ``max_pending`` TLS connections that never authenticate, every other one
    stalled half-way through its ClientHello: the server's one gate thread holds the newest
    ``max_pending`` of them and starts no thread for any, and a real TLS peer is served while
    they wait, on a thread of its own that ends with its connection. (Before the gate, each
    waiting connection had a thread: 8 here.)"""
    certs = make_certs(tmp_path / "certs")
    server_ctx, client_ctx = tls_contexts(str(certs.ca), str(certs.cert), str(certs.key))
    hello = client_hello()
    options = {"ssl_context": server_ctx, "max_pending": 8, "auth_s": 60, "handshake_s": 60}
    with job_key(), serving(**options) as (store, server):
        store.put(NAME, weights())
        before = server_threads()  # this server's gate (and any other server's threads)
        flood = [raw_connection(server.address) for _ in range(3 * server.max_pending)]
        for s in flood[1::2]:
            s.sendall(hello[: len(hello) // 2])
        wait_until(lambda: server.counts["evicted"] == 2 * server.max_pending, "the flood to be admitted")
        assert server.pending == server.max_pending and server_threads() == before
        with connection(server.address, client_ctx) as ch:
            assert torch.equal(fetch(server.address, NAME, sock=ch)[0]["layer1.w"], weights()["layer1.w"])
            assert server_threads() - before == Counter({"digen-blob-conn": 1})
        wait_until(lambda: server_threads() == before, "the served connection's thread to end")
        assert server.counts["timed_out"] == 0 and server.counts["evicted"] == 2 * server.max_pending + 1
        for s in flood:
            s.close()
        wait_until(lambda: server.active == 0, "the flood's connections to end")


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_requests_sent_back_to_back_before_any_answer_are_all_answered(tls: bool, tmp_path):
    """The gate reads the first request and not a byte past it (over TLS, the second may sit
    decrypted in the same record): the serving thread answers both, in order."""
    server_ctx = client_ctx = None
    if tls:
        certs = make_certs(tmp_path / "certs")
        server_ctx, client_ctx = tls_contexts(str(certs.ca), str(certs.cert), str(certs.key))
    with job_key() as key, serving(ssl_context=server_ctx) as (store, server):
        store.put(NAME, weights())
        store.put(f"{JOB}:weights:2", weights(seed=2))
        s = raw_connection(server.address)
        if client_ctx is not None:
            s = client_ctx.wrap_socket(s)
        with s:
            nonce = read_hello(s)["nonce"]
            frames = b""
            for seq, name in enumerate([NAME, f"{JOB}:weights:2"]):
                req = {"op": "describe", "blob": name, "seq": seq, "nonce": f"{seq}" * 32, "from": "test"}
                req["mac"] = request_mac(key, nonce, req)
                frames += encode_header(req)
            s.sendall(frames)  # one write: both requests, before reading anything
            answers = [recv_header(s), recv_header(s)]
        assert [a["ok"] for a in answers] == [True, True]
        assert [a["manifest"]["name"] for a in answers] == [NAME, f"{JOB}:weights:2"]
        assert server.counts["refused"] == 0 and server.counts["bad"] == 0


def test_closing_the_server_closes_the_connections_waiting_to_authenticate():
    with job_key(), serving(auth_s=60) as (_store, server):
        gone = server_threads() - Counter({"digen-blob-server": 1})  # once this server's gate ends
        waiting = [raw_connection(server.address) for _ in range(3)]
        for s in waiting:
            read_hello(s)
        assert server.pending == 3
        server.close()  # returns once the gate's thread has ended, having closed them
        assert server.active == 0 and server_threads() == gone
        assert [s.recv(1) for s in waiting] == [b""] * 3  # the end of each, not a timeout
        for s in waiting:
            s.close()
