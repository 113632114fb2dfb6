//! Which partition a request is for, and running it there.
//!
//! Session-keyed ops go to `session_partition(session_id)`; turn- and
//! invocation-keyed ops to the partition their id carries (an id that carries none
//! cannot name a turn of this cluster, and partition 0 answers it `not_found`).
//! The op runs on the local engine when this node leads the partition, else it is
//! forwarded to the leader over NATS request/reply and answered with the leader's
//! reply, byte for byte. Cluster-wide reads (`stats`, `sessions.list`,
//! `store.check`) are gathered from every partition; `workers.list`,
//! `functions.list` and `function.(un)register` are this node's registry (workers
//! connect to every node). A watch is relayed from its partition's leader by the
//! node the caller is connected to ([`super::relay`]).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use serde::Deserialize;
use tokio::time::Instant;
use turnd_engine::{Caller, EngineError};
use turnd_proto::*;

use super::rpc::{ForwardReply, Forwarded};
use super::Node;
use crate::router::{self, decode, encode, worker_id, Answer, Origin};

/// The ids a request's arguments may name.
#[derive(Deserialize, Default)]
pub(super) struct Keys {
    pub session_id: Option<String>,
    pub turn_id: Option<String>,
    pub invocation_id: Option<String>,
}

/// Where an op runs.
enum Target {
    One(u32),
    Every,
    Node,
}

/// The longest a forwarded request waits for the leader beyond its own wait (a
/// write not answered by then is in doubt, and its connection is closed).
pub(super) const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);

/// How often a forward looks for the leader of a partition that has none.
const LEADER_POLL: Duration = Duration::from_millis(50);

impl Node {
    /// Run an admitted op (see the module documentation).
    pub async fn run(
        self: &Arc<Self>,
        caller: &Caller,
        op: Op,
        args: &str,
        origin: Option<&Origin<'_>>,
    ) -> Result<Answer, ErrorBody> {
        if op == Op::Watch {
            return self.watch(caller, args, origin).await;
        }
        match self.target(op, args) {
            Target::One(p) => self.on_partition(p, caller, op, args, origin).await,
            Target::Node => self.on_node(caller, op, args, origin).await,
            Target::Every => self.gather(caller, op, args).await.map(Answer::Reply),
        }
    }

    fn target(&self, op: Op, args: &str) -> Target {
        match op {
            Op::Stats | Op::SessionsList | Op::StoreCheck => return Target::Every,
            Op::Hello
            | Op::Ping
            | Op::Unwatch
            | Op::WorkersList
            | Op::FunctionsList
            | Op::FunctionRegister
            | Op::FunctionUnregister => return Target::Node,
            _ => {}
        }
        Target::One(self.partition_of(&serde_json::from_str(args).unwrap_or_default()))
    }

    /// The partition the ids of a request name (0 when they name none).
    pub(super) fn partition_of(&self, k: &Keys) -> u32 {
        let count = self.cluster.partitions;
        let p = if let Some(s) = &k.session_id {
            Some(session_partition(s, count))
        } else if let Some(t) = &k.turn_id {
            turn_partition(t)
        } else if let Some(i) = &k.invocation_id {
            invocation_partition(i)
        } else {
            None
        };
        p.filter(|p| *p < count).unwrap_or(0)
    }

