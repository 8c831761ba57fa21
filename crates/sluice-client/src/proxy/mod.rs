//! `sluice pace`: a local proxy any OpenAI- or Anthropic-compatible SDK uses
//! by changing its base URL. `/<provider>/<path>` is forwarded to that
//! provider's `baseUrl` + `/<path>` with its key, paced; answers (also
//! server-sent event streams) pass through unbuffered. A streamed chat
//! completion whose client did not ask for usage is sent with
//! `stream_options.include_usage`, so that its usage chunk reconciles the
//! reservation, and that chunk is taken out of the stream it gets back
//! (however the bytes were cut on the way). A path that could leave
//! the provider's base path (`..`, `%2e%2e`, an encoded slash, …) is 400
//! `invalid_path`, sent nowhere; a redirect is followed only within the
//! provider's origin (see [`crate::same_origin_redirects`]), any other is the
//! answer, so the key never goes to another host. A separate admin
//! listener serves `GET /limits` (JSON), `PUT /limits/<provider>`,
//! `GET /status` and the settings page at `/`. What the pacer learned of
//! each provider's input count (its input ratios, see `docs/pacer.md`) is
//! kept across restarts in a file next to the config ([`ratios_path`]).
//!
//! ```no_run
//! # async fn run() -> Result<(), sluice_client::proxy::ProxyError> {
//! use sluice_client::proxy::{ProxyOptions, ProxyServer};
//! let options = ProxyOptions::new("pace.yaml", "127.0.0.1:8787".parse().unwrap())
//!     .with_admin("127.0.0.1:8788".parse().unwrap());
//! let server = ProxyServer::bind(options).await?;
//! let bound = server.bound();
//! println!("pacing on http://{}, settings on http://{}", bound.listen, bound.admin.unwrap());
//! server.serve().await
//! # }
//! ```

mod admin;
mod forward;
mod path;
mod ratios;
mod stream;

pub use forward::{BUDGET_HEADER, KEY_HEADER};
pub use ratios::{SAVE_EVERY, ratios_path};

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use sluice_core::Clock;
use sluice_store::BudgetStore;
use tokio::net::TcpListener;

use crate::config::{ConfigError, ConfigWatcher, LimitsSource};
use crate::pacer::Pacer;

/// What the proxy's listener holds and how long it waits: 1,024 connections
/// (the next waits to be accepted), a request head within 30 s (also the
/// longest a kept-alive connection may sit idle), and on stop, as long as the
/// calls in flight take (a streamed completion can run for minutes).
pub const PROXY_BOUNDS: sluice_door::Bounds = sluice_door::Bounds {
    max_connections: 1024,
    head_timeout: std::time::Duration::from_secs(30),
    grace: None,
};

/// How to run the proxy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyOptions {
    /// The pace config file (watched: edits apply on the next request).
    pub config: PathBuf,
    /// Where SDKs connect (port 0: any free port, see [`Bound`]).
    pub listen: SocketAddr,
    /// Where the admin side listens, if anywhere.
    pub admin: Option<SocketAddr>,
    /// Who the admin side lets in (`Host` names, the token; see [`sluice_door`]).
    /// [`ProxyServer::bind`] refuses an admin address beyond loopback without a token.
    pub admin_door: sluice_door::DoorConfig,
}

impl ProxyOptions {
    /// The proxy of `config` on `listen`, without an admin listener.
    pub fn new(config: impl Into<PathBuf>, listen: SocketAddr) -> Self {
        ProxyOptions {
            config: config.into(),
            listen,
            admin: None,
            admin_door: sluice_door::DoorConfig::default(),
        }
    }

    /// The same with an admin listener on `admin`.
    pub fn with_admin(mut self, admin: SocketAddr) -> Self {
        self.admin = Some(admin);
        self
    }

    /// The same with `door` at the admin listener.
    pub fn with_admin_door(mut self, door: sluice_door::DoorConfig) -> Self {
        self.admin_door = door;
        self
    }
}

/// Where the proxy actually listens (after binding port 0, the real ports).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bound {
    /// The proxy.
    pub listen: SocketAddr,
    /// The admin side.
    pub admin: Option<SocketAddr>,
}

/// Why the proxy could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProxyError {
    /// The config did not load.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The HTTP client could not be built.
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    /// Serving failed.
    #[error("serving failed: {0}")]
    Serve(#[from] std::io::Error),
    /// The admin listener would answer beyond loopback with no token.
    #[error(
        "the admin listener on {0} is reachable beyond loopback and needs a token: \
         --admin-token-file FILE or SLUICE_ADMIN_TOKEN"
    )]
    AdminWithoutToken(SocketAddr),
}

/// What the handlers share.
pub(crate) struct App<S: BudgetStore + 'static, C: Clock + 'static> {
    pub(crate) pacer: Pacer<S, C>,
    pub(crate) client: reqwest::Client,
    pub(crate) config_file: PathBuf,
    /// Where the proxy listens: `Host` must name it (or a listed name).
    pub(crate) listen: SocketAddr,
    /// Where the learned input ratios are kept ([`ratios_path`]).
    pub(crate) ratios_file: PathBuf,
    /// What that file last held, and whether writing it failed before.
    pub(crate) saved_ratios: parking_lot::Mutex<(serde_json::Value, bool)>,
}

impl<S: BudgetStore + 'static, C: Clock + 'static> App<S, C> {
    /// Writes the learned input ratios to their file if they changed.
    pub(crate) fn save_ratios(&self) {
        let mut saved = self.saved_ratios.lock();
        let (last, warned) = &mut *saved;
        ratios::save_if_changed(&self.pacer, &self.ratios_file, last, warned);
    }
}

