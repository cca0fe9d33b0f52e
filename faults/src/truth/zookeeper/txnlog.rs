//! The transaction log's format (ZooKeeper's FileTxnLog, jute encoding:
//! big-endian ints and longs, length-prefixed strings, buffers and
//! vectors), read back into the changes the truth needs.

use std::io::{BufReader, Read};

/// "ZKLG": the magic of a transaction log file.
const LOG_MAGIC: i32 = 0x5a4b_4c47;
/// The end-of-record byte after each entry.
const END_OF_RECORD: u8 = b'B';

/// What one transaction did, as far as the locks are concerned (the
/// transactions of a `multi` come out one by one, with the multi's zxid).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A node created (`create`, `create2`, a container, a TTL node).
    Create {
        /// Its path.
        path: String,
        /// Whether it is ephemeral (lives as long as the session).
        ephemeral: bool,
    },
    /// A node deleted (`delete`, or a container removed by the server).
    Delete {
        /// Its path.
        path: String,
    },
    /// The session closed or expired: its ephemeral nodes are gone.
    CloseSession,
    /// Anything else (sessions created, data set, errors): the op code.
    Other(i32),
}

/// One entry of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Txn {
    /// Its zxid: ZooKeeper's total order of changes.
    pub zxid: i64,
    /// The session that made it.
    pub session: i64,
    /// The server's wall clock when it ordered the change, ms since the epoch.
    pub time_ms: i64,
    /// What it did.
    pub change: Change,
}

/// A cursor over jute-encoded bytes.
struct Jute<'a> {
    b: &'a [u8],
}

impl<'a> Jute<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.b.len() < n {
            return Err(format!(
                "zookeeper truth: a log record ends early ({} bytes left, {n} wanted)",
                self.b.len()
            ));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }

    fn int(&mut self) -> Result<i32, String> {
        let b = self.take(4)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn long(&mut self) -> Result<i64, String> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(i64::from_be_bytes(a))
    }

    fn boolean(&mut self) -> Result<bool, String> {
        Ok(self.take(1)?[0] != 0)
    }

    /// A length-prefixed buffer (`-1`: null, read as empty).
    fn buffer(&mut self) -> Result<&'a [u8], String> {
        let n = self.int()?;
        if n < 0 {
            return Ok(&[]);
        }
        self.take(n as usize)
    }

    fn string(&mut self) -> Result<String, String> {
        Ok(String::from_utf8_lossy(self.buffer()?).into_owned())
    }

    /// A vector of ACLs: `int perms, string scheme, string id` each.
    fn skip_acls(&mut self) -> Result<(), String> {
        let n = self.int()?;
        for _ in 0..n.max(0) {
            self.int()?;
            self.string()?;
            self.string()?;
        }
        Ok(())
    }
}

/// ZooKeeper's op codes of the transactions read here.
mod op {
    pub(super) const CREATE: i32 = 1;
    pub(super) const DELETE: i32 = 2;
    pub(super) const MULTI: i32 = 14;
    pub(super) const CREATE2: i32 = 15;
    pub(super) const CREATE_CONTAINER: i32 = 19;
    pub(super) const DELETE_CONTAINER: i32 = 20;
    pub(super) const CREATE_TTL: i32 = 21;
    pub(super) const CLOSE_SESSION: i32 = -11;
}

