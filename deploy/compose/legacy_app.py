"""A stand-in for the legacy application behind dedupe-proxy: it accepts any
POST, prints what it received (with the X-Dedupe-* headers the proxy adds)
and answers 200. GET /health answers 200 for the compose healthcheck."""

import http.server
import json
import os


class LegacyApp(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.answer(200 if self.path == "/health" else 404, {"ok": self.path == "/health"})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        print(
            json.dumps(
                {
                    "path": self.path,
                    "key": self.headers.get("X-Dedupe-Key"),
                    "source": self.headers.get("X-Dedupe-Source"),
                    "attempt": self.headers.get("X-Dedupe-Attempt"),
                    "bytes": len(body),
                }
            ),
            flush=True,
        )
        self.answer(200, {"processed": True})

    def answer(self, status, document):
        payload = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    port = int(os.environ.get("PORT", "3000"))
    http.server.ThreadingHTTPServer(("0.0.0.0", port), LegacyApp).serve_forever()
