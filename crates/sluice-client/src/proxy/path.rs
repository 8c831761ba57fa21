//! Which request paths the proxy forwards: none that could leave the base
//! path of the provider it names. The proxy appends the path to a provider's
//! `baseUrl`, and a URL parser (or the provider's server) resolves dot
//! segments, so `/openai/../other/x` would reach `other/x` on the openai
//! host with the openai key. No SDK sends such paths: they are refused, in
//! every spelling, before the provider is chosen.

/// How many rounds of percent-decoding a segment is looked at through (a
/// server that decodes twice turns `%252e` into `.`).
const DECODE_ROUNDS: usize = 3;

/// Why `path` (the request target's path, still percent-encoded) is not
/// forwarded, or `None` when it may be.
///
/// Refused: a backslash; a segment that, percent-decoded (up to
/// [`DECODE_ROUNDS`] times), holds a slash, a backslash (or their full-width
/// forms), a control character or bytes that are not UTF-8 (the over-long
/// spellings of `.`); a segment made of dots alone (`.`, `..`, `...`, also
/// `%2e`, `%2E`, full-width dots, and with `;params` or spaces after them:
/// `..;x`, `.. `).
pub(crate) fn refusal(path: &str) -> Option<&'static str> {
    if path.contains('\\') {
        return Some("a backslash");
    }
    path.split('/').find_map(segment_refusal)
}

fn segment_refusal(raw: &str) -> Option<&'static str> {
    let bytes = decoded(raw.as_bytes());
    if bytes.iter().any(|&b| b == b'/' || b == b'\\') {
        return Some("an encoded slash or backslash");
    }
    if bytes.iter().any(|&b| b < 0x20 || b == 0x7f) {
        return Some("a control character");
    }
    let Ok(text) = std::str::from_utf8(&bytes) else {
        return Some("bytes that are not UTF-8 once decoded");
    };
    if text.chars().any(is_slash_like) {
        return Some("a slash look-alike");
    }
    // `..;jsessionid=1` is `..` to servlet containers.
    let before_params = text.split(';').next().unwrap_or_default();
    let core = before_params.trim_matches(|c: char| c.is_whitespace());
    if !core.is_empty() && core.chars().all(is_dot_like) {
        return Some("a `.` or `..` segment");
    }
    None
}

/// `raw` percent-decoded until nothing changes, at most [`DECODE_ROUNDS`]
/// times (a `%` not followed by two hex digits stays as it is).
fn decoded(raw: &[u8]) -> Vec<u8> {
    let mut bytes = raw.to_vec();
    for _ in 0..DECODE_ROUNDS {
        let next = decode_once(&bytes);
        if next == bytes {
            break;
        }
        bytes = next;
    }
    bytes
}

fn decode_once(bytes: &[u8]) -> Vec<u8> {
    let hex = |b: u8| char::from(b).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let (Some(&h), Some(&l)) = (bytes.get(i + 1), bytes.get(i + 2))
            && let (Some(h), Some(l)) = (hex(h), hex(l))
        {
            // Two hex digits: at most 0xff.
            out.push(u8::try_from(h * 16 + l).unwrap_or(u8::MAX));
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    out
}

/// `.` and what Unicode compatibility normalisation turns into dots.
fn is_dot_like(c: char) -> bool {
    matches!(
        c,
        '.' | '\u{FF0E}' | '\u{FE52}' | '\u{2024}' | '\u{2025}' | '\u{2026}'
    )
}

/// What Unicode compatibility normalisation turns into `/` or `\`.
fn is_slash_like(c: char) -> bool {
    matches!(c, '\u{FF0F}' | '\u{FF3C}' | '\u{FE68}')
}

#[cfg(test)]
mod tests {
    use super::refusal;

    #[test]
    fn s4_no_spelling_of_a_dot_segment_or_an_encoded_slash_passes() {
        for path in [
            "/openai/../anthropic/v1/echo",
            "/openai/./v1",
            "/openai/v1/..",
            "/openai/v1/.",
            "/../openai/v1",
            "/openai/%2e%2e/anthropic",
            "/openai/%2E%2E/anthropic",
            "/openai/.%2e/anthropic",
            "/openai/%2e./anthropic",
            "/openai/%2E/v1",
            "/openai/%252e%252e/anthropic",
            "/openai/%25252e%25252e/anthropic",
            "/openai/..;/anthropic",
            "/openai/..;jsessionid=1/anthropic",
            "/openai/%2e%2e%3b/anthropic",
            "/openai/..%20/anthropic",
            "/openai/.../anthropic",
            "/openai//../anthropic",
            "/openai/v1%2f..%2fanthropic",
            "/openai/v1%2F..%2Fanthropic",
            "/openai/v1%5c..%5canthropic",
            "/openai/v1%5C..%5Canthropic",
            "/openai/v1%252f..",
            "/openai/..\\anthropic",
            "/openai/v1\\x",
            "/openai/%c0%ae%c0%ae/anthropic",
            "/openai/%e0%80%ae%e0%80%ae/anthropic",
            "/openai/%ef%bc%8e%ef%bc%8e/anthropic",
            "/openai/%e2%80%a5/anthropic",
            "/openai/v1%ef%bc%8fx",
            "/openai/v1%00/x",
            "/openai/v1%0d%0ax",
        ] {
            assert!(refusal(path).is_some(), "{path} passed");
        }
    }

    #[test]
    fn s4_an_sdks_paths_pass() {
        for path in [
            "/openai/v1/chat/completions",
            "/openai/chat/completions",
            "/anthropic/v1/messages",
            "/openai/v1/files/file-abc.jsonl/content",
            "/openai/v1/.well-known/x",
            "/openai/v1/a..b",
            "/openai/v1/..a",
            "/openai/v1/models/gpt-4o;v=1",
            "/openai/v1/models/ft%3Agpt-4o%3Aorg",
            "/openai/v1/100%",
            "/openai/v1/%zz",
            "/openai//v1/chat/completions",
            "/openai",
            "/",
            "",
        ] {
            assert_eq!(refusal(path), None, "{path}");
        }
    }
}
