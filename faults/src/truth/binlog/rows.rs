//! Decoding `mariadb-binlog -v` output into the lock changes of a run, and
//! checking them (see the parent module for the rules).

use std::collections::BTreeMap;

use crate::{
    history::{ServerTruth, ROW_LOCK_UNJUDGED},
    model::Target,
};

/// One decoded row change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowEvent {
    /// The table (without the database).
    pub table: String,
    /// `INSERT`, `UPDATE` or `DELETE`.
    pub kind: &'static str,
    /// The row before (`UPDATE`, `DELETE`), column values `@1…` as printed.
    pub before: Vec<Option<String>>,
    /// The row after (`INSERT`, `UPDATE`).
    pub after: Vec<Option<String>>,
    /// The statement that made it (`#Q>` annotation), if logged.
    pub statement: String,
    /// The event header's time: the second (since the epoch, UTC) in which
    /// the statement started.
    pub when_s: Option<i64>,
}

/// Parses `mariadb-binlog -v` output into row events.
///
/// # Errors
///
/// An unreadable row line.
pub fn parse(text: &str) -> Result<Vec<RowEvent>, String> {
    let mut out: Vec<RowEvent> = Vec::new();
    let mut statement = String::new();
    let mut when_s = None;
    let mut target_after = false;
    for line in text.lines() {
        if let Some(q) = line.strip_prefix("#Q> ") {
            statement = q.to_owned();
            continue;
        }
        if let Some(w) = header_time(line) {
            when_s = Some(w);
            continue;
        }
        let Some(body) = line.strip_prefix("### ") else {
            continue;
        };
        let body = body.trim_start();
        for (prefix, kind) in [
            ("INSERT INTO ", "INSERT"),
            ("UPDATE ", "UPDATE"),
            ("DELETE FROM ", "DELETE"),
        ] {
            if let Some(name) = body.strip_prefix(prefix) {
                let table = name
                    .rsplit('.')
                    .next()
                    .unwrap_or(name)
                    .trim_matches('`')
                    .to_owned();
                out.push(RowEvent {
                    table,
                    kind,
                    before: Vec::new(),
                    after: Vec::new(),
                    statement: statement.clone(),
                    when_s,
                });
                target_after = kind == "INSERT";
            }
        }
        match body {
            "SET" => target_after = true,
            "WHERE" => target_after = false,
            _ => {}
        }
        if let Some(v) = body.strip_prefix('@') {
            let (n, value) = v
                .split_once('=')
                .ok_or_else(|| format!("binlog truth: unreadable row line `{line}`"))?;
            let n: usize = n
                .parse()
                .map_err(|_| format!("binlog truth: unreadable row line `{line}`"))?;
            let ev = out.last_mut().ok_or_else(|| {
                format!("binlog truth: a row value outside a row event: `{line}`")
            })?;
            let cols = if target_after {
                &mut ev.after
            } else {
                &mut ev.before
            };
            if cols.len() < n {
                cols.resize(n, None);
            }
            cols[n - 1] = value_of(value);
        }
    }
    Ok(out)
}

/// The time of an event header `#261130 15:57:04 server id 1 …` (printed
/// in UTC: `mariadb-binlog` runs with `TZ=UTC`), seconds since the epoch.
fn header_time(line: &str) -> Option<i64> {
    let rest = line.strip_prefix('#')?;
    let date = rest.get(..6)?;
    if !date.bytes().all(|b| b.is_ascii_digit()) || !rest.contains(" server id ") {
        return None;
    }
    let time = rest[6..].split_whitespace().next()?;
    let dt = format!("20{}-{}-{} {time}", &date[..2], &date[2..4], &date[4..6]);
    micros(&dt).map(|us| us / 1_000_000)
}

/// A printed value: `NULL`, `'text'`, or a number (an unsigned one printed
/// as `-1 (18446744073709551615)` keeps the part in brackets).
fn value_of(v: &str) -> Option<String> {
    let v = v.trim();
    if v == "NULL" {
        return None;
    }
    if let (Some(a), Some(b)) = (v.find('\''), v.rfind('\'')) {
        if b > a {
            return Some(v[a + 1..b].to_owned());
        }
    }
    if let (Some(a), Some(b)) = (v.find('('), v.rfind(')')) {
        return Some(v[a + 1..b].to_owned());
    }
    Some(v.split_whitespace().next().unwrap_or(v).to_owned())
}

