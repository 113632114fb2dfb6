//! A range of several sled databases (the main one and time windows) read as one, in
//! key order: each source is read in chunks, only as far as the merge needs it.
//!
//! A session's keys are spread over the windows its turns fell in, mostly in `seq`
//! order across them: a page of a session's events usually comes from one window.
//! Taking a page's worth from every source and merging would read each page once
//! per open window; here a source the merge does not reach costs one small read.

use std::collections::VecDeque;

use super::Shared;
use crate::error::StoreError;

/// Entries a source is first read in: enough for most pages; doubled at every
/// further read of the same source, up to [`MAX_CHUNK`].
const MAX_CHUNK: usize = 1024;

type Pair = (sled::IVec, sled::IVec);

struct Cursor<'a> {
    src: &'a Shared,
    /// What is left of the range to read: `[start, end)`.
    start: Vec<u8>,
    end: Vec<u8>,
    buf: VecDeque<Pair>,
    done: bool,
    chunk: usize,
}

impl Cursor<'_> {
    /// Read the next chunk when the buffer is empty.
    fn fill(&mut self, reverse: bool) -> Result<(), StoreError> {
        if !self.buf.is_empty() || self.done {
            return Ok(());
        }
        if self.start >= self.end {
            self.done = true;
            return Ok(());
        }
        let n = self.chunk;
        let got: Vec<Pair> = self.src.with(|h| {
            let range = h.db.range(self.start.clone()..self.end.clone());
            let taken: sled::Result<Vec<Pair>> = if reverse {
                range.rev().take(n).collect()
            } else {
                range.take(n).collect()
            };
            taken
                .map_err(|e| StoreError::Read(e.to_string()))?
                .into_iter()
                .map(|(k, v)| Ok((k, self.src.resolved(v)?)))
                .collect()
        })?;
        if got.len() < n {
            self.done = true;
        }
        if let Some((k, _)) = got.last() {
            if reverse {
                self.end = k.to_vec();
            } else {
                // The first key after `k`.
                self.start = k.to_vec();
                self.start.push(0);
            }
        }
        self.chunk = (n * 2).min(MAX_CHUNK);
        self.buf.extend(got);
        Ok(())
    }
}

/// The merged range: ascending (descending when `reverse`), each key once.
pub(crate) struct Merged<'a> {
    cursors: Vec<Cursor<'a>>,
    reverse: bool,
    failed: bool,
}

impl<'a> Merged<'a> {
    /// `[start, end)` of `sources`, each read first in chunks of `first` entries.
    pub(crate) fn new(
        sources: impl IntoIterator<Item = &'a Shared>,
        start: &[u8],
        end: &[u8],
        reverse: bool,
        first: usize,
    ) -> Merged<'a> {
        let cursors = sources
            .into_iter()
            .map(|src| Cursor {
                src,
                start: start.to_vec(),
                end: end.to_vec(),
                buf: VecDeque::new(),
                done: false,
                chunk: first.clamp(1, MAX_CHUNK),
            })
            .collect();
        Merged {
            cursors,
            reverse,
            failed: false,
        }
    }

    fn next_entry(&mut self) -> Result<Option<Pair>, StoreError> {
        let reverse = self.reverse;
        let mut best: Option<usize> = None;
        for i in 0..self.cursors.len() {
            self.cursors[i].fill(reverse)?;
            let Some((k, _)) = self.cursors[i].buf.front() else {
                continue;
            };
            let better = match best.and_then(|b| self.cursors[b].buf.front()) {
                None => true,
                Some((bk, _)) => (k < bk) != reverse && k != bk,
            };
            if better {
                best = Some(i);
            }
        }
        let Some(b) = best else { return Ok(None) };
        let Some(entry) = self.cursors[b].buf.pop_front() else {
            return Ok(None);
        };
        // The same key in another source (none is expected): taken once.
        for c in &mut self.cursors {
            if c.buf.front().is_some_and(|(k, _)| *k == entry.0) {
                c.buf.pop_front();
            }
        }
        Ok(Some(entry))
    }
}

impl Iterator for Merged<'_> {
    type Item = Result<Pair, StoreError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.next_entry() {
            Ok(Some(e)) => Some(Ok(e)),
            Ok(None) => None,
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sled::SledOptions;
    use std::collections::BTreeMap;

    /// Keys spread over three databases, runs of each interleaved: every range, both
    /// ways, with every limit, reads what one database holding all of them would,
    /// in order and each key once; and a source the merge does not get past its
    /// first entries is read no further.
    #[test]
    fn several_sources_read_as_one_in_key_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dbs: Vec<Shared> = (0..3)
            .map(|i| Shared::open(&dir.path().join(i.to_string()), SledOptions::default()))
            .collect::<Result<_, _>>()
            .expect("open");
        let mut all = BTreeMap::new();
        for n in 0u32..300 {
            // Runs of 40 keys per source, then a few scattered ones.
            let src = if n % 7 == 0 {
                2
            } else {
                ((n / 40) % 2) as usize
            };
            let k = format!("k{n:04}").into_bytes();
            dbs[src]
                .with(|h| {
                    h.db.insert(k.clone(), n.to_be_bytes().to_vec())
                        .map_err(|e| StoreError::Write(e.to_string()))
                })
                .expect("insert");
            all.insert(k, n);
        }
        let bounds = [
            b"k".to_vec(),
            b"k0000".to_vec(),
            b"k0039".to_vec(),
            b"k0040".to_vec(),
            b"k0123".to_vec(),
            b"k0299".to_vec(),
            b"l".to_vec(),
        ];
        for (i, start) in bounds.iter().enumerate() {
            for end in &bounds[i..] {
                for reverse in [false, true] {
                    let mut want: Vec<u32> = all
                        .range(start.clone()..end.clone())
                        .map(|(_, v)| *v)
                        .collect();
                    if reverse {
                        want.reverse();
                    }
                    for first in [1, 2, 16, 64, 5000] {
                        let got: Vec<u32> = Merged::new(dbs.iter(), start, end, reverse, first)
                            .map(|r| {
                                let (_, v) = r.expect("read");
                                u32::from_be_bytes(v.as_ref().try_into().expect("u32"))
                            })
                            .collect();
                        assert_eq!(
                            got, want,
                            "{start:?}..{end:?} reverse {reverse} first {first}"
                        );
                        for limit in [1, 5, 41] {
                            let got: Vec<u32> = Merged::new(dbs.iter(), start, end, reverse, first)
                                .take(limit)
                                .map(|r| {
                                    let (_, v) = r.expect("read");
                                    u32::from_be_bytes(v.as_ref().try_into().expect("u32"))
                                })
                                .collect();
                            let w: Vec<u32> = want.iter().take(limit).copied().collect();
                            assert_eq!(got, w);
                        }
                    }
                }
            }
        }
        // Laziness: the first 10 keys come from source 0 (keys 1 – 9 of its first run
        // and key 0 of source 2); source 1 is read once, one chunk of 16.
        let mut m = Merged::new(dbs.iter(), b"k", b"l", false, 16);
        for _ in 0..10 {
            m.next().expect("entry").expect("read");
        }
        assert_eq!(
            m.cursors[1].buf.len(),
            16,
            "one chunk of source 1, untouched"
        );
        assert!(!m.cursors[1].done);
        assert_eq!(m.cursors[1].chunk, 32);
    }
}
