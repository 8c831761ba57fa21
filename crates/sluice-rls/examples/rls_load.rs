//! A load generator for any Envoy rate-limit service (RLS v3): `STREAMS` calls in
//! flight at once over `CONNECTIONS` HTTP/2 connections for `SECONDS`, each asking
//! `DOMAIN` about one descriptor `(user, u<n>)` over 1,000 users (`RLS_USERS`: that
//! many instead, e.g. 1 for one hot key); prints decisions/s,
//! p50 and p99 latency, and how many were over the limit or failed, as one line of
//! JSON. Used by `bench/rls/run` against sluice and Kuadrant's limitador alike.
//!
//! It speaks HTTP/2 itself, as little of it as a gRPC client needs, so that it
//! costs the two cores it shares with the server as little as it can: every
//! call's HEADERS and DATA frames are encoded once before the run (a literal
//! header block, so no HPACK state), the calls that can go out are written
//! together, and the answers' header blocks are skipped unread. A call counts as
//! decided when its answer's message arrives and parses; as failed when the
//! stream ends without one or is reset. (The earlier version on tonic's client
//! cost about 15 µs of CPU per call, more than either server.)
//!
//! `cargo run --release -p sluice-rls --example rls_load -- ADDR [STREAMS=64]
//! [SECONDS=10] [DOMAIN=bench] [CONNECTIONS=4]`

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use prost::Message;
use sluice_rls::proto::rate_limit_descriptor::Entry;
use sluice_rls::proto::rate_limit_response::Code;
use sluice_rls::proto::{RateLimitDescriptor, RateLimitRequest, RateLimitResponse};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Users asked about, round robin, unless `RLS_USERS` says how many.
const USERS: usize = 1_000;
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
/// The receive window this client opens (stream and connection): the largest.
const WINDOW: u32 = (1 << 31) - 1;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// What one connection counted.
#[derive(Default)]
struct Tally {
    latencies: Vec<u32>,
    over: u64,
    failed: u64,
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let addr = args
        .first()
        .ok_or("usage: rls_load ADDR [STREAMS] [SECONDS] [DOMAIN] [CONNECTIONS]")?
        .clone();
    let streams: usize = args.get(1).map_or(Ok(64), |s| s.parse())?;
    let seconds: u64 = args.get(2).map_or(Ok(10), |s| s.parse())?;
    let domain = args.get(3).cloned().unwrap_or_else(|| "bench".to_owned());
    let connections: usize = args.get(4).map_or(Ok(4), |s| s.parse::<usize>())?.max(1);
    let calls = Arc::new(encode_calls(&addr, &domain));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..connections {
        // The streams shared out, the first connections taking one more.
        let share = streams / connections + usize::from(c < streams % connections);
        let stream = TcpStream::connect(&addr).await?;
        stream.set_nodelay(true)?;
        let (calls, stop) = (Arc::clone(&calls), Arc::clone(&stop));
        // Connection c asks users c, c + connections, …: every call in flight
        // asks about a user of its own, as in the tonic version.
        tasks.push(tokio::spawn(drive(
            stream,
            share.max(1),
            (c, connections),
            calls,
            stop,
        )));
    }
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    let (mut over, mut failed) = (0u64, 0u64);
    for task in tasks {
        let tally = task.await??;
        all.extend(tally.latencies);
        over += tally.over;
        failed += tally.failed;
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort_unstable();
    let at = |q: f64| {
        let i = ((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1));
        all.get(i).copied().unwrap_or(0)
    };
    println!(
        "{{\"decisions\":{},\"per_second\":{:.0},\"p50_us\":{},\"p99_us\":{},\"over_limit\":{over},\"failed\":{failed},\"cpu_ticks\":{}}}",
        all.len(),
        all.len() as f64 / elapsed,
        at(0.50),
        at(0.99),
        own_cpu_ticks()
    );
    Ok(())
}

/// The CPU this process used so far (user + system), in clock ticks; 0 where
/// `/proc` does not say.
fn own_cpu_ticks() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            let after = stat.rsplit_once(") ")?.1;
            let fields: Vec<&str> = after.split_whitespace().collect();
            Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0)
}

/// Each user's call, ready to send but for its stream id: the HEADERS frame
/// (header block and all) and the DATA frame that ends the stream.
struct Calls {
    headers: Vec<u8>,
    data: Vec<Vec<u8>>,
}

