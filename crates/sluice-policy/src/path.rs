//! Request paths as the upstream reads them: the path is matched and
//! forwarded in its normal form, so that a route cannot be reached under another
//! spelling (`//chats`, `/%63hats`, `/x/../chats`) that the upstream would still read
//! as the route, while sluice counted it as something cheaper.
//!
//! The normal form is RFC 3986's (§6.2.2): percent-encodings of unreserved
//! characters (`A-Z a-z 0-9 - . _ ~`) decoded, the hex digits of the others upper
//! case (`%2f` → `%2F`: an encoded `/` stays encoded, it is not a separator), then
//! dot segments removed (§5.2.4); and, when the policy says so, repeated slashes
//! merged into one. A path whose `..` would climb above the root, with a `%` not
//! followed by two hex digits, or with a raw `\` (which WHATWG URL parsers, and so
//! many servers, read as `/`: `/oauth\register` is `/oauth/register` to them) has no
//! normal form: it is refused.
//!
//! Path parameters (`;name=value` in a segment) are kept: most servers read `;` as
//! a character of the segment, servlet containers drop the parameters. Where the two
//! readings would match different routes, the request is refused (see
//! [`without_parameters`] and [`Policy::route_checked`](crate::Policy::route_checked)).

use std::borrow::Cow;

/// How paths are normalised before they are matched and forwarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Paths {
    /// Merge repeated slashes (`//a///b` → `/a/b`), as nginx (`merge_slashes on`)
    /// and most frameworks read them.
    pub merge_slashes: bool,
    /// Whether the literal segments of route patterns match letters of either case.
    pub case: PathCase,
}

impl Default for Paths {
    fn default() -> Self {
        Paths {
            merge_slashes: true,
            case: PathCase::Insensitive,
        }
    }
}

/// How the literal segments of route patterns match a request's path
/// (`paths.case`).
///
/// The default is [`PathCase::Insensitive`]: Express, ASP.NET and IIS route `/CHATS`
/// to the `/chats` handler, so a limiter that matched case-sensitively would count
/// it in the default class while the upstream runs the route. Matching either case
/// can only make a request match a route it would otherwise miss; an upstream that
/// routes case-sensitively (Werkzeug, Go's `ServeMux`) just answers 404 to the other
/// spellings, after they were counted as the route. `sensitive` is for policies
/// whose routes differ only by case (which `sluice check` warns of).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PathCase {
    /// `/CHATS` matches the pattern `/chats` (ASCII letters; the default).
    #[default]
    Insensitive,
    /// `/CHATS` matches only a pattern `/CHATS`.
    Sensitive,
}

/// Why a request's method and path have no one reading: a path with no normal form,
/// or a method or path spelling that servers read as different routes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PathError {
    /// A `..` segment would climb above the root (`/../x`, `/a/../../x`).
    #[error("the path climbs above the root with '..'")]
    AboveRoot,
    /// A `%` not followed by two hex digits.
    #[error("the path has a '%' that is not followed by two hex digits")]
    BadPercentEncoding,
    /// A raw `\`, which many servers read as `/`.
    #[error("the path has a '\\', which many servers read as '/'")]
    Backslash,
    /// Path parameters (`;…` in a segment) change the route the path matches: an
    /// upstream that drops them (as servlet containers do) reads another route.
    #[error("path parameters (';') change the route the path matches")]
    ParametersChangeRoute,
    /// An encoded slash (`%2F`, or `%5C`, a backslash many servers read as `/`)
    /// changes the route the path matches: an upstream that decodes the path
    /// before routing it (Werkzeug, Django, Starlette, …) reads another route.
    #[error("an encoded '/' ('%2F' or '%5C') changes the route the path matches")]
    EncodedSlashChangesRoute,
    /// The method differs from a known one only by case (`post`): some servers run
    /// it as that method, the route table matches it as no method.
    #[error("the method differs from a known method only by case")]
    MethodCase,
    /// A method-override field (`X-HTTP-Method-Override` and its kin) that sluice
    /// cannot read, or that names a method whose route is not the request's own.
    #[error("a method-override field changes the route the request matches, or cannot be read")]
    MethodOverride,
}

