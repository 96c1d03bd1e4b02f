"""A reward server the tests control (a thread of the test process, plain HTTP): it answers
``/health`` always and ``/score`` as its ``mode`` says: ``ok`` (each image's mean pixel),
``gate`` (``ok`` once :attr:`RewardServer.gate` is set), ``hang`` (never answers), ``bad``
(a body without a score list). It counts the ``/score`` requests it received (``scores``)
and the ``/health`` requests (``healths``)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class RewardServer:
    def __init__(self, mode: str = "ok"):
        self.mode = mode
        self.gate = threading.Event()
        self.release = threading.Event()  # set at close: hung requests end
        self.scores = 0
        self.healths = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path.startswith("/health"):
                    with server.lock:
                        server.healths += 1
                self._send(200, {"status": "ok", "reward": "test"})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.scores += 1
                if server.mode == "hang":
                    server.release.wait()
                    return
                if server.mode == "bad":
                    self._send(200, {"result": "no scores here"})
                    return
                if server.mode == "gate":
                    server.gate.wait()
                self._send(200, {"scores": [0.5 + 0.01 * (i % 7) for i in range(len(body["prompts"]))]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> RewardServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.gate.set()
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