    /// Ops of this node alone.
    async fn on_node(
        &self,
        caller: &Caller,
        op: Op,
        args: &str,
        origin: Option<&Origin<'_>>,
    ) -> Result<Answer, ErrorBody> {
        let reply = match op {
            Op::FunctionRegister => {
                let worker = worker_id(caller)?;
                let a: RegisterArgs = decode(args)?;
                encode(
                    &self
                        .workers
                        .register(&worker, &a, self.cfg.turns.default_timeout_ms)?,
                )
            }
            Op::FunctionUnregister => {
                let worker = worker_id(caller)?;
                let a: FunctionIdArgs = decode(args)?;
                self.workers.unregister(&worker, &a.function_id)?;
                Ok("{}".to_string())
            }
            Op::WorkersList => encode(&WorkersOk {
                workers: self.workers.workers(),
            }),
            Op::FunctionsList => encode(&FunctionsOk {
                functions: self.workers.functions(),
            }),
            Op::Unwatch => {
                let a: WatchIdArgs = decode(args)?;
                let origin = router::connection(origin)?;
                if !self.relays.stop(&origin.outbox.conn_id, &a.watch_id) {
                    return Err(EngineError::NoWatch(a.watch_id).into());
                }
                Ok("{}".to_string())
            }
            Op::Ping => Ok("{}".to_string()),
            _ => Err(ErrorBody::new(
                ErrorCode::Conflict,
                "this connection already said hello",
            )),
        };
        reply.map(Answer::Reply)
    }

    /// Run `op` on partition `p`'s engine: here, or on its leader.
    pub(crate) async fn on_partition(
        &self,
        p: u32,
        caller: &Caller,
        op: Op,
        args: &str,
        origin: Option<&Origin<'_>>,
    ) -> Result<Answer, ErrorBody> {
        if let Some((led, _admitted)) = self.serving(p) {
            return router::run(&led.engine, caller, op, args, origin).await;
        }
        self.forward(p, caller, op, args).await.map(Answer::Reply)
    }

    /// Forward `op` to partition `p`'s leader and return its reply.
    async fn forward(
        &self,
        p: u32,
        caller: &Caller,
        op: Op,
        args: &str,
    ) -> Result<String, ErrorBody> {
        let wait = match op {
            Op::TurnWait => serde_json::from_str::<WaitArgs>(args)
                .ok()
                .and_then(|a| a.timeout_ms)
                .map_or(Duration::ZERO, Duration::from_millis),
            _ => Duration::ZERO,
        };
        self.counters.forwarded.inc();
        let f = Forwarded {
            role: caller.role,
            worker_id: caller.worker_id.clone(),
            op: op.name().to_string(),
            args: args.to_string(),
            relay: None,
            settings: None,
        };
        self.ask_leader(p, op, &f, FORWARD_TIMEOUT + wait).await
    }

    /// Send `f` to partition `p`'s leader (once more to the lease's holder now when
    /// the one it knew is gone) and return its answer.
    pub(super) async fn ask_leader(
        &self,
        p: u32,
        op: Op,
        f: &Forwarded,
        timeout: Duration,
    ) -> Result<String, ErrorBody> {
        let body = serde_json::to_vec(f)
            .map_err(|e| ErrorBody::new(ErrorCode::Internal, format!("encode a forward: {e}")))?;
        let body = Bytes::from(body);
        // A partition between leaders (a hand-over, a drain, a takeover) is
        // waited for, up to two leases and two tries of a takeover's stream
        // requests (a try the stream does not answer waits out its bound),
        // before the request is refused: nothing has been sent yet, so the wait
        // changes nothing but the answer's time. A node that drains waits too: it
        // closes its connections only once their requests are answered.
        let patience = Instant::now()
            + 2 * Duration::from_millis(self.cluster.lease_ms)
            + 2 * turnd_cluster::log::API_TRY_TIMEOUT;
        let mut leader = self.leader_of(p, false).await;
        loop {
            let Some(to) = leader.clone() else {
                if Instant::now() >= patience {
                    return Err(no_leader(p));
                }
                tokio::time::sleep(LEADER_POLL).await;
                leader = self.leader_of(p, true).await;
                continue;
            };
            let req = async_nats::Request::new()
                .payload(body.clone())
                .timeout(Some(timeout));
            let sent = self
                .nats
                .client()
                .send_request(super::rpc::subject(p, &to), req)
                .await;
            match sent.map(|m| serde_json::from_slice::<ForwardReply>(&m.payload)) {
                Ok(Ok(ForwardReply::Ok(text))) => return Ok(text),
                Ok(Ok(ForwardReply::Error(e))) => return Err(e),
                Ok(Ok(ForwardReply::InDoubt(m))) => return Err(ErrorBody::in_doubt(m)),
                Ok(Err(e)) => {
                    return Err(ErrorBody::in_doubt(format!(
                        "partition {p}'s leader sent an unreadable answer: {e}"
                    )))
                }
                // The leader it knew is gone, or its lease ran out (nothing was run):
                // once more, to the lease's holder now.
                Ok(Ok(ForwardReply::NotLeading)) => {}
                Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => {}
                Err(e) => return Err(forward_failed(p, &to, op, &e)),
            }
            let now = self.leader_of(p, true).await;
            if now == leader {
                if Instant::now() >= patience {
                    return Err(no_leader(p));
                }
                tokio::time::sleep(LEADER_POLL).await;
            }
            leader = now;
        }
    }

