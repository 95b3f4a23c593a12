"""Bad request bodies answer 422 naming the field, never 500: NaN and Infinity included.

Python's json module (which FastAPI parses bodies with) accepts the tokens NaN, Infinity and
-Infinity and turns a number too large for a float (1e999) into inf; none of them is JSON. Two
pieces, installed by `install_validation(app)` (called from api/errors.py):

- `NonFiniteBodyMiddleware` refuses such a value anywhere in a JSON body with
  `422 {"detail": [{"type": "finite_number", "loc": ["body", <field>, ...], "msg"}], "error":
  "invalid"}` before any route sees it (also where a model would accept it: a field bounded only
  from below takes Infinity), and a body that is not text or nests too deeply to parse with a
  `json_invalid` 422 (FastAPI answered those with a 400);
- `validation_error_handler` replaces FastAPI's default 422 handler, which echoes each error's
  `input` and failed with a 500 when that input was a non-finite float (the answer is rendered
  with allow_nan=False): non-finite values are never echoed, a lone UTF-16 surrogate (which JSON's
  \\u escapes can spell, UTF-8 cannot encode and FastAPI's handler failed to render) is named and
  escaped, every error keeps its `loc`, and the answer carries `"error": "invalid"` like the
  service's other errors.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

FINITE_MSG = "must be a finite number (NaN, Infinity and numbers beyond the float range are not JSON)"
NOT_JSON_MSG = "the body must be a JSON object sent with Content-Type: application/json"
SURROGATE_MSG = "holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape not in a pair): not Unicode text"


class _NonFinite:
    """What a NaN/Infinity token (or an overflowing number) parses to while a body is checked."""


_NON_FINITE = _NonFinite()


def _parse_float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NON_FINITE


class UnreadableBody(ValueError):
    """A body that is no text or nests deeper than the parser goes: FastAPI answered these with an
    undocumented `400 "There was an error parsing the body"`."""


def non_finite_paths(body: bytes) -> list[list[str | int]] | None:
    """The paths (keys and list indexes) of every non-finite number in a JSON body; None when the
    body is not JSON (FastAPI then answers its own json_invalid 422, naming where). Raises
    UnreadableBody when it is not UTF-8 (or -16/-32) text or nests too deeply to parse."""
    try:
        doc = json.loads(body, parse_constant=lambda _: _NON_FINITE, parse_float=_parse_float)
    except UnicodeDecodeError as exc:
        raise UnreadableBody(f"the body is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except RecursionError:
        raise UnreadableBody("the body nests arrays or objects too deeply to parse") from None
    except ValueError:
        return None
    found: list[list[str | int]] = []
    stack: list[tuple[Any, list[str | int]]] = [(doc, [])]
    while stack:
        value, path = stack.pop()
        if value is _NON_FINITE:
            found.append(path)
        elif isinstance(value, dict):
            stack.extend((v, [*path, k]) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, [*path, i]) for i, v in enumerate(value))
    return sorted(found, key=lambda p: [str(x) for x in p])


def _is_json(scope: Scope) -> bool:
    """FastAPI's own rule for parsing a body as JSON: no content-type, or application/json or +json."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or (
                media.startswith(b"application/") and media.endswith(b"+json")
            )
    return True


def _answer(paths: list[list[str | int]]) -> bytes:
    detail = [{"type": "finite_number", "loc": ["body", *p], "msg": FINITE_MSG} for p in paths]
    return json.dumps({"detail": detail, "error": "invalid"}).encode()


def _unreadable(why: str) -> bytes:
    return json.dumps(
        {"detail": [{"type": "json_invalid", "loc": ["body"], "msg": why}], "error": "invalid"}
    ).encode()


class NonFiniteBodyMiddleware:
    """Answer 422 to a JSON body holding NaN, Infinity, -Infinity or an overflowing number."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH") or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:  # the body is bounded by BodyLimitMiddleware, which wraps this one
            message = await receive()
            if message["type"] != "http.request":
                return  # client went away
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            paths = non_finite_paths(body) if body else None
            content = _answer(paths) if paths else None
        except UnreadableBody as exc:
            content = _unreadable(str(exc))
        if content is not None:
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(content)).encode()),
            ]
            await send({"type": "http.response.start", "status": 422, "headers": headers})
            await send({"type": "http.response.body", "body": content})
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_has_non_finite(v) for v in value)
    return False


def _encodable(value: Any) -> Any:
    """`value` with every string that UTF-8 cannot encode (a lone surrogate, which JSON's \\u escapes
    can spell) escaped as text: the answer must be renderable to echo it."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode()
        return value
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_encodable(v) for v in value)
    return value


def safe_errors(errors: Any) -> list[dict[str, Any]]:
    """Pydantic/FastAPI errors made JSON-safe: an `input` or `ctx` holding a non-finite float is
    dropped (and the message says a finite number is needed when the input itself was one); a string
    holding a lone surrogate is named and escaped, never left to fail the rendering. A body that was
    not read as JSON (another Content-Type: a form, text) is named, not echoed back whole."""
    out = []
    for error in errors:
        error = dict(error)
        if error.get("type") == "string_unicode":
            error["msg"] = SURROGATE_MSG
            error.pop("input", None)
        elif tuple(error.get("loc", ())) == ("body",) and isinstance(error.get("input"), (str, bytes)):
            error["msg"] = NOT_JSON_MSG
            del error["input"]
        if _has_non_finite(error.get("input")):
            if isinstance(error["input"], float):
                error["msg"] = FINITE_MSG
            del error["input"]
        if _has_non_finite(error.get("ctx")):
            del error["ctx"]
        out.append(_encodable(error))
    encoded: list[dict[str, Any]] = jsonable_encoder(out)
    return encoded


async def validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """422 with every error's `loc`, never echoing a non-finite value; `error` is `invalid`, as for
    every other invalid input."""
    assert isinstance(exc, RequestValidationError)
    return JSONResponse(status_code=422, content={"detail": safe_errors(exc.errors()), "error": "invalid"})


def install_validation(app: FastAPI) -> None:
    """The NaN/Infinity body check and the non-echoing 422 handler."""
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_middleware(NonFiniteBodyMiddleware)
