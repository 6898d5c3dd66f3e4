"""A local HTTP server for stand-ins of remote services (the Hugging Face Hub) in tests: no network."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietHandler(BaseHTTPRequestHandler):
    """HEAD and GET both go to `respond(body)`; nothing is logged to stderr."""

    def respond(self, body: bool) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def do_HEAD(self):
        self.respond(body=False)

    def do_GET(self):
        self.respond(body=True)

    def log_message(self, *args):
        pass


class LocalServer:
    """Serves `handler` on 127.0.0.1 at a free port, in a thread, until `close()`; `url` is its base."""

    def __init__(self, handler: type[QuietHandler]):
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
