//! The two forms the commit path gives what it stores: a batch as one commit log
//! record ([`encode`], [`decode`]), and a value as sled holds it ([`pack`],
//! [`unpack`]), each LZ4-compressed when that saves space.

use crate::error::StoreError;
use crate::model::{Batch, KvOp};
use crate::sled::values;

/// A value stored in sled compressed starts with these two bytes (no value of the
/// layout does: they are JSON text, turn ids, or the applied mark, which is never
/// compressed), followed by LZ4 block data with its length prepended.
const PACKED: [u8; 2] = [0, b'4'];
/// Values shorter than this are stored as they are.
const PACK_FROM: usize = 96;

/// The form a value takes in sled: LZ4-compressed when that saves space (turn and
/// invocation records and events are JSON with many repeated field names).
pub(super) fn pack(v: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if v.len() >= PACK_FROM {
        let c = lz4_flex::block::compress_prepend_size(v);
        if c.len() + PACKED.len() < v.len() {
            let mut out = Vec::with_capacity(c.len() + PACKED.len());
            out.extend_from_slice(&PACKED);
            out.extend_from_slice(&c);
            return std::borrow::Cow::Owned(out);
        }
    }
    std::borrow::Cow::Borrowed(v)
}

/// A value read from sled (with a value file pointer resolved:
/// [`crate::sled::Shared::stored`]), decompressed when [`pack`] compressed it.
pub(super) fn unpack(v: &[u8]) -> Result<Vec<u8>, StoreError> {
    if values::is_pointer(v) {
        return Err(StoreError::Corrupt(
            "a value file pointer read as a value".into(),
        ));
    }
    match v.strip_prefix(&PACKED[..]) {
        Some(c) => lz4_flex::block::decompress_size_prepended(c)
            .map_err(|e| StoreError::Corrupt(format!("compressed value: {e}"))),
        None => Ok(v.to_vec()),
    }
}

/// A commit log record [`encode`] compressed starts with these two bytes (one that
/// is not starts with its first operation's tag length, `1, 0`), followed by LZ4
/// block data with its length prepended.
const LOG_PACKED: [u8; 2] = [0xFF, b'4'];
/// Records shorter than this are written as they are.
const LOG_PACK_FROM: usize = 512;
/// Longest record a compressed one may expand to: a batch is bounded by the
/// protocol's frame limit many times over, and a length past this is corruption
/// (the record's CRC passed, so not a torn write), never an allocation to make.
const LOG_UNPACKED_MAX: usize = 1 << 30;

/// A batch as one log record: per operation a tag (1 put, 2 delete), the key's
/// length and bytes and, for a put, the value's; LZ4-compressed when that saves
/// space. A one-step turn's two records hold its turn and invocation records,
/// events and session meta as JSON, then all of them again folded (about 4 KB):
/// compressed they took the device's writes per turn from 6.8 to
/// about 4.6 KB (`docs/benchmarks.md`). It runs on the committing caller's
/// thread, not the log writer's.
pub fn encode(batch: &Batch) -> Vec<u8> {
    let plain = encode_plain(batch);
    if plain.len() < LOG_PACK_FROM {
        return plain;
    }
    let Ok(size) = u32::try_from(plain.len()) else {
        return plain;
    };
    // The marker, the plain size (u32 LE) and the block, compressed in place: the
    // layout `compress_prepend_size` gives after the marker, without its copy.
    let head = LOG_PACKED.len() + 4;
    let mut out = vec![0u8; head + lz4_flex::block::get_maximum_output_size(plain.len())];
    out[..LOG_PACKED.len()].copy_from_slice(&LOG_PACKED);
    out[LOG_PACKED.len()..head].copy_from_slice(&size.to_le_bytes());
    match lz4_flex::block::compress_into(&plain, &mut out[head..]) {
        Ok(n) if head + n < plain.len() => {
            out.truncate(head + n);
            out
        }
        _ => plain,
    }
}

/// [`encode`] without compression.
fn encode_plain(batch: &Batch) -> Vec<u8> {
    let size: usize = batch
        .ops
        .iter()
        .map(|op| match op {
            KvOp::Put(k, v) => 9 + k.len() + v.len(),
            KvOp::Delete(k) => 5 + k.len(),
        })
        .sum();
    let mut out = Vec::with_capacity(size);
    let mut bytes = |b: &[u8]| {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    };
    for op in &batch.ops {
        match op {
            KvOp::Put(k, v) => {
                bytes(&[1]);
                bytes(k);
                bytes(v);
            }
            KvOp::Delete(k) => {
                bytes(&[2]);
                bytes(k);
            }
        }
    }
    out
}

