//! Who may use the operator page, checked before any screen runs: the `Host` a request
//! names (against DNS rebinding), the origin of every write (against cross-site
//! requests), and, with `[auth]` tokens, an operator token or a sign-in session.
//!
//! Signing in trades an operator token for a session: a random id from the operating
//! system's CSPRNG, kept in memory with its expiry, sent back as an `HttpOnly`,
//! `SameSite=Strict` cookie (`Secure` under TLS); the token itself never goes into a
//! cookie. Failed sign-ins are counted per client address in a bounded table, and an
//! address over the limit is refused until its minute is over.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Form;
use maud::html;
use ring::rand::{SecureRandom, SystemRandom};
use turnd_proto::Role;

use super::render::{page, redirect};
use super::Ui;
use crate::admin::state::ClientAddr;

pub const COOKIE: &str = "turnd_ui";
/// Sign-in sessions held at once; the one closest to its end makes room for a new one.
const MAX_SESSIONS: usize = 1_024;
/// Client addresses whose failed sign-ins are counted one by one; past this, the
/// addresses not in the table share one count.
const MAX_TRACKED: usize = 4_096;
const WINDOW: Duration = Duration::from_secs(60);

/// Sign-in sessions and failed sign-ins.
pub struct Logins {
    sessions: Mutex<HashMap<String, Instant>>,
    failures: Mutex<Failures>,
    rng: SystemRandom,
}

#[derive(Default)]
struct Failures {
    by_client: HashMap<IpAddr, (Instant, u64)>,
    /// The count shared by addresses the table has no room for.
    overflow: Option<(Instant, u64)>,
}

impl Failures {
    /// The count of `ip`'s current minute (a new one when the last is over).
    fn slot(&mut self, ip: IpAddr, now: Instant) -> &mut (Instant, u64) {
        if !self.by_client.contains_key(&ip) && self.by_client.len() >= MAX_TRACKED {
            self.by_client
                .retain(|_, (start, _)| now.duration_since(*start) < WINDOW);
        }
        let slot = if self.by_client.contains_key(&ip) || self.by_client.len() < MAX_TRACKED {
            self.by_client.entry(ip).or_insert((now, 0))
        } else {
            self.overflow.get_or_insert((now, 0))
        };
        if now.duration_since(slot.0) >= WINDOW {
            *slot = (now, 0);
        }
        slot
    }

    /// How long `ip` must wait before it may try again, when it is over `limit`.
    fn wait(&mut self, ip: IpAddr, limit: u64, now: Instant) -> Option<Duration> {
        let (start, n) = *self.slot(ip, now);
        (n >= limit).then(|| WINDOW.saturating_sub(now.duration_since(start)))
    }

    fn failed(&mut self, ip: IpAddr, now: Instant) {
        self.slot(ip, now).1 += 1;
    }
}

impl Logins {
    pub fn new() -> Logins {
        Logins {
            sessions: Mutex::new(HashMap::new()),
            failures: Mutex::new(Failures::default()),
            rng: SystemRandom::new(),
        }
    }

    /// A new session lasting `ttl`, or `None` when the CSPRNG fails.
    fn open(&self, ttl: Duration) -> Option<String> {
        let mut bytes = [0u8; 32];
        self.rng.fill(&mut bytes).ok()?;
        let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let now = Instant::now();
        let mut s = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        if s.len() >= MAX_SESSIONS {
            s.retain(|_, end| *end > now);
        }
        if s.len() >= MAX_SESSIONS {
            let first = s
                .iter()
                .min_by_key(|(_, end)| **end)
                .map(|(k, _)| k.clone());
            if let Some(k) = first {
                s.remove(&k);
            }
        }
        s.insert(id.clone(), now + ttl);
        Some(id)
    }

    fn valid(&self, id: &str) -> bool {
        let mut s = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        match s.get(id) {
            Some(end) if *end > Instant::now() => true,
            Some(_) => {
                s.remove(id);
                false
            }
            None => false,
        }
    }

    fn close(&self, id: &str) {
        let mut s = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        s.remove(id);
    }
}

// ------------------------------------------------------------------ checks

