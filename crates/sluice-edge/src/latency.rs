//! The latency histograms of `/metrics` (`sluice_decision_seconds`,
//! `sluice_upstream_seconds`): fixed buckets counted in place.
//!
//! Every request records two latencies. The `metrics` crate's Prometheus
//! histogram keeps each value it is given until the next upkeep or scrape sorts
//! it into its bucket: an allocation now and then and a second pass over every
//! value. A [`Latency`] finds the bucket at once and adds one to it, and one to
//! the sum, with two relaxed atomic adds on a shard of its own thread (so the
//! worker threads never share a cache line); the scrape adds the shards up.
//! [`render`] writes them in Prometheus' text format, after the recorder's own.

use std::fmt::Write as _;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// The most bucket bounds a histogram has (one more bucket counts past the last).
pub const MAX_BOUNDS: usize = 16;

/// Shards of a histogram: threads record on `thread % SHARDS`.
const SHARDS: usize = 8;

/// One thread's counts: a cache line or more of its own.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard {
    /// By bucket (not cumulative), the last one past every bound.
    counts: [AtomicU64; MAX_BOUNDS + 1],
    /// Nanoseconds.
    sum: AtomicU64,
}

/// One histogram: a family's name and (for one of several series) a label.
#[derive(Debug)]
pub struct Latency {
    family: &'static str,
    label: Option<(&'static str, &'static str)>,
    /// The bounds, in seconds as written and in nanoseconds as compared.
    bounds: &'static [f64],
    bounds_nanos: [u64; MAX_BOUNDS],
    shards: [Shard; SHARDS],
}

impl Latency {
    /// A histogram of `family` (with `label` when set) with the bucket `bounds`
    /// (seconds, increasing; at most [`MAX_BOUNDS`], the rest ignored).
    pub fn new(
        family: &'static str,
        label: Option<(&'static str, &'static str)>,
        bounds: &'static [f64],
    ) -> Self {
        let bounds = &bounds[..bounds.len().min(MAX_BOUNDS)];
        let mut bounds_nanos = [u64::MAX; MAX_BOUNDS];
        for (nanos, seconds) in bounds_nanos.iter_mut().zip(bounds) {
            // Bounds are small positive seconds: the cast cannot wrap.
            *nanos = (seconds * 1e9).round() as u64;
        }
        Latency {
            family,
            label,
            bounds,
            bounds_nanos,
            shards: Default::default(),
        }
    }

    /// Counts one latency of `elapsed`.
    pub fn record(&self, elapsed: Duration) {
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let bucket = self.bounds_nanos[..self.bounds.len()]
            .iter()
            .position(|&bound| nanos <= bound)
            .unwrap_or(self.bounds.len());
        let shard = &self.shards[shard_of_this_thread()];
        shard.counts[bucket].fetch_add(1, Ordering::Relaxed);
        shard.sum.fetch_add(nanos, Ordering::Relaxed);
    }

    /// The counts by bucket (not cumulative) and the sum in nanoseconds.
    fn totals(&self) -> ([u64; MAX_BOUNDS + 1], u64) {
        let mut counts = [0u64; MAX_BOUNDS + 1];
        let mut sum = 0u64;
        for shard in &self.shards {
            for (total, count) in counts.iter_mut().zip(&shard.counts) {
                *total = total.wrapping_add(count.load(Ordering::Relaxed));
            }
            sum = sum.wrapping_add(shard.sum.load(Ordering::Relaxed));
        }
        (counts, sum)
    }

    /// Writes its series (buckets, sum and count) to `out`.
    fn render_series(&self, out: &mut String) {
        let (counts, sum) = self.totals();
        let label = self
            .label
            .map(|(name, value)| format!("{name}=\"{value}\","))
            .unwrap_or_default();
        let family = self.family;
        let mut cumulative = 0u64;
        for (bound, count) in self.bounds.iter().zip(counts) {
            cumulative += count;
            let _ = writeln!(out, "{family}_bucket{{{label}le=\"{bound}\"}} {cumulative}");
        }
        cumulative += counts[self.bounds.len()];
        let _ = writeln!(out, "{family}_bucket{{{label}le=\"+Inf\"}} {cumulative}");
        let braces = |l: &str| {
            let l = l.trim_end_matches(',');
            if l.is_empty() {
                String::new()
            } else {
                format!("{{{l}}}")
            }
        };
        let _ = writeln!(out, "{family}_sum{} {}", braces(&label), sum as f64 / 1e9);
        let _ = writeln!(out, "{family}_count{} {cumulative}", braces(&label));
    }
}