fn encode_calls(addr: &str, domain: &str) -> Calls {
    let mut block = Vec::new();
    block.push(0x83); // :method POST (static table 3)
    block.push(0x86); // :scheme http (6)
    literal(
        &mut block,
        4,
        b"/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
    );
    literal(&mut block, 1, addr.as_bytes()); // :authority
    literal(&mut block, 31, b"application/grpc"); // content-type
    block.push(0x00); // te, a new name, not indexed
    string(&mut block, b"te");
    string(&mut block, b"trailers");
    let mut headers = Vec::new();
    frame(&mut headers, HEADERS, END_HEADERS, 0, &block);
    let users = std::env::var("RLS_USERS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(USERS);
    let data = (0..users)
        .map(|user| {
            let request = RateLimitRequest {
                domain: domain.to_owned(),
                descriptors: vec![RateLimitDescriptor {
                    entries: vec![Entry {
                        key: "user".to_owned(),
                        value: format!("u{user}"),
                    }],
                    limit: None,
                    hits_addend: None,
                }],
                hits_addend: 1,
            };
            let message = request.encode_to_vec();
            let mut body = vec![0];
            body.extend_from_slice(&u32::try_from(message.len()).unwrap_or(0).to_be_bytes());
            body.extend_from_slice(&message);
            let mut data = Vec::new();
            frame(&mut data, DATA, END_STREAM, 0, &body);
            data
        })
        .collect();
    Calls { headers, data }
}

/// A header field as a literal without indexing, its name from the static
/// table (`index` < 127 here).
fn literal(block: &mut Vec<u8>, index: u8, value: &[u8]) {
    if index < 15 {
        block.push(index);
    } else {
        block.push(0x0f);
        block.push(index - 15);
    }
    string(block, value);
}

/// An HPACK string, not Huffman-coded (lengths < 127 here).
fn string(block: &mut Vec<u8>, value: &[u8]) {
    block.push(u8::try_from(value.len()).unwrap_or(0x7f));
    block.extend_from_slice(value);
}

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = u32::try_from(payload.len()).unwrap_or(0);
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// Sets the stream id of a frame encoded with id 0.
fn with_stream(out: &mut Vec<u8>, encoded: &[u8], stream: u32) {
    let at = out.len();
    out.extend_from_slice(encoded);
    out[at + 5..at + 9].copy_from_slice(&stream.to_be_bytes());
}

/// A call in flight: its stream, when it was sent, whether its message came.
struct InFlight {
    stream: u32,
    sent: Instant,
    answered: Option<bool>,
}

/// One connection: keeps `streams` calls in flight until `stop`, then lets
/// the last ones finish; asks users `first_user`, `first_user + stride`, ….
async fn drive(
    mut socket: TcpStream,
    streams: usize,
    (first_user, stride): (usize, usize),
    calls: Arc<Calls>,
    stop: Arc<AtomicBool>,
) -> Result<Tally, Error> {
    let mut out = Vec::with_capacity(64 * 1024);
    out.extend_from_slice(PREFACE);
    // SETTINGS_INITIAL_WINDOW_SIZE (4) at the largest, then the connection's.
    let mut settings = vec![0, 4];
    settings.extend_from_slice(&WINDOW.to_be_bytes());
    frame(&mut out, SETTINGS, 0, 0, &settings);
    frame(
        &mut out,
        WINDOW_UPDATE,
        0,
        0,
        &(WINDOW - 65_535).to_be_bytes(),
    );
    socket.write_all(&out).await?;
    out.clear();

    let mut tally = Tally {
        latencies: Vec::with_capacity(1 << 20),
        ..Tally::default()
    };
    let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
    let mut in_flight: Vec<InFlight> = Vec::with_capacity(streams);
    let mut next_stream: u32 = 1;
    let mut user = first_user;
    // What the server allows, once its SETTINGS came.
    let mut allowed: Option<usize> = None;
    // Connection-level send window (DATA bytes this client may still send).
    let mut send_window: i64 = 65_535;
    // DATA bytes received since the last WINDOW_UPDATE this client sent.
    let mut received: u64 = 0;
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        if let Some(allowed) = allowed
            && !stopping
        {
            while in_flight.len() < streams.min(allowed) {
                let data = &calls.data[user % calls.data.len()];
                let payload = i64::try_from(data.len() - 9).unwrap_or(i64::MAX);
                if payload > send_window {
                    break;
                }
                send_window -= payload;
                user += stride;
                with_stream(&mut out, &calls.headers, next_stream);
                with_stream(&mut out, data, next_stream);
                in_flight.push(InFlight {
                    stream: next_stream,
                    sent: Instant::now(),
                    answered: None,
                });
                next_stream += 2;
            }
        }
        if !out.is_empty() {
            socket.write_all(&out).await?;
            out.clear();
        }
        if stopping && in_flight.is_empty() {
            return Ok(tally);
        }
        let read = if stopping {
            // The last answers get a few seconds; what does not come failed.
            match tokio::time::timeout(Duration::from_secs(5), socket.read_buf(&mut buf)).await {
                Ok(read) => read?,
                Err(_) => {
                    tally.failed += in_flight.len() as u64;
                    return Ok(tally);
                }
            }
        } else {
            socket.read_buf(&mut buf).await?
        };
        if read == 0 {
            return Err("the server closed the connection".into());
        }
        let mut at = 0;
        while buf.len() - at >= 9 {
            let head = &buf[at..at + 9];
            let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            if buf.len() - at < 9 + len {
                break;
            }
            let payload = &buf[at + 9..at + 9 + len];
            at += 9 + len;
            let (kind, flags) = (head[3], head[4]);
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            match kind {
                DATA => {
                    received += len as u64;
                    let body = unpadded(payload, flags)?;
                    if let Some(call) = in_flight.iter_mut().find(|c| c.stream == stream) {
                        // One gRPC message: a byte of flags, four of length.
                        let answer = body.get(5..).map(RateLimitResponse::decode);
                        call.answered = Some(matches!(answer, Some(Ok(_))));
                        if let Some(Ok(answer)) = answer
                            && answer.overall_code == i32::from(Code::OverLimit)
                        {
                            tally.over += 1;
                        }
                    }
                    if flags & END_STREAM != 0 {
                        finish(&mut in_flight, stream, &mut tally);
                    }
                }
                HEADERS => {
                    if flags & END_HEADERS == 0 {
                        return Err("a header block in CONTINUATION frames".into());
                    }
                    if flags & END_STREAM != 0 {
                        finish(&mut in_flight, stream, &mut tally);
                    }
                }
                RST_STREAM => {
                    if let Some(call) = in_flight.iter_mut().find(|c| c.stream == stream) {
                        call.answered = Some(false);
                    }
                    finish(&mut in_flight, stream, &mut tally);
                }
                SETTINGS if flags & ACK == 0 => {
                    allowed = Some(max_streams(payload).unwrap_or(usize::MAX));
                    frame(&mut out, SETTINGS, ACK, 0, &[]);
                }
                PING if flags & ACK == 0 => frame(&mut out, PING, ACK, 0, payload),
                GOAWAY => return Err("the server sent GOAWAY".into()),
                WINDOW_UPDATE if stream == 0 && payload.len() == 4 => {
                    let increment =
                        u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                    send_window += i64::from(increment & 0x7fff_ffff);
                }
                _ => {}
            }
        }
        buf.drain(..at);
        // Give the server back its connection window long before it runs out.
        if received > 1 << 30 {
            let back = u32::try_from(received).unwrap_or(0);
            frame(&mut out, WINDOW_UPDATE, 0, 0, &back.to_be_bytes());
            received = 0;
        }
    }
}

