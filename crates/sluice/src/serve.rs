//! `sluice serve`: flags, their checks, and the run of the gateway library
//! ([`sluice_gateway`]) until SIGTERM or Ctrl-C.
//!
//! On start it prints exactly one line to stdout naming the bound addresses. SIGTERM or
//! Ctrl-C stops accepting, lets in-flight requests finish for up to
//! [`SHUTDOWN_GRACE`], then exits 0.

use std::io::Write as _;
use std::net::{SocketAddr, ToSocketAddrs as _};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use sluice_gateway::Upstream;
use sluice_gateway::otlp::{OtlpConfig, OtlpProtocol};
use sluice_gateway::{
    Drain, Gateway, GatewayConfig, SHUTDOWN_GRACE, StartError, StoreSpec, UpstreamTls,
};

use crate::BadInput;

/// Longest accepted `--upstream-timeout`.
const MAX_UPSTREAM_TIMEOUT_SECS: f64 = 3600.0;

/// Flags of `sluice serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Policy file (YAML). Without it the built-in default policy runs. The file is
    /// read again on SIGHUP and when it changes (once its writer closes it or it is
    /// renamed into place; never half-written): a new policy that passes `sluice
    /// check` (and changes no lanes) replaces the running one without a restart; one
    /// that does not is logged and the running policy stays. At most 4 MiB.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Address the gateway listens on (port 0 picks a free port).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080", value_parser = parse_addr)]
    pub listen: SocketAddr,

    /// Address of the admin listener: /metrics, /status, the live dashboard at / and
    /// the JSON it reads, /dashboard.json (port 0 picks a free port).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9090", value_parser = parse_addr)]
    pub admin: SocketAddr,

    /// A PEM file of the gateway listener's certificate chain (its own certificate
    /// first): the gateway then speaks TLS only (rustls, TLS 1.2 and 1.3, ALPN `h2` and
    /// `http/1.1`). Needs --tls-key. Both files are read again when they change, with
    /// no restart and no connection dropped; a changed pair that does not parse, does
    /// not match or has expired is refused (logged as an error, counted in
    /// `sluice_tls_certificate_reloads_total{outcome="refused"}`, shown in /status and
    /// by `sluice_tls_certificate_stale`) and the certificate in use stays. At start a
    /// bad pair refuses to start. A handshake must finish within the head timeout
    /// (30 s).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// A PEM file of the private key of --tls-cert (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// As --tls-cert, for the admin listener.
    #[arg(long, value_name = "FILE", requires = "admin_tls_key")]
    pub admin_tls_cert: Option<PathBuf>,

    /// As --tls-key, for the admin listener.
    #[arg(long, value_name = "FILE", requires = "admin_tls_cert")]
    pub admin_tls_key: Option<PathBuf>,

    /// Also answer forward-auth check requests on ADDR: nginx's `auth_request`,
    /// Traefik's ForwardAuth and Caddy's `forward_auth` ask `GET /check` about the
    /// request they hold (named by X-Original-URI/-Method or X-Forwarded-Uri/-Method)
    /// and get 204 or the refusal, with X-RateLimit-*; decided by the same policy and
    /// budgets as the gateway. Routes that need the body or a lane are refused there
    /// (`sluice check` lists them). Trust the proxy's address in
    /// `identity.trusted_proxies` so its X-Forwarded-For is read. Port 0 picks a free
    /// port.
    #[arg(long, value_name = "ADDR", value_parser = parse_addr)]
    pub check: Option<SocketAddr>,

    /// Also serve Envoy's rate-limit service on ADDR (gRPC,
    /// envoy.service.ratelimit.v3.RateLimitService, with grpc.health.v1 health
    /// checking): descriptors are decided by the policy's `domains:` (and the files
    /// of --rls-config) on the same store and replicas as the gateway. Port 0 picks a
    /// free port.
    #[arg(long, value_name = "ADDR", value_parser = parse_addr)]
    pub rls: Option<SocketAddr>,

    /// A directory of envoyproxy/ratelimit configuration files (*.yaml, one domain
    /// each, loaded unchanged) added to the policy's `domains:`; read at start and
    /// again with every reload of --config.
    #[arg(long, value_name = "DIR")]
    pub rls_config: Option<PathBuf>,

    /// Who the admin listener lets in (`--admin-host`, `--admin-token-file`).
    #[command(flatten)]
    pub door: crate::door::DoorArgs,

    /// Serve the admin listener's /metrics without the admin token, for a Prometheus
    /// that scrapes without one (its `Host` is still checked).
    #[arg(long)]
    pub metrics_open: bool,

    /// Base URL of the upstream API (http://HOST[:PORT][/PREFIX] or
    /// https://HOST[:PORT][/PREFIX]). Without it a built-in demo upstream runs on a free
    /// loopback port. An https upstream's certificate is verified against the system's
    /// root certificates (or --upstream-ca), over TLS 1.2 or 1.3 and HTTP/1.1; every
    /// request to it takes the hyper path (the HTTP/1.1 fast path is plain HTTP only).
    #[arg(long, value_name = "URL", value_parser = Upstream::parse)]
    pub upstream: Option<Upstream>,

    /// A PEM file of CA certificates that verify the https --upstream, in place of the
    /// system's root certificates.
    #[arg(long, value_name = "FILE")]
    pub upstream_ca: Option<PathBuf>,

    /// Which of the policy's profiles applies, by name (the built-in policy has
    /// `production`, e.g. expensive 30/min, and `local`, roomier, e.g. expensive
    /// 150/min). Default: the policy's own `profile:`, `production` in the
    /// built-in policy. A name the policy does not have is refused, naming those
    /// it has.
    #[arg(long, value_name = "NAME")]
    pub profile: Option<String>,

    /// A dry run: every budget, bucket, quota and route is in shadow mode — decided
    /// and counted as usual, a refusal it would give counted in
    /// `sluice_shadow_refusals_total`, logged and shown on the dashboard, and the
    /// request forwarded instead. Kept across policy reloads.
    #[arg(long)]
    pub dry_run: bool,

    /// Where budgets live: `memory` (one process), or shared by replicas: `redis://…`,
    /// `rediss://…` (TLS; `?ssl_ca_certs=PEM` trusts that CA instead of the system's,
    /// `&ssl_certfile=PEM&ssl_keyfile=PEM` for mutual TLS), `redis+unix:///PATH`, a
    /// cluster `redis+cluster://HOST:PORT,HOST:PORT,…`, or the master Redis Sentinels
    /// name, followed across failovers: `redis+sentinel://HOST:PORT,HOST:PORT,…/MASTER[/DB]`.
    #[arg(long, value_name = "memory|redis://…", default_value = "memory", value_parser = StoreParser)]
    pub store: StoreSpec,

    /// Shift this replica's clock by SECS (negative: behind). A drill for clock skew:
    /// with a Redis store every decision uses the Redis server's clock, so windows and
    /// resets do not move.
    #[arg(
        long,
        value_name = "SECS",
        default_value_t = 0,
        allow_hyphen_values = true
    )]
    pub clock_offset: i64,

    /// Directory of the embedded durable store: monthly quota counts and the batch
    /// lane's queue. Default: $XDG_STATE_HOME/sluice, else ~/.local/state/sluice, else
    /// ./sluice-data. One process per directory. Not used with a Redis store (quotas
    /// then live in Redis).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,

    /// How far a monthly quota count is taken before the call it admits is forwarded:
    /// `write` (to the operating system: survives a restart, a crash or kill -9 of
    /// sluice, not a crash of the machine) or `flush` (to the disk, one fdatasync per
    /// group commit: survives a crash of the machine too, at a cost in latency).
    #[arg(long, value_name = "write|flush", default_value = "write", value_parser = ["write", "flush"])]
    pub quota_sync: String,

    /// Seconds to wait for the upstream's response headers before answering 504
    /// (fractions allowed, e.g. 0.5). Streaming bodies are not cut by it.
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = |s: &str| parse_seconds(s, false, MAX_UPSTREAM_TIMEOUT_SECS))]
    pub upstream_timeout: Duration,

    /// Gateway worker threads, each serving its share of the connections with its own
    /// upstream connection pool (default: one per CPU the process may use; at most 1024).
    /// `--check` and `--rls` run as many threads each.
    #[arg(long, value_name = "N", value_parser = parse_workers)]
    pub workers: Option<NonZeroUsize>,

    /// Most client connections open at once, idle ones included; at the limit the
    /// gateway stops accepting until one closes (new clients wait in the kernel's
    /// listen backlog). Each may hold an upstream connection too: the soft open-file
    /// limit is raised toward the hard one to hold two per connection; past the hard
    /// one the cap is lowered, with a warning.
    #[arg(long, value_name = "N", default_value = "10000")]
    pub max_connections: NonZeroUsize,

    /// Most client connections open at once from one address (the policy's trusted
    /// proxies aside), on the gateway and on each of --check and --rls; past it a new
    /// connection from that address is closed at once.
    #[arg(long, value_name = "N", default_value = "256")]
    pub max_connections_per_ip: NonZeroUsize,

    /// Most request-body bytes the gateway holds in memory at once, over every
    /// connection (bodies it takes in whole before deciding); past it a new request
    /// with a body gets 503 with Retry-After. Default 256 MiB.
    #[arg(long, value_name = "BYTES", default_value_t = sluice_edge::DEFAULT_MAX_BUFFERED_BYTES)]
    pub max_buffered_bytes: usize,

    /// The share of --max-buffered-bytes one client address may hold, a fraction
    /// above 0 and at most 1 (1: no share but the bound): past it, that address's new
    /// request with a body gets the same 503 with Retry-After while others are served.
    /// A client holding nothing may always start one body. The address is the one
    /// sluice believes: behind the policy's trusted proxies, the client they name in
    /// X-Forwarded-For (IPv6 grouped by the policy's prefix), not the proxy.
    #[arg(long, value_name = "FRACTION", default_value = "0.125", value_parser = parse_share)]
    pub max_buffered_share: f64,

    /// Most budget cells the in-process store holds (one per caller and budget in a
    /// window; about 20 bytes each). Its tables are allocated for all of them at
    /// start (as a fixed-size zone), so the store's memory is set by this flag
    /// and does not move with traffic: the default takes about 20 MB once
    /// traffic has touched it (a cap needing more than half the machine's memory
    /// is refused at start). Past it, a new caller shares an overflow
    /// budget with the other new callers of its network (the /24 of an IPv4
    /// client, the /56 of an IPv6 one), in a table of max-keys/8 cells; callers
    /// that hold a cell keep it. Not used with a Redis store.
    #[arg(long, value_name = "N", default_value = "1000000", value_parser = parse_max_keys)]
    pub max_keys: usize,

    /// Most unfinished batch items (queued or running) of all workspaces
    /// together, whatever their own backlogs: past it a submit is refused with
    /// 503 and Retry-After, nothing queued. One client address may hold
    /// 1/--batch-address-share of it.
    #[arg(long, value_name = "N", default_value_t = sluice_batch::DEFAULT_MAX_QUEUED_ITEMS, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_max_queued_items: u64,

    /// Most MiB of batch item bodies and results the queue stores (finished
    /// batches count until purged after their `keep_hours`): past it a submit
    /// is refused with 503 and Retry-After. One client address may hold
    /// 1/--batch-address-share of it.
    #[arg(long, value_name = "MIB", default_value_t = sluice_batch::DEFAULT_MAX_STORED_BYTES / (1024 * 1024), value_parser = clap::value_parser!(u64).range(1..=1 << 24))]
    pub batch_max_stored_mib: u64,

    /// One client address (through trusted proxies; an IPv6 client by its
    /// prefix) may hold at most 1/N of the batch queue's item and byte bounds
    /// (1: no share of its own).
    #[arg(long, value_name = "N", default_value_t = sluice_batch::DEFAULT_ORIGIN_SHARE, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub batch_address_share: u32,

    /// Seconds a call of the built-in demo upstream's message optimizer takes
    /// (`POST /messages/optimize`, the `optimize_message` tool), so its lane's waits,
    /// refusals and breaker can be watched (fractions allowed; 0 to 600). Ignored
    /// with --upstream.
    #[arg(long, value_name = "SECS", default_value = "3", value_parser = |s: &str| parse_seconds(s, true, sluice_demo::optimizer::MAX_CALL_SECONDS))]
    pub demo_optimize_seconds: Duration,

    /// How log lines on stderr are written: `text` (one readable line per event) or
    /// `json` (one JSON object per line). Each refusal is one line (target
    /// `sluice::refusal`) with its request id, reason, budget or lane, class and the
    /// caller's digest (never a credential).
    #[arg(long, value_name = "text|json", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,

    /// The least severe log lines written (refusals, reloads and access lines are
    /// `info`).
    #[arg(long, value_name = "LEVEL", default_value = "info",
          value_parser = ["error", "warn", "info", "debug"])]
    pub log_level: String,

    /// Write one access line per request (target `sluice::access`: request id,
    /// method, path without the query, status, duration, peer). Off by default.
    #[arg(long)]
    pub access_log: bool,

    /// Most refusal lines written a second, so that a flood of refused requests is
    /// not also a flood of log writes; past it refusals are only counted (as always,
    /// in /metrics), and the next line written says how many lines were left out.
    /// 0 writes every refusal.
    #[arg(long, value_name = "N", default_value_t = sluice_gateway::DEFAULT_REFUSAL_LOG_PER_SECOND)]
    pub refusal_log_per_second: u32,

    /// Send a span per decided request (on the gateway, --check and each --rls call)
    /// to an OpenTelemetry collector at URL
    /// (http://HOST:PORT or https://…; OTLP over gRPC, e.g. port 4317, unless
    /// --otlp-protocol says otherwise). Each span (`sluice.request`, kind server)
    /// carries the decision: sluice.outcome, sluice.class, sluice.budget,
    /// sluice.limit, sluice.remaining, sluice.reason, sluice.store.latency_ms and
    /// http.response.status_code. A request's valid W3C `traceparent` is the span's
    /// parent, and the upstream is sent a `traceparent` naming sluice's span. Spans
    /// wait in a bounded queue (4096) and are sent in batches; a collector that is
    /// down or slow never slows a request: past the bound spans are dropped and
    /// counted in sluice_otlp_spans_dropped_total. After activity the metrics of
    /// /metrics follow (at most every 10 s, only when changed). Nothing is sent at
    /// rest. Off by default.
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,

    /// How spans reach --otlp-endpoint: `grpc`, or `http/protobuf` (POST to the URL,
    /// `/v1/traces` added when it has no path).
    #[arg(long, value_name = "grpc|http/protobuf", default_value = "grpc",
          value_parser = ["grpc", "http/protobuf"], requires = "otlp_endpoint")]
    pub otlp_protocol: String,

    /// The share of traces that begin at sluice whose spans are sent, 0 to 1; a
    /// request continuing a trace follows its `traceparent`'s sampled flag.
    #[arg(long, value_name = "RATIO", default_value = "1.0", value_parser = parse_ratio,
          requires = "otlp_endpoint")]
    pub otlp_sample_ratio: f64,

    /// Most finished spans waiting to be sent to --otlp-endpoint; past it (a
    /// collector that is down or slow) a span is dropped and counted in
    /// sluice_otlp_spans_dropped_total.
    #[arg(long, value_name = "N", default_value_t = sluice_gateway::otlp::QUEUE_SPANS,
          value_parser = parse_queue,
          requires = "otlp_endpoint")]
    pub otlp_max_queue: usize,
}

