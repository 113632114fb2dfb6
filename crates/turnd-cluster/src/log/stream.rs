//! A partition's stream on the wire: its configuration, its bounds, reads of a
//! range (an ordered consumer) and of one message (direct get), a publish whose
//! answer is sorted into what it means for an append, and a purge.

use std::time::Duration;

use async_nats::jetstream::{consumer, stream};
use async_nats::HeaderMap;
use bytes::Bytes;
use futures_util::StreamExt;

use crate::error::LogError;
use crate::nats::Nats;

/// The stream of partition `p`.
pub fn stream_name(p: u32) -> String {
    format!("TURND_P{p}")
}

/// The subject partition `p`'s log messages are published on.
pub fn subject(p: u32) -> String {
    format!("turnd.p.{p}.log")
}

/// How a partition's log is kept and written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogConfig {
    pub partition: u32,
    /// Servers holding the stream: 3 in production (1 for tests).
    pub replicas: usize,
    /// The stream's size limit; past it appends are refused (`discard: new`).
    pub max_bytes: i64,
    /// How long the servers remember a message id, so that a resend is answered
    /// with the first copy's sequence.
    pub duplicate_window: Duration,
    /// How long one publish waits for its acknowledgement before it is in doubt.
    pub ack_timeout: Duration,
    /// How long a read waits for the next message before it fails.
    pub read_timeout: Duration,
    /// The first and the longest pause between tries of an append in doubt.
    pub retry_min: Duration,
    pub retry_max: Duration,
    /// A trim is worth asking for once this many groups are held before the
    /// store's mark, at most every `trim_interval`.
    pub trim_every: usize,
    pub trim_interval: Duration,
    /// A node whose mark did not move for this long is not waited for by a trim.
    pub replica_timeout: Duration,
    /// How long a standby goes on gathering messages after the first of a batch,
    /// so that a stream written a message at a time is applied, and synced, in
    /// groups rather than once a message. Its lag grows by at most this much; no
    /// turn waits for a standby.
    pub standby_linger: Duration,
    /// How often a leader reads its stream's leader, to publish its appends on a
    /// connection to that server ([`super::route`]); zero: never after the open.
    pub follow_leader_every: Duration,
    /// Never purge the stream: every node can then open the partition from the
    /// stream's start, whatever its store holds (until a node can copy a peer's
    /// checkpoint, a node behind a trimmed stream cannot take the partition over).
    pub keep_all: bool,
}

impl LogConfig {
    /// The defaults for partition `p`.
    pub fn new(p: u32) -> LogConfig {
        LogConfig {
            partition: p,
            replicas: 3,
            max_bytes: 1 << 30,
            duplicate_window: Duration::from_secs(120),
            ack_timeout: Duration::from_secs(2),
            read_timeout: Duration::from_secs(10),
            retry_min: Duration::from_millis(20),
            retry_max: Duration::from_millis(500),
            trim_every: 1024,
            trim_interval: Duration::from_secs(5),
            replica_timeout: Duration::from_secs(60),
            standby_linger: Duration::from_millis(10),
            follow_leader_every: Duration::from_secs(2),
            keep_all: false,
        }
    }

    fn stream_config(&self) -> stream::Config {
        stream::Config {
            name: stream_name(self.partition),
            subjects: vec![subject(self.partition)],
            storage: stream::StorageType::File,
            num_replicas: self.replicas,
            discard: stream::DiscardPolicy::New,
            max_bytes: self.max_bytes,
            duplicate_window: self.duplicate_window,
            allow_direct: true,
            // A message taken out of the middle would leave a gap no reader could
            // tell from a lost write.
            deny_delete: true,
            ..Default::default()
        }
    }
}

/// Bind partition `cfg.partition`'s stream, making it when there is none. A stream
/// made otherwise (other replicas, subject or limits policy) is refused.
pub(crate) async fn ensure(nats: &Nats, cfg: &LogConfig) -> Result<stream::Stream, LogError> {
    let want = cfg.stream_config();
    let s = again(|| async {
        nats.jetstream()
            .get_or_create_stream(want.clone())
            .await
            .map_err(|e| LogError::nats(&format!("bind stream {}", want.name), e))
    })
    .await?;
    let have = s.cached_info().config.clone();
    if have.subjects != want.subjects
        || have.num_replicas != want.num_replicas
        || have.discard != want.discard
        || have.storage != want.storage
        || have.max_age != Duration::ZERO
        || have.max_messages > 0
        || !have.allow_direct
    {
        return Err(LogError::Config(format!(
            "stream {} exists with another configuration (subjects {:?}, {} replicas, discard {:?}, max_age {:?}, max_msgs {}, direct {}); turnd needs subject {:?}, {} replicas, discard new, file storage, no age or count limit, direct get",
            want.name, have.subjects, have.num_replicas, have.discard, have.max_age,
            have.max_messages, have.allow_direct, want.subjects[0], want.num_replicas
        )));
    }
    Ok(s)
}

