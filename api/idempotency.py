"""Idempotent job registration: POST /v1/jobs with an `Idempotency-Key` header.

A controller that retries a registration after a connection error or a timeout (the service may
have committed the first attempt) must get the job it already registered, not a second one. The
first registration with a key stores, in the same transaction as the job, a hash of the key, a hash
of the request (the parsed body, so spacing and key order do not matter) and the answer. A later
request with the same key and the same body gets that answer again (201, same body); with another
body it is refused (422). Keys are kept as long as the job, in SQLite: they survive a restart.

The answer holds the worker token, which the service otherwise keeps only hashed. It is stored
encrypted with a key stream derived from the Idempotency-Key (SHAKE-256), which the store does not
keep: reading the SQLite file does not reveal the token as long as the key cannot be guessed (keys
shorter than 16 characters are refused); the retrying client, who knows the key, gets it back. Use a
random key (a UUID) per registration.
"""

from __future__ import annotations

import hashlib
import json
import time

from api.errors import IdempotencyConflictError
from api.models import JobCreate, JobCreated
from api.records import IdempotencyRecord
from planner.errors import InvalidInputError

MIN_KEY_LENGTH, MAX_KEY_LENGTH = 16, 255  # 16+: a key short enough to guess would unseal the token


def check_key(key: str) -> None:
    """A key is 16..255 visible ASCII characters; InvalidInputError (422) otherwise."""
    if not MIN_KEY_LENGTH <= len(key) <= MAX_KEY_LENGTH or not all(33 <= ord(c) <= 126 for c in key):
        raise InvalidInputError(
            f"Idempotency-Key: must be {MIN_KEY_LENGTH} to {MAX_KEY_LENGTH} visible ASCII characters "
            "(a random one, e.g. a UUID)"
        )


def key_hash(key: str) -> str:
    return hashlib.sha256(b"recycle-idempotency-key\0" + key.encode()).hexdigest()


def request_hash(req: JobCreate) -> str:
    """`repartition` counts only when on: a key stored before the field existed still matches."""
    body = req.model_dump_json(exclude=None if req.repartition else {"repartition"})
    return hashlib.sha256(body.encode()).hexdigest()


def _stream(key: str, n: int) -> bytes:
    return hashlib.shake_256(b"recycle-worker-token\0" + key.encode()).digest(n)


def seal(token: str, key: str) -> str:
    """The worker token (hex) encrypted with the key's stream, as hex."""
    raw = token.encode()
    return bytes(a ^ b for a, b in zip(raw, _stream(key, len(raw)), strict=True)).hex()


def unseal(cipher: str, key: str) -> str:
    raw = bytes.fromhex(cipher)
    return bytes(a ^ b for a, b in zip(raw, _stream(key, len(raw)), strict=True)).decode()


def new_record(key: str, req: JobCreate, answer: JobCreated) -> IdempotencyRecord:
    """What the store keeps for the first registration with `key` (its answer is `answer`)."""
    body = answer.model_dump(mode="json")
    body["worker_token"] = ""
    return IdempotencyRecord(
        key_hash=key_hash(key),
        request_hash=request_hash(req),
        job_id=answer.id,
        status_code=201,
        response_json=json.dumps(body),
        token_cipher=seal(answer.worker_token, key),
        created_at=time.time(),
    )


def replayed_answer(rec: IdempotencyRecord, key: str, req: JobCreate) -> JobCreated:
    """The first answer given for `key`, or IdempotencyConflictError when `req` is another request."""
    if rec.request_hash != request_hash(req):
        raise IdempotencyConflictError(
            "Idempotency-Key was already used for a different request body (it registered job "
            f"{rec.job_id}); use a new key for a new job"
        )
    body = json.loads(rec.response_json)
    body["worker_token"] = unseal(rec.token_cipher, key)
    return JobCreated.model_validate(body)