/// Checks what clap cannot (the config is readable, the data dir is a directory, the
/// open-file limit holds the connections) and resolves the flags into the gateway's
/// configuration.
///
/// # Errors
/// [`BadInput`] naming the flag and what was expected.
pub fn config_from_args(args: ServeArgs) -> Result<GatewayConfig, BadInput> {
    let (policy, policy_file) = match &args.config {
        Some(path) => {
            let (mut policy, mut file) =
                sluice_gateway::PolicyFile::load(path.clone(), args.profile.clone())
                    .map_err(BadInput)?;
            file.dry_run = args.dry_run;
            policy.dry_run |= args.dry_run;
            if let Some(dir) = &args.rls_config {
                policy = sluice_gateway::reload::with_domain_dir(policy, dir).map_err(BadInput)?;
                file.domain_dir = Some(dir.clone());
            }
            (policy, Some(file))
        }
        None => {
            let policy = sluice_policy::default_policy().map_err(|e| BadInput(e.to_string()))?;
            let mut policy = match &args.profile {
                Some(profile) => policy
                    .with_profile(profile)
                    .map_err(|e| BadInput(format!("--profile: {e}")))?,
                None => policy,
            };
            policy.dry_run |= args.dry_run;
            let policy = match &args.rls_config {
                Some(dir) => {
                    sluice_gateway::reload::with_domain_dir(policy, dir).map_err(BadInput)?
                }
                None => policy,
            };
            (policy, None)
        }
    };
    for warning in policy.warnings() {
        tracing::warn!("policy: {warning}");
    }
    let data_dir = args
        .data_dir
        .unwrap_or_else(sluice_gateway::process::default_data_dir);
    if data_dir.exists() && !data_dir.is_dir() {
        return Err(BadInput(format!(
            "--data-dir {}: exists and is not a directory",
            data_dir.display()
        )));
    }
    let open = if args.metrics_open {
        vec!["/metrics".to_owned()]
    } else {
        Vec::new()
    };
    let admin_door = args.door.door(args.admin, open)?;
    let mut config = GatewayConfig::new(policy, data_dir);
    config.admin_door = admin_door;
    config.policy_file = policy_file;
    config.access_log = args.access_log;
    config.listen = args.listen;
    config.admin = args.admin;
    config.tls = listener_tls("gateway", "--tls-cert", args.tls_cert, args.tls_key)?;
    config.admin_tls = listener_tls(
        "admin",
        "--admin-tls-cert",
        args.admin_tls_cert,
        args.admin_tls_key,
    )?;
    config.check = args.check;
    config.rls = args.rls;
    config.upstream = match (args.upstream, args.upstream_ca) {
        (upstream, None) => upstream,
        (Some(upstream), Some(ca)) if upstream.is_https() => {
            let bad = |e: String| BadInput(format!("--upstream-ca {}: {e}", ca.display()));
            let pem = std::fs::read(&ca).map_err(|e| bad(e.to_string()))?;
            Some(upstream.with_tls(UpstreamTls::from_pem(&pem).map_err(bad)?))
        }
        (_, Some(_)) => {
            return Err(BadInput(
                "--upstream-ca verifies an https upstream: give --upstream https://…".to_owned(),
            ));
        }
    };
    config.store = args.store;
    config.clock_offset = args.clock_offset;
    config.quota_sync = match args.quota_sync.as_str() {
        "flush" => sluice_store::JournalSync::Flush,
        _ => sluice_store::JournalSync::Write,
    };
    config.upstream_timeout = args.upstream_timeout;
    if let Some(workers) = args.workers {
        config.workers = workers;
    }
    config.max_connections = {
        let (fits, warning) =
            sluice_gateway::process::connections_within_fd_limit(args.max_connections)
                .map_err(BadInput)?;
        if let Some(warning) = warning {
            tracing::warn!("{warning}");
        }
        fits
    };
    config.max_connections_per_ip = args.max_connections_per_ip;
    config.max_buffered_bytes = args.max_buffered_bytes;
    config.max_buffered_share = args.max_buffered_share;
    if matches!(config.store, StoreSpec::Memory) {
        sluice_gateway::process::keys_within_memory(args.max_keys).map_err(BadInput)?;
    }
    config.max_keys = args.max_keys;
    config.batch_bounds = sluice_gateway::BatchBounds {
        max_queued_items: args.batch_max_queued_items,
        max_stored_bytes: args.batch_max_stored_mib * 1024 * 1024,
        address_share: args.batch_address_share,
    };
    config.demo_optimize_time = args.demo_optimize_seconds;
    config.refusal_log_per_second = args.refusal_log_per_second;
    Ok(config)
}

