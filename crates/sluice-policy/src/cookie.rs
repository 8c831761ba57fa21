//! The session cookie, read out of a `Cookie` field as the common frameworks read
//! it, or not at all.
//!
//! Python's `SimpleCookie`, Werkzeug, Express's `cookie` and most others take
//! `session=secret`, `session = secret`, `session="secret"` and
//! `other=1; session="secret"` for one cookie with the value `secret`, and Express
//! percent-decodes it (`secret%2Dada` is `secret-ada`). sluice reads the same value
//! in every one of those spellings, so that a spelling is never a second caller nor
//! a way around a revocation. A value the frameworks read differently from one
//! another (a backslash escape inside quotes, a space, a comma, a bad `%`, bytes that
//! are not text) cannot be read unambiguously: it is [`Pair::Unreadable`], and the
//! request is refused rather than counted as someone else.

use std::borrow::Cow;

/// What one `name=value` pair of a `Cookie` field is, for a session cookie name.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pair<'a> {
    /// A cookie of another name.
    Other,
    /// The session cookie, with its value as the upstream reads it (unquoted,
    /// percent-decoded); empty when it has none.
    Session(Cow<'a, str>),
    /// The session cookie, with a value sluice cannot read as every common
    /// framework would.
    Unreadable,
}

impl Pair<'_> {
    /// True for the session cookie, readable or not.
    pub(crate) fn is_session(&self) -> bool {
        !matches!(self, Pair::Other)
    }
}

/// The pairs of one `Cookie` field value (`a=1; b=2`), each read for `session`.
pub(crate) fn pairs<'a>(field: &'a [u8], session: &'a str) -> impl Iterator<Item = Pair<'a>> {
    field
        .split(|&b| b == b';')
        .map(move |pair| read(pair, session))
}

/// Reads one pair (`name=value`, spaces around either allowed) for `session`.
pub(crate) fn read<'a>(pair: &'a [u8], session: &str) -> Pair<'a> {
    let (name, value) = match pair.iter().position(|&b| b == b'=') {
        Some(at) => (&pair[..at], Some(&pair[at + 1..])),
        None => (pair, None),
    };
    if name.trim_ascii() != session.as_bytes() {
        // `x=1 session=V` (or `x=1, session=V`): Python's `SimpleCookie` ends a
        // pair at a space and reads the session cookie; this pair cannot be read
        // as every framework would.
        if hides_session(pair, session.as_bytes()) {
            return Pair::Unreadable;
        }
        return Pair::Other;
    }
    // `session` alone: some read it as an empty value, some as no cookie.
    let Some(value) = value else {
        return Pair::Unreadable;
    };
    let value = value.trim_ascii();
    let inner = match value {
        [b'"', inner @ .., b'"'] => inner,
        [b'"', ..] | [.., b'"'] => return Pair::Unreadable,
        _ => value,
    };
    if !inner.iter().all(|&b| is_cookie_octet(b)) {
        return Pair::Unreadable;
    }
    match percent_decoded(inner) {
        Some(value) => Pair::Session(value),
        None => Pair::Unreadable,
    }
}

/// True when `session=` starts inside `pair` after a space, a tab or a comma
/// (spaces before the `=` allowed): a pair that some parsers split there.
fn hides_session(pair: &[u8], session: &[u8]) -> bool {
    if session.is_empty() {
        return false;
    }
    pair.windows(session.len())
        .enumerate()
        .filter(|&(at, w)| at > 0 && w == session)
        .any(|(at, _)| {
            matches!(pair[at - 1], b' ' | b'\t' | b',')
                && pair[at + session.len()..]
                    .iter()
                    .find(|&&b| b != b' ' && b != b'\t')
                    == Some(&b'=')
        })
}

/// RFC 6265's `cookie-octet`: visible ASCII but `"`, `,`, `;` and `\`.
fn is_cookie_octet(b: u8) -> bool {
    matches!(b, 0x21 | 0x23..=0x2B | 0x2D..=0x3A | 0x3C..=0x5B | 0x5D..=0x7E)
}

/// `value` with its `%XX` decoded, as Express reads a cookie (borrowed when it has
/// no `%`); `None` for a `%` without two hex digits or a result that is not UTF-8.
fn percent_decoded(value: &[u8]) -> Option<Cow<'_, str>> {
    if !value.contains(&b'%') {
        return std::str::from_utf8(value).ok().map(Cow::Borrowed);
    }
    let mut out = Vec::with_capacity(value.len());
    let mut rest = value;
    while let Some((&b, tail)) = rest.split_first() {
        if b == b'%' {
            let [hi, lo, ..] = tail else { return None };
            let hex = |d: u8| char::from(d).to_digit(16);
            let byte = hex(*hi)? * 16 + hex(*lo)?;
            out.push(u8::try_from(byte).ok()?);
            rest = &tail[2..];
        } else {
            out.push(b);
            rest = tail;
        }
    }
    String::from_utf8(out).ok().map(Cow::Owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(pair: &str) -> Pair<'_> {
        read(pair.as_bytes(), "session")
    }

    #[test]
    fn every_common_spelling_reads_one_value() {
        for pair in [
            "session=secret-ada",
            " session=secret-ada",
            "session = secret-ada",
            "session=\"secret-ada\"",
            "session= \"secret-ada\" ",
            "session=secret%2Dada",
            "session=\"secret%2dada\"",
        ] {
            assert_eq!(
                value(pair),
                Pair::Session(Cow::Borrowed("secret-ada")),
                "{pair:?}"
            );
        }
    }

    #[test]
    fn other_names_are_not_the_session() {
        for pair in ["sessionx=1", "Session=1", "other=session", "x", ""] {
            assert_eq!(value(pair), Pair::Other, "{pair:?}");
        }
    }

    #[test]
    fn what_frameworks_read_differently_is_unreadable() {
        for pair in [
            "session",
            "session=\"secret\\055ada\"",
            "session=\"secret",
            "session=secret\"",
            "session=\"a\"b\"",
            "session=secret ada",
            "session=secret,ada",
            "session=secret%2",
            "session=secret%zz",
            "session=secret%FF",
            // Python's SimpleCookie reads the session cookie out of these.
            "x=1 session=secret",
            "x=1, session=secret",
            "x=1\tsession = secret",
            "x session=secret",
        ] {
            assert_eq!(value(pair), Pair::Unreadable, "{pair:?}");
        }
        // Names that only end in the session's, or a value that names it, are
        // other cookies.
        for pair in ["x=my_session=1", "x=1 sessions=2", "x=session"] {
            assert_eq!(value(pair), Pair::Other, "{pair:?}");
        }
    }

    #[test]
    fn a_field_is_read_pair_by_pair() {
        let read: Vec<Pair<'_>> = pairs(b"other=1; session=\"secret-ada\"", "session").collect();
        assert_eq!(
            read,
            vec![Pair::Other, Pair::Session(Cow::Borrowed("secret-ada"))]
        );
        assert_eq!(value("session="), Pair::Session(Cow::Borrowed("")));
        assert_eq!(value("session=\"\""), Pair::Session(Cow::Borrowed("")));
    }
}