/// The change(s) of one transaction body of type `ty`.
fn changes_of(ty: i32, body: &[u8], out: &mut Vec<Change>) -> Result<(), String> {
    let mut j = Jute { b: body };
    match ty {
        // CreateTxn: path, data, acl, ephemeral, parentCVersion.
        op::CREATE | op::CREATE2 => {
            let path = j.string()?;
            j.buffer()?;
            j.skip_acls()?;
            let ephemeral = j.boolean()?;
            out.push(Change::Create { path, ephemeral });
        }
        // CreateContainerTxn / CreateTTLTxn: path, data, acl, … — never
        // ephemeral.
        op::CREATE_CONTAINER | op::CREATE_TTL => {
            let path = j.string()?;
            out.push(Change::Create {
                path,
                ephemeral: false,
            });
        }
        op::DELETE | op::DELETE_CONTAINER => {
            let path = j.string()?;
            out.push(Change::Delete { path });
        }
        op::CLOSE_SESSION => out.push(Change::CloseSession),
        // MultiTxn: a vector of (type, buffer); all or nothing, one zxid.
        op::MULTI => {
            let n = j.int()?;
            for _ in 0..n.max(0) {
                let sub = j.int()?;
                let data = j.buffer()?;
                changes_of(sub, data, out)?;
            }
        }
        other => out.push(Change::Other(other)),
    }
    Ok(())
}

/// Adler-32, the checksum of every log entry.
fn adler32(data: &[u8]) -> u32 {
    const MOD: u32 = 65_521;
    let (mut a, mut b) = (1u32, 0u32);
    for chunk in data.chunks(5_552) {
        for &x in chunk {
            a += u32::from(x);
            b += a;
        }
        a %= MOD;
        b %= MOD;
    }
    (b << 16) | a
}

