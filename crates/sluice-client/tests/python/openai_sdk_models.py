"""The official `openai` Python SDK through `sluice pace`, two models with limits
of their own (SPEC M1).

Usage: python openai_sdk_models.py BASE_URL SECONDS MODEL=RPM [MODEL=RPM ...]
Keeps THREADS requests per model in flight for SECONDS, then prints, per model,
`model NAME sent N rate R` where R is the requests per minute between its first
and last answer; and `budget NAME VALUE` with the x-sluice-budget header of one
answer. Any error (a 429 included: the SDK retries nothing here) fails the run.
"""

import sys
import threading
import time

import openai

THREADS = 3
base_url, seconds = sys.argv[1], float(sys.argv[2])
models = dict(arg.split("=") for arg in sys.argv[3:])
client = openai.OpenAI(base_url=base_url, api_key="sk-client-key-replaced-by-the-proxy", max_retries=0, timeout=60)
messages = [{"role": "user", "content": "Say hello."}]

done = {m: [] for m in models}
errors = []
lock = threading.Lock()
stop_at = time.monotonic() + seconds


def worker(model):
    while time.monotonic() < stop_at:
        try:
            raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=16)
            r = raw.parse()
            assert r.usage is not None and r.usage.total_tokens > 0, r
            with lock:
                done[model].append((time.monotonic(), raw.headers.get("x-sluice-budget")))
        except Exception as e:  # noqa: BLE001 - any failure fails the run
            with lock:
                errors.append(f"{model}: {e!r}")
            return


threads = [threading.Thread(target=worker, args=(m,)) for m in models for _ in range(THREADS)]
for t in threads:
    t.start()
for t in threads:
    t.join()
if errors:
    print("\n".join(errors), flush=True)
    sys.exit(1)
for m, answers in done.items():
    times = sorted(t for t, _ in answers)
    rate = (len(times) - 1) * 60.0 / (times[-1] - times[0])
    print(f"model {m} sent {len(times)} rate {rate:.1f}", flush=True)
    print(f"budget {m} {answers[0][1]}", flush=True)
