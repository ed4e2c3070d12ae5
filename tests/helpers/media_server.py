"""A local HTTP server on 127.0.0.1 serving test media: files by name, plus /redirect/N (N hops
to /image.png), /big (21 MB without Content-Length), /big-declared (a Content-Length of 21 MB)
and /missing (404). It stops when closed."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BIG = 21 * 2**20


class MediaServer:
    def __init__(self, files: dict[str, bytes]) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_GET(self) -> None:  # noqa: N802
                path = self.path.lstrip("/")
                if path.startswith("redirect/"):
                    hops = int(path.split("/")[1])
                    self.send_response(302)
                    self.send_header("Location", f"/redirect/{hops - 1}" if hops > 1 else "/image.png")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif path in ("big", "big-declared"):
                    self.send_response(200)
                    if path == "big-declared":
                        self.send_header("Content-Length", str(BIG))
                    self.end_headers()
                    try:
                        for _ in range(BIG // 2**20):
                            self.wfile.write(b"\0" * 2**20)
                    except (BrokenPipeError, ConnectionResetError):
                        outer.cut_short += 1  # the client stopped reading
                elif path in files:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(files[path])))
                    self.end_headers()
                    self.wfile.write(files[path])
                else:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()

        self.cut_short = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
