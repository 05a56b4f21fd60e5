use idem_ports::StoreError;

/// Maps a sqlx error onto the port's error contract.
pub fn map_sqlx_error(err: sqlx::Error) -> StoreError {
    match &err {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            match code.as_str() {
                "23505" => StoreError::UniqueViolation { constraint: db.constraint().unwrap_or_default().to_owned() },
                "55P03" => StoreError::LockTimeout,
                "40001" | "40P01" => StoreError::Retryable(db.message().to_owned()),
                // connection exceptions, admin/crash shutdown, cannot connect now, read-only after failover
                c if c.starts_with("08") || matches!(c, "57P01" | "57P02" | "57P03" | "25006") => {
                    StoreError::Unavailable(db.message().to_owned())
                }
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