/// The stream's first message held and its last sequence (`first > last` when it
/// holds none).
pub(crate) async fn bounds(s: &stream::Stream) -> Result<(u64, u64), LogError> {
    let info = again(|| async {
        s.get_info()
            .await
            .map_err(|e| LogError::nats("stream info", e))
    })
    .await?;
    let st = info.state;
    let first = if st.messages == 0 {
        st.last_sequence + 1
    } else {
        st.first_sequence.max(1)
    };
    Ok((first, st.last_sequence))
}

/// The messages with sequences `from..=to`, in order (each with its sequence):
/// an ordered consumer from `from`, read until `to`. A missing message is an error.
pub(crate) async fn read(
    s: &stream::Stream,
    p: u32,
    from: u64,
    to: u64,
    wait: Duration,
) -> Result<Vec<(u64, Bytes)>, LogError> {
    if from > to {
        return Ok(Vec::new());
    }
    let mut msgs = open_tail(s, p, from).await?;
    let mut out = Vec::with_capacity((to - from + 1).min(1 << 16) as usize);
    let mut expect = from;
    while expect <= to {
        let (seq, payload, _) = next_with_pending(&mut msgs, wait).await?.ok_or_else(|| {
            LogError::Nats(format!("message {expect} did not come within {wait:?}"))
        })?;
        if seq != expect {
            return Err(LogError::Nats(format!(
                "read message {seq} where {expect} was expected: messages {from} to {to} are not all held"
            )));
        }
        out.push((seq, payload));
        expect += 1;
    }
    Ok(out)
}

/// An ordered consumer of partition `p`'s stream from sequence `from` on.
pub(crate) async fn open_tail(
    s: &stream::Stream,
    p: u32,
    from: u64,
) -> Result<consumer::pull::Ordered, LogError> {
    again(|| async {
        let c = s
            .create_consumer(consumer::pull::OrderedConfig {
                filter_subject: subject(p),
                deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: from.max(1),
                },
                ..Default::default()
            })
            .await
            .map_err(|e| LogError::nats("create a reader of the stream", e))?;
        c.messages()
            .await
            .map_err(|e| LogError::nats("read the stream", e))
    })
    .await
}

/// Tries of a JetStream API call that can fail for a while (a stream or meta
/// leader being elected, a server just back answering "temporarily unavailable").
const API_TRIES: u32 = 8;

/// How long one try of a JetStream API call waits for its answer. A stream whose
/// leader is being elected answers nothing: a try waits out its whole bound, and
/// with JetStream's own 5 s a takeover waiting on a new stream leader got through
/// up to 5 s after the election, once for each call on its way (binding the
/// stream, its bounds, a reader of it). Those calls read, bind the stream (made
/// once), or make an ephemeral reader the server drops once unused: a try
/// abandoned and made again changes nothing that counts.
pub const API_TRY_TIMEOUT: Duration = Duration::from_secs(1);

/// `f` until it works, up to [`API_TRIES`] times (each bounded by
/// [`API_TRY_TIMEOUT`]) with a pause from 100 ms doubling in between; the last
/// error when none worked.
async fn again<T, F, Fut>(f: F) -> Result<T, LogError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, LogError>>,
{
    let mut pause = Duration::from_millis(100);
    let mut tries = 1;
    loop {
        let tried = tokio::time::timeout(API_TRY_TIMEOUT, f())
            .await
            .unwrap_or_else(|_| {
                Err(LogError::Nats(format!(
                    "no answer within {API_TRY_TIMEOUT:?}"
                )))
            });
        match tried {
            Ok(v) => return Ok(v),
            Err(e) if tries >= API_TRIES => return Err(e),
            Err(e) => tracing::debug!("tried again after {pause:?}: {e}"),
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
        tries += 1;
    }
}

/// The next message of an ordered consumer, with its stream sequence and how many
/// messages follow it now; None when none came within `wait`.
pub(crate) async fn next_with_pending(
    msgs: &mut consumer::pull::Ordered,
    wait: Duration,
) -> Result<Option<(u64, Bytes, u64)>, LogError> {
    let Ok(m) = tokio::time::timeout(wait, msgs.next()).await else {
        return Ok(None);
    };
    let m = m
        .ok_or_else(|| LogError::Nats("the stream's reader ended".into()))?
        .map_err(|e| LogError::nats("read the stream", e))?;
    let info = m
        .info()
        .map_err(|e| LogError::nats("a message's info", e))?;
    let (seq, pending) = (info.stream_sequence, info.pending);
    Ok(Some((seq, m.message.payload.clone(), pending)))
}

/// The message at `seq`: None when the server answering holds none there (a
/// replica may be behind: absent is never proof).
pub(crate) async fn get(s: &stream::Stream, seq: u64) -> Result<Option<Bytes>, LogError> {
    match s.direct_get(seq).await {
        Ok(m) => Ok(Some(m.payload)),
        Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => Ok(None),
        Err(e) => Err(LogError::nats(&format!("get message {seq}"), e)),
    }
}

/// Purge every message before `seq`; returns how many went.
pub(crate) async fn purge_below(s: &stream::Stream, seq: u64) -> Result<u64, LogError> {
    s.purge()
        .sequence(seq)
        .await
        .map(|r| r.purged)
        .map_err(|e| LogError::nats(&format!("purge below {seq}"), e))
}

/// What one publish of an append came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Stored at this sequence (or, a resend, stored there before).
    Stored(u64),
    /// The stream's last sequence was not the one expected.
    WrongLast(String),
    /// Refused for good: nothing of it was stored.
    Refused(String),
    /// Refused for good because the stream is full: nothing of it was stored.
    Full(String),
    /// No answer that settles it: a timeout, a lost connection, no stream leader,
    /// an error the server may not repeat.
    InDoubt(String),
}

