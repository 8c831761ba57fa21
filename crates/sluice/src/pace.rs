//! `sluice pace`: the client-side pacing proxy. `/<provider>/<path>`
//! is forwarded to that provider's `baseUrl` + `/<path>` with its key, paced to
//! its TPM, RPM and RPD.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;
use sluice_client::Pacer;
use sluice_client::TokioClock;
use sluice_client::config::{ConfigWatcher, LimitsSource};
use sluice_client::proxy::{ProxyError, ProxyOptions, ProxyServer};
use sluice_store::{Guarded, RedisConfig, RedisStore};

use crate::BadInput;
use crate::serve::parse_addr;
use sluice_gateway::StoreSpec;
use sluice_gateway::process::termination_signal;

/// Flags of `sluice pace`.
#[derive(Debug, Args)]
pub struct PaceArgs {
    /// Pacer config (YAML: `providers: <name>: { apiKey: ${ENV}, baseUrl, rateLimits:
    /// { tpm, rpm, rpd } }`, 0 = unlimited). Edits apply on the next request.
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,

    /// Address of the pacing proxy: point an SDK's base URL at
    /// `http://ADDR/<provider>` (port 0 picks a free port).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8088", value_parser = parse_addr)]
    pub listen: std::net::SocketAddr,

    /// Address of the admin listener: `GET /limits` (JSON), the live settings page at
    /// `/` and the JSON it reads, `GET /dashboard.json`.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9091", value_parser = parse_addr)]
    pub admin: std::net::SocketAddr,

    /// Who the admin listener lets in (`--admin-host`, `--admin-token-file`).
    #[command(flatten)]
    pub door: crate::door::DoorArgs,

    /// Where the budgets live: `memory` (this process) or a Redis URL
    /// (`redis://…`, `rediss://…`, `redis+unix:///…`, `redis+sentinel://…/MASTER`, as for
    /// `sluice serve --store`) so every process on one key shares one budget.
    #[arg(long, value_name = "memory|redis://…", default_value = "memory", value_parser = crate::serve::StoreParser)]
    pub store: StoreSpec,
}

/// Runs `sluice pace` until SIGTERM / Ctrl-C.
///
/// # Errors
/// [`BadInput`] for a config that does not load; anything else is a runtime failure.
pub fn run(args: PaceArgs) -> anyhow::Result<()> {
    crate::block_on(pace(args))
}

fn config_error(e: ProxyError) -> anyhow::Error {
    match e {
        ProxyError::Config(c) => BadInput(c.to_string()).into(),
        e @ ProxyError::AdminWithoutToken(_) => BadInput(e.to_string()).into(),
        other => anyhow::Error::new(other),
    }
}

async fn pace(args: PaceArgs) -> anyhow::Result<()> {
    let termination = termination_signal().context("installing signal handlers")?;
    let door = args.door.door(args.admin, Vec::new())?;
    let options = ProxyOptions::new(args.config.clone(), args.listen)
        .with_admin(args.admin)
        .with_admin_door(door);
    let StoreSpec::Redis(url) = &args.store else {
        let server = ProxyServer::bind(options).await.map_err(config_error)?;
        announce(server.bound(), "memory")?;
        return server
            .serve_with_shutdown(async move {
                termination.await;
            })
            .await
            .context("serving");
    };
    let watcher: Arc<dyn LimitsSource> =
        Arc::new(ConfigWatcher::open(&args.config).map_err(|e| BadInput(e.to_string()))?);
    let redis = RedisStore::connect(RedisConfig::new(url.clone()))
        .await
        .with_context(|| format!("connecting to the store {}", args.store.describe()))?;
    let pacer = Pacer::with_store(Guarded::new(redis), TokioClock::system(), watcher);
    let server = ProxyServer::with_pacer(options, pacer)
        .await
        .map_err(config_error)?;
    announce(server.bound(), "redis")?;
    server
        .serve_with_shutdown(async move {
            termination.await;
        })
        .await
        .context("serving")
}

fn announce(bound: sluice_client::proxy::Bound, store: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let admin = bound
        .admin
        .map_or_else(String::new, |a| format!(", admin http://{a}"));
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "sluice pace: listening on http://{}{admin}, store {store}",
        bound.listen
    )?;
    out.flush()?;
    Ok(())
}
