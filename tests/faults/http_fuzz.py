"""Malformed HTTP requests for the gateway, from a seeded random.Random: the requests
of tests/faults/test_fuzz_http.py, and the raw-socket clients that misbehave.

Every request here must be refused with a 4xx and OpenAI's error body; the raw
clients (slow, half-closed, broken framing) need only leave the server serving.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field

_JSON = {"Content-Type": "application/json"}
_WRONG = [None, True, 0, -1, 1.5, "", "x", [], [1], {}, {"a": 1}]  # values of the wrong type for some field
_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream",
           "stream_options", "stop_token_ids", "ignore_eos", "return_token_ids"]
_CHAT_FIELDS = ["messages", "max_completion_tokens"]


@dataclass
class Malformed:
    what: str
    path: str
    body: bytes
    headers: dict = field(default_factory=lambda: dict(_JSON))
    method: str = "POST"


def _dumps(body) -> bytes:
    return json.dumps(body).encode()


def _is_refused(field_name: str, value, chat: bool) -> bool:
    """Whether `value` in `field_name` must be refused (None is "not given" for most)."""
    if value is None:
        return field_name in ("model", "prompt", "messages")
    ok = {
        "model": lambda v: False,  # any other name is an unknown model (404)
        "prompt": lambda v: (isinstance(v, str) and v != "") or v == [1] or v == ["x"],
        "messages": lambda v: False,
        "max_tokens": lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 64,
        "max_completion_tokens": lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 64,
        "temperature": lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v <= 2,
        "top_p": lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v <= 1,
        "top_k": lambda v: isinstance(v, int) and not isinstance(v, bool) and -1 <= v < 1 << 31,
        "n": lambda v: v == 1 and not isinstance(v, bool),
        "seed": lambda v: isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < 1 << 64,
        "stop": lambda v: v == "x" or v == [],
        "stream": lambda v: isinstance(v, bool),
        "stream_options": lambda v: False,  # only with stream: true
        "stop_token_ids": lambda v: v == [] or v == [1],
        "ignore_eos": lambda v: isinstance(v, bool),
        "return_token_ids": lambda v: isinstance(v, bool),
    }[field_name]
    return not ok(value)


class MalformedRequests:
    def __init__(self, rng: random.Random, model: str, max_request_bytes: int) -> None:
        self.rng = rng
        self.model = model
        self.max_request_bytes = max_request_bytes

    def base(self, chat: bool) -> dict:
        if chat:
            return {"model": self.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        return {"model": self.model, "prompt": "Hi", "max_tokens": 2}

    def fixed(self) -> list[Malformed]:
        """Cases every run sends: max_tokens that fit the model's context but not the
        KV memory of a test stack's worker (refused by the scheduler, not the gateway)."""
        return [Malformed("max_tokens=8000", path, _dumps({**self.base(path == "/v1/chat/completions"),
                                                           "max_tokens": 8000}))
                for path in ("/v1/completions", "/v1/chat/completions")]

    def next(self) -> Malformed:
        rng = self.rng
        chat = rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = self.base(chat)
        what = rng.randrange(14)
        if what == 0:  # broken JSON
            text = _dumps(body)
            bad = rng.choice([text[:rng.randrange(len(text))], text + b"}", text.replace(b'"', b"'"),
                              text[:-1] + b",}", b"{", b"", b"nul", rng.randbytes(rng.randrange(1, 64))])
            return Malformed("broken JSON", path, bad)
        if what == 1:  # JSON, but not an object
            return Malformed("not an object", path, rng.choice([b"[]", b'"x"', b"1", b"null", b"[{}]", b"true"]))
        if what == 2:  # a field of the wrong type or an absurd value
            names = _FIELDS + (_CHAT_FIELDS if chat else [])
            for _ in range(100):
                name = rng.choice([n for n in names if n != ("prompt" if chat else "messages")])
                value = rng.choice(_WRONG + self._absurd(name))
                if _is_refused(name, value, chat):
                    body[name] = value
                    return Malformed(f"{name}={str(value)[:40]}", path, _dumps(body))
            raise AssertionError("no refused value found")
        if what == 3:  # numbers JSON can spell and Python cannot hold, or JSON cannot spell
            name = rng.choice(["max_tokens", "temperature", "top_p", "seed", "n", "top_k"])
            literal = rng.choice([b"9" * rng.randrange(4400, 6000), b"1e999", b"-1e999", b"NaN", b"Infinity",
                                  b"-Infinity", b"1" + b"0" * 400])
            text = _dumps({**body, name: 7}).replace(f'"{name}": 7'.encode(), f'"{name}": '.encode() + literal)
            return Malformed(f"{name} as {literal[:12]!r}", path, text)
        if what == 4:  # invalid UTF-8 in a string
            text = _dumps(body).replace(b'"Hi"', b'"H' + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80",
                                                                      b"\xf8\x88\x80\x80\x80"]) + b'i"')
            return Malformed("invalid UTF-8", path, text)
        if what == 5:  # an unpaired surrogate spelled as a JSON escape
            spot = rng.choice(["text", "stop"])
            escape = rng.choice([b"\\ud800", b"\\udfff", b"\\ud83d x"])
            if spot == "stop":
                text = _dumps({**body, "stop": ["S"]}).replace(b'"S"', b'"' + escape + b'"')
            else:
                text = _dumps(body).replace(b'"Hi"', b'"H' + escape + b'"')
            return Malformed(f"surrogate in {spot}", path, text)
        if what == 6:
            if rng.random() < 0.5:  # larger than the gateway takes
                body["prompt" if not chat else "user"] = "x" * (self.max_request_bytes + rng.randrange(1, 4096))
                return Malformed("oversized", path, _dumps(body))
            # Taken, but longer than the context window (the gateway must not spend
            # seconds tokenizing it first)
            text = "word " * ((self.max_request_bytes - 200) // 5)
            if chat:
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
            return Malformed("long prompt", path, _dumps(body))
        if what == 7:
            ctype = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=b",
                                "application/xml", "text/html", "image/png", "application/octet-stream"])
            return Malformed(f"content type {ctype}", path, _dumps(body), {"Content-Type": ctype})
        if what == 8:  # unknown fields, at the top or inside
            name = rng.choice(["foo", "temperture", "max_token", "logprobs_x", "", "\u00e9t\u00e9", "x" * 300])
            if rng.random() < 0.3:
                body["stream"], body["stream_options"] = True, {name or "y": True}
            else:
                body[name] = rng.choice(_WRONG)
            return Malformed(f"unknown field {name[:20]!r}", path, _dumps(body))
        if what == 9:  # nesting deeper than any parser should recurse
            depth = rng.choice([rng.randrange(10, 500), rng.randrange(5000, 200000)])
            open_, close = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
            text = _dumps({**body, "N": 0}).replace(b'"N": 0', b'"N": ' + open_ * depth + b"1" + close * depth)
            return Malformed(f"nested {depth}", path, text)
        if what == 10:  # messages that are not messages
            messages = rng.choice([[], {}, "hi", [{}], [{"role": "wizard", "content": "x"}], [{"role": "user"}],
                                   [{"role": "user", "content": [{"type": "image_url"}]}], [1],
                                   [{"role": "user", "content": [{"type": "text", "text": 5}]}]])
            return Malformed(f"messages {str(messages)[:30]}", "/v1/chat/completions",
                             _dumps({"model": self.model, "messages": messages}))
        if what == 11:  # prompts the model cannot take
            prompt = rng.choice([[], [-1], [1 << 40], [1.5], list(range(20000)), [["a"], ["b"]], ""])
            return Malformed("prompt", "/v1/completions", _dumps({"model": self.model, "prompt": prompt}))
        if what == 12:
            return Malformed("unknown model", path, _dumps({**body, "model": rng.choice(["gpt-4", "", "x" * 500])}))
        return rng.choice([Malformed("GET a POST route", path, b"", {}, "GET"),
                           Malformed("unknown route", "/v1/engines", _dumps(body)),
                           Malformed("PUT", path, _dumps(body), dict(_JSON), "PUT")])

    def _absurd(self, name: str) -> list:
        # 8000: within the real model's context (8192), past a test stack's KV per worker
        return {"max_tokens": [0, 8000, 10**6, 10**18, 10**100], "max_completion_tokens": [0, 8000, 10**9],
                "temperature": [-1, 2.5, 1e308, 10**30], "top_p": [0, 1.5, -0.1], "top_k": [-2, 1 << 31, 10**40],
                "n": [0, 2, 10**9, -1], "seed": [1 << 64, -(1 << 63) - 1, 10**50],
                "stop": [["x"] * 17, [""], [1]], "stop_token_ids": [[-1], [1 << 40], [1.5], ["a"]],
                "stream_options": [{"include_usage": True}]}.get(name, [])