/// Reads one log file's transactions in order, until the end of what was
/// written (ZooKeeper pads its files with zeros) or `stop_after` (the
/// zxid of the end marker) has been read. Each entry's checksum is checked.
///
/// # Errors
///
/// When the file is not a transaction log, or an entry is damaged.
pub fn read_log(r: impl Read, stop_after: Option<i64>) -> Result<Vec<Txn>, String> {
    let mut r = BufReader::with_capacity(1 << 16, r);
    let mut head = [0u8; 16];
    r.read_exact(&mut head)
        .map_err(|e| format!("zookeeper truth: reading a log header: {e}"))?;
    let mut j = Jute { b: &head };
    let (magic, version) = (j.int()?, j.int()?);
    if magic != LOG_MAGIC || version != 2 {
        return Err(format!(
            "zookeeper truth: not a version-2 transaction log (magic {magic:#x}, version {version})"
        ));
    }
    let mut out = Vec::new();
    let mut buf = Vec::new();
    loop {
        let mut pre = [0u8; 12];
        match r.read_exact(&mut pre) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(format!("zookeeper truth: reading the log: {e}")),
        }
        let mut j = Jute { b: &pre };
        let (crc, len) = (j.long()?, j.int()?);
        if len <= 0 {
            // The zero padding after the last entry.
            break;
        }
        buf.resize(len as usize + 1, 0);
        match r.read_exact(&mut buf) {
            Ok(()) => {}
            // An entry being written right now: past anything asked for.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(format!("zookeeper truth: reading the log: {e}")),
        }
        let (entry, eor) = buf.split_at(len as usize);
        if eor[0] != END_OF_RECORD || i64::from(adler32(entry)) != crc {
            return Err(format!(
                "zookeeper truth: a damaged log entry after zxid {:#x}",
                out.last().map_or(0, |t: &Txn| t.zxid)
            ));
        }
        // TxnHeader: clientId, cxid, zxid, time, type; then the txn (and,
        // since 3.6, a digest of the tree, not read).
        let mut j = Jute { b: entry };
        let session = j.long()?;
        j.int()?;
        let zxid = j.long()?;
        let time_ms = j.long()?;
        let ty = j.int()?;
        let mut changes = Vec::new();
        changes_of(ty, j.b, &mut changes)?;
        out.extend(changes.into_iter().map(|change| Txn {
            zxid,
            session,
            time_ms,
            change,
        }));
        if stop_after.is_some_and(|z| zxid >= z) {
            break;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A log written the way ZooKeeper writes one (header, then per entry
    /// checksum, length, header and record, end-of-record byte, then zero
    /// padding) reads back, `multi` included; a damaged entry is an error.
    #[test]
    fn the_log_format_reads_back_and_damage_is_refused() {
        fn put_str(b: &mut Vec<u8>, s: &str) {
            b.extend((s.len() as i32).to_be_bytes());
            b.extend(s.as_bytes());
        }
        fn create_body(path: &str, ephemeral: bool) -> Vec<u8> {
            let mut b = Vec::new();
            put_str(&mut b, path);
            put_str(&mut b, "data");
            b.extend(1i32.to_be_bytes());
            b.extend(31i32.to_be_bytes());
            put_str(&mut b, "world");
            put_str(&mut b, "anyone");
            b.push(u8::from(ephemeral));
            b.extend(3i32.to_be_bytes());
            b
        }
        fn entry(log: &mut Vec<u8>, session: i64, zxid: i64, ty: i32, body: &[u8]) {
            let mut e = Vec::new();
            e.extend(session.to_be_bytes());
            e.extend(1i32.to_be_bytes());
            e.extend(zxid.to_be_bytes());
            e.extend((1_000 + zxid).to_be_bytes());
            e.extend(ty.to_be_bytes());
            e.extend(body);
            e.extend([0, 0, 0, 2, 0, 0, 0, 0, 1, 2, 3, 4]); // digest
            log.extend(i64::from(adler32(&e)).to_be_bytes());
            log.extend((e.len() as i32).to_be_bytes());
            log.extend(&e);
            log.push(b'B');
        }
        let mut log = Vec::new();
        log.extend(LOG_MAGIC.to_be_bytes());
        log.extend(2i32.to_be_bytes());
        log.extend(0i64.to_be_bytes());
        entry(&mut log, 5, 1, -10, &20_000i32.to_be_bytes());
        entry(
            &mut log,
            5,
            2,
            op::CREATE2,
            &create_body("/ff/kq/a-0000000000", true),
        );
        let mut multi = Vec::new();
        multi.extend(2i32.to_be_bytes());
        for (ty, body) in [
            (op::CREATE, create_body("/ff/kq/b-0000000001", true)),
            (op::DELETE, {
                let mut b = Vec::new();
                put_str(&mut b, "/ff/kq/a-0000000000");
                b
            }),
        ] {
            multi.extend(ty.to_be_bytes());
            multi.extend((body.len() as i32).to_be_bytes());
            multi.extend(body);
        }
        entry(&mut log, 6, 3, op::MULTI, &multi);
        entry(&mut log, 6, 4, op::CLOSE_SESSION, &0i32.to_be_bytes());
        let written = log.len();
        log.extend([0u8; 64]);
        let txns = read_log(log.as_slice(), None).unwrap();
        assert_eq!(
            txns.iter()
                .map(|t| (t.zxid, t.session, t.time_ms, t.change.clone()))
                .collect::<Vec<_>>(),
            [
                (1, 5, 1_001, Change::Other(-10)),
                (
                    2,
                    5,
                    1_002,
                    Change::Create {
                        path: "/ff/kq/a-0000000000".into(),
                        ephemeral: true
                    }
                ),
                (
                    3,
                    6,
                    1_003,
                    Change::Create {
                        path: "/ff/kq/b-0000000001".into(),
                        ephemeral: true
                    }
                ),
                (
                    3,
                    6,
                    1_003,
                    Change::Delete {
                        path: "/ff/kq/a-0000000000".into()
                    }
                ),
                (4, 6, 1_004, Change::CloseSession),
            ]
        );
        assert_eq!(read_log(log.as_slice(), Some(2)).unwrap().len(), 2);
        let mut damaged = log.clone();
        damaged[written - 20] ^= 1;
        assert!(read_log(damaged.as_slice(), None).is_err());
        assert!(read_log(&b"ZKSN\0\0\0\x02\0\0\0\0\0\0\0\0"[..], None).is_err());
        assert_eq!(adler32(b"Wikipedia"), 0x11e6_0398);
    }
}
