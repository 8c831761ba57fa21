//! The provider's count is the truth: per provider and model, the ratio of
//! the input tokens the provider reported (`usage.prompt_tokens`) to the
//! pacer's own estimate of the same request, learned from every answer
//! whose usage settles a reservation, and the factor a request's input
//! reservation is multiplied by.
//!
//! The ratio is a running mean of the log-ratio (the mean of the first
//! [`WINDOW`] samples, then an EWMA with weight `1 / WINDOW`), each sample
//! clamped to [[`MIN_RATIO`], [`MAX_RATIO`]] and, once the ratio is
//! trusted ([`TRUSTED`] samples), to within ×/÷ [`MAX_STEP`] of it: a usage
//! that disagrees wildly (10×) moves the ratio a little, within bounds, and
//! does not poison it.
//!
//! A provider's count may not be a constant multiple of the estimate: a
//! per-message overhead of its own weighs more on a short prompt of many
//! messages than on a long one. The mean then under-reserves some requests
//! while their answers are on the way, and a window filled to the limit by
//! the pacer's books is over it in the provider's. So once trusted, the
//! factor carries the spread of the samples too: [`SPREAD`] standard
//! deviations of the log-ratio, at most [`MAX_SPREAD`]. The reservation is
//! settled to the provider's count when the answer ends, so the margin only
//! holds while a request is in flight.

use std::collections::HashMap;

/// The least ratio ever used.
pub(crate) const MIN_RATIO: f64 = 0.5;
/// The greatest ratio ever used.
pub(crate) const MAX_RATIO: f64 = 4.0;
/// Samples before the learned ratio is trusted: below, a request never
/// reserves less than its raw estimate, and a ratio above 1 carries a
/// margin.
pub(crate) const TRUSTED: u32 = 8;
/// The margin on a ratio above 1 with one sample; it shrinks linearly to 0
/// at [`TRUSTED`] samples.
pub(crate) const MARGIN: f64 = 0.2;
/// Samples averaged before the mean turns into an EWMA of this weight's
/// inverse.
pub(crate) const WINDOW: u32 = 16;
/// Once trusted, one sample moves the log-ratio at most `ln(MAX_STEP)`
/// before weighting (a factor of 1.5 either way).
pub(crate) const MAX_STEP: f64 = 1.5;
/// Standard deviations of the log-ratio added to a trusted ratio.
pub(crate) const SPREAD: f64 = 3.0;
/// The most the spread margin multiplies a trusted ratio by.
pub(crate) const MAX_SPREAD: f64 = 1.25;
/// Once trusted, a sample moves the variance as if it were at most this
/// many standard deviations from the mean …
pub(crate) const CLIP: f64 = 3.0;
/// … taking the deviation as at least this (in log-ratio) when the samples
/// so far agree.
pub(crate) const MIN_DEVIATION: f64 = 0.01;
/// The most models whose ratio one provider keeps; past it, further models
/// share one ratio (still learned, only less precisely).
pub(crate) const MAX_MODELS: usize = 256;

/// The key of the ratio that models past [`MAX_MODELS`] share.
const OVERFLOW: &str = "\0other";

/// One model's learned ratio.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct InputRatio {
    /// Mean of ln(reported / estimated), within the bounds.
    log_mean: f64,
    /// Samples seen (saturating).
    samples: u32,
    /// Variance of the log-ratio samples (weighted as the mean).
    log_var: f64,
}

impl InputRatio {
    /// A ratio as persisted or shown: `ratio` after `samples` samples.
    pub(crate) fn from_parts(ratio: f64, samples: u32) -> Self {
        let ratio = if ratio.is_finite() { ratio } else { 1.0 };
        InputRatio {
            log_mean: ratio.clamp(MIN_RATIO, MAX_RATIO).ln(),
            samples,
            log_var: 0.0,
        }
    }

    /// The learned ratio (1 before any sample).
    pub(crate) fn ratio(&self) -> f64 {
        self.log_mean.exp().clamp(MIN_RATIO, MAX_RATIO)
    }

    /// Samples seen.
    pub(crate) fn samples(&self) -> u32 {
        self.samples
    }