impl Paths {
    /// The normal form of `path` (an origin-form path, without the query): borrowed
    /// when `path` is normal already, as almost every request's is. A path that does
    /// not start with `/` (`*`) is returned as it is.
    ///
    /// # Errors
    /// [`PathError`] when the path has no normal form.
    pub fn normalize<'p>(&self, path: &'p str) -> Result<Cow<'p, str>, PathError> {
        if !path.starts_with('/') || is_normal(path.as_bytes(), self.merge_slashes) {
            return Ok(Cow::Borrowed(path));
        }
        if path.contains('\\') {
            return Err(PathError::Backslash);
        }
        let decoded = normalize_percent(path)?;
        remove_dot_segments(&decoded, self.merge_slashes).map(Cow::Owned)
    }
}

/// True when `path` (starting with `/`) needs no change: no `%`, no `\\`, no dot
/// segment and, when merging, no empty segment but a final one. One pass, no
/// allocation.
fn is_normal(path: &[u8], merge_slashes: bool) -> bool {
    let mut at = 0;
    while at < path.len() {
        match path[at] {
            b'%' | b'\\' => return false,
            b'/' => {
                let next = path.get(at + 1).copied();
                if next == Some(b'/') && merge_slashes {
                    return false;
                }
                if next == Some(b'.') {
                    // `/.` or `/..`, then a `/` or the end.
                    let after = match path.get(at + 2) {
                        Some(b'.') => path.get(at + 3),
                        other => other,
                    };
                    if matches!(after, None | Some(b'/')) {
                        return false;
                    }
                }
            }
            _ => {}
        }
        at += 1;
    }
    true
}

/// `path` with the parameters of each segment (from a `;` to the segment's end)
/// removed, as servlet containers read it (`/oauth;x/register;y` → `/oauth/register`):
/// borrowed when it has no `;`.
pub fn without_parameters(path: &str) -> Cow<'_, str> {
    if !path.contains(';') {
        return Cow::Borrowed(path);
    }
    let mut out = String::with_capacity(path.len());
    for (i, segment) in path.split('/').enumerate() {
        if i > 0 {
            out.push('/');
        }
        out.push_str(segment.split(';').next().unwrap_or(segment));
    }
    Cow::Owned(out)
}

/// The reading of a normal `path` by a server that decodes `%2F` and `%5C` to
/// `/` before routing it (dot segments and, with `merge_slashes`, empty ones then
/// removed again); `None` when the path has neither.
///
/// # Errors
/// [`PathError::AboveRoot`] when that reading climbs above the root.
pub(crate) fn with_encoded_slashes(
    path: &str,
    merge_slashes: bool,
) -> Result<Option<String>, PathError> {
    // Looked for without a copy: every request's path comes through here.
    let slash = |w: &[u8]| {
        w[0] == b'%'
            && matches!(
                (w[1], w[2].to_ascii_uppercase()),
                (b'2', b'F') | (b'5', b'C')
            )
    };
    if !path.as_bytes().windows(3).any(slash) {
        return Ok(None);
    }
    let mut decoded = String::with_capacity(path.len());
    let mut rest = path;
    while let Some(at) = rest.find('%') {
        decoded.push_str(&rest[..at]);
        let code = rest.get(at + 1..at + 3).unwrap_or("");
        if code.eq_ignore_ascii_case("2F") || code.eq_ignore_ascii_case("5C") {
            decoded.push('/');
            rest = &rest[at + 3..];
        } else {
            decoded.push('%');
            rest = &rest[at + 1..];
        }
    }
    decoded.push_str(rest);
    remove_dot_segments(&decoded, merge_slashes).map(Some)
}

