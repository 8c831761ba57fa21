//! Calendar months in UTC, for monthly quotas.
//!
//! Civil-date arithmetic after Howard Hinnant's `days_from_civil` /
//! `civil_from_days`, valid for every date the [`Timestamp`] range holds.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::Timestamp;

const SECS_PER_DAY: u64 = 86_400;

/// One calendar month in UTC: `[start, end)` in Unix seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MonthPeriod {
    /// The year, e.g. 2026.
    pub year: i64,
    /// The month, 1 = January.
    pub month: u32,
    /// First second of the month (Unix seconds).
    pub start: u64,
    /// First second of the next month (Unix seconds): the quota's reset.
    pub end: u64,
}

impl MonthPeriod {
    /// Month `month` (1 = January) of `year`, in UTC; `None` when `month` is not
    /// 1 to 12 or the year is outside 1970 to 2500 (the years a [`Timestamp`]
    /// holds).
    pub fn new(year: i64, month: u32) -> Option<MonthPeriod> {
        if !(1..=12).contains(&month) || !(1970..=2500).contains(&year) {
            return None;
        }
        let start = days_from_civil(year, month, 1) as u64 * SECS_PER_DAY;
        Some(month_of(Timestamp::from_secs(start)))
    }
}

/// The calendar month (UTC) that holds `t`.
#[inline]
pub fn month_of(t: Timestamp) -> MonthPeriod {
    let days = (t.as_secs() / SECS_PER_DAY) as i64;
    let (year, month, _) = civil_from_days(days);
    let start = days_from_civil(year, month, 1);
    let (ny, nm) = if month == 12 {
        (year + 1, 1)
    } else {
        (year, month + 1)
    };
    let end = days_from_civil(ny, nm, 1);
    MonthPeriod {
        year,
        month,
        start: start as u64 * SECS_PER_DAY,
        end: end as u64 * SECS_PER_DAY,
    }
}

/// The last month [`month_bounds`] computed, packed as `start << 32 | end`
/// (Unix seconds; 0 = none yet). Month boundaries change twelve times a
/// year, so almost every call is answered from here.
static LAST_MONTH: AtomicU64 = AtomicU64::new(0);

/// `[start, end)` in Unix seconds of the calendar month (UTC) holding `t`:
/// [`month_of`] without the date fields, cached.
#[inline]
pub(crate) fn month_bounds(t: Timestamp) -> (u64, u64) {
    let secs = t.as_secs();
    let cached = LAST_MONTH.load(Ordering::Relaxed);
    let (start, end) = (cached >> 32, cached & 0xffff_ffff);
    if start <= secs && secs < end {
        return (start, end);
    }
    let m = month_of(t);
    // Months past 2106 do not fit the packed form: computed every time.
    if m.end <= u64::from(u32::MAX) {
        LAST_MONTH.store((m.start << 32) | m.end, Ordering::Relaxed);
    }
    (m.start, m.end)
}

/// Days since 1970-01-01 of the proleptic Gregorian date `y-m-d`.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The proleptic Gregorian date `(year, month, day)` of a day count since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ts(s: &str) -> Timestamp {
        let t: jiff::Timestamp = s.parse().expect("test timestamp");
        Timestamp::from_nanos(t.as_nanosecond() as u64)
    }

    fn secs(s: &str) -> u64 {
        ts(s).as_secs()
    }

    #[test]
    fn december_rolls_into_january_of_the_next_year() {
        let p = month_of(ts("2026-12-31T23:59:59Z"));
        assert_eq!((p.year, p.month), (2026, 12));
        assert_eq!(p.start, secs("2026-12-01T00:00:00Z"));
        assert_eq!(p.end, secs("2027-01-01T00:00:00Z"));
        let next = month_of(Timestamp::from_secs(p.end));
        assert_eq!((next.year, next.month), (2027, 1));
        assert_eq!(next.start, p.end);
    }

    #[test]
    fn february_in_leap_and_non_leap_years() {
        let leap = month_of(ts("2028-02-15T12:00:00Z"));
        assert_eq!(leap.end - leap.start, 29 * SECS_PER_DAY);
        assert_eq!(leap.end, secs("2028-03-01T00:00:00Z"));
        let plain = month_of(ts("2027-02-15T12:00:00Z"));
        assert_eq!(plain.end - plain.start, 28 * SECS_PER_DAY);
        // Century rules: 2100 is not a leap year, 2000 was.
        assert_eq!(
            month_of(ts("2100-02-01T00:00:00Z")).end,
            secs("2100-03-01T00:00:00Z")
        );
        let y2k = month_of(ts("2000-02-29T23:00:00Z"));
        assert_eq!(y2k.end - y2k.start, 29 * SECS_PER_DAY);
    }

    #[test]
    fn the_last_nanosecond_of_a_month_belongs_to_it() {
        let end = ts("2026-12-01T00:00:00Z").as_nanos();
        let last = month_of(Timestamp::from_nanos(end - 1));
        assert_eq!((last.year, last.month), (2026, 11));
        assert_eq!(last.end, end / 1_000_000_000);
        let first = month_of(Timestamp::from_nanos(end));
        assert_eq!((first.year, first.month), (2026, 12));
    }

    #[test]
    fn a_month_named_by_year_and_number() {
        let dec = MonthPeriod::new(2026, 12).expect("a month");
        assert_eq!(dec, month_of(ts("2026-12-15T00:00:00Z")));
        assert_eq!(MonthPeriod::new(1970, 1).map(|m| m.start), Some(0));
        for (y, m) in [(2026, 0), (2026, 13), (1969, 12), (2501, 1)] {
            assert_eq!(MonthPeriod::new(y, m), None, "{y}-{m}");
        }
    }

    #[test]
    fn cached_bounds_follow_the_clock_both_ways() {
        let nov = ts("2026-11-15T00:00:00Z");
        let dec = ts("2026-12-15T00:00:00Z");
        for t in [nov, dec, nov, ts("1999-02-01T00:00:00Z"), dec] {
            let m = month_of(t);
            assert_eq!(month_bounds(t), (m.start, m.end));
        }
    }

    proptest! {
        #[test]
        fn agrees_with_jiff(secs in 0u64..8_000_000_000) {
            let p = month_of(Timestamp::from_secs(secs));
            let z = jiff::Timestamp::from_second(secs as i64).expect("in range").to_zoned_datetime(jiff::tz::TimeZone::UTC);
            let start = z.start_of_day().expect("day").first_of_month().expect("month");
            let end = start.checked_add(jiff::Span::new().months(1)).expect("next month");
            prop_assert_eq!(p.year, i64::from(z.year()));
            prop_assert_eq!(p.month, z.month() as u32);
            prop_assert_eq!(p.start as i64, start.timestamp().as_second());
            prop_assert_eq!(p.end as i64, end.timestamp().as_second());
        }
    }
}
