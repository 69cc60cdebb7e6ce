"""A Hugging Face hub served from memory on 127.0.0.1, for the tests that download through huggingface_hub."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from urllib.parse import urlparse


class FakeHub:
    """Repositories served from memory on 127.0.0.1 as the hub serves a file (`{repo}/resolve/main/{file}`, or at
    the repository's one commit instead of main): HEAD
    for its metadata, GET for its bytes; a missing repository or file is the hub's 404 with its error code. Also the
    two API answers transformers asks for when it loads a tokenizer: a repository's info (`api/models/{repo}`: its
    commit and files) and a folder's listing (`api/models/{repo}/tree/main/{folder}`). HF_ENDPOINT pointed here,
    huggingface_hub takes its real download path. `etags`: a filename's ETag when it should not be the
    SHA-256 of its bytes (a download that does not match its hash)."""

    def __init__(self, repos: dict[str, dict[str, bytes]], etags: dict[str, str] | None = None):
        self.requests: list[str] = []
        etags = etags or {}
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _headers(self) -> bytes | None:
                hub.requests.append(f"{self.command} {self.path}")
                repo, _, rest = self.path.lstrip("/").partition("/resolve/")
                revision, _, filename = rest.partition("/")  # main, or the commit the repository's info names
                known = revision in ("main", hashlib.sha1(repo.encode()).hexdigest())
                data = repos.get(repo, {}).get(filename) if known else None
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

            def _api(self) -> bool:
                """Answer an api/models/ request (True), else leave the request to the file path (False)."""
                path = urlparse(self.path).path
                if not path.startswith("/api/models/"):
                    return False
                hub.requests.append(f"{self.command} {self.path}")
                rest = path[len("/api/models/") :]
                repo = next((r for r in repos if rest == r or rest.startswith(r + "/")), None)
                tail = rest[len(repo) :].strip("/") if repo else ""
                if repo is None or not (tail in ("", "revision/main") or tail.startswith("tree/main")):
                    return self._json(None, "RepoNotFound")
                files = repos[repo]
                if tail.startswith("tree/main"):
                    folder = tail[len("tree/main") :].strip("/")
                    inside = [f for f in files if not folder or f.startswith(folder + "/")]
                    if folder and not inside:
                        return self._json(None, "EntryNotFound")
                    return self._json([{"type": "file", "path": f, "size": len(files[f])} for f in inside])
                sha = hashlib.sha1(repo.encode()).hexdigest()
                return self._json({"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]})

            def _json(self, answer, error: str | None = None) -> bool:
                body = b"" if answer is None else json.dumps(answer).encode()
                self.send_response(404 if answer is None else 200)
                if error:
                    self.send_header("X-Error-Code", error)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)
                return True

            def do_HEAD(self):  # noqa: N802 — http.server's naming
                if not self._api():
                    self._headers()

            def do_GET(self):  # noqa: N802
                if self._api():
                    return
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
