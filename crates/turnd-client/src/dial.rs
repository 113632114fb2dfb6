//! Connecting to the first of several URLs that answers: a cluster's nodes each
//! answer any caller request, so a caller is given all of them and uses whichever is
//! up.
//!
//! The URLs are tried in order from a starting point (wrapping round), each once and
//! each for at most [`OPEN_TIMEOUT`], so one node that takes connections but never
//! answers does not hold the others up. A refusal that every node would repeat (a
//! token not accepted, an unsupported protocol: any error that is not retryable)
//! ends the round at once; a URL that cannot be reached, or a node that is shutting
//! down, moves on to the next. The error of a failed round names every URL tried.

use std::time::Duration;

use tracing::debug;
use turnd_proto::{HelloArgs, HelloOk};

use crate::connection::Connection;
use crate::error::ClientError;

/// Longest wait for one URL's connection and `hello` answer before the next URL is
/// tried.
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a caller (re)connects: its URLs, in the order tried, and its `hello`.
#[derive(Clone)]
pub(crate) struct Dial {
    pub urls: Vec<String>,
    pub hello: HelloArgs,
}

impl std::fmt::Debug for Dial {
    /// The URLs only: the `hello` holds the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dial")
            .field("urls", &self.urls)
            .finish_non_exhaustive()
    }
}

/// A greeted connection and the index of its URL in [`Dial::urls`].
pub(crate) struct Opened {
    pub conn: Connection,
    pub at: usize,
}

impl Dial {
    /// A dial of `urls`; [`ClientError::Connect`] when there is none.
    pub fn new(urls: Vec<String>, hello: HelloArgs) -> Result<Dial, ClientError> {
        if urls.is_empty() {
            return Err(ClientError::Connect("no URL to connect to".to_string()));
        }
        Ok(Dial { urls, hello })
    }

    /// Connect to the first URL that answers, trying them in order from index
    /// `start` (wrapping round), each once.
    pub async fn open_from(&self, start: usize) -> Result<Opened, ClientError> {
        let n = self.urls.len();
        let mut failed: Vec<(&str, ClientError)> = Vec::new();
        let round = self.urls.iter().enumerate().cycle().skip(start % n.max(1));
        for (at, url) in round.take(n) {
            match open_one(url, self.hello.clone()).await {
                Ok((conn, _hello)) => return Ok(Opened { conn, at }),
                Err(e) if !e.is_retryable() => return Err(e),
                Err(e) => {
                    debug!(%url, error = %e, "cannot connect; trying the next URL");
                    failed.push((url, e));
                }
            }
        }
        Err(none_answered(failed))
    }
}

/// The error of a round in which no URL answered: the one URL's own error, or one
/// naming every URL and why it failed.
fn none_answered(mut failed: Vec<(&str, ClientError)>) -> ClientError {
    if failed.len() == 1 {
        if let Some((_, e)) = failed.pop() {
            return e;
        }
    }
    let each: Vec<String> = failed
        .into_iter()
        .map(|(url, e)| match e {
            // The connection error names its URL already.
            ClientError::Connect(msg) if msg.starts_with(url) => msg,
            ClientError::Closed => {
                format!("{url}: the connection closed before `hello` was answered")
            }
            e => format!("{url}: {e}"),
        })
        .collect();
    ClientError::Connect(format!("no URL answered: {}", each.join("; ")))
}

/// Connect to `url` and say `hello`, within [`OPEN_TIMEOUT`].
async fn open_one(url: &str, hello: HelloArgs) -> Result<(Connection, HelloOk), ClientError> {
    match tokio::time::timeout(OPEN_TIMEOUT, Connection::connect(url, hello)).await {
        Ok(r) => r,
        Err(_) => Err(ClientError::Connect(format!(
            "{url}: no answer within {}s",
            OPEN_TIMEOUT.as_secs()
        ))),
    }
}

/// A comma-separated list of URLs (as the CLI's `--url` and `TURND_URL` take them),
/// each trimmed of surrounding whitespace ([`turnd_proto::url_list::parse`]). An
/// empty entry (`a,,b`, a trailing comma) or an empty list is an error saying so.
pub fn parse_url_list(s: &str) -> Result<Vec<String>, String> {
    turnd_proto::url_list::parse(s).map_err(|e| {
        if s.trim().is_empty() {
            "no URL given: expected ws://HOST:PORT/v1, or several separated by commas".to_string()
        } else {
            e
        }
    })
}
