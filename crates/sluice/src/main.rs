//! `sluice`: rate limiting for both ends of an API.
//!
//! `sluice serve` runs the gateway, `sluice pace` the client-side pacer,
//! `sluice check` validates a policy file. `main` maps errors to exit codes:
//! 0 success, 1 runtime failure, 2 bad input (flags, config).

use std::io::Write as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub mod door;
pub mod pace;
pub mod serve;

/// mimalloc instead of the system allocator: the gateway allocates and frees small
/// buffers (headers, futures, body frames) on every request, across threads, and
/// mimalloc's thread-local free lists take a measured share of that cost off each
/// request (see BENCHMARKS.md, the gateway row).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Rate limiting for both ends of an API.
#[derive(Debug, Parser)]
#[command(name = "sluice", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway: per-caller, per-class, per-IP budgets in front of an upstream.
    Serve(Box<serve::ServeArgs>),
    /// Run Envoy's rate-limit service alone (gRPC RLS v3 on `--rls ADDR`, with the
    /// admin listener and, with `--check`, the forward-auth listener): `sluice serve`
    /// without its HTTP gateway. Takes `serve`'s flags; the gateway's own
    /// (`--listen`, `--upstream`, `--workers`, the batch and body bounds) do not apply.
    Rls(Box<serve::ServeArgs>),
    /// Run the client-side pacer: keep LLM calls inside TPM, RPM and RPD limits.
    Pace(pace::PaceArgs),
    /// Validate a policy file or a pacer config (top-level `providers:`) and print what
    /// it resolves to (exit 2 with every problem found when it is not valid).
    Check(CheckArgs),
}

/// Flags of `sluice check`.
#[derive(Debug, clap::Args)]
struct CheckArgs {
    /// The policy or pacer config (YAML) to check; or an envoyproxy/ratelimit
    /// configuration file (top-level `domain:`), or a directory of them (what
    /// `sluice serve --rls-config` reads).
    #[arg(value_name = "FILE")]
    file: std::path::PathBuf,
    /// The replicas the bound of each leased budget is printed for (SPEC D4);
    /// default: the policy's `store.replicas`.
    #[arg(long, value_name = "N")]
    replicas: Option<std::num::NonZeroU32>,
}

/// One line per domain: its name, where it came from and its rules.
fn describe_domains(domains: &[sluice_policy::domains::Domain]) -> String {
    let mut out = String::new();
    for d in domains {
        let rules: Vec<String> = d
            .rules
            .iter()
            .map(|r| {
                let limit = if r.unlimited {
                    "unlimited".to_owned()
                } else {
                    format!("{}/{}", r.limit, r.unit.name())
                };
                let shadow = if r.shadow { " (shadow)" } else { "" };
                format!("{} {limit}{shadow}", r.id)
            })
            .collect();
        out.push_str(&format!(
            "domain {} ({}): {}\n",
            d.name,
            if d.source.is_empty() {
                "policy"
            } else {
                &d.source
            },
            if rules.is_empty() {
                "no rules".to_owned()
            } else {
                rules.join(", ")
            }
        ));
    }
    out
}

/// `sluice check FILE`: what a policy (or, for a file with top-level `providers:`, a
/// pacer config) resolves to on stdout, or every problem found (exit 2).
///
/// Written with `write!`, not `print!` (which panics when stdout fails): a reader
/// that stops early (`sluice check FILE | head`) ends the command quietly, see
/// [`is_closed_pipe`].
fn check(args: &CheckArgs) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    if args.file.is_dir() {
        let domains = sluice_policy::domains::load_domain_dir(&args.file, &[])
            .map_err(|e| BadInput(e.to_string()))?;
        write!(out, "{}", describe_domains(&domains))?;
        writeln!(out, "{}: ok", args.file.display())?;
        out.flush()?;
        return Ok(());
    }
    let text = std::fs::read_to_string(&args.file)
        .map_err(|e| BadInput(format!("{}: {e}", args.file.display())))?;
    if text.lines().any(|l| l.starts_with("domain:")) {
        let domain = sluice_policy::domains::parse_domain_file(&text, &args.file)
            .map_err(|e| BadInput(e.to_string()))?;
        write!(out, "{}", describe_domains(std::slice::from_ref(&domain)))?;
    } else if text.lines().any(|l| l.starts_with("providers:")) {
        let config =
            sluice_client::config::load(&args.file).map_err(|e| BadInput(e.to_string()))?;
        writeln!(out, "{:#}", config.limits_json())?;
    } else {
        let mut policy =
            sluice_policy::parse_str(&text, &args.file).map_err(|e| BadInput(e.to_string()))?;
        if let Some(replicas) = args.replicas {
            policy.store.replicas = replicas;
        }
        check_alert_secrets(&policy, &args.file)?;
        write!(out, "{}", policy.describe())?;
        write!(out, "{}", describe_domains(&policy.domains))?;
        let gaps: Vec<String> = sluice_edge::forward_auth::gaps(&policy)
            .into_iter()
            .map(|(route, gap)| {
                format!(
                    "{} {} ({})",
                    route.method.as_ref().map_or("*", |m| m.as_str()),
                    route.path.as_ref().map_or("*", |p| p.as_str()),
                    gap.as_str()
                )
            })
            .collect();
        if !gaps.is_empty() {
            writeln!(
                out,
                "not served by --check: {} (put `sluice serve` in front of these routes)",
                gaps.join(", ")
            )?;
        }
        for warning in policy.warnings() {
            writeln!(out, "warning: {warning}")?;
        }
    }
    writeln!(out, "{}: ok", args.file.display())?;
    out.flush()?;
    Ok(())
}

/// SPEC O3: each alert's secret file can be read and is not empty, as `sluice serve`
/// needs it to start (a relative one is read from the policy file's directory).
///
/// # Errors
/// [`BadInput`] naming the alert and the file.
fn check_alert_secrets(
    policy: &sluice_policy::Policy,
    file: &std::path::Path,
) -> anyhow::Result<()> {
    let base = file.parent().unwrap_or_else(|| std::path::Path::new(""));
    for (n, alert) in policy.alerts.iter().enumerate() {
        let secret = base.join(&alert.secret_file);
        match std::fs::read(&secret) {
            Ok(bytes) if !bytes.trim_ascii().is_empty() => {}
            Ok(_) => {
                return Err(BadInput(format!(
                    "alerts[{n}].secret_file {}: empty",
                    secret.display()
                ))
                .into());
            }
            Err(e) => {
                return Err(
                    BadInput(format!("alerts[{n}].secret_file {}: {e}", secret.display())).into(),
                );
            }
        }
    }
    Ok(())
}

/// True when `error` comes from writing to a pipe whose reader has gone (`EPIPE`; Rust
/// programs ignore `SIGPIPE`, so the write fails instead of ending the process): the
/// reader took what it wanted, which is no failure to report.
fn is_closed_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// An error caused by what the user asked for (flags, files, config), as opposed to a
/// failure while running. `main` exits with code 2 for these, 1 for everything else.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadInput(pub String);

/// Runs `work` on a multi-threaded runtime, giving its tasks a second to end after.
fn block_on(work: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| anyhow::anyhow!("starting the async runtime: {e}"))?;
    let result = runtime.block_on(work);
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => serve::run(*args),
        Command::Rls(args) => serve::run_rls(*args),
        Command::Pace(args) => pace::run(args),
        Command::Check(args) => check(&args),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        // Exits quietly, as `head` asked by closing the pipe.
        Err(error) if is_closed_pipe(&error) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("sluice: {error:#}");
            if error.downcast_ref::<BadInput>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
