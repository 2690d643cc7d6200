"""A Hugging Face Hub stand-in on loopback for the upload tests: the endpoints huggingface_hub's
`create_repo`, `create_branch` and `upload_folder` call over the LFS protocol (the tests set
HF_HUB_DISABLE_XET=1: the real Hub speaks Xet to hf_xet, which has no local stand-in), keeping
what a real Hub would keep (repos, branches, LFS objects, commits) and every Authorization header.
`fail_once = (text, status)`: the next request whose path holds `text` is answered `status`.
Requests without a bearer token are refused (401), as the Hub refuses writes."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}  # repo id -> {"private", "branches": {name: {path: bytes}}}
        self.lfs: dict[str, bytes] = {}  # sha256 -> content
        self.commits: list[dict] = []  # {"repo", "revision", "summary", "files": {path: bytes}}
        self.auth: list[str] = []  # the Authorization header of each request, in order
        self.requests: list[str] = []
        self.fail_once: tuple[str, int] | None = None
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":  # streamed uploads
                    data = b""
                    while (n := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                        data += self.rfile.read(n)
                        self.rfile.readline()
                    self.rfile.readline()
                    return data
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _reply(self, code: int, data: object = None, headers: dict | None = None) -> None:
                raw = json.dumps(data).encode() if data is not None else b""
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(raw)

            def handle_one(self, method: str) -> None:
                body = self._body()
                hub.requests.append(f"{method} {self.path}")
                hub.auth.append(self.headers.get("Authorization", ""))
                if hub.fail_once and hub.fail_once[0] in self.path:
                    status, hub.fail_once = hub.fail_once[1], None
                    return self._reply(status, {"error": "failed on purpose"})
                hub.route(self, method, self.path.split("?")[0], body)

            def do_GET(self) -> None:
                self.handle_one("GET")

            def do_POST(self) -> None:
                self.handle_one("POST")

            def do_PUT(self) -> None:
                self.handle_one("PUT")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def route(self, h, method: str, path: str, body: bytes) -> None:
        # Upload URLs are pre-signed (S3 on the real Hub): the client sends them no token.
        signed = path.startswith("/lfs-upload/")
        if not signed and not h.headers.get("Authorization", "").startswith("Bearer "):
            return h._reply(401, {"error": "Invalid credentials in Authorization header"})
        if method == "POST" and path == "/api/validate-yaml":  # a model card's front matter
            return h._reply(200, {"errors": [], "warnings": []})
        if method == "GET" and path == "/api/whoami-v2":
            return h._reply(200, {"name": "tester", "type": "user", "orgs": []})
        if method == "POST" and path == "/api/repos/create":
            req = json.loads(body)
            repo = f"{req.get('organization') or 'tester'}/{req['name']}"
            if repo in self.repos:
                return h._reply(
                    409, {"error": "You already created this model repo", "url": f"{self.url}/{repo}"}
                )
            private = req.get("visibility") == "private" or bool(req.get("private"))
            self.repos[repo] = {"private": private, "branches": {"main": {}}}
            return h._reply(200, {"url": f"{self.url}/{repo}", "name": repo})
        parts = path.strip("/").split("/")
        if method == "POST" and parts[:2] == ["api", "models"] and parts[4:5] == ["branch"]:
            repo, branch = "/".join(parts[2:4]), "/".join(parts[5:])
            branches = self.repos[repo]["branches"]
            if branch in branches:
                return h._reply(409, {"error": "Reference already exists"})
            branches[branch] = dict(branches["main"])
            return h._reply(200, {})
        if method == "POST" and parts[:2] == ["api", "models"] and parts[4:5] == ["preupload"]:
            files = json.loads(body)["files"]
            modes = [
                {
                    "path": f["path"],
                    "uploadMode": "lfs" if f["size"] > 1000 else "regular",
                    "shouldIgnore": False,
                }
                for f in files
            ]
            return h._reply(200, {"files": modes, "commitOid": "0" * 40})
        if method == "POST" and path.endswith(".git/info/lfs/objects/batch"):
            objects = []
            for o in json.loads(body)["objects"]:
                entry = {"oid": o["oid"], "size": o["size"]}
                if o["oid"] not in self.lfs:  # already stored: no action, nothing is sent again
                    entry["actions"] = {"upload": {"href": f"{self.url}/lfs-upload/{o['oid']}"}}
                objects.append(entry)
            return h._reply(200, {"transfer": "basic", "objects": objects})
        if method == "PUT" and parts[0] == "lfs-upload":
            if hashlib.sha256(body).hexdigest() != parts[1]:
                return h._reply(400, {"error": "sha256 mismatch"})
            self.lfs[parts[1]] = body
            return h._reply(200, {})
        if method == "POST" and parts[:2] == ["api", "models"] and parts[4:5] == ["commit"]:
            repo, revision = "/".join(parts[2:4]), "/".join(parts[5:])
            lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
            header = next(x["value"] for x in lines if x["key"] == "header")
            files = {}
            for x in lines:
                v = x["value"]
                if x["key"] == "file":
                    files[v["path"]] = base64.b64decode(v["content"])
                elif x["key"] == "lfsFile":
                    files[v["path"]] = self.lfs[v["oid"]]
            self.repos[repo]["branches"].setdefault(revision, {}).update(files)
            self.commits.append(
                {"repo": repo, "revision": revision, "summary": header["summary"], "files": files}
            )
            return h._reply(200, {"commitUrl": f"{self.url}/{repo}/commit/{len(self.commits)}",
                                  "commitOid": f"{len(self.commits):040x}", "pullRequestUrl": None})  # fmt: skip
        return h._reply(404, {"error": f"no route {method} {path}"})