/// `YYYY-MM-DD HH:MM:SS[.ffffff]` (UTC) as µs since the epoch.
pub fn micros(dt: &str) -> Option<i64> {
    let (date, time) = dt.split_once(' ')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(|x| x.parse::<i64>());
    let (h, mi, s) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    let frac: i64 = format!("{frac:0<6}").get(..6)?.parse().ok()?;
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 86_400 + h * 3_600 + mi * 60 + s) * 1_000_000) + frac)
}

/// What one row change means for a key's lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A new grant: token, start and expiry (server µs).
    Grant {
        /// The key.
        key: String,
        /// The token.
        token: u64,
        /// Start on the server's clock.
        start: i64,
        /// Expiry on the server's clock.
        expiry: i64,
    },
    /// The current grant's expiry moved.
    Extend {
        /// The key.
        key: String,
        /// The token.
        token: u64,
        /// New expiry.
        expiry: i64,
    },
    /// A statement that deletes expired rows only deleted this grant's row
    /// while it was current (see the module docs): an overlap.
    SweptWhileCurrent {
        /// The key.
        key: String,
        /// The token.
        token: u64,
    },
    /// The grant ended now (`explicit`) or only at its expiry (a statement
    /// that deletes expired rows only).
    End {
        /// The key.
        key: String,
        /// The token.
        token: u64,
        /// Ended by this change, not by its expiry.
        explicit: bool,
    },
}

fn col(r: &[Option<String>], i: usize) -> Option<&str> {
    r.get(i).and_then(|v| v.as_deref())
}

fn num(r: &[Option<String>], i: usize, what: &str) -> Result<u64, String> {
    col(r, i)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("binlog truth: no {what} in a row: {r:?}"))
}

fn time(r: &[Option<String>], i: usize, what: &str) -> Result<i64, String> {
    col(r, i)
        .and_then(micros)
        .ok_or_else(|| format!("binlog truth: no {what} in a row: {r:?}"))
}

/// The `INTERVAL n MICROSECOND` of a statement (its TTL).
fn interval(statement: &str) -> Option<i64> {
    let i = statement.find("INTERVAL ")?;
    statement[i + 9..].split_whitespace().next()?.parse().ok()
}