/// The operations of a record written by [`encode`].
pub fn decode(p: &[u8]) -> Result<Vec<KvOp>, StoreError> {
    let Some(c) = p.strip_prefix(&LOG_PACKED[..]) else {
        return decode_plain(p);
    };
    let corrupt = |what: String| StoreError::Corrupt(format!("commit log record: {what}"));
    let size = c
        .get(..4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| corrupt("compressed, and cut short".into()))?;
    if size as usize > LOG_UNPACKED_MAX {
        return Err(corrupt(format!("compressed, claims {size} bytes")));
    }
    let plain = lz4_flex::block::decompress_size_prepended(c)
        .map_err(|e| corrupt(format!("compressed: {e}")))?;
    decode_plain(&plain)
}

/// The operations of a record [`encode_plain`] wrote.
fn decode_plain(mut p: &[u8]) -> Result<Vec<KvOp>, StoreError> {
    fn take<'a>(p: &mut &'a [u8]) -> Result<&'a [u8], StoreError> {
        let corrupt = || StoreError::Corrupt("commit log record is cut short".into());
        let len_bytes = p.get(..4).ok_or_else(corrupt)?;
        let len =
            u32::from_le_bytes([len_bytes[0], len_bytes[1], len_bytes[2], len_bytes[3]]) as usize;
        let b = p.get(4..4 + len).ok_or_else(corrupt)?;
        *p = &p[4 + len..];
        Ok(b)
    }
    let mut ops = Vec::new();
    while !p.is_empty() {
        let tag = take(&mut p)?;
        match tag {
            [1] => {
                let k = take(&mut p)?.to_vec();
                ops.push(KvOp::Put(k, take(&mut p)?.to_vec()));
            }
            [2] => ops.push(KvOp::Delete(take(&mut p)?.to_vec())),
            _ => {
                return Err(StoreError::Corrupt(format!(
                    "commit log record has an unknown operation {tag:?}"
                )))
            }
        }
    }
    Ok(ops)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(k: &[u8], v: &str) -> Batch {
        let mut b = Batch::new();
        b.put_raw(k.to_vec(), v.as_bytes().to_vec());
        b
    }

    #[test]
    fn values_are_stored_compressed_when_that_saves_space() {
        let record = br#"{"turn_id":"t_0192","session_id":"s","status":"completed","function_id":"f","settings":{"timeout_ms":30000,"delivery":"at_least_once","max_attempts":3,"concurrency":8},"created_at_ms":1,"updated_at_ms":2,"phase":"done"}"#;
        let packed = pack(record);
        assert!(packed.starts_with(&PACKED) && packed.len() < record.len());
        assert_eq!(unpack(&packed).expect("unpack"), record.to_vec());
        for plain in [&b"t_0192"[..], &b"{}"[..], &[7u8; 200][..0]] {
            assert_eq!(&*pack(plain), plain, "short values stay as they are");
            assert_eq!(unpack(plain).expect("unpack"), plain.to_vec());
        }
        assert!(unpack(&[0, b'4', 9, 9]).is_err());
    }

    #[test]
    fn records_encode_and_decode() {
        let mut b = put(b"k1", "v1");
        b.delete(b"gone".to_vec());
        b.put_raw(Vec::new(), Vec::new());
        let ops = decode(&encode(&b)).expect("decode");
        assert_eq!(format!("{ops:?}"), format!("{:?}", b.ops));
        assert!(decode(&encode(&b)[..7]).is_err());
    }

    /// A record of repetitive JSON past [`LOG_PACK_FROM`] is written compressed and
    /// reads back the same; one that does not shrink, or a short one, as it is; a
    /// compressed record cut short or claiming a huge size is corrupt. A record
    /// written plain reads back too, whatever its length.
    #[test]
    fn long_records_are_compressed_and_read_back() {
        let json = r#"{"turn_id":"t_0001","session_id":"s","status":"completed"}"#.repeat(20);
        let b = put(b"T1", &json);
        let rec = encode(&b);
        assert!(rec.starts_with(&LOG_PACKED), "compressed");
        assert!(
            rec.len() * 3 < json.len(),
            "{} of {}",
            rec.len(),
            json.len()
        );
        assert_eq!(
            format!("{:?}", decode(&rec).expect("decode")),
            format!("{:?}", b.ops)
        );
        assert_eq!(
            format!("{:?}", decode(&encode_plain(&b)).expect("plain")),
            format!("{:?}", b.ops)
        );
        let short = put(b"k", "v");
        assert_eq!(encode(&short), encode_plain(&short));
        let noise: String = (0..2000u32)
            .map(|i| char::from(b'!' + (i.wrapping_mul(2_654_435_761).rotate_left(13) % 90) as u8))
            .collect();
        let random = put(b"k", &noise);
        let r = encode(&random);
        assert!(r.starts_with(&LOG_PACKED) == (r.len() < encode_plain(&random).len()));
        assert!(decode(&rec[..rec.len() - 3]).is_err());
        let mut huge = LOG_PACKED.to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        huge.extend_from_slice(&[0; 8]);
        assert!(matches!(decode(&huge), Err(StoreError::Corrupt(_))));
    }
}