/// RFC 3986 §2.3 unreserved characters.
fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Percent-encodings of unreserved characters decoded, the others' hex upper case.
fn normalize_percent(path: &str) -> Result<Cow<'_, str>, PathError> {
    let bytes = path.as_bytes();
    let Some(first) = bytes.iter().position(|&b| b == b'%') else {
        return Ok(Cow::Borrowed(path));
    };
    let mut out = String::with_capacity(path.len());
    out.push_str(&path[..first]);
    let mut at = first;
    while at < bytes.len() {
        let b = bytes[at];
        if b != b'%' {
            // Copy the run up to the next `%` as it is (it may hold UTF-8).
            let end = bytes[at..]
                .iter()
                .position(|&b| b == b'%')
                .map_or(bytes.len(), |n| at + n);
            out.push_str(&path[at..end]);
            at = end;
            continue;
        }
        let (Some(hi), Some(lo)) = (
            bytes.get(at + 1).copied().and_then(hex_value),
            bytes.get(at + 2).copied().and_then(hex_value),
        ) else {
            return Err(PathError::BadPercentEncoding);
        };
        let decoded = (hi << 4) | lo;
        if is_unreserved(decoded) {
            out.push(char::from(decoded));
        } else {
            out.push('%');
            out.push(char::from(b"0123456789ABCDEF"[usize::from(hi)]));
            out.push(char::from(b"0123456789ABCDEF"[usize::from(lo)]));
        }
        at += 3;
    }
    Ok(Cow::Owned(out))
}