/// The lock meaning of the run's row changes (see the module docs).
///
/// # Errors
///
/// A row of a run table that does not have the schema's columns.
pub fn changes(target: Target, base: &str, rows: &[RowEvent]) -> Result<Vec<Change>, String> {
    let table = match target {
        Target::MySqlUniqueKey => base.to_owned(),
        Target::MySqlOptimistic => format!("{base}_optimistic"),
        Target::MySqlRowLock => format!("{base}_live"),
        _ => return Err("binlog truth: not a MySQL target".into()),
    };
    let mut out = Vec::new();
    for r in rows.iter().filter(|r| r.table == table) {
        match target {
            // id, lock_key, owner, reentrant_count, expire_time, create_time
            Target::MySqlUniqueKey => {
                let row = if r.kind == "INSERT" {
                    &r.after
                } else {
                    &r.before
                };
                let key = col(row, 1).unwrap_or_default().to_owned();
                let token = num(row, 0, "id")?;
                match r.kind {
                    "INSERT" => out.push(Change::Grant {
                        key,
                        token,
                        start: time(row, 5, "create_time")?,
                        expiry: time(row, 4, "expire_time")?,
                    }),
                    "UPDATE" => out.push(Change::Extend {
                        key,
                        token,
                        expiry: time(&r.after, 4, "expire_time")?,
                    }),
                    _ => {
                        let sweep = r.statement.contains("expire_time <");
                        let expiry = time(row, 4, "expire_time")?;
                        let second_end = r.when_s.map(|w| (w + 1) * 1_000_000);
                        if sweep && second_end.is_some_and(|end| expiry >= end) {
                            out.push(Change::SweptWhileCurrent {
                                key: key.clone(),
                                token,
                            });
                        }
                        out.push(Change::End {
                            key,
                            token,
                            explicit: true,
                        });
                    }
                }
            }
            // id, lock_key, owner, hold_count, expire_time, conn_id (schema
            // 2's MEMORY table): a grant is a `REPLACE`, logged as the old
            // row's DELETE and the new row's INSERT with a new id (the
            // token); an UPDATE with the same id extends or re-enters. A
            // release writes nothing, so only grants and tokens are judged.
            Target::MySqlRowLock => {
                let row = if r.kind == "DELETE" {
                    continue;
                } else {
                    &r.after
                };
                let key = col(row, 1).unwrap_or_default().to_owned();
                // The lifetime row (`\x01lifetime`) carries the epoch, not a grant.
                if key.starts_with("\\x01") || key.starts_with('\u{1}') {
                    continue;
                }
                let token = num(row, 0, "id")?;
                let expiry = time(row, 4, "expire_time")?;
                if r.kind == "UPDATE" && num(&r.before, 0, "id")? == token {
                    out.push(Change::Extend { key, token, expiry });
                } else {
                    let ttl = interval(&r.statement).ok_or_else(|| {
                        format!(
                            "binlog truth: no TTL in the grant statement `{}`",
                            r.statement
                        )
                    })?;
                    out.push(Change::Grant {
                        key,
                        token,
                        start: expiry - ttl,
                        expiry,
                    });
                }
            }
            // lock_key, holder, version, reentrant_count, expire_time
            Target::MySqlOptimistic => {
                let (holder_col, token_col) = (1, 2);
                if r.kind == "DELETE" {
                    continue;
                }
                let key = col(&r.after, 0).unwrap_or_default().to_owned();
                let token = num(&r.after, token_col, "token")?;
                let before = if r.kind == "UPDATE" {
                    Some(num(&r.before, token_col, "token")?)
                } else {
                    None
                };
                let holder = col(&r.after, holder_col);
                match holder {
                    None => {
                        if before.is_some() && col(&r.before, holder_col).is_some() {
                            out.push(Change::End {
                                key,
                                token,
                                explicit: true,
                            });
                        }
                    }
                    // Same token, same holder: an extension (a new holder
                    // with the same token is a grant, and a regression).
                    Some(h) if before == Some(token) && col(&r.before, holder_col) == Some(h) => {
                        out.push(Change::Extend {
                            key,
                            token,
                            expiry: time(&r.after, 4, "expire_time")?,
                        })
                    }
                    Some(_) => {
                        let expiry = time(&r.after, 4, "expire_time")?;
                        let ttl = interval(&r.statement).ok_or_else(|| {
                            format!(
                                "binlog truth: no TTL in the grant statement `{}`",
                                r.statement
                            )
                        })?;
                        out.push(Change::Grant {
                            key,
                            token,
                            start: expiry - ttl,
                            expiry,
                        });
                    }
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Checks the changes in commit order (see the module docs); also returns
/// every granted token (for matching the clients' grants).
pub fn check(changes: &[Change], overlaps_unjudged: bool) -> (ServerTruth, Vec<u64>) {
    struct Cur {
        token: u64,
        expiry: i64,
        ended: bool,
    }
    let mut cur: BTreeMap<&str, Cur> = BTreeMap::new();
    let mut last: BTreeMap<&str, u64> = BTreeMap::new();
    let mut t = ServerTruth::default();
    let mut tokens = Vec::new();
    for c in changes {
        match c {
            Change::Grant {
                key,
                token,
                start,
                expiry,
            } => {
                t.grants += 1;
                tokens.push(*token);
                if let Some(p) = cur.get(key.as_str()) {
                    if !p.ended && p.expiry > *start && !overlaps_unjudged {
                        t.overlaps += 1;
                    }
                }
                if last.get(key.as_str()).is_some_and(|l| token <= l) {
                    t.token_regressions += 1;
                }
                last.insert(key, *token);
                cur.insert(
                    key,
                    Cur {
                        token: *token,
                        expiry: *expiry,
                        ended: false,
                    },
                );
            }
            Change::Extend { key, token, expiry } => {
                if let Some(p) = cur.get_mut(key.as_str()).filter(|p| p.token == *token) {
                    p.expiry = *expiry;
                }
            }
            Change::SweptWhileCurrent { .. } => t.overlaps += 1,
            Change::End {
                key,
                token,
                explicit,
            } => {
                if let Some(p) = cur.get_mut(key.as_str()).filter(|p| p.token == *token) {
                    p.ended |= *explicit;
                }
            }
        }
    }
    if overlaps_unjudged {
        t.overlaps_unjudged = Some(ROW_LOCK_UNJUDGED);
    }
    (t, tokens)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const LOG: &str = r#"
# at 724
#261130 15:57:04 server id 1  end_log_pos 849 CRC32 0xd2568142 	Annotate_rows:
#Q> INSERT INTO `ff_x` (lock_key, owner, reentrant_count, expire_time, create_time) VALUES ('k', 'o1', 1, UTC_TIMESTAMP(6) + INTERVAL 600000 MICROSECOND, UTC_TIMESTAMP(6))
#261130 15:57:04 server id 1  end_log_pos 963 CRC32 0xa72d0d34 	Write_rows: table id 18 flags: STMT_END_F
### INSERT INTO `test`.`ff_x`
### SET
###   @1=7
###   @2='k'
###   @3='o1'
###   @4=1
###   @5='2026-11-30 15:57:05.000000'
###   @6='2026-11-30 15:57:04.400000'
# Number of rows: 1
#Q> DELETE FROM `ff_x` WHERE id = 7 AND owner = 'o1' AND reentrant_count <= 1 AND expire_time > UTC_TIMESTAMP(6)
#261130 15:57:03 server id 1  end_log_pos 1221 CRC32 0x0693e134 	Delete_rows: table id 18 flags: STMT_END_F
### DELETE FROM `test`.`ff_x`
### WHERE
###   @1=7
###   @2='k'
###   @3='o1'
###   @4=1
###   @5='2026-11-30 15:57:05.000000'
###   @6='2026-11-30 15:57:04.400000'
#Q> INSERT INTO `ff_x` (lock_key, owner, reentrant_count, expire_time, create_time) VALUES ('k', 'o2', 1, UTC_TIMESTAMP(6) + INTERVAL 600000 MICROSECOND, UTC_TIMESTAMP(6))
### INSERT INTO `test`.`ff_x`
### SET
###   @1=8
###   @2='k'
###   @3='o2'
###   @4=1
###   @5='2026-11-30 15:57:05.200000'
###   @6='2026-11-30 15:57:04.600000'
"#;

    #[test]
    fn datetimes_are_epoch_micros() {
        assert_eq!(micros("1970-01-01 00:00:00"), Some(0));
        assert_eq!(micros("2000-03-01 00:00:01.5"), Some(951_868_801_500_000));
        assert_eq!(
            micros("2026-11-30 15:57:05.425831"),
            Some(1_796_054_225_425_831)
        );
    }

    #[test]
    fn a_release_then_a_grant_is_clean() {
        let rows = parse(LOG).unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].after[2].as_deref(), Some("o1"));
        let c = changes(Target::MySqlUniqueKey, "ff_x", &rows).unwrap();
        let (t, tokens) = check(&c, false);
        assert_eq!(
            (t.grants, t.overlaps, t.token_regressions),
            (2, 0, 0),
            "{c:?}"
        );
        assert_eq!(tokens, [7, 8]);
    }

    /// The checker can fail: an expiry-only delete of a row that had not
    /// expired (the next grant starts before its expiry), a lower token.
    #[test]
    fn a_live_row_deleted_as_expired_and_a_lower_token_are_caught() {
        let bad = LOG
            .replace(
                "WHERE id = 7 AND owner = 'o1' AND reentrant_count <= 1 AND expire_time > UTC_TIMESTAMP(6)",
                "WHERE lock_key = 'k' AND expire_time <= UTC_TIMESTAMP(6)",
            )
            .replace("###   @1=8", "###   @1=6");
        let c = changes(Target::MySqlUniqueKey, "ff_x", &parse(&bad).unwrap()).unwrap();
        let (t, _) = check(&c, false);
        assert_eq!((t.overlaps, t.token_regressions), (1, 1), "{c:?}");
    }

    #[test]
    fn a_sweep_within_the_second_of_expiry_is_not_judged_current() {
        let ok = LOG
            .replace(
                "WHERE id = 7 AND owner = 'o1' AND reentrant_count <= 1 AND expire_time > UTC_TIMESTAMP(6)",
                "WHERE lock_key = 'k' AND expire_time <= UTC_TIMESTAMP(6)",
            )
            .replace("#261130 15:57:03 server id 1  end_log_pos 1221", "#261130 15:57:05 server id 1  end_log_pos 1221");
        let rows = parse(&ok).unwrap();
        assert_eq!(rows[1].when_s, Some(1_796_054_225));
        let c = changes(Target::MySqlUniqueKey, "ff_x", &rows).unwrap();
        assert_eq!(check(&c, false).0.overlaps, 0, "{c:?}");
    }

    #[test]
    fn optimistic_takeover_of_a_current_holder_is_caught() {
        let log = r#"
#Q> UPDATE `ff_x_optimistic` SET version = LAST_INSERT_ID(version + 1), holder = 'o1', reentrant_count = 1, expire_time = UTC_TIMESTAMP(6) + INTERVAL 600000 MICROSECOND WHERE lock_key = 'k' AND (holder IS NULL OR expire_time <= UTC_TIMESTAMP(6))
### UPDATE `test`.`ff_x_optimistic`
### WHERE
###   @1='k'
###   @2=NULL
###   @3=0
###   @4=0
###   @5=NULL
### SET
###   @1='k'
###   @2='o1'
###   @3=1
###   @4=1
###   @5='2026-11-30 15:57:05.000000'
#Q> UPDATE `ff_x_optimistic` SET version = LAST_INSERT_ID(version + 1), holder = 'o2', reentrant_count = 1, expire_time = UTC_TIMESTAMP(6) + INTERVAL 600000 MICROSECOND WHERE lock_key = 'k' AND (holder IS NULL OR expire_time <= UTC_TIMESTAMP(6))
### UPDATE `test`.`ff_x_optimistic`
### WHERE
###   @1='k'
###   @2='o1'
###   @3=1
###   @4=1
###   @5='2026-11-30 15:57:05.000000'
### SET
###   @1='k'
###   @2='o2'
###   @3=2
###   @4=1
###   @5='2026-11-30 15:57:05.300000'
"#;
        let c = changes(Target::MySqlOptimistic, "ff_x", &parse(log).unwrap()).unwrap();
        // o2 starts at 04.700000, o1's grant runs to 05.000000.
        let (t, tokens) = check(&c, false);
        assert_eq!(
            (t.grants, t.overlaps, t.token_regressions),
            (2, 1, 0),
            "{c:?}"
        );
        assert_eq!(tokens, [1, 2]);
        // Judged only where the log can tell: not for row_lock.
        assert_eq!(check(&c, true).0.overlaps, 0);
    }

    /// `row_lock`'s grants as the log shows them (taken from a real
    /// `mariadb-binlog -v` of three acquisitions of `k1`): the lifetime row
    /// is not a grant, each `REPLACE` is a delete plus an insert, and a
    /// lower id after a higher one is a regression.
    #[test]
    fn row_lock_grants_come_from_the_live_table() {
        let grant = |id: u64, owner: &str| {
            format!(
                "#Q> SET STATEMENT innodb_lock_wait_timeout = 0 FOR REPLACE INTO `bl_live` (lock_key, owner, hold_count, expire_time, conn_id) SELECT 'k1', '{owner}', 1, UTC_TIMESTAMP(6) + INTERVAL 30000000 MICROSECOND, CONNECTION_ID() FROM `bl_rows` r JOIN `bl_live` l ON l.lock_key = 'lifetime' WHERE r.lock_key = 'k1' FOR UPDATE
### DELETE FROM `test`.`bl_live`
### WHERE
###   @1={}
###   @2='k1'
###   @3='previous'
###   @4=1
###   @5='2026-11-30 22:03:55.100000'
###   @6=9
### INSERT INTO `test`.`bl_live`
### SET
###   @1={id}
###   @2='k1'
###   @3='{owner}'
###   @4=1
###   @5='2026-11-30 22:04:25.1{id:05}'
###   @6=11
",
                id - 1
            )
        };
        let lifetime = r"#Q> INSERT IGNORE INTO `bl_live` (id, lock_key, hold_count) VALUES (1099511627776, 'lifetime', 0)
### INSERT INTO `test`.`bl_live`
### SET
###   @1=1099511627776
###   @2='\x01lifetime'
###   @3=NULL
###   @4=0
###   @5=NULL
###   @6=NULL
";
        let log = format!(
            "{lifetime}{}{}{}",
            grant(1_099_511_627_777, "a"),
            grant(1_099_511_627_778, "b"),
            grant(1_099_511_627_779, "c")
        );
        let c = changes(Target::MySqlRowLock, "bl", &parse(&log).unwrap()).unwrap();
        let (t, tokens) = check(&c, true);
        assert_eq!((t.grants, t.token_regressions), (3, 0), "{c:?}");
        assert_eq!(
            tokens,
            [1_099_511_627_777, 1_099_511_627_778, 1_099_511_627_779]
        );
        assert!(t.overlaps_unjudged.is_some());
        let backwards = format!(
            "{}{}",
            grant(1_099_511_627_779, "a"),
            grant(1_099_511_627_778, "b")
        );
        let c = changes(Target::MySqlRowLock, "bl", &parse(&backwards).unwrap()).unwrap();
        assert_eq!(check(&c, true).0.token_regressions, 1, "{c:?}");
    }
}