#[derive(serde::Deserialize)]
struct PubReply {
    seq: Option<u64>,
    error: Option<ApiError>,
}

#[derive(serde::Deserialize)]
struct ApiError {
    #[serde(default)]
    err_code: u64,
    #[serde(default)]
    description: String,
}

/// JetStream's error codes an append takes as final.
const WRONG_LAST_SEQUENCE: u64 = 10071;
const MESSAGE_TOO_LARGE: u64 = 10054;
const STORE_FAILED: u64 = 10077;

/// Publish `payload` on `subject` over `client` with the stream's expected last
/// sequence and a message id, and sort the answer.
pub(crate) async fn publish(
    client: &async_nats::Client,
    subject: &str,
    expect_last: Option<u64>,
    msg_id: &str,
    payload: Bytes,
    wait: Duration,
) -> Outcome {
    let mut h = HeaderMap::new();
    if let Some(last) = expect_last {
        h.insert(
            async_nats::header::NATS_EXPECTED_LAST_SEQUENCE,
            last.to_string().as_str(),
        );
    }
    h.insert(async_nats::header::NATS_MESSAGE_ID, msg_id);
    let req = async_nats::client::Request::new()
        .headers(h)
        .payload(payload)
        .timeout(Some(wait));
    let reply = match client.send_request(subject.to_string(), req).await {
        Ok(m) => m,
        Err(e) => {
            return match e.kind() {
                async_nats::client::RequestErrorKind::MaxPayloadExceeded => {
                    Outcome::Refused(format!("the message is larger than the server takes: {e}"))
                }
                _ => Outcome::InDoubt(format!("publish: {e}")),
            };
        }
    };
    sort_reply(&reply.payload)
}

/// What a publish's reply says.
fn sort_reply(payload: &[u8]) -> Outcome {
    let r: PubReply = match serde_json::from_slice(payload) {
        Ok(r) => r,
        Err(e) => return Outcome::InDoubt(format!("an acknowledgement that does not parse: {e}")),
    };
    match (r.seq, r.error) {
        (_, Some(e)) if e.err_code == WRONG_LAST_SEQUENCE => Outcome::WrongLast(e.description),
        (_, Some(e)) if e.err_code == MESSAGE_TOO_LARGE => Outcome::Refused(e.description),
        (_, Some(e))
            if e.err_code == STORE_FAILED && e.description.contains("maximum bytes exceeded") =>
        {
            Outcome::Full(e.description)
        }
        (_, Some(e)) => Outcome::InDoubt(format!("error {}: {}", e.err_code, e.description)),
        (Some(seq), None) => Outcome::Stored(seq),
        (None, None) => Outcome::InDoubt("an acknowledgement without a sequence".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_is_sorted_into_what_it_means_for_an_append() {
        assert_eq!(sort_reply(br#"{"stream":"S","seq":7}"#), Outcome::Stored(7));
        assert_eq!(
            sort_reply(br#"{"stream":"S","seq":7,"duplicate":true}"#),
            Outcome::Stored(7)
        );
        assert!(matches!(
            sort_reply(br#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 9"}}"#),
            Outcome::WrongLast(_)
        ));
        assert!(matches!(
            sort_reply(br#"{"error":{"code":503,"err_code":10077,"description":"maximum bytes exceeded"}}"#),
            Outcome::Full(_)
        ));
        assert!(matches!(
            sort_reply(br#"{"error":{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}}"#),
            Outcome::InDoubt(_)
        ));
        assert!(matches!(sort_reply(b"not json"), Outcome::InDoubt(_)));
    }
}
