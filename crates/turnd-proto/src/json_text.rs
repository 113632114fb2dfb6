//! Scans of JSON text that do not parse it: how deep it nests, whether it is
//! compact. The daemon runs them over every frame it reads and every payload it
//! keeps, and a payload is mostly the text of its strings (an agent's chat
//! messages), so a scan skips a string's content to its next quote or backslash
//! with [`memchr::memchr2`] rather than byte by byte.

/// The index just past the closing quote of the string whose content starts at
/// `from` (just past its opening quote), escapes skipped; the text's length when
/// the string is not closed.
fn string_end(text: &[u8], mut from: usize) -> usize {
    while let Some(at) = text
        .get(from..)
        .and_then(|rest| memchr::memchr2(b'"', b'\\', rest))
    {
        let i = from + at;
        if text[i] == b'"' {
            return i + 1;
        }
        // A backslash: the next byte is escaped, whatever it is.
        from = i + 2;
    }
    text.len()
}

/// Hand `f` every byte of `text` outside its strings (quotes included) while it
/// returns true; whether it did to the end.
fn outside_strings(text: &str, mut f: impl FnMut(u8) -> bool) -> bool {
    let b = text.as_bytes();
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        if c == b'"' {
            i = string_end(b, i + 1);
            continue;
        }
        if !f(c) {
            return false;
        }
        i += 1;
    }
    true
}

/// Whether `text` nests deeper than `max` arrays and objects (counted without
/// parsing, so that a hostile frame cannot make a parser recurse). Brackets inside
/// strings do not count.
pub fn nests_deeper_than(text: &str, max: u64) -> bool {
    let mut depth = 0u64;
    !outside_strings(text, |c| match c {
        b'{' | b'[' => {
            depth += 1;
            depth <= max
        }
        b'}' | b']' => {
            depth = depth.saturating_sub(1);
            true
        }
        _ => true,
    })
}

/// Whether `text` has no whitespace outside its strings: what every SDK sends, and
/// the form the daemon keeps a payload in.
pub fn is_compact(text: &str) -> bool {
    outside_strings(text, |c| !matches!(c, b' ' | b'\n' | b'\r' | b'\t'))
}

#[cfg(test)]
mod tests {
    use super::{is_compact, nests_deeper_than};

    /// The scans as a byte-by-byte state machine: what the fast ones must agree with.
    fn reference(text: &str, max: u64) -> (bool, bool) {
        let (mut depth, mut deeper, mut compact) = (0u64, false, true);
        let (mut in_str, mut escaped) = (false, false);
        for b in text.bytes() {
            if in_str {
                match b {
                    _ if escaped => escaped = false,
                    b'\\' => escaped = true,
                    b'"' => in_str = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => in_str = true,
                b'{' | b'[' => {
                    depth += 1;
                    deeper |= depth > max;
                }
                b'}' | b']' => depth = depth.saturating_sub(1),
                b' ' | b'\n' | b'\r' | b'\t' => compact = false,
                _ => {}
            }
        }
        (deeper, compact)
    }

    #[test]
    fn depth_is_counted_outside_strings() {
        assert!(!nests_deeper_than(r#"{"a":[1,{"b":2}]}"#, 3));
        assert!(nests_deeper_than(r#"{"a":[1,{"b":[2]}]}"#, 3));
        assert!(!nests_deeper_than(r#"{"a":"[[[[[[[[[[\"[[[["}"#, 2));
        assert!(nests_deeper_than(&"[".repeat(100), 64));
    }

    /// Every text of up to 7 bytes over the bytes the scans look at (and one they
    /// do not), and longer texts with long strings, escapes and unclosed strings,
    /// give the same answers as the byte-by-byte scan, for every depth limit.
    #[test]
    fn the_scans_agree_with_a_byte_by_byte_scan() {
        const ALPHABET: &[u8] = b"\"\\[]{} a";
        let mut texts: Vec<String> = Vec::new();
        let mut current: Vec<Vec<u8>> = vec![Vec::new()];
        for _ in 0..7 {
            let mut next = Vec::new();
            for t in &current {
                for &c in ALPHABET {
                    let mut u = t.clone();
                    u.push(c);
                    next.push(u);
                }
            }
            texts.extend(
                current
                    .iter()
                    .map(|t| String::from_utf8(t.clone()).expect("ASCII")),
            );
            current = next;
        }
        texts.extend(
            current
                .into_iter()
                .map(|t| String::from_utf8(t).expect("ASCII")),
        );
        let long = "the quick brown fox [jumps] {over} the lazy dog ".repeat(40);
        texts.push(format!(
            r#"{{"messages":[{{"role":"user","content":"{long}"}}]}}"#
        ));
        texts.push(format!(r#"[[[["{long}\"]]]]\\", [[ ]]]]"#));
        texts.push(format!(r#"{{"a":"{long}"#));
        texts.push(format!(r#"{{"a":"{long}\"#));
        for t in &texts {
            for max in 0..5 {
                let (deeper, compact) = reference(t, max);
                assert_eq!(nests_deeper_than(t, max), deeper, "depth {max} of {t:?}");
                assert_eq!(is_compact(t), compact, "{t:?}");
            }
        }
        assert!(texts.len() > 2_000_000, "{} texts", texts.len());
    }
}
