"""A stand-in for an SGLang server, written from SGLang's documented native HTTP API (it is NOT
SGLang): ``/health``, ``/get_model_info``, streaming ``/generate`` with ``input_ids`` and
``return_logprob``, ``/update_weights_from_disk``, ``/flush_cache``, ``/release_memory_occupation`` and
``/resume_memory_occupation``, ``/get_server_info``, and the distributed weight update:
``/init_weights_update_group`` joins the trainer's group the way SGLang's
``init_custom_process_group`` builds it (a ``tcp://`` rendezvous, the store prefixed by the group
name, torch's process-group helper), and ``/update_weights_from_distributed`` receives one
broadcast per named tensor, as SGLang's model runner does. It records every request body so tests
can check what weir sends, and the tensors it received.

Its "model" is arithmetic on token ids, so expected outputs can be worked out by hand: the next token
after context ``c`` is ``(c[-1] + step) % vocab`` where ``step`` is 1 for the initial weights and
the tensor ``step`` of the last weights directory loaded; the reported log-prob is
``-step / 10``. A token equal to a stop id ends the sample (kept in the output, as with
``no_stop_trim``). Each token takes ``delay_s``.

Run as a script (``python sglang_standin.py PORT``) it serves on PORT until killed: a server process
that weir can start, lose and restart.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from safetensors.torch import load_file


def join_group(body: dict):
    """SGLang's ``init_custom_process_group`` for a server of one tensor-parallel rank: a
    rendezvous at the trainer's ``tcp://`` address, the store prefixed by the group's name, and
    torch's own process-group helper; the group's ranks are its global ranks."""
    import datetime

    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=120)
    url = f"tcp://{body['master_address']}:{body['master_port']}"
    rank, size, name = body["rank_offset"], body["world_size"], body["group_name"]
    store, rank, size = next(rendezvous(url, rank, size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(name, store)
    pg, _ = _new_process_group_helper(
        size, rank, [], body["backend"], store, group_name=name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(size)}
    return pg


class StandIn:
    def __init__(self, vocab: int = 1000, delay_s: float = 0.0, port: int = 0) -> None:
        self.vocab, self.delay_s = vocab, delay_s
        self.step = 1
        self.requests: list[tuple[str, dict]] = []
        self.released = False
        self.dead = False
        self.flushes = 0
        self.groups: dict = {}
        self.received: dict = {}  # name -> tensor, from /update_weights_from_distributed
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _json(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health" and not standin.dead:
                    self._json(200, {})
                elif self.path == "/get_model_info":
                    self._json(200, {"model_path": "stand-in", "is_generation": True})
                elif self.path == "/get_server_info":
                    self._json(200, {"tp_size": 1, "version": "stand-in"})
                elif self.path == "/received":  # for tests: what the group delivered, and when
                    got = {k: v.flatten().tolist() for k, v in standin.received.items()}
                    self._json(200, {"tensors": got, "flushes": standin.flushes})
                else:
                    self._json(404, {"error": "not found"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                standin.requests.append((self.path, body))
                if self.path == "/generate":
                    return standin._generate(self, body)
                if self.path == "/update_weights_from_disk":
                    f = Path(body["model_path"]) / "model.safetensors"
                    if not f.exists():
                        return self._json(200, {"success": False, "message": f"no {f}"})
                    standin.step = int(load_file(f)["step"].item())
                    return self._json(200, {"success": True, "message": "ok"})
                if self.path == "/flush_cache":
                    standin.flushes += 1
                    return self._json(200, {})
                if self.path == "/init_weights_update_group":
                    standin.groups[body["group_name"]] = join_group(body)
                    return self._json(200, {"success": True, "message": "joined"})
                if self.path == "/update_weights_from_distributed":
                    standin._receive(body)
                    if body.get("flush_cache"):
                        standin.flushes += 1
                    return self._json(200, {"success": True, "message": "updated"})
                if self.path == "/release_memory_occupation":
                    standin.released = True
                    return self._json(200, {})
                if self.path == "/resume_memory_occupation":
                    standin.released = False
                    return self._json(200, {})
                return self._json(404, {"error": "not found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _generate(self, h: BaseHTTPRequestHandler, body: dict) -> None:
        sp = body["sampling_params"]
        ctx = list(body["input_ids"])
        stops = set(sp.get("stop_token_ids") or [])
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def send(obj) -> None:
            data = (
                f"data: {obj}\n\n" if isinstance(obj, str) else f"data: {json.dumps(obj)}\n\n"
            ).encode()
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            h.wfile.flush()

        out: list[list] = []  # cumulative [logprob, token_id, text], as SGLang streams them
        reason = None
        try:
            while reason is None:
                if self.dead:  # killed: drop the connection mid-stream, as a crashed server does
                    h.close_connection = True
                    h.connection.shutdown(2)
                    return
                if self.released:
                    raise RuntimeError("generate while memory is released")
                time.sleep(self.delay_s)
                tok = (ctx[-1] + self.step) % self.vocab
                ctx.append(tok)
                out.append([-self.step / 10, tok, None])
                if tok in stops:
                    reason = {"type": "stop", "matched": tok}
                elif len(out) >= sp["max_new_tokens"]:
                    reason = {"type": "length", "length": len(out)}
                send({"text": "", "meta_info": {"id": "x", "output_token_logprobs": list(out),
                                                "finish_reason": reason}})  # fmt: skip
            send("[DONE]")
            h.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client closed the stream (weir pausing or aborting): the request ends

    def _receive(self, body: dict) -> None:
        """One broadcast from rank 0 per tensor, in the order the names come."""
        import torch
        import torch.distributed as dist

        pg = self.groups[body["group_name"]]
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(t, src=0, group=pg)
            self.received[name] = t
        if "step" in self.received:
            self.step = int(self.received["step"].item())

    def close(self) -> None:
        self.dead = True
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    import sys

    StandIn(port=int(sys.argv[1])).thread.join()