def check_refusal(m: Malformed, status: int, body) -> None:
    assert 400 <= status < 500, (m.what, status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, (m.what, status, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, (m.what, error)
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), (m.what, error)


# -- raw clients --------------------------------------------------------------------------
BROKEN_FRAMING = [b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/9.9\r\nHost: x\r\n\r\n",
                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 20000 + b"\r\n\r\n",
                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"ZZ\r\nab\r\n0\r\n\r\n",
                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n",
                  b"POST /v1/comp\x00letions HTTP/1.1\r\nHost: x\r\n\r\n"]


async def raw_exchange(port: int, data: bytes, half_close: bool,
                       timeout: float = 30) -> bytes:  # noqa: ASYNC109 (the quiet time that ends the read, not a deadline)
    """Send `data` (then end our side when `half_close`), and read what comes back
    until the server closes or `timeout` passes with nothing more."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if half_close:
            writer.write_eof()
        out = b""
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), timeout)
            if not chunk:
                return out
            out += chunk
            if not half_close and b"\r\n\r\n" in out:
                return out  # a response to a request that keeps its connection: its head is enough
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


async def slow_client(port: int, request: bytes, gaps: int, gap_s: float) -> None:
    """A client that sends `request` a byte at a time, `gap_s` apart, for `gaps` bytes,
    then gives up (closes) without sending the rest."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for b in request[:gaps]:
            writer.write(bytes([b]))
            await writer.drain()
            await asyncio.sleep(gap_s)  # the slowness is the point: nothing to wait for
    finally:
        writer.close()
