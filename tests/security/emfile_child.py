"""Run as a child process by ``test_blobs_abuse``: a blob server whose process runs out of file
descriptors while a peer connects. Prints one JSON line: what the server and the peer saw.

The child lowers its own ``RLIMIT_NOFILE`` and fills it, so the parent's test process keeps
its descriptors."""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import socket
import sys

import torch

from digen.dataplane.auth import keyring, new_key
from digen.dataplane.blobs import BlobServer, BlobStore, fetch
from digen.dataplane.wire import recv_header
from tests.security.blob_helpers import wait_until


class Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.accept_warnings = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING and "accept failed" in record.getMessage():
            self.accept_warnings += 1


def main() -> dict:
    counter = Count()
    logging.getLogger("digen.dataplane.blobs").addHandler(counter)
    keyring().add("job", new_key())
    store = BlobStore()
    store.put("job:x", {"t": torch.arange(5.0)})
    server = BlobServer(store, backoff_s=0.01)
    host, port = server.address.rsplit(":", 1)
    peer = socket.socket()  # made before the descriptors run out
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
    held = []
    try:
        while True:
            held.append(os.dup(0))
    except OSError as exc:
        assert exc.errno == errno.EMFILE
    peer.connect((host, int(port)))  # the kernel takes it; the server's accept() gets EMFILE
    wait_until(lambda: server.counts["accept_failed"] >= 3, "three failed accepts")
    failed_while_out = server.counts["accept_failed"]
    for fd in held:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    peer.settimeout(10)
    hello = recv_header(peer)  # accepted once descriptors are free again
    peer.close()
    got, _ = fetch(server.address, "job:x")
    server.close()
    wait_until(lambda: server.active == 0, "the server's connections ended")
    return {
        "failed_while_out": failed_while_out,
        "hello": hello.get("hello"),
        "fetched": got["t"].tolist(),
        "accept_warnings": counter.accept_warnings,
    }


if __name__ == "__main__":
    json.dump(main(), sys.stdout)
    print(flush=True)
    # What is under test ends with the line above. The interpreter's own teardown is not:
    # once, on a loaded CI machine, this child aborted after printing ("terminate called
    # without an active exception", a torch thread torn down at exit), which says nothing
    # about the accept loop. So the child leaves without that teardown.
    sys.stderr.flush()
    os._exit(0)
