"""The official `openai` Python SDK on a run whose turns are spent (SPEC T7): the
pause (409 `turn_budget_exhausted`, `continue_or_finish`) is raised as the SDK's
ConflictError with its body intact, not retried; the owner grants one more turn
with `POST /runs/<id>/continue` and the SDK's next call goes through.

Usage: python turns_sdk.py GATEWAY_URL API_KEY
Prints one JSON object of what happened; the Rust test asserts on it.
"""

import json
import sys
import urllib.request

# The HTTP client this SDK release is built on (its hooks see every attempt).
import httpx2 as httpx
import openai

base, key = sys.argv[1], sys.argv[2]
# Every request the SDK sent, its own retries included.
attempts = []


def record(request):
    attempts.append(request.headers.get("x-stainless-retry-count"))


client = openai.OpenAI(
    base_url=base + "/v1",
    api_key=key,
    max_retries=2,
    default_headers={"X-Sluice-Run": "r1", "X-Sluice-Depth": "quick"},
    http_client=httpx.Client(event_hooks={"request": [record]}, timeout=30),
)


def chat():
    return client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "Go on."}], max_tokens=50
    )


def run_endpoint(method, path, body=None):
    request = urllib.request.Request(
        base + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


result = {"successes": 0}
for _ in range(10):
    try:
        chat()
        result["successes"] += 1
    except openai.APIError as e:
        result["error"] = {
            "class": type(e).__name__,
            "conflict": isinstance(e, openai.ConflictError),
            "rate_limit": isinstance(e, openai.RateLimitError),
            "status": getattr(e, "status_code", None),
            "code": getattr(e, "code", None),
            "type": getattr(e, "type", None),
            "body": e.body,
            "retry_after": e.response.headers.get("retry-after") if hasattr(e, "response") else None,
        }
        break
result["attempts"] = len(attempts)
result["retry_counts"] = attempts[:]
result["state_paused"] = run_endpoint("GET", "/runs/r1")
result["continue"] = run_endpoint("POST", "/runs/r1/continue", {"turns": 1})
try:
    answer = chat()
    result["after_continue"] = answer.choices[0].message.content
except openai.APIError as e:
    result["after_continue"] = {"class": type(e).__name__, "body": e.body}
result["state_after"] = run_endpoint("GET", "/runs/r1")
print(json.dumps(result), flush=True)
