//! What one message of a partition's stream carries: a small versioned head (the
//! partition, the writer's epoch, the sequence its writer saw last, the node, where
//! the message stands in its group) and the records, with a CRC over all of it.
//!
//! The head is what the validity rule ([`crate::fence`]) judges; the records are
//! the store's own log records (`turnd_store::logged::encode`), framed here
//! unchanged. A message that does not decode (a flipped bit, a torn copy) is an
//! error for whoever reads it, never a message that counts for nothing: a reader
//! must not quietly differ from a replica that read a good copy.
//!
//! Layout (integers big-endian): `b"TD"`, version (1), kind, partition (u32), epoch
//! (u64), prev_seq (u64), part (u16), parts (u16), first_index (u32), node length
//! (u16) and bytes, record count (u32), each record as length (u32) and bytes, and
//! the CRC-32 of everything before it (u32).

use crate::error::LogError;

const MAGIC: &[u8; 2] = b"TD";
/// The envelope's version; a reader refuses any other.
pub const VERSION: u8 = 1;

/// Bytes of an envelope besides its node id and records.
pub const OVERHEAD: usize = 2 + 1 + 1 + 4 + 8 + 8 + 2 + 2 + 4 + 2 + 4 + 4;
/// Bytes each record adds besides its payload.
pub const PER_RECORD: usize = 4;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Records of a committer group (or of a part of one).
    Data,
    /// A writer's claim to lead: valid, it makes its own sequence the epoch.
    Fence,
}

/// A message's head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub kind: Kind,
    pub partition: u32,
    /// The epoch its writer leads in (a fence: the epoch its writer last saw).
    pub epoch: u64,
    /// The last sequence its writer saw in the stream: the message is valid only
    /// at `prev_seq + 1`.
    pub prev_seq: u64,
    /// Which part of its group this message is (0 for the first), of `parts`.
    pub part: u16,
    pub parts: u16,
    /// The index within its group of this message's first record.
    pub first_index: u32,
    /// The node that wrote it.
    pub node: String,
}

/// A message decoded: its head and its records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    pub head: Head,
    pub records: Vec<Vec<u8>>,
}

/// The message of `head` and `records`.
pub fn encode(head: &Head, records: &[&[u8]]) -> Vec<u8> {
    let size =
        OVERHEAD + head.node.len() + records.iter().map(|r| r.len() + PER_RECORD).sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.push(match head.kind {
        Kind::Data => 0,
        Kind::Fence => 1,
    });
    out.extend_from_slice(&head.partition.to_be_bytes());
    out.extend_from_slice(&head.epoch.to_be_bytes());
    out.extend_from_slice(&head.prev_seq.to_be_bytes());
    out.extend_from_slice(&head.part.to_be_bytes());
    out.extend_from_slice(&head.parts.to_be_bytes());
    out.extend_from_slice(&head.first_index.to_be_bytes());
    out.extend_from_slice(&(head.node.len() as u16).to_be_bytes());
    out.extend_from_slice(head.node.as_bytes());
    out.extend_from_slice(&(records.len() as u32).to_be_bytes());
    for r in records {
        out.extend_from_slice(&(r.len() as u32).to_be_bytes());
        out.extend_from_slice(r);
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_be_bytes());
    out
}

/// A cursor over a message's bytes.
struct Bytes<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Bytes<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], LogError> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.buf.len());
        let Some(end) = end else {
            return Err(LogError::Corrupt(format!(
                "a message ends at byte {} where {n} more were expected",
                self.buf.len()
            )));
        };
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], LogError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
}

/// The message in `buf`, checked: its CRC, magic, version and lengths.
pub fn decode(buf: &[u8]) -> Result<Decoded, LogError> {
    if buf.len() < OVERHEAD {
        return Err(LogError::Corrupt(format!(
            "a message of {} bytes is shorter than an envelope",
            buf.len()
        )));
    }
    let (body, crc) = buf.split_at(buf.len() - 4);
    let want = u32::from_be_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if crc32fast::hash(body) != want {
        return Err(LogError::Corrupt(
            "a message's CRC does not match its bytes".into(),
        ));
    }
    let mut b = Bytes { buf: body, at: 0 };
    if b.take(2)? != MAGIC {
        return Err(LogError::Corrupt("a message that is not turnd's".into()));
    }
    let [version, kind] = b.array::<2>()?;
    if version != VERSION {
        return Err(LogError::Corrupt(format!(
            "a message of envelope version {version} (this turnd reads {VERSION})"
        )));
    }
    let kind = match kind {
        0 => Kind::Data,
        1 => Kind::Fence,
        k => return Err(LogError::Corrupt(format!("a message of unknown kind {k}"))),
    };
    let partition = u32::from_be_bytes(b.array()?);
    let epoch = u64::from_be_bytes(b.array()?);
    let prev_seq = u64::from_be_bytes(b.array()?);
    let part = u16::from_be_bytes(b.array()?);
    let parts = u16::from_be_bytes(b.array()?);
    let first_index = u32::from_be_bytes(b.array()?);
    let node_len = u16::from_be_bytes(b.array()?) as usize;
    let node = String::from_utf8_lossy(b.take(node_len)?).into_owned();
    let count = u32::from_be_bytes(b.array()?) as usize;
    let mut records = Vec::with_capacity(count.min(body.len() / PER_RECORD));
    for _ in 0..count {
        let len = u32::from_be_bytes(b.array()?) as usize;
        records.push(b.take(len)?.to_vec());
    }
    if b.at != body.len() {
        return Err(LogError::Corrupt(format!(
            "a message has {} bytes past its records",
            body.len() - b.at
        )));
    }
    Ok(Decoded {
        head: Head {
            kind,
            partition,
            epoch,
            prev_seq,
            part,
            parts,
            first_index,
            node,
        },
        records,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head() -> Head {
        Head {
            kind: Kind::Data,
            partition: 7,
            epoch: 12,
            prev_seq: 40,
            part: 1,
            parts: 3,
            first_index: 5,
            node: "n1".into(),
        }
    }

    #[test]
    fn a_message_decodes_to_what_was_encoded() {
        let recs: [&[u8]; 3] = [b"one", b"", b"three"];
        let m = encode(&head(), &recs);
        assert_eq!(
            m.len(),
            OVERHEAD + 2 + recs.iter().map(|r| r.len() + 4).sum::<usize>()
        );
        let d = decode(&m).expect("decode");
        assert_eq!(d.head, head());
        assert_eq!(d.records, vec![b"one".to_vec(), vec![], b"three".to_vec()]);
    }

    #[test]
    fn a_flipped_bit_or_a_torn_message_is_an_error_not_a_message() {
        let m = encode(&head(), &[b"payload"]);
        for at in [0, 9, m.len() / 2, m.len() - 1] {
            let mut bad = m.clone();
            bad[at] ^= 0x10;
            assert!(
                matches!(decode(&bad), Err(LogError::Corrupt(_))),
                "bit flipped at {at}"
            );
        }
        assert!(matches!(
            decode(&m[..m.len() - 3]),
            Err(LogError::Corrupt(_))
        ));
    }
}