fn parse_queue(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=1 << 20).contains(&n) => Ok(n),
        _ => Err("expected a whole number of spans from 1 to 1048576".into()),
    }
}

fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err("expected a fraction from 0 to 1, such as 0.1".into()),
    }
}

/// The OpenTelemetry export `--otlp-*` ask for (SPEC O1), if any.
fn otlp_from_args(args: &ServeArgs) -> Option<OtlpConfig> {
    let endpoint = args.otlp_endpoint.clone()?;
    let protocol = match args.otlp_protocol.as_str() {
        "http/protobuf" => OtlpProtocol::HttpProtobuf,
        _ => OtlpProtocol::Grpc,
    };
    let mut config = OtlpConfig::new(endpoint, protocol);
    config.sample_ratio = args.otlp_sample_ratio;
    config.queue_spans = args.otlp_max_queue;
    Some(config)
}

fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err("expected a fraction above 0 and at most 1, such as 0.125".into()),
    }
}

fn parse_max_keys(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (64..=1 << 32).contains(&n) => Ok(n),
        _ => Err("expected a whole number of cells from 64 to 4294967296".into()),
    }
}

pub(crate) fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let mut addrs = s
        .to_socket_addrs()
        .map_err(|e| format!("expected HOST:PORT such as 127.0.0.1:8080 ({e})"))?;
    addrs
        .next()
        .ok_or_else(|| format!("`{s}` resolves to no address"))
}

