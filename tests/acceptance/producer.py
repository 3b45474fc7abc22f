"""A web process's stand-in: it sends lock_enqueue tasks and serves their outcomes.

    python -m tests.acceptance.producer serve|mount

``serve`` starts celery_pglock.metrics.serve_producer on a free port; ``mount`` serves the
registry of producer_registry() through prometheus_client.make_wsgi_app at /metrics of a
WSGI app of its own, as a web app's own /metrics would. Either way it prints the port, then
for each line ``<run> <key>`` on stdin calls ``until_finished.delay(run, key)`` and prints
the task id it got back. The app and its queue come from the acceptance environment
(PGLOCK_TEST_QUEUE: a queue no worker consumes, so that nothing runs).
"""

from __future__ import annotations

import sys
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

import prometheus_client

from celery_pglock import metrics
from tests.acceptance import enqueue_app


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def _mount() -> int:
    """A WSGI app of this process with the producer registry at /metrics."""
    exporter = prometheus_client.make_wsgi_app(
        metrics.producer_registry(enqueue_app.app)
    )

    def web_app(environ, start_response):
        if environ["PATH_INFO"] == "/metrics":
            return exporter(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found"]

    server = make_server("127.0.0.1", 0, web_app, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return int(server.server_port)


def main(argv: list[str]) -> int:
    (mode,) = argv
    if mode == "serve":
        port = metrics.serve_producer(enqueue_app.app, port=0, address="127.0.0.1").port
    else:
        port = _mount()
    print(port, flush=True)
    for line in sys.stdin:
        run, key = line.split()
        print(enqueue_app.until_finished.delay(run, key).id, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