    /// The node that holds partition `p`'s lease, as the last round saw it, or as
    /// the owners bucket says now (`fresh`, or when the round saw none).
    async fn leader_of(&self, p: u32, fresh: bool) -> Option<String> {
        if !fresh {
            if let Some(l) = self.leaders.read().get(&p) {
                return Some(l.clone());
            }
        }
        let lease = self.owners.get(p).await.ok().flatten();
        self.note_leader(p, lease.as_ref(), turnd_cluster::members::now_ms())
    }

    /// A cluster-wide read: the op on every partition, the answers combined. Any
    /// partition that cannot answer fails the whole read (a partial answer would
    /// say less than it seems to).
    async fn gather(&self, caller: &Caller, op: Op, args: &str) -> Result<String, ErrorBody> {
        let count = self.cluster.partitions;
        let answers =
            join_all((0..count).map(|p| self.on_partition(p, caller, op, args, None))).await;
        let mut texts = Vec::with_capacity(answers.len());
        for a in answers {
            match a? {
                Answer::Reply(t) => texts.push(t),
                Answer::Queued => {
                    return Err(ErrorBody::new(
                        ErrorCode::Internal,
                        "a gathered read was queued",
                    ))
                }
            }
        }
        match op {
            Op::Stats => encode(&StatsOk {
                stats: super::status::sum_stats(&texts, self.workers.workers().len() as u64)?,
            }),
            Op::SessionsList => encode(&super::status::merge_sessions(&texts, decode(args)?)?),
            _ => {
                let mut violations = Vec::new();
                for t in &texts {
                    violations.extend(decode::<CheckOk>(t)?.violations);
                }
                encode(&CheckOk { violations })
            }
        }
    }
}

/// Ops that change nothing: a forward of one that got no answer changed nothing.
fn reads(op: Op) -> bool {
    matches!(
        op,
        Op::TurnGet
            | Op::TurnWait
            | Op::TurnList
            | Op::SessionInspect
            | Op::SessionEvents
            | Op::SessionsList
            | Op::Stats
            | Op::StoreCheck
    )
}

/// Nobody leads partition `p` now: nothing was sent, nothing changed.
fn no_leader(p: u32) -> ErrorBody {
    ErrorBody::new(
        ErrorCode::Unavailable,
        format!("partition {p} has no leader now (it is being taken over); nothing was changed"),
    )
}

/// The answer to a forward that failed.
fn forward_failed(p: u32, to: &str, op: Op, e: &async_nats::RequestError) -> ErrorBody {
    use async_nats::RequestErrorKind as K;
    match e.kind() {
        // Nobody received it: nothing changed.
        K::NoResponders => no_leader(p),
        K::MaxPayloadExceeded => ErrorBody::new(
            ErrorCode::TooLarge,
            format!("the request is larger than the NATS servers' max_payload: {e}"),
        ),
        _ if reads(op) => ErrorBody::new(
            ErrorCode::Unavailable,
            format!("partition {p}'s leader {to} did not answer: {e}"),
        ),
        // Sent, and maybe done: no answer may say it was not.
        _ => ErrorBody::in_doubt(format!("partition {p}'s leader {to} did not answer: {e}")),
    }
}
