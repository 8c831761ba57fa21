#!/usr/bin/env python3
"""bench/chaos: the instrumented upstream, the load, the batch submitter and the check.

Python 3.11 standard library only. Subcommands:

  upstream PORTFILE LOG [DELAY]   an HTTP/1.1 upstream answering 200 to everything; it
                                  writes the port it bound to PORTFILE and one line per
                                  request to LOG: time, method, path, X-API-Key,
                                  X-Sluice-Workspace, Idempotency-Key, the body's "item"
                                  (POST /messages/optimize waits DELAY seconds first)
  load OUT SECONDS CONC TIMEOUT PORT…
                                  CONC threads, each sending POST /limited and
                                  POST /counted in turn to the replicas in turn, one
                                  keep-alive connection per replica, TIMEOUT seconds per
                                  request; every 60 requests a new caller (its own key,
                                  so its own workspace), so every caller meets its limits
                                  (20 an hour, 20 a month) and the refusals are exact.
                                  One line per request to OUT.
  batch OUT ITEMS DEADLINE PORT…  submits ITEMS items in batches of 1,000, each with its
                                  own idempotency_key, retrying a submit that got no
                                  answer on the next replica with the same key; then reads
                                  the batches' status until every item is done or DEADLINE
                                  seconds have passed. Writes what it saw to OUT (JSON).
  check NAME WORK                 reads WORK/{upstream.log,load.log,events.log,
                                  quotas.json,batch.json} and prints the pass line.
  quotas OUT ADMIN LOAD           reads the `counted` usage of every caller of LOAD from
                                  ADMIN (/quotas?workspace=key:<sha256>) into OUT.
"""

import hashlib
import http.client
import http.server
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.request

KEYED_ROUTES = {"/limited": 20, "/counted": 20}  # limit per caller per window
PER_CALLER = 60  # requests per caller: 30 on each route, past its limit of 20
IDLE_CLOSE = 30.0  # seconds a replica keeps an idle client connection (its header read timeout)


# ---------------------------------------------------------------- the upstream
def upstream(portfile, log, delay=0.0):
    lines = []
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def handle_any(self):
            n = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(n) if n else b""
            item = "-"
            if self.path == "/messages/optimize":
                try:
                    item = str(json.loads(body).get("item", "-"))
                except (ValueError, AttributeError):
                    pass
                if delay:
                    time.sleep(delay)
            line = "%.6f\t%s\t%s\t%s\t%s\t%s\t%s\n" % (
                time.time(), self.command, self.path,
                self.headers.get("x-api-key", "-"), self.headers.get("x-sluice-workspace", "-"),
                self.headers.get("idempotency-key", "-"), item)
            with lock:
                lines.append(line)
            out = b'{"ok":true}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_POST = do_PUT = do_DELETE = handle_any

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024

        def handle_error(self, request, client_address):
            pass  # a replica killed mid-request resets its connection: expected here

    server = Server(("127.0.0.1", 0), Handler)
    f = open(log, "a")

    def flush():
        with lock:
            batch, lines[:] = lines[:], []
        f.writelines(batch)
        f.flush()

    def flusher():
        while True:
            time.sleep(0.2)
            flush()

    def stop(*_):
        flush()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threading.Thread(target=flusher, daemon=True).start()
    with open(portfile + ".tmp", "w") as p:
        p.write(str(server.server_address[1]))
    os.rename(portfile + ".tmp", portfile)
    server.serve_forever()