/// This thread's shard: threads take the next one the first time they record.
fn shard_of_this_thread() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    SHARD.with(|s| *s)
}

/// Histogram buckets (seconds) of `sluice_decision_seconds`: a memory decision takes
/// about a microsecond, a Redis one a loopback round trip or more.
pub const DECISION_SECONDS_BUCKETS: &[f64] = &[
    0.000_001,
    0.000_002_5,
    0.000_005,
    0.000_01,
    0.000_025,
    0.000_05,
    0.000_1,
    0.000_25,
    0.000_5,
    0.001,
    0.002_5,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
];

/// Histogram buckets (seconds) of `sluice_upstream_seconds`.
pub const UPSTREAM_SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

// Every bucket of both families is kept (a histogram keeps at most MAX_BOUNDS).
const _: () = assert!(DECISION_SECONDS_BUCKETS.len() <= MAX_BOUNDS);
const _: () = assert!(UPSTREAM_SECONDS_BUCKETS.len() <= MAX_BOUNDS);

/// `sluice_decision_seconds`: the time the budget store took to decide all
/// budgets of one request.
pub static DECISION_SECONDS: LazyLock<Latency> =
    LazyLock::new(|| Latency::new("sluice_decision_seconds", None, DECISION_SECONDS_BUCKETS));

/// `sluice_upstream_seconds{outcome}`, by outcome: `response`, `error`, `timeout`.
pub static UPSTREAM_SECONDS: LazyLock<[Latency; 3]> = LazyLock::new(|| {
    ["response", "error", "timeout"].map(|outcome| {
        Latency::new(
            "sluice_upstream_seconds",
            Some(("outcome", outcome)),
            UPSTREAM_SECONDS_BUCKETS,
        )
    })
});

/// Appends every latency family, each with its `# HELP` and `# TYPE`, to `out`
/// (a Prometheus text exposition).
pub fn render(out: &mut String) {
    let families: [(&str, &str, &[&Latency]); 2] = [
        (
            "sluice_decision_seconds",
            "Time the budget store took to decide all budgets of one request.",
            &[&DECISION_SECONDS],
        ),
        (
            "sluice_upstream_seconds",
            "Time from forwarding a request to the upstream's response headers, by outcome.",
            &[
                &UPSTREAM_SECONDS[0],
                &UPSTREAM_SECONDS[1],
                &UPSTREAM_SECONDS[2],
            ],
        ),
    ];
    for (family, help, series) in families {
        let _ = writeln!(out, "# HELP {family} {help}");
        let _ = writeln!(out, "# TYPE {family} histogram");
        for latency in series {
            latency.render_series(out);
        }
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: &[f64] = &[0.001, 0.01];

    #[test]
    fn each_latency_counts_in_its_bucket_cumulatively_rendered() {
        let latency = Latency::new("t_seconds", Some(("outcome", "x")), BOUNDS);
        latency.record(Duration::from_micros(500));
        latency.record(Duration::from_millis(1)); // on the bound: le is inclusive
        latency.record(Duration::from_millis(5));
        std::thread::scope(|s| {
            s.spawn(|| latency.record(Duration::from_secs(2)));
        });
        let mut out = String::new();
        latency.render_series(&mut out);
        assert_eq!(
            out,
            "t_seconds_bucket{outcome=\"x\",le=\"0.001\"} 2\n\
             t_seconds_bucket{outcome=\"x\",le=\"0.01\"} 3\n\
             t_seconds_bucket{outcome=\"x\",le=\"+Inf\"} 4\n\
             t_seconds_sum{outcome=\"x\"} 2.0065\n\
             t_seconds_count{outcome=\"x\"} 4\n"
        );
    }

    #[test]
    fn a_family_without_a_label_has_no_braces_on_its_sum() {
        let latency = Latency::new("t_seconds", None, BOUNDS);
        latency.record(Duration::from_millis(20));
        let mut out = String::new();
        latency.render_series(&mut out);
        assert!(out.contains("t_seconds_bucket{le=\"+Inf\"} 1\n"), "{out}");
        assert!(out.contains("t_seconds_sum 0.02\n"), "{out}");
        assert!(out.contains("t_seconds_count 1\n"), "{out}");
    }
}
