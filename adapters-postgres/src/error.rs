use idem_ports::StoreError;

/// Maps a sqlx error onto the port's error contract.
pub fn map_sqlx_error(err: sqlx::Error) -> StoreError {
    match &err {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            if matches!(code.as_str(), "25006" | "57P01" | "57P02" | "57P03") {
                crate::servers::server_lost(); // a demoted or departing server: its connections are not reused
            }
            match code.as_str() {
                "23505" => StoreError::UniqueViolation { constraint: db.constraint().unwrap_or_default().to_owned() },
                "55P03" => StoreError::LockTimeout,
                "40001" | "40P01" => StoreError::Retryable(db.message().to_owned()),
                c if is_transient_sqlstate(c) => StoreError::Unavailable(format!("{code}: {}", db.message())),
                _ => StoreError::Other(format!("{code}: {}", db.message())),
            }
        }
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => StoreError::Unavailable(err.to_string()),
        sqlx::Error::RowNotFound => StoreError::NotFound,
        _ => StoreError::Other(err.to_string()),
    }
}

/// SQLSTATEs that say nothing about the data: the same statement can succeed later. Connection exceptions
/// (08), statement timeout and operator intervention (57014, 57P01–57P03), insufficient resources such as
/// out of memory, disk full, too many connections or out of shared memory (53), system I/O errors (58),
/// internal errors (XX000), read-only after a failover (25006), and a prepared statement that a pooler's
/// server connection already has or lacks (42P05, 26000). Anything classed here is retried with
/// backoff and never blamed on an event or request.
pub fn is_transient_sqlstate(code: &str) -> bool {
    code.starts_with("08")
        || code.starts_with("53")
        || code.starts_with("58")
        || matches!(code, "57014" | "57P01" | "57P02" | "57P03" | "25006" | "XX000")
        // behind a transaction pooler (PgBouncer) a named prepared statement can meet a server connection
        // that has it already or lacks it: the connection's trouble, never the event's
        || matches!(code, "26000" | "42P05")
}

#[cfg(test)]
mod tests {
    use super::is_transient_sqlstate;

    #[test]
    fn resource_and_server_trouble_is_transient_and_data_errors_are_not() {
        for code in [
            "08006", "08001", "08P01", "57014", "57P01", "53100", "53200", "53300", "58030", "XX000", "25006", "26000",
            "42P05",
        ] {
            assert!(is_transient_sqlstate(code), "{code}");
        }
        for code in ["23505", "23514", "22003", "22P02", "42P01", "40001", "55P03"] {
            assert!(!is_transient_sqlstate(code), "{code}");
        }
    }
}