    /// Learns from one answer: the provider reported `reported` input tokens
    /// for a request estimated at `estimated`. Nothing is learned from an
    /// estimate or a report of 0.
    pub(crate) fn learn(&mut self, estimated: u32, reported: u32) {
        if estimated == 0 || reported == 0 {
            return;
        }
        let mut x = (f64::from(reported) / f64::from(estimated))
            .clamp(MIN_RATIO, MAX_RATIO)
            .ln();
        if self.samples >= TRUSTED {
            let step = MAX_STEP.ln();
            x = x.clamp(self.log_mean - step, self.log_mean + step);
        }
        let n = self.samples.saturating_add(1);
        let weight = 1.0 / f64::from(n.min(WINDOW));
        let delta = x - self.log_mean;
        self.log_mean = (self.log_mean + weight * delta).clamp(MIN_RATIO.ln(), MAX_RATIO.ln());
        // West's weighted update: the running variance for the first
        // samples, then exponentially weighted as the mean; once trusted, a
        // sample counts at most [`CLIP`] deviations away, so one wild
        // report does not widen the margin for long.
        let dev = if self.samples >= TRUSTED {
            let lim = CLIP * self.log_var.sqrt().max(MIN_DEVIATION);
            delta.clamp(-lim, lim)
        } else {
            delta
        };
        let var = (1.0 - weight) * (self.log_var + weight * dev * dev);
        self.log_var = if var.is_finite() { var.max(0.0) } else { 0.0 };
        self.samples = n;
    }

    /// The margin for the samples' spread: `exp(SPREAD × σ)` of the
    /// log-ratio, at most [`MAX_SPREAD`] (1 when every sample agrees).
    pub(crate) fn spread(&self) -> f64 {
        (SPREAD * self.log_var.sqrt()).exp().clamp(1.0, MAX_SPREAD)
    }

    /// What a request's input estimate is multiplied by to reserve: 1
    /// before any sample; below [`TRUSTED`] samples never less than 1, and
    /// a ratio above 1 with a margin shrinking with the samples; then the
    /// ratio with the margin of its spread ([`InputRatio::spread`]).
    pub(crate) fn factor(&self) -> f64 {
        let r = self.ratio();
        if self.samples == 0 {
            1.0
        } else if self.samples < TRUSTED {
            if r > 1.0 {
                let left = f64::from(TRUSTED - self.samples) / f64::from(TRUSTED - 1);
                (r * (1.0 + MARGIN * left)).min(MAX_RATIO)
            } else {
                1.0
            }
        } else {
            (r * self.spread()).min(MAX_RATIO)
        }
    }

    /// `estimate` input tokens as reserved: × [`InputRatio::factor`],
    /// rounded up.
    pub(crate) fn scale(&self, estimate: u32) -> u32 {
        let f = self.factor();
        if f == 1.0 {
            return estimate;
        }
        // Rounded up, but not for the last bits of a float (1.3 × 1000 is
        // 1300, not 1301).
        let scaled = (f64::from(estimate) * f - 1e-6).ceil().max(0.0);
        if scaled >= f64::from(u32::MAX) {
            u32::MAX
        } else {
            // In range: checked just above, and never negative.
            scaled as u32
        }
    }
}

/// One provider's learned ratios, per model (bounded by [`MAX_MODELS`]).
#[derive(Debug, Default)]
pub(crate) struct InputRatios {
    models: HashMap<String, InputRatio>,
}