/// RFC 3986 §5.2.4 on an absolute path (starting with `/`), refusing a `..` above the
/// root rather than dropping it; empty segments (but a final one) dropped too when
/// `merge_slashes`.
fn remove_dot_segments(path: &str, merge_slashes: bool) -> Result<String, PathError> {
    let mut out = String::with_capacity(path.len());
    let mut segments = path[1..].split('/').peekable();
    // The output ends with a `/` that no segment follows (`/a/.` → `/a/`).
    let mut trailing = false;
    while let Some(segment) = segments.next() {
        let last = segments.peek().is_none();
        match segment {
            "." => trailing = last,
            ".." => {
                let parent = out.rfind('/').ok_or(PathError::AboveRoot)?;
                out.truncate(parent);
                trailing = last;
            }
            "" if last => trailing = true,
            "" if merge_slashes => {}
            _ => {
                out.push('/');
                out.push_str(segment);
                trailing = false;
            }
        }
    }
    if trailing || out.is_empty() {
        out.push('/');
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MERGE: Paths = Paths {
        case: PathCase::Insensitive,
        merge_slashes: true,
    };
    const KEEP: Paths = Paths {
        case: PathCase::Insensitive,
        merge_slashes: false,
    };

    fn normal(paths: Paths, path: &str) -> String {
        match paths.normalize(path) {
            Ok(p) => p.into_owned(),
            Err(e) => format!("error: {e}"),
        }
    }

    #[test]
    fn e6_a_normal_path_is_borrowed_as_it_is() {
        for path in [
            "/",
            "/chats",
            "/chats/",
            "/a/b.c/d..e/.f/..g/...",
            "/routines/42/run",
            "/caf\u{e9}",
            "*",
        ] {
            assert!(
                matches!(MERGE.normalize(path), Ok(Cow::Borrowed(p)) if p == path),
                "{path}"
            );
        }
        assert!(matches!(KEEP.normalize("/a//b"), Ok(Cow::Borrowed(_))));
    }

    #[test]
    fn e6_other_spellings_of_a_route_become_the_route() {
        for (path, want) in [
            ("//chats", "/chats"),
            ("/chats//", "/chats/"),
            ("///oauth//register", "/oauth/register"),
            ("/%63hats", "/chats"),
            ("/oauth/%72egister", "/oauth/register"),
            ("/%6F%61%75%74%68/register", "/oauth/register"),
            ("/x/../chats", "/chats"),
            ("/./chats", "/chats"),
            ("/x/%2e%2E/chats", "/chats"),
            ("/a/b/..", "/a/"),
            ("/a/b/.", "/a/b/"),
            ("/a/..", "/"),
            ("/.", "/"),
            ("/a/./b/../../c", "/c"),
            ("/a/%7e%2d%5F", "/a/~-_"),
        ] {
            assert_eq!(normal(MERGE, path), want, "{path}");
        }
    }

    #[test]
    fn reserved_and_non_ascii_encodings_stay_encoded_in_upper_case() {
        assert_eq!(normal(MERGE, "/a%2fb"), "/a%2Fb");
        assert_eq!(normal(MERGE, "/a%2F..%2Fb"), "/a%2F..%2Fb");
        assert_eq!(normal(MERGE, "/caf%c3%a9"), "/caf%C3%A9");
        assert_eq!(normal(MERGE, "/%3a%40%25"), "/%3A%40%25");
        assert_eq!(normal(MERGE, "/caf\u{e9}/%41"), "/caf\u{e9}/A");
    }

    #[test]
    fn empty_segments_stay_when_slashes_are_not_merged() {
        assert_eq!(normal(KEEP, "//chats"), "//chats");
        assert_eq!(
            normal(KEEP, "/a//../b"),
            "/a/b",
            "RFC 3986: `..` drops the empty segment"
        );
        assert_eq!(normal(KEEP, "/a//./"), "/a//");
        assert_eq!(normal(KEEP, "/a/%62//c"), "/a/b//c");
    }

    #[test]
    fn a_path_above_the_root_or_badly_encoded_has_no_normal_form() {
        for path in [
            "/..",
            "/../etc",
            "/a/../../x",
            "/%2e%2e/x",
            "//../x",
            "/./../x",
        ] {
            assert_eq!(MERGE.normalize(path), Err(PathError::AboveRoot), "{path}");
        }
        for path in ["/%", "/%4", "/%zz", "/a%g0", "/%%41"] {
            assert_eq!(
                MERGE.normalize(path),
                Err(PathError::BadPercentEncoding),
                "{path}"
            );
        }
    }

    #[test]
    fn e7_a_raw_backslash_has_no_normal_form() {
        for path in [
            "/oauth\\register",
            "/\\oauth/register",
            "/a/%41\\b",
            "/a\\..\\b",
        ] {
            for paths in [MERGE, KEEP] {
                assert_eq!(paths.normalize(path), Err(PathError::Backslash), "{path}");
            }
        }
        assert_eq!(
            normal(MERGE, "/a%5Cb"),
            "/a%5Cb",
            "an encoded one stays encoded"
        );
    }

    #[test]
    fn path_parameters_are_dropped_per_segment() {
        assert!(matches!(
            without_parameters("/chats"),
            Cow::Borrowed("/chats")
        ));
        for (path, bare) in [
            ("/chats;x=1", "/chats"),
            ("/oauth;x/register;y=2", "/oauth/register"),
            ("/a;b;c/;d/e", "/a//e"),
            ("/;", "/"),
        ] {
            assert_eq!(without_parameters(path), bare, "{path}");
        }
    }

    /// Paths made of the pieces that need normalising.
    fn path_strategy() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            Just("/".to_owned()),
            Just(".".to_owned()),
            Just("..".to_owned()),
            Just("%2e".to_owned()),
            Just("%2F".to_owned()),
            Just("%41".to_owned()),
            Just("%c3%a9".to_owned()),
            Just("~".to_owned()),
            "[a-z]{1,3}",
        ];
        proptest::collection::vec(piece, 0..12).prop_map(|p| format!("/{}", p.concat()))
    }

    proptest! {
        #[test]
        fn normalizing_is_idempotent_and_leaves_no_dot_or_empty_segment(
            path in path_strategy(),
            merge in any::<bool>(),
        ) {
            let paths = Paths {
                merge_slashes: merge,
                case: PathCase::Insensitive,
            };
            if let Ok(once) = paths.normalize(&path) {
                let twice = paths.normalize(&once);
                prop_assert_eq!(twice.as_deref(), Ok(once.as_ref()));
                prop_assert!(once.starts_with('/'));
                prop_assert!(!merge || !once.contains("//"), "{}", once);
                let inner = once.trim_end_matches('/');
                for segment in inner.split('/').skip(1) {
                    prop_assert!(segment != "." && segment != "..", "{}", once);
                }
                // Every `%` left encodes a reserved or non-ASCII byte, in upper case.
                for (at, _) in once.match_indices('%') {
                    let hex = &once[at + 1..at + 3];
                    prop_assert!(hex.bytes().all(|b| b.is_ascii_digit() || b.is_ascii_uppercase()), "{}", once);
                    let byte = u8::from_str_radix(hex, 16);
                    prop_assert!(byte.is_ok_and(|b| !is_unreserved(b)), "{}", once);
                }
            }
        }
    }
}
