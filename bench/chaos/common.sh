# bench/chaos: what every chaos script shares (sourced, not run). Starts and stops real
# processes on loopback: redis-server, `sluice serve` replicas (the release binary),
# the instrumented upstream (chaos.py upstream). Every process started is stopped on
# exit; every wait is bounded.
# shellcheck shell=bash

CHAOS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$CHAOS/../.." && pwd)"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
# PROFILE=debug runs the binary `cargo test` already built (the README test command does,
# to spare CI a release build); the checks are the same, the replicas slower.
PROFILE="${PROFILE:-release}"
BIN="${BIN:-$TARGET/$PROFILE/sluice}"
POLICY="${POLICY:-$CHAOS/policy.yaml}"
CONC="${CONC:-12}"               # load threads
CLIENT_TIMEOUT="${CLIENT_TIMEOUT:-5}" # seconds per request before the load gives up on it
export STORE_TIMEOUT_MS=20       # the policy's store.timeout_ms
export HANG_MS="${HANG_MS:-1020}" # a request slower than this hung: the store timeout + 1 s
WORK="$(mktemp -d "${TMPDIR:-/tmp}/sluice-chaos.XXXXXX")"
PIDS=()                          # every process this script started
declare -A REPLICA_PID=()

build() {
    if [ "${BUILD:-1}" = 1 ]; then
        if [ "$PROFILE" = release ]; then
            (cd "$ROOT" && cargo build --release -q --locked -p sluice)
        else
            (cd "$ROOT" && cargo build -q --locked -p sluice)
        fi
    fi
    [ -x "$BIN" ] || { echo "no binary at $BIN" >&2; exit 1; }
}

cleanup() {
    local pid
    if [ -n "${WATCHDOG_PID:-}" ]; then kill -TERM "$WATCHDOG_PID" 2>/dev/null || true; fi
    if [ -f "$WORK/watchdog" ]; then echo "chaos: $(cat "$WORK/watchdog")" >&2; fi
    for pid in "${PIDS[@]}" "${REPLICA_PID[@]}"; do
        kill -CONT "$pid" 2>/dev/null || true
        kill -KILL "$pid" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    if [ -n "${MOUNTED:-}" ]; then umount "$MOUNTED" 2>/dev/null || umount -l "$MOUNTED" 2>/dev/null || true; fi
    if [ "${KEEP:-0}" = 1 ]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Events are stamped without a fork ($EPOCHREALTIME), so that a busy machine does not
# move them.
event() { echo "$EPOCHREALTIME $*" >>"$WORK/events.log"; }

# Waits up to $2 seconds (default 10) for the command "$1" to succeed.
wait_for() {
    local deadline=$((SECONDS + ${2:-10}))
    until eval "$1" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.02
    done
}

start_upstream() {
    python3 "$CHAOS/chaos.py" upstream "$WORK/upstream.port" "$WORK/upstream.log" "${1:-0}" &
    PIDS+=("$!")
    wait_for "test -s '$WORK/upstream.port'" 10 || { echo "the upstream did not start" >&2; exit 1; }
    UPSTREAM="http://127.0.0.1:$(cat "$WORK/upstream.port")"
}

# start_redis [extra redis-server args…]: a redis-server on a free port, its files in
# $WORK/redis; sets REDIS_PORT and REDIS_PID.
REDIS_ARGS=()
start_redis() {
    REDIS_PORT="${REDIS_PORT:-$(free_port)}"
    mkdir -p "$WORK/redis"
    [ "$#" -gt 0 ] && REDIS_ARGS=("$@")
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --dir "$WORK/redis" --save '' \
        --daemonize no --logfile "$WORK/redis/redis.log" "${REDIS_ARGS[@]}" &
    REDIS_PID=$!
    PIDS+=("$REDIS_PID")
    wait_for "redis-cli -p $REDIS_PORT ping | grep -q PONG" 20 || { echo "redis-server did not start" >&2; exit 1; }
}

# start_replica I STORE [extra flags…]: replica I (ports PORT[I], ADMIN[I] chosen once)
# on STORE with its own data dir; waits for its start line; records an `up I` event
# when it listens (after a restart, the moment recovery is measured from).
declare -A PORT=() ADMIN=()
start_replica() {
    local i="$1" store="$2"
    shift 2
    [ -n "${PORT[$i]:-}" ] || { PORT[$i]=$(free_port); ADMIN[$i]=$(free_port); }
    : >"$WORK/replica$i.out"
    event spawn "$i"
    "$BIN" serve --config "$POLICY" --listen "127.0.0.1:${PORT[$i]}" --admin "127.0.0.1:${ADMIN[$i]}" \
        --upstream "$UPSTREAM" --store "$store" --data-dir "$WORK/data$i" --workers 1 \
        --upstream-timeout 5 --log-level warn "$@" >>"$WORK/replica$i.out" 2>>"$WORK/replica$i.err" &
    REPLICA_PID[$i]=$!
    local pid=$!
    wait_for "grep -q 'listening on' '$WORK/replica$i.out' || ! kill -0 $pid" 20 || true
    if ! grep -q 'listening on' "$WORK/replica$i.out"; then
        echo "replica $i did not start: $(tail -3 "$WORK/replica$i.err")" >&2
        event start-failed "$i"
        # MAY_FAIL=1: the caller handles it (and the check reports it).
        [ "${MAY_FAIL:-0}" = 1 ] && return 1
        exit 1
    fi
    event up "$i"
}

kill_replica() {
    local i="$1"
    event kill "$i" # stamped before the signal: no call it cut short ends before it
    kill -KILL "${REPLICA_PID[$i]}" 2>/dev/null || true
    wait "${REPLICA_PID[$i]}" 2>/dev/null || true
}

ports() {
    local i out=()
    for i in $(printf '%s\n' "${!PORT[@]}" | sort -n); do out+=("${PORT[$i]}"); done
    echo "${out[@]}"
}

run_load() { # run_load SECONDS: the load against every replica, in the background; sets LOAD_PID
    # shellcheck disable=SC2046
    python3 "$CHAOS/chaos.py" load "$WORK/load.log" "$1" "$CONC" "$CLIENT_TIMEOUT" $(ports) &
    LOAD_PID=$!
    PIDS+=("$LOAD_PID")
}

# The pass line; exits with the check's status.
finish() {
    local name="$1" admin="$2"
    python3 "$CHAOS/chaos.py" quotas "$WORK/quotas.json" "$admin" "$WORK/load.log"
    python3 "$CHAOS/chaos.py" check "$name" "$WORK"
}

# A hard bound on the whole script: past LIMIT seconds it stops (and cleans up).
# Its sleep holds no output of the script (a pipe reading it would wait for the sleep)
# and ends with it (cleanup sends TERM).
watchdog() {
    local limit="$1" self=$$
    (
        exec </dev/null >/dev/null 2>&1
        sleep "$limit" &
        nap=$!
        trap 'kill "$nap"; exit 0' TERM
        wait "$nap"
        echo "past the hard limit of ${limit} s: stopped" >"$WORK/watchdog"
        kill -TERM "$self"
    ) &
    WATCHDOG_PID=$!
}