/// A DATA frame's payload without its padding.
fn unpadded(payload: &[u8], flags: u8) -> Result<&[u8], Error> {
    if flags & PADDED == 0 {
        return Ok(payload);
    }
    let pad = usize::from(*payload.first().ok_or("an empty padded frame")?);
    payload
        .get(1..payload.len().saturating_sub(pad))
        .ok_or_else(|| "bad padding".into())
}

/// SETTINGS_MAX_CONCURRENT_STREAMS (3) in a SETTINGS payload.
fn max_streams(payload: &[u8]) -> Option<usize> {
    payload.chunks_exact(6).rev().find_map(|setting| {
        (u16::from_be_bytes([setting[0], setting[1]]) == 3)
            .then(|| u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]) as usize)
    })
}

/// The stream ended: counts its call, decided or failed.
fn finish(in_flight: &mut Vec<InFlight>, stream: u32, tally: &mut Tally) {
    let Some(at) = in_flight.iter().position(|c| c.stream == stream) else {
        return;
    };
    let call = in_flight.swap_remove(at);
    if call.answered == Some(true) {
        let took = call.sent.elapsed().as_micros();
        tally
            .latencies
            .push(u32::try_from(took).unwrap_or(u32::MAX));
    } else {
        tally.failed += 1;
    }
}
