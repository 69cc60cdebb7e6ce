"""A Hugging Face hub served from memory on 127.0.0.1, for the tests that download through huggingface_hub."""

from __future__ import annotations

import hashlib
import http.server
import threading


class FakeHub:
    """Repositories served from memory on 127.0.0.1 as the hub serves a file (`{repo}/resolve/main/{file}`): HEAD
    for its metadata, GET for its bytes; a missing repository or file is the hub's 404 with its error code. HF_ENDPOINT
    pointed here, huggingface_hub takes its real download path. `etags`: a filename's ETag when it should not be the
    SHA-256 of its bytes (a download that does not match its hash). The hub's API (/api/models/...) is not served: for
    a repository held here it answers as for a missing entry."""

    def __init__(self, repos: dict[str, dict[str, bytes]], etags: dict[str, str] | None = None):
        self.requests: list[str] = []
        etags = etags or {}
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _headers(self) -> bytes | None:
                hub.requests.append(f"{self.command} {self.path}")
                repo, _, filename = self.path.lstrip("/").partition("/resolve/main/")
                if self.path.startswith("/api/models/"):
                    # the hub's API (repository info, folder listings: transformers' tokenizers ask for their chat
                    # templates) is not served: for a repository held here it answers as for a missing entry, which
                    # clients take as "nothing there", not as a missing repository
                    repo, filename = "/".join(self.path.split("?")[0].split("/")[3:5]), None
                data = repos.get(repo, {}).get(filename)
                if data is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound" if repo in repos else "RepoNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                self.send_response(200)
                self.send_header("X-Repo-Commit", hashlib.sha1(repo.encode()).hexdigest())
                self.send_header("ETag", f'"{etags.get(filename) or hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                return data

            def do_HEAD(self):  # noqa: N802 — http.server's naming
                self._headers()

            def do_GET(self):  # noqa: N802
                data = self._headers()
                if data is not None:
                    self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
