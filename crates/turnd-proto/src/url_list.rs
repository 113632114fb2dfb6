//! A list of URLs written as one setting, separated by commas: the daemon URLs of a
//! cluster's nodes (the CLI's `--url`, `TURND_URL`) and the NATS system account's
//! servers (`cluster.nats_system`). One parser, so that both refuse the same typos.

/// The URLs of `s`, each trimmed of surrounding whitespace. An empty entry (`a,,b`,
/// a trailing comma) or an empty list is an error saying so.
pub fn parse(s: &str) -> Result<Vec<String>, String> {
    if s.trim().is_empty() {
        return Err("no URL given: write one URL, or several separated by commas".to_string());
    }
    let urls: Vec<String> = s.split(',').map(|u| u.trim().to_string()).collect();
    if let Some(i) = urls.iter().position(String::is_empty) {
        return Err(format!(
            "URL {} of {} in {s:?} is empty: separate URLs with single commas, \
             without a trailing one",
            i + 1,
            urls.len()
        ));
    }
    Ok(urls)
}