impl InputRatios {
    /// The key `model` is learned under ("" for a request naming none).
    fn key<'m>(&self, model: &'m str) -> &'m str {
        if self.models.len() >= MAX_MODELS && !self.models.contains_key(model) {
            OVERFLOW
        } else {
            model
        }
    }

    /// The ratio of `model` (a fresh one when nothing was learned).
    pub(crate) fn get(&self, model: &str) -> InputRatio {
        self.models
            .get(self.key(model))
            .copied()
            .unwrap_or_default()
    }

    /// Learns from one answer of `model` (see [`InputRatio::learn`]).
    pub(crate) fn learn(&mut self, model: &str, estimated: u32, reported: u32) {
        if estimated == 0 || reported == 0 {
            return;
        }
        let key = self.key(model).to_owned();
        self.models
            .entry(key)
            .or_default()
            .learn(estimated, reported);
    }

    /// Sets a ratio (restored from a file): kept only while there is room.
    pub(crate) fn restore(&mut self, model: &str, ratio: InputRatio) {
        if self.models.len() < MAX_MODELS || self.models.contains_key(model) {
            self.models.insert(model.to_owned(), ratio);
        }
    }

    /// Every model's ratio, by model ("\0other": the models past the cap).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&str, &InputRatio)> {
        self.models.iter().map(|(k, v)| (k.as_str(), v))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn c6_ratio_converges_to_what_the_provider_counts() {
        let mut r = InputRatio::default();
        assert_eq!(r.scale(1_000), 1_000);
        for _ in 0..40 {
            r.learn(1_000, 1_300);
        }
        assert!((r.ratio() - 1.3).abs() < 1e-9, "{}", r.ratio());
        assert_eq!(r.scale(1_000), 1_300);
    }

    #[test]
    fn c6_ten_times_outliers_stay_within_bounds_and_do_not_poison_the_ratio() {
        let mut r = InputRatio::default();
        for _ in 0..20 {
            r.learn(1_000, 1_300);
        }
        // One wild report each way moves it little.
        r.learn(1_000, 13_000);
        assert!(r.ratio() <= MAX_RATIO && r.ratio() < 1.4, "{}", r.ratio());
        r.learn(1_000, 130);
        assert!(r.ratio() >= MIN_RATIO && r.ratio() > 1.2, "{}", r.ratio());
        // Only wild reports, as many as you like: never past the bounds.
        let mut up = InputRatio::default();
        let mut down = InputRatio::default();
        for _ in 0..1_000 {
            up.learn(100, 1_000_000);
            down.learn(1_000_000, 1);
            assert!(up.ratio() <= MAX_RATIO && up.factor() <= MAX_RATIO);
            assert!(down.ratio() >= MIN_RATIO && down.factor() >= MIN_RATIO);
        }
        assert_eq!(up.scale(u32::MAX), u32::MAX);
        // After the outliers, the truth comes back.
        for _ in 0..100 {
            r.learn(1_000, 1_300);
        }
        assert!((r.ratio() - 1.3).abs() < 0.01, "{}", r.ratio());
    }

    #[test]
    fn c6_below_the_trusted_samples_never_reserve_below_the_estimate() {
        let mut low = InputRatio::default();
        let mut high = InputRatio::default();
        for n in 1..TRUSTED {
            low.learn(1_000, 500);
            high.learn(1_000, 1_300);
            assert_eq!(low.samples(), n);
            assert_eq!(low.scale(1_000), 1_000, "after {n} samples");
            // Above 1, a margin that shrinks with the samples.
            let f = high.factor();
            assert!(f >= 1.3, "after {n} samples: {f}");
            if n > 1 {
                let mut before = InputRatio::default();
                for _ in 1..n {
                    before.learn(1_000, 1_300);
                }
                assert!(f < before.factor());
            }
        }
        low.learn(1_000, 500);
        assert_eq!(low.samples(), TRUSTED);
        // Trusted: the provider's count, even below the estimate.
        assert_eq!(low.scale(1_000), 500);
        high.learn(1_000, 1_300);
        assert_eq!(high.scale(1_000), 1_300);
    }

    #[test]
    fn c6_a_ratio_that_varies_per_request_reserves_with_a_margin_for_its_spread() {
        // A provider adding its own overhead per message: short prompts of
        // many messages count far more than the estimate, long ones barely.
        let mut r = InputRatio::default();
        for i in 0..64u32 {
            let (est, reported) = if i % 2 == 0 { (200, 254) } else { (700, 709) };
            r.learn(est, reported);
        }
        // The mean lies between the two; the factor covers the larger.
        assert!(
            r.ratio() > 1.0 && r.ratio() < 254.0 / 200.0,
            "{}",
            r.ratio()
        );
        assert!(r.factor() >= 254.0 / 200.0, "{}", r.factor());
        assert!(r.factor() <= r.ratio() * MAX_SPREAD + 1e-9);
        // Samples that agree carry no margin.
        let mut same = InputRatio::default();
        for _ in 0..64 {
            same.learn(1_000, 1_150);
        }
        assert_eq!(same.spread(), 1.0);
        assert_eq!(same.scale(1_000), 1_150);
        // One wild report widens the margin by little.
        same.learn(1_000, 11_500);
        assert!(same.spread() < 1.03, "{}", same.spread());
    }

    #[test]
    fn c6_ratios_are_per_model_and_bounded_in_number() {
        let mut book = InputRatios::default();
        for _ in 0..TRUSTED {
            book.learn("gpt-4o", 1_000, 1_300);
            book.learn("claude", 1_000, 2_000);
        }
        assert_eq!(book.get("gpt-4o").scale(1_000), 1_300);
        assert_eq!(book.get("claude").scale(1_000), 2_000);
        assert_eq!(book.get("other").scale(1_000), 1_000);
        for i in 0..(2 * MAX_MODELS) {
            book.learn(&format!("m{i}"), 1_000, 1_000);
        }
        assert_eq!(book.iter().count(), MAX_MODELS + 1);
        // The first models keep their own ratios.
        assert_eq!(book.get("gpt-4o").scale(1_000), 1_300);
    }
}
