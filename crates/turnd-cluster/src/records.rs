//! The endpoints' own records, shared by every node (`turnd_endpoints`): what a
//! daemon on its own keeps in its store under the prefix `X` and no engine reads
//! (the iii endpoint's reattach secret and queue definitions). Every node must sign
//! with the same secret and see the same queues, so they live in one replicated
//! bucket, not in any partition.
//!
//! Reads go to the bucket's stream leader (`STREAM.MSG.GET`), not to any replica
//! (the bucket allows direct gets, which a lagging follower may answer): a record
//! written through one node is read by the next request on any other. A record made
//! once ([`Records::create`]) is created only if absent, so nodes racing to make it
//! agree on the one that landed first.

use std::sync::Arc;

use async_nats::jetstream::kv;

use crate::{LogError, Nats};

/// The bucket of the endpoints' records.
pub const RECORDS_BUCKET: &str = "turnd_endpoints";

/// The records bucket.
#[derive(Clone)]
pub struct Records {
    kv: kv::Store,
}

/// `key` as a KV key: letters, digits, `_`, `-` and `/` as they are, every other
/// byte as `=XX` (so that a `.` in a queue name does not split the subject).
pub fn kv_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'/') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("={b:02X}"));
        }
    }
    out
}

impl Records {
    /// Bind the bucket, making it (on `replicas` servers) when there is none.
    pub async fn open(nats: &Arc<Nats>, replicas: usize) -> Result<Records, LogError> {
        Ok(Records {
            kv: nats.bucket(RECORDS_BUCKET, replicas).await?,
        })
    }

    /// The record `key` as the bucket's leader has it (None: never written, or
    /// deleted).
    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, LogError> {
        let subject = format!("{}{}", self.kv.prefix, kv_key(key));
        match self
            .kv
            .stream
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            Ok(m) => {
                let deleted = m
                    .headers
                    .get("KV-Operation")
                    .is_some_and(|op| op.as_str() != "PUT");
                Ok((!deleted).then(|| m.payload.to_vec()))
            }
            Err(e)
                if e.kind()
                    == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
            {
                Ok(None)
            }
            Err(e) => Err(LogError::nats(&format!("read the record {key}"), e)),
        }
    }

    /// Write the record `key` (answered once the bucket's replicas have it).
    pub async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), LogError> {
        self.kv
            .put(kv_key(key), value.into())
            .await
            .map(|_| ())
            .map_err(|e| LogError::nats(&format!("write the record {key}"), e))
    }

    /// The record `key`: `value` when there was none (written now), else the one
    /// already there, whoever wrote it.
    pub async fn create(&self, key: &str, value: Vec<u8>) -> Result<Vec<u8>, LogError> {
        match self.kv.create(kv_key(key), value.clone().into()).await {
            Ok(_) => return Ok(value),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => return Err(LogError::nats(&format!("create the record {key}"), e)),
        }
        self.get(key)
            .await?
            .ok_or_else(|| LogError::Corrupt(format!("the record {key} exists and cannot be read")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_keep_what_kv_takes_and_escape_the_rest() {
        assert_eq!(kv_key("iii/secret"), "iii/secret");
        assert_eq!(kv_key("iii/queue/a.b c"), "iii/queue/a=2Eb=20c");
        assert_ne!(kv_key("iii/queue/a.b"), kv_key("iii/queue/a=2Eb"));
    }
}
