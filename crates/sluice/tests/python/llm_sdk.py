"""The official `openai` and `anthropic` Python SDKs against `sluice serve`'s token
routes (SPEC T5): a refusal raises each SDK's own RateLimitError, in its API's
words, and the SDK's own retry waits the Retry-After sluice gave.

Usage: python llm_sdk.py GATEWAY_URL
Prints one line per check; exits non-zero on the first failure.
"""

import sys
import time

import anthropic
# The HTTP client these SDK releases are built on (its hooks see every response).
import httpx2 as httpx
import openai

base = sys.argv[1]
# Every response the SDKs get: when, its status, its Retry-After.
seen = []


def record(response):
    seen.append((time.monotonic(), response.status_code, response.headers.get("retry-after")))


def http():
    return httpx.Client(event_hooks={"response": [record]}, timeout=30)


oa = openai.OpenAI(base_url=base + "/v1", api_key="sk-sdk", max_retries=0, http_client=http())
an = anthropic.Anthropic(base_url=base, api_key="sk-sdk", max_retries=0, http_client=http())
messages = [{"role": "user", "content": "Say hi."}]


def chat(client):
    return client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=50)


def message(client):
    return client.messages.create(model="claude-sonnet-4-5", messages=messages, max_tokens=50)


def until_refused(call, client, error):
    """Calls until the SDK raises `error`; returns it."""
    for _ in range(100):
        try:
            call(client)
        except error as e:
            return e
    raise AssertionError("never refused")


e = until_refused(chat, oa, openai.RateLimitError)
assert e.status_code == 429 and e.code == "rate_limit_exceeded", e.body
assert int(e.response.headers["retry-after"]) >= 1, e.response.headers
assert e.response.headers["x-ratelimit-remaining-tokens"] is not None, e.response.headers
print("openai RateLimitError ok", e.response.headers["x-ratelimit-reset-tokens"], flush=True)

e = until_refused(message, an, anthropic.RateLimitError)
assert e.status_code == 429 and e.body["error"]["type"] == "rate_limit_error", e.body
assert int(e.response.headers["retry-after"]) >= 1, e.response.headers
print("anthropic RateLimitError ok", flush=True)


def retried(call, client, error):
    """Refused, then the SDK's own retry: every retry after a 429 waited its
    Retry-After. The window may turn between the refusal and the call that
    retries (then nothing was retried): tried again, a few times."""
    for _ in range(5):
        until_refused(call, client, error)
        seen.clear()
        call(client.with_options(max_retries=3))
        waits = [
            (later[0] - t, float(after))
            for (t, status, after), later in zip(seen, seen[1:])
            if status == 429
        ]
        if waits:
            for waited, after in waits:
                assert waited >= after - 0.05, (waited, after, seen)
            return waits
    raise AssertionError("the SDK never retried a refusal")


print("openai retry waited", retried(chat, oa, openai.RateLimitError), flush=True)
print("anthropic retry waited", retried(message, an, anthropic.RateLimitError), flush=True)
