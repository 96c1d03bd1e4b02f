"""Blob servers answer only the job's processes: a request without the job's HMAC, with
another job's key, or replayed from another connection gets a refusal frame and no data."""

from __future__ import annotations

import pytest
import torch

from digen.dataplane.auth import Keyring, keyring, new_key, request_mac
from digen.dataplane.blobs import BlobLost, connection, fetch, tls_contexts
from digen.dataplane.wire import recv_header, send_frame
from tests.reliability.certs import make_certs
from tests.security.blob_helpers import (
    JOB,
    job_key,
    raw_connection,
    read_hello,
    serving,
    until_closed,
    weights,
)

NAME = f"{JOB}:weights:3"


def test_a_request_without_the_credential_gets_a_refusal_and_no_data():
    with job_key(), serving() as (store, server):
        store.put(NAME, weights(), {"version": "3"})
        with raw_connection(server.address) as s:
            hello = read_hello(s)
            assert hello["hello"] == "digen-blob/2" and len(hello["nonce"]) == 32
            send_frame(s, {"op": "get", "blob": NAME, "names": None, "exclude": [], "dtype": None})
            answer = until_closed(s)
        assert b'"error": "refused"' in answer and b"layer0" not in answer
        assert server.counts["refused"] == 1 and server.bytes_sent == 0
        assert fetch(server.address, NAME)[0].keys() == weights().keys()  # the job's own fetch works


def servers_keys(key: bytes) -> Keyring:
    """The server's own keyring (in a job, its process's): here apart from this client's."""
    ring = Keyring()
    ring.add(JOB, key)
    return ring


def test_a_request_signed_with_a_wrong_key_gets_no_data():
    with job_key() as key, serving(keys=servers_keys(key)) as (store, server):
        store.put(NAME, weights())
        keyring().add(JOB, new_key())  # this client holds another key than the server's
        with pytest.raises(BlobLost, match="not authorized"):
            fetch(server.address, NAME)
        assert server.counts["refused"] == 1 and server.bytes_sent == 0


def test_a_process_without_the_jobs_key_does_not_even_ask():
    with job_key() as key, serving(keys=servers_keys(key)) as (store, server):
        store.put(NAME, weights())
        keyring().drop(JOB)
        with pytest.raises(BlobLost, match="no key for job secjob"):
            fetch(server.address, NAME)
        assert server.counts["refused"] == 0 and server.bytes_sent == 0


def test_a_blob_of_another_job_is_refused_with_this_jobs_key():
    with job_key(), job_key("other"), serving() as (store, server):
        store.put("other:weights:1", weights())
        key = keyring().get(JOB)
        assert key is not None
        with raw_connection(server.address) as s:  # signed with secjob's key, for other's blob
            nonce = read_hello(s)["nonce"]
            req = {"op": "get", "blob": "other:weights:1", "names": None, "exclude": [], "dtype": None}
            req |= {"seq": 0, "nonce": "c" * 32, "from": "test"}
            req["mac"] = request_mac(key, nonce, req)
            send_frame(s, req)
            assert b'"error": "refused"' in until_closed(s)
        assert server.bytes_sent == 0


def test_a_captured_request_replayed_on_another_connection_or_twice_is_refused():
    with job_key() as key, serving() as (store, server):
        store.put(NAME, weights())
        with raw_connection(server.address) as s:
            nonce = read_hello(s)["nonce"]
            req = {"op": "describe", "blob": NAME, "seq": 0, "nonce": "c" * 32, "from": "test"}
            req["mac"] = request_mac(key, nonce, req)
            send_frame(s, req)
            assert recv_header(s)["ok"] is True  # the genuine request
            send_frame(s, req)  # the same bytes again on the same connection: seq is stale
            assert b'"error": "refused"' in until_closed(s)
        with raw_connection(server.address) as s:  # the same bytes on a new connection: new nonce
            read_hello(s)
            send_frame(s, req)
            assert b'"error": "refused"' in until_closed(s)
        assert server.counts["refused"] == 2


def test_with_mutual_tls_the_hmac_still_applies(tmp_path):
    certs = make_certs(tmp_path / "certs")
    server_ctx, client_ctx = tls_contexts(str(certs.ca), str(certs.cert), str(certs.key))
    with (
        job_key() as key,
        serving(keys=servers_keys(key), ssl_context=server_ctx, handshake_s=0.5) as (
            store,
            server,
        ),
    ):
        store.put(NAME, weights())
        with connection(server.address, client_ctx) as ch:
            assert torch.equal(fetch(server.address, NAME, sock=ch)[0]["layer1.w"], weights()["layer1.w"])
        keyring().add(JOB, new_key())  # a node of the cluster (a signed certificate), not of the job
        with connection(server.address, client_ctx) as ch, pytest.raises(BlobLost, match="not authorized"):
            fetch(server.address, NAME, sock=ch)
        assert server.counts["refused"] == 1


def test_a_forked_process_has_its_own_incarnation_and_signs_with_it():
    """Workers are forked from one fork server: each must name itself, not the server (its
    blobs' producer, and the requester a blob server counts connections by)."""
    import json
    import os

    from digen.dataplane.auth import incarnation

    mine = incarnation()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once, running nothing of pytest's
        os.close(read)
        os.write(write, json.dumps([os.getpid(), incarnation()]).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        child_pid, theirs = json.loads(f.read())
    os.waitpid(pid, 0)
    assert incarnation() == mine and f":{os.getpid()}:" in mine
    assert theirs != mine and f":{child_pid}:" in theirs