/// The name of a `Host` header value, without its port and brackets.
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// Whether the page answers to `host`: an IP address (a browser sends one only to that
/// address, so no other site's name can lead to it), `localhost` and names under it,
/// and the configured names.
pub fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let name = host_name(host).trim_end_matches('.').to_ascii_lowercase();
    if name.parse::<IpAddr>().is_ok() || name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    allowed.iter().any(|a| {
        let a = a.to_ascii_lowercase();
        match a.strip_prefix('.') {
            Some(domain) => name == domain || name.ends_with(&a),
            None => name == a,
        }
    })
}

/// Whether a write comes from the page itself: the browser says the request is
/// same-origin (`Sec-Fetch-Site`), or its `Origin` names the host it was sent to. A
/// request with neither header is not from a browser and passes.
fn same_origin(headers: &HeaderMap) -> Result<(), String> {
    let get = |h: &str| headers.get(h).and_then(|v| v.to_str().ok());
    if let Some(site) = get("sec-fetch-site") {
        return match site {
            "same-origin" | "none" => Ok(()),
            other => Err(format!("a {other} request may not change anything here")),
        };
    }
    let Some(origin) = get("origin") else {
        return Ok(());
    };
    let host = get("host").unwrap_or("");
    let authority = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"));
    match authority {
        Some(a) if a.eq_ignore_ascii_case(host) => Ok(()),
        _ => Err(format!(
            "the request comes from {origin:?}, not from this page ({host:?})"
        )),
    }
}

fn refusal(status: StatusCode, message: &str) -> Response {
    let mut r = (status, format!("{message}\n")).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Every request to the page: the `Host` check, the origin of a write, then the
/// operator token or session (sign-in and the page's assets excepted).
pub async fn guard(State(ui): State<Arc<Ui>>, req: Request, next: Next) -> Response {
    let headers = req.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !host_allowed(host, &ui.shared.config.admin.allowed_hosts) {
        return refusal(
            StatusCode::FORBIDDEN,
            &format!(
                "this admin listener does not answer to the host {host:?}: add it to admin.allowed_hosts"
            ),
        );
    }
    if !matches!(*req.method(), Method::GET | Method::HEAD) {
        if let Err(why) = same_origin(headers) {
            return refusal(StatusCode::FORBIDDEN, &format!("refused: {why}"));
        }
    }
    let path = req.uri().path();
    let open = path == "/" || path == "/ui/login" || path.starts_with("/ui/assets/");
    if !open && !authorized(&ui, headers) {
        return login_page(&ui, StatusCode::UNAUTHORIZED, None);
    }
    next.run(req).await
}

// ------------------------------------------------------------------ sign-in

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

fn session_cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='))
}

/// Whether the request carries an operator token or a live session (always, with no
/// tokens configured).
fn authorized(ui: &Ui, headers: &HeaderMap) -> bool {
    if !ui.has_tokens() {
        return true;
    }
    bearer(headers).is_some_and(|t| operator_token(ui, t))
        || session_cookie(headers).is_some_and(|id| ui.logins.valid(id))
}

fn operator_token(ui: &Ui, given: &str) -> bool {
    let mut ok = false;
    for t in &ui.shared.config.auth.tokens {
        // Compare against every token in constant time, whatever matches first.
        let eq = constant_time_eq::constant_time_eq(t.token.as_bytes(), given.as_bytes());
        ok |= eq && t.role == Role::Operator;
    }
    ok
}

pub fn login_page(ui: &Ui, status: StatusCode, message: Option<&str>) -> Response {
    let mut r = page(
        ui,
        "Sign in",
        html! {
            h1 { "Sign in" }
            p { "This daemon has tokens configured: the page needs an operator token." }
            @if let Some(m) = message { p.bad #login-error { (m) } }
            form method="post" action="/ui/login" {
                label { "Operator token " input type="password" name="token" autocomplete="current-password"; }
                " " button type="submit" { "Sign in" }
            }
        },
    );
    *r.status_mut() = status;
    r
}

pub async fn login_form(State(ui): State<Arc<Ui>>, headers: HeaderMap) -> Response {
    if authorized(&ui, &headers) {
        return redirect("/ui");
    }
    login_page(&ui, StatusCode::OK, None)
}

/// Whether the browser reached the page over TLS: the listener's own, or a reverse
/// proxy's that says so.
fn over_tls(ui: &Ui, headers: &HeaderMap) -> bool {
    ui.shared.config.server.tls_cert.is_some()
        || headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|p| p.eq_ignore_ascii_case("https"))
}