/// A bound, not yet serving proxy.
pub struct ProxyServer<
    S: BudgetStore + 'static = sluice_store::MemoryStore<crate::TokioClock>,
    C: Clock + 'static = crate::TokioClock,
> {
    app: Arc<App<S, C>>,
    listener: TcpListener,
    admin: Option<TcpListener>,
    admin_door: Option<Arc<sluice_door::Door>>,
    bound: Bound,
}

impl ProxyServer {
    /// Loads the config, warms the tokenizers it uses and binds the
    /// listeners (the books are in memory: one process).
    ///
    /// # Errors
    /// [`ProxyError::Config`] (file, key path, line) or [`ProxyError::Bind`].
    pub async fn bind(options: ProxyOptions) -> Result<Self, ProxyError> {
        let watcher: Arc<dyn LimitsSource> = Arc::new(ConfigWatcher::open(&options.config)?);
        let pacer = Pacer::new(watcher);
        Self::with_pacer(options, pacer).await
    }
}

impl<S: BudgetStore + 'static, C: Clock + 'static> ProxyServer<S, C> {
    /// [`ProxyServer::bind`] with a pacer built by the caller (e.g. over a
    /// shared store, so that several proxies share one budget).
    /// The pacer's config source should watch `options.config`.
    ///
    /// # Errors
    /// [`ProxyError::Bind`] or [`ProxyError::Client`].
    pub async fn with_pacer(options: ProxyOptions, pacer: Pacer<S, C>) -> Result<Self, ProxyError> {
        for p in pacer.config().providers.values() {
            p.encoding.warm();
        }
        // What an earlier run learned of the providers' input counts.
        let ratios_file = ratios_path(&options.config);
        let restored = ratios::load(&pacer, &ratios_file);
        if restored > 0 {
            tracing::info!(file = %ratios_file.display(), ratios = restored, "restored learned input ratios");
        }
        let saved_ratios = parking_lot::Mutex::new((ratios::to_json(&pacer), false));
        let client = reqwest::Client::builder()
            .pool_idle_timeout(std::time::Duration::from_secs(60))
            // The key goes to the provider's origin and nowhere else.
            .redirect(crate::same_origin_redirects())
            .build()?;
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ProxyError::Bind { addr, source })
        };
        if let Some(admin) = options.admin
            && sluice_door::needs_token(admin)
            && options.admin_door.token.is_none()
        {
            return Err(ProxyError::AdminWithoutToken(admin));
        }
        let listener = bind(options.listen).await?;
        let admin = match options.admin {
            Some(a) => Some(bind(a).await?),
            None => None,
        };
        let bound = Bound {
            listen: listener.local_addr()?,
            admin: admin.as_ref().map(TcpListener::local_addr).transpose()?,
        };
        let admin_door = bound
            .admin
            .map(|a| Arc::new(sluice_door::Door::new(a, options.admin_door.clone())));
        Ok(ProxyServer {
            app: Arc::new(App {
                pacer,
                client,
                config_file: options.config,
                listen: bound.listen,
                ratios_file,
                saved_ratios,
            }),
            listener,
            admin,
            admin_door,
            bound,
        })
    }

    /// Where it listens.
    pub fn bound(&self) -> Bound {
        self.bound
    }

    /// The pacer behind the proxy.
    pub fn pacer(&self) -> &Pacer<S, C> {
        &self.app.pacer
    }

    /// Serves for good, within [`PROXY_BOUNDS`] (the settings listener within
    /// [`sluice_door::ADMIN_BOUNDS`]).
    ///
    /// # Errors
    /// None today: a failed accept is logged and tried again. The `Result`
    /// keeps room for errors of serving ([`ProxyError::Serve`]).
    pub async fn serve(self) -> Result<(), ProxyError> {
        self.serve_with_shutdown(std::future::pending()).await
    }

    /// Serves until `shutdown` completes, then finishes the requests in
    /// flight, however long they take.
    ///
    /// # Errors
    /// None today, as [`ProxyServer::serve`].
    pub async fn serve_with_shutdown(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ProxyError> {
        let (tx, rx) = tokio::sync::watch::channel(false);
        let wait = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|v| *v).await;
        };
        let proxy = sluice_door::serve(
            self.listener,
            forward::router(self.app.clone()),
            PROXY_BOUNDS,
            wait(rx.clone()),
        );
        let admin = self.admin.zip(self.admin_door).map(|(l, door)| {
            let router = admin::router(self.app.clone()).layer(
                axum::middleware::from_fn_with_state(door, sluice_door::guard),
            );
            sluice_door::serve(l, router, sluice_door::ADMIN_BOUNDS, wait(rx))
        });
        tokio::spawn(async move {
            shutdown.await;
            let _ = tx.send(true);
        });
        // The learned input ratios go to their file now and then, and once
        // more when the last request has ended.
        let app = self.app.clone();
        let saver = tokio::spawn(async move {
            loop {
                tokio::time::sleep(SAVE_EVERY).await;
                app.save_ratios();
            }
        });
        match admin {
            Some(admin) => {
                tokio::join!(proxy, admin);
            }
            None => proxy.await,
        }
        saver.abort();
        self.app.save_ratios();
        Ok(())
    }
}

/// Runs `sluice pace`: loads `options.config`, binds, and serves until an
/// error. To learn the bound addresses first (port 0), use
/// [`ProxyServer::bind`], [`ProxyServer::bound`], [`ProxyServer::serve`].
///
/// # Errors
/// [`ProxyError`].
pub async fn run_proxy(options: ProxyOptions) -> Result<(), ProxyError> {
    ProxyServer::bind(options).await?.serve().await
}
