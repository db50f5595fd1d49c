//! MariaDB/MySQL: which of some connections have a transaction open, read from the
//! text of `SHOW ENGINE INNODB STATUS`.
//!
//! Not from `information_schema.innodb_trx`: InnoDB fills that table from a cache it
//! refreshes only when nobody has read the table for 0.1 s, so a probe that polls more
//! often keeps seeing the transactions of its first read: one rolled back seconds ago
//! stays listed, one begun since never shows (tried on MariaDB 10.11: polled every
//! 20 ms, a transaction rolled back after 0.9 s was still listed 2 s later).
//! `SHOW ENGINE INNODB STATUS` is written afresh for every call.

/// What to run on the server; its third column (`Status`) is the text that
/// [`active_transactions`] reads.
pub(crate) const STATUS: &str = "SHOW ENGINE INNODB STATUS";

/// How many of the connections `thread_ids` (their `CONNECTION_ID()`s) have a
/// transaction open (`ACTIVE`) in `status`, the text of [`STATUS`].
pub(crate) fn active_transactions(status: &str, thread_ids: &[i64]) -> usize {
    status
        .split("---TRANSACTION ")
        .skip(1)
        .filter(|transaction| {
            let header = transaction.lines().next().unwrap_or_default();
            header.contains("ACTIVE")
                && thread_id(transaction).is_some_and(|id| thread_ids.contains(&id))
        })
        .count()
}

/// The connection a transaction of the status text belongs to: its line
/// `MariaDB thread id 12, OS thread handle …` (`MySQL thread id` on MySQL).
fn thread_id(transaction: &str) -> Option<i64> {
    let (_, after) = transaction.split_once(" thread id ")?;
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::active_transactions;

    const STATUS_TEXT: &str = "LIST OF TRANSACTIONS FOR EACH SESSION:
---TRANSACTION 421, not started
0 lock struct(s), heap size 1128, 0 row lock(s)
MariaDB thread id 7, OS thread handle 1, query id 1 localhost root
---TRANSACTION 28, ACTIVE 0 sec
1 lock struct(s), heap size 1128, 0 row lock(s), undo log entries 1
MariaDB thread id 12, OS thread handle 140379262265024, query id 582 localhost root
SELECT SLEEP(1)
---TRANSACTION 29, ACTIVE 3 sec
MySQL thread id 120, OS thread handle 2, query id 9 localhost root
--------
FILE I/O";

    #[test]
    fn counts_the_active_transactions_of_the_given_connections_only() {
        assert_eq!(active_transactions(STATUS_TEXT, &[12]), 1);
        assert_eq!(active_transactions(STATUS_TEXT, &[12, 120]), 2);
        assert_eq!(
            active_transactions(STATUS_TEXT, &[7, 1, 140379262265024]),
            0
        );
        assert_eq!(active_transactions(STATUS_TEXT, &[]), 0);
    }
}
