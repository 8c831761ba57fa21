//! The side-by-side snippets of `docs/` (compiled and run as doc tests of
//! sluice-store, sluice-tower and sluice-client): for each job, sluice's side
//! takes no more lines than its peer's.

use std::path::Path;

/// The visible lines of the code block after each `<!-- marker -->`: what a
/// reader copies (no blank lines, no `# ` lines rustdoc hides).
fn blocks(text: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let Some(marker) = line
            .strip_prefix("<!-- ")
            .and_then(|l| l.strip_suffix(" -->"))
        else {
            continue;
        };
        let mut count = 0;
        let mut inside = false;
        for l in lines.by_ref() {
            if l.starts_with("```") {
                if inside {
                    break;
                }
                inside = true;
                continue;
            }
            let t = l.trim();
            if inside && !t.is_empty() && t != "#" && !t.starts_with("# ") {
                count += 1;
            }
        }
        out.push((marker.to_owned(), count));
    }
    out
}

#[test]
fn each_sluice_snippet_is_no_longer_than_its_peer() {
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs");
    let mut pairs = 0;
    for name in [
        "vs-governor.md",
        "vs-tower-governor.md",
        "vs-reqwest-retry.md",
    ] {
        let text = std::fs::read_to_string(docs.join(name)).expect("docs file");
        let b = blocks(&text);
        assert_eq!(b.len(), 2, "{name}: one peer and one sluice block");
        let (peer, sluice) = (&b[0], &b[1]);
        assert!(
            peer.0.starts_with("peer: ") && sluice.0 == "sluice",
            "{name}: {b:?}"
        );
        assert!(
            sluice.1 <= peer.1,
            "{name}: sluice takes {} lines, {} takes {}",
            sluice.1,
            peer.0,
            peer.1
        );
        pairs += 1;
    }
    assert_eq!(pairs, 3);
}