# ---------------------------------------------------------------- the load
def load(out, seconds, conc, timeout, ports):
    run = "%x" % int(time.time() * 1000)
    end = time.time() + seconds
    seq = [0]
    seq_lock = threading.Lock()
    results = [[] for _ in range(conc)]

    def worker(w):
        conns = {}
        last_used = {}
        rec = results[w]
        while time.time() < end:
            with seq_lock:
                n = seq[0]
                seq[0] += 1
            r = n % len(ports)
            route = "/limited" if (n // len(ports)) % 2 == 0 else "/counted"
            key = "%s-c%d" % (run, n // PER_CALLER)
            conn = conns.get(r)
            if conn is None:
                conn = conns[r] = http.client.HTTPConnection("127.0.0.1", ports[r], timeout=timeout)
                last_used[r] = None
            t0 = time.time()
            # How long the connection sat idle before this request (-1: a new one).
            idle = -1.0 if last_used[r] is None else t0 - last_used[r]
            why = ""
            try:
                conn.request("POST", route, body=b"", headers={"x-api-key": key})
                resp = conn.getresponse()
                resp.read()
                status = str(resp.status)
                if resp.getheader("connection", "").lower() == "close":
                    conn.close()
                    del conns[r]
            except ConnectionRefusedError:
                status = "refused"
            except (TimeoutError, socket.timeout):
                status = "timeout"
            except (OSError, http.client.HTTPException) as e:
                status = "error"
                why = repr(e).replace("\t", " ").replace("\n", " ")
            t1 = time.time()
            last_used[r] = t1
            if status in ("refused", "timeout", "error"):
                conn.close()
                conns.pop(r, None)
            rec.append("%.6f\t%.6f\t%d\t%s\t%s\t%s\t%s\t%.3f\n" % (t0, t1, r, route, key, status, why, idle))
            if status == "refused":
                time.sleep(0.01)  # a replica that is down: do not spin on it

    # A heartbeat: a thread of this process that wakes every 20 ms. When it wakes late,
    # the load itself (or the whole machine) was stalled: a request that took long
    # then is not one that sluice held. Stalls past 100 ms go to OUT.stalls.
    stalls = []

    def heartbeat():
        last = time.time()
        while time.time() < end:
            time.sleep(0.02)
            t = time.time()
            if t - last > 0.12:
                stalls.append("%.6f\t%.6f\n" % (last + 0.02, t))
            last = t

    threading.Thread(target=heartbeat, daemon=True).start()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open(out, "w") as f:
        for rec in results:
            f.writelines(rec)
    with open(out + ".stalls", "w") as f:
        f.writelines(stalls)


# ---------------------------------------------------------------- the batch
def http_json(port, method, path, body=None, key=None, timeout=5.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"content-type": "application/json"}
        if key:
            headers["x-api-key"] = key
        conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                     headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, None
    finally:
        conn.close()


def batch(out, items, deadline, ports):
    run = "%x" % int(time.time() * 1000)
    key = "batch-" + run
    start = time.time()
    stop_at = start + deadline
    sizes = [min(1000, items - i) for i in range(0, items, 1000)]
    submits = []  # one per batch: its idempotency_key, every batch_id answered, attempts
    n = 0
    for j, size in enumerate(sizes):
        body = {"items": [{"message": "chaos", "item": "%s-b%d-i%d" % (run, j, k)} for k in range(size)],
                "idempotency_key": "%s-%d" % (run, j)}
        ids, attempts = [], 0
        while time.time() < stop_at:
            port = ports[n % len(ports)]
            n += 1
            attempts += 1
            try:
                status, reply = http_json(port, "POST", "/messages/optimize/batch", body, key, timeout=10)
            except (OSError, http.client.HTTPException):
                time.sleep(0.1)
                continue
            if status == 202:
                ids.append(reply["batch_id"])
                # Ask once more with the same key on another replica: the same batch.
                try:
                    status2, reply2 = http_json(ports[n % len(ports)], "POST", "/messages/optimize/batch",
                                                body, key, timeout=10)
                    if status2 == 202:
                        ids.append(reply2["batch_id"])
                except (OSError, http.client.HTTPException):
                    pass
                break
            time.sleep(0.1)
        submits.append({"idempotency_key": body["idempotency_key"], "size": size,
                        "batch_ids": ids, "attempts": attempts,
                        "items": [i["item"] for i in body["items"]]})
    submitted = time.time()
    states = {}
    while time.time() < stop_at:
        states = {}
        for s in submits:
            for bid in sorted(set(s["batch_ids"])):
                port = ports[n % len(ports)]
                n += 1
                try:
                    status, reply = http_json(port, "GET", "/messages/optimize/batches/" + bid, key=key)
                except (OSError, http.client.HTTPException):
                    status, reply = 0, None
                if status == 200 and reply:
                    states[bid] = {k: reply.get(k) for k in ("state", "total", "done", "failed", "queued", "running")}
                else:
                    states[bid] = {"state": "unread"}
        if states and all(v.get("state") == "done" for v in states.values()):
            break
        time.sleep(1)
    json.dump({"submits": submits, "states": states, "start": start, "submitted": submitted,
               "finished": time.time()}, open(out, "w"))


# ---------------------------------------------------------------- quotas
def workspace(key):
    return "key:" + hashlib.sha256(key.encode()).hexdigest()


def quotas(out, admin, load_log):
    keys = sorted({line.split("\t")[4] for line in open(load_log) if "\t/counted\t" in line})
    usage = {}
    for k in keys:
        url = "http://%s/quotas?workspace=%s" % (admin, workspace(k))
        for attempt in range(5):
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    doc = json.load(r)
                break
            except OSError:
                if attempt == 4:
                    raise
                time.sleep(0.5)
        fams = doc.get("quotas", doc.get("families", doc)) if isinstance(doc, dict) else doc
        used = 0
        for f in fams if isinstance(fams, list) else []:
            if f.get("family") == "counted":
                used = int(f.get("usage", 0))
        usage[k] = used
    json.dump(usage, open(out, "w"))


# ---------------------------------------------------------------- the check
def check(name, work):
    env = os.environ
    hang_ms = float(env.get("HANG_MS", "1020"))
    recovery_max = float(env.get("RECOVERY_MAX", "1.0"))
    store_ms = env.get("STORE_TIMEOUT_MS", "20")

    events = []
    for line in open(os.path.join(work, "events.log")):
        t, kind, *rest = line.split()
        events.append((float(t), kind, rest[0] if rest else ""))
    start = events[0][0] if events else 0.0
    # On the memory store (MEMORY_WINDOWS=1), a replica killed and started again has
    # forgotten its `/limited` windows by design (docs/deployment.md): each of its
    # lives counts a window of its own. The quota counts (`/counted`) are durable
    # and always checked across restarts.
    restarts = sorted(t for t, kind, _ in events if kind == "kill")
    memory_windows = env.get("MEMORY_WINDOWS") == "1"

    def life(t):
        return sum(1 for k in restarts if k <= t) if memory_windows else 0

    # What the upstream received, per route and caller.
    received = {}  # (route, key, window) -> count
    items = {}  # item -> list of idempotency keys it ran under
    runs = {}  # item -> times it reached the upstream
    for line in open(os.path.join(work, "upstream.log")):
        t, method, path, key, ws, idem, item = line.rstrip("\n").split("\t")
        if path in KEYED_ROUTES:
            window = (int(float(t)) // 3600, life(float(t))) if path == "/limited" else 0
            received[(path, key, window)] = received.get((path, key, window), 0) + 1
        elif path == "/messages/optimize" and item != "-":
            items.setdefault(item, []).append(idem)
            runs.setdefault(item, []).append(float(t))

    # What the load saw.
    reqs = []
    whys = []
    for line in open(os.path.join(work, "load.log")):
        t0, t1, r, route, key, status, why, idle = line.rstrip("\n").split("\t")
        reqs.append((float(t0), float(t1), int(r), route, key, status))
        whys.append((why, float(idle)))

    # Calls in flight at a fault: reached a replica and answered neither 200 nor 429
    # (503 or 504, or no answer while that replica was killed): each may have been
    # counted without being forwarded. A request sent on a connection to a replica
    # already dead (until it is up again) never reached one; any other error is a fault
    # of its own.
    down = {}  # replica -> [(killed, up again)]
    for t, kind, arg in events:
        if kind == "kill":
            down.setdefault(int(arg), []).append([t, float("inf")])
        elif kind == "up" and down.get(int(arg)):
            down[int(arg)][-1][1] = t
    uncertain = {}
    answered = {}
    stray = 0
    for (t0, t1, r, route, key, status), (why, idle) in zip(reqs, whys):
        if status == "refused":
            continue
        answered[status] = answered.get(status, 0) + 1
        if status == "error":
            spans = down.get(r, [])
            if any(t0 - 0.05 <= k <= t1 + 0.05 for k, _ in spans):
                pass  # in flight at the kill
            elif any(k <= t0 <= u for k, u in spans):
                answered["error"] -= 1
                answered["to a dead replica"] = answered.get("to a dead replica", 0) + 1
                continue
            elif idle >= IDLE_CLOSE - 1:
                # A kept-alive connection the replica closed after its idle timeout,
                # as HTTP allows, just as the load sent on it (the load's threads pick
                # replicas in turn, and one may leave a replica alone that long).
                # Counted as in flight, to be safe.
                answered["error"] -= 1
                answered["on a connection closed idle"] = answered.get("on a connection closed idle", 0) + 1
            else:
                stray += 1
                near = sorted(events, key=lambda e: abs(e[0] - t0))[:3]
                print("without an answer: replica %d, %s, sent %.3f s after the start on a "
                      "connection idle %.3f s (-1: new), answered after %.3f s: %s; nearest events: %s"
                      % (r, route, t0 - start, idle, t1 - t0, why or "?",
                         ", ".join("%s %s at %+.3f s" % (k, a, t - t0) for t, k, a in near)))
        if status not in ("200", "429"):
            uncertain[(route, key)] = uncertain.get((route, key), 0) + 1
    sent = sum(answered.values())
    ok = True
    notes = []
    if stray:
        ok = False
        notes.append("%d requests without an answer while their replica was up" % stray)
    # A replica that panicked (a debug build checks its arithmetic) fails the run, and
    # its message says where.
    for name_ in sorted(os.listdir(work)):
        if name_.startswith("replica") and name_.endswith(".err"):
            for line in open(os.path.join(work, name_), errors="replace"):
                if "panicked" in line:
                    ok = False
                    notes.append("%s: %s" % (name_[:-4], line.strip()))

    # Admitted past a limit.
    worst_excess, worst_bound = 0, 0
    over_bound = 0
    for (route, key, window), got in received.items():
        excess = got - KEYED_ROUTES[route]
        bound = uncertain.get((route, key), 0)
        if excess > worst_excess or (excess == worst_excess and bound > worst_bound):
            worst_excess, worst_bound = max(excess, 0), bound
        if excess > bound:
            over_bound += 1
    if over_bound:
        ok = False
        notes.append("%d windows past their limit by more than their calls in flight" % over_bound)
    max_bound = max(uncertain.values(), default=0)

    # Quota counts: usage >= received (none lost), usage <= received + in flight.
    lost = doubled = 0
    qpath = os.path.join(work, "quotas.json")
    if os.path.exists(qpath):
        usage = json.load(open(qpath))
        for key, used in usage.items():
            got = received.get(("/counted", key, 0), 0)
            if used < got:
                lost += got - used
            if used > got + uncertain.get(("/counted", key), 0):
                doubled += used - got - uncertain.get(("/counted", key), 0)
        if lost:
            ok = False
            notes.append("%d quota counts lost (upstream received more than counted)" % lost)
        if doubled:
            ok = False
            notes.append("%d quota counts past received + in flight" % doubled)
        notes.append("quota usage of %d callers checked" % len(usage))

    # Batch items: each run, and never under two Idempotency-Keys.
    bpath = os.path.join(work, "batch.json")
    batch_txt = ""
    batch_tail = ""
    if os.path.exists(bpath):
        b = json.load(open(bpath))
        want = [i for s in b["submits"] for i in s["items"]]
        b_lost = sum(1 for i in want if i not in items)
        b_doubled = sum(1 for i in want if len(set(items.get(i, []))) > 1)
        b_rerun = sum(len(items.get(i, [])) - len(set(items.get(i, []))) for i in want)
        two_ids = sum(1 for s in b["submits"] if len(set(s["batch_ids"])) > 1)
        not_done = [bid for bid, st in b["states"].items() if st.get("state") != "done"]
        failed = sum(int(st.get("failed") or 0) for st in b["states"].values())
        # An item a killed replica was running runs again once its claim runs out.
        again = max((max(ts) - min(ts) for ts in runs.values() if len(ts) > 1), default=0.0)
        if b_lost or b_doubled or two_ids or not_done or not want:
            ok = False
        batch_txt = ("batch: %d items, %d lost, %d doubled (two Idempotency-Keys), %d run again with the same key, "
                     "at most %.1f s after its first run, "
                     "%d failed, %d submits answered with two batch ids, %d batches not done (%d items still running), "
                     "drained in %.1f s" % (
                         len(want), b_lost, b_doubled, b_rerun, again, failed, two_ids, len(not_done),
                         sum(int(b["states"][bid].get("running") or 0) for bid in not_done),
                         b["finished"] - b["submitted"]))
        lost += b_lost
        doubled += b_doubled
        stuck = sum(int(b["states"][bid].get("running") or 0) for bid in not_done)
        batch_tail = "; batch of %d: %d lost, %d doubled, %d still running at the deadline" % (
            len(want), b_lost, b_doubled, stuck)

    # Hangs: every request that reached a replica answered within the store timeout
    # plus a margin — less any time the load itself was stalled meanwhile (its
    # heartbeat woke late: the machine, not sluice, held the request).
    stalls = []
    spath = os.path.join(work, "load.log.stalls")
    if os.path.exists(spath):
        stalls = [tuple(map(float, l.split())) for l in open(spath)]

    def stalled(a, b):
        return sum(max(0.0, min(b, s1) - max(a, s0)) for s0, s1 in stalls)

    lat = [((t1 - t0) * 1000, (t1 - t0 - stalled(t0, t1)) * 1000)
           for t0, t1, r, route, key, status in reqs if status != "refused"]
    max_lat = max((x for x, _ in lat), default=0)
    max_own = max((y for _, y in lat), default=0)
    slow = sum(1 for x, _ in lat if x > hang_ms)
    hung = sum(1 for _, y in lat if y > hang_ms)
    timeouts = answered.get("timeout", 0)
    if hung or timeouts:
        ok = False
        notes.append("%d requests past %.0f ms besides the load's own stalls (%d client timeouts)"
                     % (hung, hang_ms, timeouts))

    # Recovery: from each fault's end (the restarted replica listening, Redis answering
    # PING again, SIGCONT, the filler deleted) to the first 200 through the replica (or,
    # for a store fault, through every replica: the slowest).
    recoveries = []
    admitted = sorted((t1, r) for t0, t1, r, route, key, status in reqs if status == "200")
    replicas = sorted({r for _, r in admitted})
    last_sent = max((q[0] for q in reqs), default=0.0)
    for t, kind, arg in events:
        if kind not in ("up", "store-up"):
            continue
        if kind == "up" and not any(k < t for k, _ in down.get(int(arg), [])):
            continue  # a first start, not a restart
        if t > last_sent - 1.5:
            continue  # the load ended before this fault could be measured
        targets = [int(arg)] if kind == "up" else replicas
        worst = worst_own = 0.0
        for r in targets:
            first = next((t1 for t1, rr in admitted if rr == r and t1 >= t), None)
            if first is None:
                worst = worst_own = float("inf")
                break
            worst = max(worst, first - t)
            worst_own = max(worst_own, first - t - stalled(t, first))
        recoveries.append((worst, worst_own))
    rec = max((x for x, _ in recoveries), default=0.0)
    rec_own = max((y for _, y in recoveries), default=0.0)
    if rec_own > recovery_max:
        ok = False
        notes.append("a recovery took %.2f s (> %.1f s) besides the load's own stalls" % (rec_own, recovery_max))
    faults = sum(1 for _, k, _ in events if k in ("kill", "store-down", "pause", "fill"))
    failed_starts = sum(1 for _, k, _ in events if k == "start-failed")
    if failed_starts:
        ok = False
        notes.append("%d replica starts failed (the replica exited: see its log)" % failed_starts)

    codes = ", ".join("%s×%d" % (k, v) for k, v in sorted(answered.items()) if v)
    print("requests: %d sent to a replica (%s); %d refused connections to a replica that was down"
          % (sent, codes, sum(1 for q in reqs if q[5] == "refused")))
    print("faults: %d; recoveries (s): %s" % (faults, " ".join("%.2f" % x for x, _ in recoveries) or "none"))
    starts = []
    spawned = {}
    for t, kind, arg in events:
        if kind == "spawn":
            spawned[arg] = t
        elif kind == "up" and arg in spawned:
            starts.append(t - spawned.pop(arg))
    if starts:
        print("replica starts (spawn to start line; the port refuses connections until then): %d, longest %.2f s"
              % (len(starts), max(starts)))
    print("the load's own stalls (its 20 ms heartbeat late by more than 100 ms): %d, %.2f s in all, longest %.2f s"
          % (len(stalls), sum(b - a for a, b in stalls), max((b - a for a, b in stalls), default=0.0)))
    print("latency: max %.0f ms (%.0f ms besides the load's stalls), %d requests past %.0f ms "
          "(store timeout %s ms + margin), %d besides the load's stalls"
          % (max_lat, max_own, slow, hang_ms, store_ms, hung))
    print("recovery: at most %.2f s (%.2f s besides the load's stalls), from each restarted replica's start "
          "line, Redis's PING or SIGCONT, or the filler's deletion to the first 200 through the replica "
          "(through every replica for a store fault)" % (rec, rec_own))
    if batch_txt:
        print(batch_txt)
    for n in notes:
        print(n)
    if sent == 0 or not admitted:
        ok = False
        print("no request was admitted: the run measured nothing")
    line = "%s: %s — %d lost, %d doubled, max excess %d ≤ bound %d (largest in-flight count of one caller: %d), " \
           "max latency %.0f ms (%.0f ms besides the load's stalls), recovery ≤ %.2f s (%.2f s)" % (
               name, "PASS" if ok else "FAIL", lost, doubled, worst_excess, worst_bound, max_bound, max_lat,
               max_own, rec, rec_own
           ) + batch_tail
    print(line)
    return 0 if ok else 1


def main(argv):
    cmd = argv[1]
    if cmd == "upstream":
        upstream(argv[2], argv[3], float(argv[4]) if len(argv) > 4 else 0.0)
    elif cmd == "load":
        load(argv[2], float(argv[3]), int(argv[4]), float(argv[5]), [int(p) for p in argv[6:]])
    elif cmd == "batch":
        batch(argv[2], int(argv[3]), float(argv[4]), [int(p) for p in argv[5:]])
    elif cmd == "quotas":
        quotas(argv[2], argv[3], argv[4])
    elif cmd == "check":
        return check(argv[2], argv[3])
    else:
        raise SystemExit("unknown command " + cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
