//! `hello`: the first request of a connection, run by the reader in line. It checks
//! the protocol version and the token against the role asked for, attaches a worker
//! (or an operator that names a `worker_id`) to the engine, and settles who the
//! connection is ([`Caller`]) for every request after it.

use turnd_engine::Caller;
use turnd_proto::{ErrorBody, ErrorCode, HelloArgs, HelloOk, Role, PROTOCOL_VERSION};

use super::Conn;
use crate::router::{self, Reply};

impl Conn {
    /// Whether `token` is accepted for `role`: a token of that role or an operator
    /// token; with no tokens configured, any.
    fn token_ok(&self, role: Role, token: Option<&str>) -> bool {
        let tokens = &self.shared.config.auth.tokens;
        if tokens.is_empty() {
            return true;
        }
        let given = token.unwrap_or("").as_bytes();
        let mut ok = false;
        for t in tokens {
            // Compare against every token in constant time, whatever matches first.
            let eq = constant_time_eq::constant_time_eq(t.token.as_bytes(), given);
            ok |= eq && (t.role == role || t.role == Role::Operator);
        }
        ok
    }

    /// Run a `hello` and answer it.
    pub(super) async fn hello(&self, args: &str) -> Result<Reply, ErrorBody> {
        if self.auth.get().is_some() {
            return Err(ErrorBody::new(
                ErrorCode::Conflict,
                "this connection already said hello",
            ));
        }
        if self.shared.draining.is_cancelled() {
            return Err(ErrorBody::new(
                ErrorCode::ShuttingDown,
                "the server is shutting down",
            ));
        }
        let h: HelloArgs = router::decode(args)?;
        self.check(&h)?;
        // A worker, or an operator that names a worker_id, serves functions from this
        // connection; an operator may use every op.
        let serves = h.role == Role::Worker || (h.role == Role::Operator && h.worker_id.is_some());
        let reconciled = if serves {
            Some(
                self.shared
                    .backend
                    .worker_hello(&h, self.outbox.clone())
                    .await?,
            )
        } else {
            None
        };
        let caller = Caller {
            role: h.role,
            worker_id: if serves { h.worker_id.clone() } else { None },
        };
        if self.auth.set(caller).is_err() {
            return Err(ErrorBody::new(
                ErrorCode::Conflict,
                "this connection already said hello",
            ));
        }
        self.count_as(h.role);
        let cfg = &self.shared.config.server;
        router::encode(&HelloOk {
            server: "turnd".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            boot_id: self.shared.backend.boot_id().to_string(),
            connection_id: self.outbox.conn_id.clone(),
            heartbeat_ms: cfg.heartbeat_ms,
            max_frame_bytes: cfg.max_frame_bytes,
            reconciled,
        })
    }

    /// The protocol version and the token of a `hello`.
    fn check(&self, h: &HelloArgs) -> Result<(), ErrorBody> {
        if h.protocol != PROTOCOL_VERSION {
            return Err(ErrorBody::new(
                ErrorCode::UnsupportedProtocol,
                format!(
                    "protocol {} is not supported; this server speaks {PROTOCOL_VERSION}",
                    h.protocol
                ),
            ));
        }
        if !self.token_ok(h.role, h.token.as_deref()) {
            tracing::warn!(peer = %self.peer, role = h.role.as_str(), "hello refused: token does not match");
            return Err(ErrorBody::new(
                ErrorCode::NotAuthenticated,
                format!("token not accepted for role {}", h.role.as_str()),
            ));
        }
        Ok(())
    }
}