/// Most gateway worker threads `--workers` accepts.
const MAX_WORKERS: usize = 1024;

fn parse_workers(s: &str) -> Result<NonZeroUsize, String> {
    s.parse::<NonZeroUsize>()
        .ok()
        .filter(|n| n.get() <= MAX_WORKERS)
        .ok_or_else(|| format!("expected a whole number from 1 to {MAX_WORKERS}"))
}

/// A number of seconds (fractions allowed) above 0, or 0 itself when `zero_ok`, up to
/// `max`.
fn parse_seconds(s: &str, zero_ok: bool, max: f64) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| "expected a number of seconds such as 30 or 0.5".to_owned())?;
    if !(secs > 0.0 || zero_ok && secs == 0.0) || secs > max {
        let low = if zero_ok {
            "0 to"
        } else {
            "more than 0 and at most"
        };
        return Err(format!("expected {low} {max} seconds"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Runs `sluice serve` until SIGTERM / Ctrl-C.
///
/// # Errors
/// [`BadInput`] for flags that do not hold together or a data dir that cannot be
/// used; any other error (a port that cannot be bound, a runtime that cannot start)
/// is a runtime failure.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    // Both are one of clap's possible values.
    let level = args.log_level.parse().unwrap_or(tracing::Level::INFO);
    sluice_gateway::process::init_logs(args.log_format == "json", level);
    let otlp = otlp_from_args(&args);
    let config = config_from_args(args)?;
    crate::block_on(serve(config, otlp))
}

/// Runs `sluice rls`: the rate-limit service (and admin, and `--check` when given)
/// without the HTTP gateway, until SIGTERM / Ctrl-C.
///
/// # Errors
/// [`BadInput`] without `--rls`, and as [`run`].
pub fn run_rls(args: ServeArgs) -> anyhow::Result<()> {
    let level = args.log_level.parse().unwrap_or(tracing::Level::INFO);
    sluice_gateway::process::init_logs(args.log_format == "json", level);
    if args.rls.is_none() {
        return Err(BadInput(
            "sluice rls needs --rls ADDR, the address of the rate-limit service".to_owned(),
        )
        .into());
    }
    let otlp = otlp_from_args(&args);
    let mut config = config_from_args(args)?;
    config.gateway = false;
    crate::block_on(serve(config, otlp))
}

/// Starts the gateway (and the span export, with `otlp`), prints the start line,
/// serves until a termination signal, then drains.
async fn serve(config: GatewayConfig, otlp: Option<OtlpConfig>) -> anyhow::Result<()> {
    // Signal handlers are installed before the start line is printed, so a SIGTERM
    // sent by whoever reads that line is always handled gracefully.
    let termination =
        sluice_gateway::process::termination_signal().context("installing signal handlers")?;
    // Before the limiter is made: it reads `traceparent` only with a tracer.
    let exporting = match &otlp {
        Some(otlp) => Some(
            sluice_gateway::otlp::start(otlp)
                .map_err(|e| BadInput(format!("--otlp-endpoint: {e}")))?,
        ),
        None => None,
    };
    let gateway = Gateway::start(config).await.map_err(|e| match e {
        StartError::DataDir(e) => anyhow::Error::new(BadInput(format!("--data-dir: {e}"))),
        e @ (StartError::AdminWithoutToken(_) | StartError::UpstreamTls(_)) => {
            anyhow::Error::new(BadInput(e.to_string()))
        }
        other => anyhow::Error::new(other),
    })?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", gateway.start_line())
        .and_then(|()| stdout.flush())
        .context("writing the start line to stdout")?;
    drop(stdout);

    let signal = termination.await;
    tracing::info!("{signal} received, finishing in-flight requests");
    if let Drain::TimedOut { connections } = gateway.shutdown().await {
        tracing::warn!(
            "grace period of {} s over ({connections} connection(s) were open), \
             closing the rest",
            SHUTDOWN_GRACE.as_secs()
        );
    }
    if let Some(exporting) = exporting {
        exporting.shutdown().await;
    }
    Ok(())
}

/// Reads `--store` without echoing it: clap's own error for a bad value
/// repeats the value, and a Redis URL may carry a password.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StoreParser;

impl clap::builder::TypedValueParser for StoreParser {
    type Value = StoreSpec;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<StoreSpec, clap::Error> {
        let refuse = |why: String| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("invalid value for '--store': {why}\n"),
            )
            .with_cmd(cmd)
        };
        let text = value
            .to_str()
            .ok_or_else(|| refuse("not UTF-8".to_owned()))?;
        text.parse::<StoreSpec>().map_err(|e| refuse(e.to_string()))
    }
}

/// A listener's certificate and key, read and checked (SPEC O5): a bad pair refuses
/// to start, naming the flag and the file.
fn listener_tls(
    listener: &'static str,
    flag: &str,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> Result<Option<sluice_gateway::ListenerTls>, BadInput> {
    match (cert, key) {
        (Some(cert), Some(key)) => sluice_gateway::ListenerTls::load(listener, &cert, &key)
            .map(Some)
            .map_err(|e| BadInput(format!("{flag}: {e}"))),
        _ => Ok(None),
    }
}
