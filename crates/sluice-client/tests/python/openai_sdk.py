"""The official `openai` Python SDK through `sluice pace` (SPEC C1-C3).

Usage: python openai_sdk.py BASE_URL
BASE_URL is the proxy's provider prefix, e.g. http://127.0.0.1:PORT/sim.
Prints one line per check; exits non-zero on the first failure.
"""

import sys

import openai

base_url = sys.argv[1]
client = openai.OpenAI(base_url=base_url, api_key="sk-client-key-replaced-by-the-proxy", max_retries=0, timeout=60)
messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]

r = client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=20)
assert r.choices[0].message.content, r
assert r.usage is not None and r.usage.completion_tokens > 0, r
print("chat ok", r.usage.total_tokens, flush=True)

chunks, text, usage = 0, "", None
stream = client.chat.completions.create(
    model="gpt-4o", messages=messages, max_tokens=20, stream=True, stream_options={"include_usage": True}
)
for event in stream:
    chunks += 1
    if event.usage is not None:
        usage = event.usage
    for choice in event.choices:
        text += choice.delta.content or ""
assert chunks >= 3 and text and usage is not None, (chunks, text, usage)
print("stream ok", chunks, usage.total_tokens, flush=True)

# Larger than the provider's whole TPM: the proxy's 413, as an SDK error.
try:
    client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=1_000_000)
except openai.APIStatusError as e:
    assert e.status_code == 413, e
    assert e.body["code"] == "request_too_large", e.body
    print("oversize ok", e.status_code, flush=True)
else:
    raise AssertionError("oversize request was sent")
