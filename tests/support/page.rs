//! The operator page's HTTP, as the tests speak it: one request per connection
//! (`Connection: close`) read whole, answers' headers, and server-sent event streams
//! read an event at a time.

use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

/// An event stream's lines.
pub type Lines = tokio::io::Lines<BufReader<tokio::net::TcpStream>>;

/// An answer of the admin listener.
pub struct Reply {
    pub status: u16,
    pub head: String,
    pub body: String,
}

/// One HTTP/1.1 request to the admin listener (`Connection: close`).
pub async fn http(
    admin: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> anyhow::Result<Reply> {
    let addr = admin.trim_start_matches("http://");
    let s = tokio::net::TcpStream::connect(addr).await?;
    exchange(s, addr, &format!("{method} {path}"), headers, body).await
}

/// Send one request (`METHOD PATH`) on `s`, to `addr`, and read the whole answer.
pub async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    addr: &str,
    line: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> anyhow::Result<Reply> {
    let mut req = format!("{line} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .context("no complete answer within 10s")?;
    // A TLS peer may close without close_notify once the answer is whole.
    if let Err(e) = read {
        if e.kind() != std::io::ErrorKind::UnexpectedEof {
            return Err(e.into());
        }
    }
    let text = String::from_utf8_lossy(&buf).to_string();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .map(|(h, b)| (h.to_string(), b.to_string()))
        .unwrap_or((text.clone(), String::new()));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no status line in {head:?}"))?;
    Ok(Reply { status, head, body })
}

/// `GET path`.
pub async fn get(admin: &str, path: &str) -> anyhow::Result<Reply> {
    http(admin, "GET", path, &[], "").await
}

/// A header of an answer, by name (any case).
pub fn header<'a>(r: &'a Reply, name: &str) -> Option<&'a str> {
    r.head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then_some(v.trim())
    })
}

/// An open server-sent event stream of the admin listener, from `local` (an address
/// of the loopback range to connect from).
pub async fn open_feed(admin: &str, path: &str, local: &str) -> anyhow::Result<(u16, Lines)> {
    let addr: std::net::SocketAddr = admin.trim_start_matches("http://").parse()?;
    let sock = tokio::net::TcpSocket::new_v4()?;
    sock.bind(format!("{local}:0").parse()?)?;
    let mut s = sock.connect(addr).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await?;
    let mut lines = BufReader::new(s).lines();
    let status = lines.next_line().await?.unwrap_or_default();
    let code = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no status line: {status:?}"))?;
    Ok((code, lines))
}

/// The next SSE event of a stream: its name (`message` when none) and data.
pub async fn next_sse(lines: &mut Lines) -> anyhow::Result<(String, String)> {
    let (mut name, mut data) = (String::from("message"), Vec::new());
    loop {
        let line = lines.next_line().await?.context("stream ended")?;
        if let Some(n) = line.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            data.push(d.to_string());
        } else if line.is_empty() && !data.is_empty() {
            return Ok((name, data.join("\n")));
        }
    }
}
