"""A stand-in for ``dynspec_testbed.serve`` in ``test_testbed_plugin``'s port test: it
answers ``/health_generate`` on ``--port`` like a healthy server, or, when the port
is taken, prints uvicorn's bind error and stays up without serving, as a real
SGLang server does."""

import http.server
import sys
import time

from dynspec_testbed.server import BIND_FAILURE


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


port = int(sys.argv[sys.argv.index("--port") + 1])
try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as e:
    print(
        f"ERROR:    [Errno {e.errno}] {BIND_FAILURE} ('127.0.0.1', {port}): address already in use",
        flush=True,
    )
    while True:
        time.sleep(1)
server.serve_forever()
