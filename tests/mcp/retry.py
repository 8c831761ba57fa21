#!/usr/bin/env python3
"""urllib3's `Retry(respect_retry_after_header=True)` against `sluice serve` (SPEC H2):
"never" is not "not yet".

    retry.py http://127.0.0.1:PORT     # a policy with 2 s windows, expensive 3

- not yet: a caller spends its expensive budget (POST /chats until a 429); the next
  POST /chats, sent with urllib3's Retry honouring Retry-After, is refused, retried
  once after Retry-After, and succeeds;
- never: a JSON-RPC batch of 4 expensive tool calls against a limit of 3 can never
  fit: 429 without Retry-After, `cost_exceeds_limit` in every error's data, and
  urllib3 does not retry it.

Each check prints `ok: ...` or `FAIL: ...`; the last line is
`session RESULT passed=P failed=F` (read by scripts/mcp-test).
"""

from __future__ import annotations

import json
import sys
import time

import urllib3
from urllib3.util.retry import Retry

EXPENSIVE_LIMIT = 3
# The policy's window is 2 s: no wait is longer.
MAX_WAIT_SECONDS = 3
# Rounds of "spend it, then ask with retries" before giving up (a window may turn
# between the two).
ROUNDS = 3


class Checks:
    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        print(f"{'ok' if ok else 'FAIL'}: {what}" + (f" ({detail})" if detail else ""))
        return ok


def retrying() -> Retry:
    # No status_forcelist: only an answer with Retry-After (429, 503, 413) is retried.
    return Retry(
        total=2,
        connect=0,
        read=0,
        allowed_methods=None,
        respect_retry_after_header=True,
        backoff_factor=0,
        raise_on_status=False,
    )


def not_yet(checks: Checks, http: urllib3.PoolManager, base: str) -> None:
    for round_ in range(ROUNDS):
        key = f"retry-not-yet-{round_}"
        spent = 0
        # What the last refusal said to wait (urllib3's history keeps no headers).
        waited = None
        while spent <= EXPENSIVE_LIMIT * 2:
            r = http.request("POST", f"{base}/chats", headers={"x-api-key": key}, retries=False)
            if r.status == 429:
                waited = r.headers.get("retry-after")
                break
            spent += 1
        started = time.monotonic()
        r = http.request("POST", f"{base}/chats", headers={"x-api-key": key}, retries=retrying())
        took = time.monotonic() - started
        history = r.retries.history if r.retries else ()
        if not history and round_ + 1 < ROUNDS:
            continue  # the window turned between the two: admitted at once
        checks.check(
            len(history) == 1 and history[0].status == 429 and waited is not None,
            "not yet: the 429 carries Retry-After and urllib3 retries once",
            f"history={[h.status for h in history]}, Retry-After {waited!r}",
        )
        checks.check(
            r.status == 200,
            "not yet: the retry after Retry-After succeeds",
            f"status {r.status}, Retry-After {waited}, {took:.2f} s in all",
        )
        checks.check(
            waited is not None and int(waited) <= MAX_WAIT_SECONDS and took >= int(waited) - 1.05,
            "not yet: urllib3 slept Retry-After before the retry",
            f"Retry-After {waited}, {took:.2f} s",
        )
        return


def never(checks: Checks, http: urllib3.PoolManager, base: str) -> None:
    batch = [
        {"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {"name": "start_chat", "arguments": {}}}
        for i in range(EXPENSIVE_LIMIT + 1)
    ]
    started = time.monotonic()
    r = http.request(
        "POST",
        f"{base}/mcp",
        body=json.dumps(batch).encode(),
        headers={
            "x-api-key": "retry-never",
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
        },
        retries=retrying(),
    )
    took = time.monotonic() - started
    history = r.retries.history if r.retries else ()
    checks.check(
        r.status == 429 and "retry-after" not in r.headers,
        "never: a batch costing more than the whole limit is 429 without Retry-After",
        f"status {r.status}, Retry-After {r.headers.get('retry-after')!r}",
    )
    checks.check(len(history) == 0, "never: urllib3 does not retry it", f"history={history!r}, {took:.2f} s")
    try:
        errors = json.loads(r.data)
    except ValueError:
        errors = None
    reasons = [e.get("error", {}).get("data", {}).get("reason") for e in errors] if isinstance(errors, list) else None
    checks.check(
        reasons == ["cost_exceeds_limit"] * len(batch),
        "never: each JSON-RPC error says cost_exceeds_limit",
        f"reasons={reasons!r}",
    )


def main() -> int:
    base = sys.argv[1].rstrip("/")
    print(f"retry: urllib3 {urllib3.__version__} Retry(respect_retry_after_header=True) -> {base}")
    checks = Checks()
    http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=5, read=20))
    try:
        never(checks, http, base)
        not_yet(checks, http, base)
    except Exception as exc:  # noqa: BLE001 - any escape is a failed run
        checks.check(False, "retry.py ran to the end", f"{type(exc).__name__}: {exc}")
    print(f"session RESULT passed={checks.passed} failed={checks.failed}")
    return 0 if checks.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