fn with_cookie(mut r: Response, cookie: &str) -> Response {
    match HeaderValue::from_str(cookie) {
        Ok(v) => {
            r.headers_mut().insert(header::SET_COOKIE, v);
            r
        }
        Err(_) => refusal(StatusCode::INTERNAL_SERVER_ERROR, "cannot set the cookie"),
    }
}

pub async fn login(
    State(ui): State<Arc<Ui>>,
    ConnectInfo(ClientAddr(peer)): ConnectInfo<ClientAddr>,
    headers: HeaderMap,
    Form(f): Form<HashMap<String, String>>,
) -> Response {
    if !ui.has_tokens() {
        return redirect("/ui");
    }
    let cfg = &ui.shared.config.admin;
    let now = Instant::now();
    let wait = {
        let mut fails = ui
            .logins
            .failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        fails.wait(peer.ip(), cfg.login_failures_per_minute, now)
    };
    if let Some(wait) = wait {
        let secs = wait.as_secs().max(1);
        let mut r = login_page(
            &ui,
            StatusCode::TOO_MANY_REQUESTS,
            Some(&format!(
                "Too many failed sign-ins from this address: try again in {secs} s."
            )),
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        return r;
    }
    let token = f.get("token").map(String::as_str).unwrap_or("");
    if !operator_token(&ui, token) {
        let mut fails = ui
            .logins
            .failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        fails.failed(peer.ip(), now);
        return login_page(
            &ui,
            StatusCode::UNAUTHORIZED,
            Some("That is not an operator token."),
        );
    }
    let ttl = Duration::from_millis(cfg.session_ms);
    let Some(id) = ui.logins.open(ttl) else {
        return refusal(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the system's random number generator failed",
        );
    };
    let secure = if over_tls(&ui, &headers) {
        "; Secure"
    } else {
        ""
    };
    let cookie = format!(
        "{COOKIE}={id}; Path=/ui; Max-Age={}; HttpOnly; SameSite=Strict{secure}",
        ttl.as_secs().max(1)
    );
    with_cookie(redirect("/ui"), &cookie)
}

pub async fn logout(State(ui): State<Arc<Ui>>, headers: HeaderMap) -> Response {
    if let Some(id) = session_cookie(&headers) {
        ui.logins.close(id);
    }
    let secure = if over_tls(&ui, &headers) {
        "; Secure"
    } else {
        ""
    };
    let cookie = format!("{COOKIE}=; Path=/ui; Max-Age=0; HttpOnly; SameSite=Strict{secure}");
    with_cookie(redirect("/ui/login"), &cookie)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_loopback_names_addresses_or_listed() {
        let none: Vec<String> = Vec::new();
        for ok in [
            "localhost",
            "localhost:7421",
            "app.localhost:1",
            "127.0.0.1:7421",
            "10.1.2.3",
            "[::1]:7421",
            "[fe80::1]",
        ] {
            assert!(host_allowed(ok, &none), "{ok}");
        }
        for bad in [
            "attacker.example",
            "attacker.example:7421",
            "",
            "localhost.evil.example",
        ] {
            assert!(!host_allowed(bad, &none), "{bad}");
        }
        let listed = vec!["turnd.internal".to_string(), ".ops.example".to_string()];
        assert!(host_allowed("TURND.internal:443", &listed));
        assert!(host_allowed("a.ops.example", &listed));
        assert!(host_allowed("ops.example", &listed));
        assert!(!host_allowed("xops.example", &listed));
        assert!(!host_allowed("turnd.internal.evil", &listed));
    }

    #[test]
    fn failed_sign_ins_are_counted_per_address_in_bounded_memory() {
        let mut f = Failures::default();
        let t0 = Instant::now();
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        for _ in 0..3 {
            assert!(f.wait(a, 3, t0).is_none());
            f.failed(a, t0);
        }
        assert!(f.wait(a, 3, t0).is_some(), "over the limit");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        assert!(
            f.wait(b, 3, t0).is_none(),
            "another address has its own count"
        );
        assert!(f.wait(a, 3, t0 + WINDOW).is_none(), "a new minute");
        for i in 0..(MAX_TRACKED as u32 + 100) {
            f.failed(IpAddr::from(i.to_be_bytes()), t0 + WINDOW);
        }
        assert!(f.by_client.len() <= MAX_TRACKED);
        assert!(f.overflow.is_some_and(|(_, n)| n >= 100));
    }
}
